"""Tied weights start from the first stage's copy, as on DeepSpeed's own topology.

DeepSpeed 0.19.8's ``PipelineModule`` (runtime/pipe/module.py) ties a ``TiedLayerSpec`` key across the stages
that hold it: ``_index_tied_modules`` makes one group per (data, model) fibre, members in stage order, and
``_synchronize_tied_weights`` (end of ``__init__``, and after ``load_state_dir``) broadcasts each tied weight
from ``src=min(comm['ranks'])``. On DeepSpeed's topology (pipe outermost) the lowest global rank of a fibre is
its first stage, so the embedding's initial values (built on stage 0 with its seed) reach the output layer.
Under a plan that puts a later stage on lower launch ranks, ``min`` picks that stage's copy instead: the same
model, another initialization. Here the module's ``_synchronize_tied_weights`` runs DeepSpeed's own loop with
``deepspeed.comm.broadcast`` told, for each tied group, the member with the lowest *logical* rank (the one
DeepSpeed would use for the same coordinates). Only the broadcast source changes: the groups, their members and
the gradient all-reduce (``allreduce_tied_weight_gradients``) are DeepSpeed's.
"""
from __future__ import annotations

from typing import Sequence

from ..core.plan import Plan
from ..runtime.patches import PATCHES

LABEL = "deepspeed.tied"


def first_stage_source(plan: Plan, ranks: Sequence[int]) -> int:
    """The tied group's member DeepSpeed broadcasts from on its own topology: the lowest logical rank."""
    logical = plan.logical_of_physical
    return min(ranks, key=lambda r: logical[r])


def start_tied_weights_on_first_stage(module, plan: Plan) -> None:
    """Make ``module`` broadcast every tied weight from its first stage (call before DeepSpeed's ``__init__``,
    which synchronizes at its end). No-op on an identity plan (``min`` is already the first stage)."""
    if plan.is_identity:
        return

    def make(_bound_original):
        def _synchronize_tied_weights():
            sources = {id(comm["group"]): first_stage_source(plan, comm["ranks"])
                       for comm in module.tied_comms.values()}
            if not sources:
                return type(module)._synchronize_tied_weights(module)
            import deepspeed.comm as ds_comm

            def from_first_stage(broadcast):
                def planned(tensor, src, group=None, *args, **kwargs):
                    return broadcast(tensor, sources.get(id(group), src), group, *args, **kwargs)
                return planned
            with PATCHES.temporarily(LABEL + ".broadcast", [(ds_comm, "broadcast", from_first_stage)]):
                return type(module)._synchronize_tied_weights(module)
        return _synchronize_tied_weights

    PATCHES.apply(module, "_synchronize_tied_weights", make, label=LABEL)
