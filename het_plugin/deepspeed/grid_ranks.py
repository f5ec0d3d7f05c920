"""The grid's "model-parallel rank" in DeepSpeed's logical order, so gradient clipping is DeepSpeed's own.

DeepSpeed 0.19.8's ``PipelineParallelGrid.__init__`` (runtime/pipe/topology.py) builds one "model-parallel"
group per data slice -- every rank with the same 'data' coordinate, all stages and tensor slices -- from
``sorted(topo.get_axis_list('data', d))`` and sets ``ds_model_rank`` to this rank's index in that *sorted* list
of global ranks. ``clip_grad_norm_`` (runtime/utils.py; the engine's ``clip_fp32_gradients`` passes the grid
as ``mpu``, and ``gradient_clipping`` defaults to 1.0) counts a parameter that is not marked model-parallel
only where ``mpu.get_model_parallel_rank() == 0``, then sums over that group. With DeepSpeed's own topology
rank 0 of the slice is the lowest global rank, i.e. stage 0 (tensor slice 0), so the clip norm is stage 0's
gradients' norm (plus model-parallel parameters everywhere). Under a plan that permutes ranks the lowest
global rank of a slice may sit on another stage, so the norm -- and with clipping on, the update -- would
change although the split is the same.

:func:`align_model_parallel_rank` sets ``ds_model_rank`` to this rank's index among the slice's *logical*
ranks, which is what DeepSpeed computes for the same coordinates on its own topology. The group itself
(members, creation order) is untouched: only which member counts as "0" changes. The same rank feeds
``get_grad_zeros``, ``get_weight_norm`` and ZeRO's norm (all through ``get_model_parallel_rank`` or
``bwc_tensor_model_parallel_rank``, the latter reading the 'model' coordinate, already the plan's).
"""
from __future__ import annotations

from ..core.plan import Plan


def logical_model_rank(plan: Plan, rank: int) -> int:
    """This rank's index in its data slice, counted in logical (DeepSpeed topology) order."""
    logical = plan.logical_of_physical
    mine = logical[rank]
    data = plan.coord(rank)["dp"]
    slice_logicals = sorted(logical[r] for r in range(plan.world_size) if plan.coord(r)["dp"] == data)
    return slice_logicals.index(mine)


def align_model_parallel_rank(grid, plan: Plan) -> None:
    """Give ``grid`` DeepSpeed's model-parallel rank for this rank's coordinates (no-op on an identity plan)."""
    if plan.is_identity:
        return
    grid.ds_model_rank = logical_model_rank(plan, grid.global_rank)
