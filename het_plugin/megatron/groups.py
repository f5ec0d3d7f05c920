"""Megatron-Core's groups, built on the plan's placement (the mechanism; see docs/megatron.md).

Megatron-Core takes every group's rank list from ``RankGenerator.get_ranks`` and creates every group
through ``parallel_state.create_group``. While :func:`planned_groups` is active:

* ``get_ranks`` returns *physical* ranks: each logical rank ``r`` becomes ``plan.rank_of_logical[r]``
  (one permutation serves the decoder and the expert generator, and every combined group);
* ``create_group`` asks het_plugin's one group policy (:mod:`het_plugin.runtime.group_policy`, through the
  :class:`~het_plugin.runtime.applied.AppliedPlan`) how to create the group -- backend (``het_shim`` for
  groups spanning vendors), ``pg_options`` (NCCL ``net_name`` per communicator, or the shim's options),
  the gloo interface, and ``sort_ranks=False`` for a permuted member list, so a member's group rank is
  its parallel coordinate (sorting would make a permuted pipeline's group ranks disagree with
  ``_PIPELINE_GLOBAL_RANKS``: Megatron then deadlocks, seen with PP=4 and tied embeddings).
  ``create_group`` calls ``torch.distributed.new_group`` itself, so the order flag is added there for the
  duration of that one call. Megatron's NCCL options are copied per group before the plan's ``net_name`` is
  written (Megatron shares one object among hierarchical groups; :mod:`het_plugin.runtime.nccl_options`).

Group building is guarded (:mod:`het_plugin.runtime.guard`): every gloo group is created with at most the
bound as its creation timeout (Megatron's ``distributed_timeout_minutes`` is restored on the group), and a
rank that fails or disappears stops every rank within the bound.

The global rank itself is never relabelled: logs, checkpoints and LOCAL_RANK -> device stay the launcher's.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Optional

from ..runtime.applied import AppliedPlan
from ..runtime.group_policy import spans_vendors
from ..runtime.nccl_options import OptionNotes
from ..runtime.patches import PATCHES

log = logging.getLogger("het_plugin.megatron")


@contextlib.contextmanager
def planned_groups(applied: AppliedPlan, *, parallel_state=None, timeout_s: Optional[float] = None
                   ) -> Iterator[AppliedPlan]:
    """Patch Megatron-Core's rank generator and group creation for the duration of group building;
    every group created is recorded in ``applied.records``. The phase is guarded (runtime.guard): a rank
    that fails or disappears stops every rank within ``timeout_s`` (None: HET_PLUGIN_TIMEOUT or the default).
    Groups made after the window follow the plan through :func:`het_plugin.megatron.late_groups.install`; the
    caller ends a previous plan's (:func:`het_plugin.megatron.late_groups.uninstall`, as ``mcore.build_groups``)."""
    if parallel_state is None:
        from megatron.core import parallel_state
    if spans_vendors(applied.plan):
        from .. import comm  # noqa: F401   registers het_shim, the backend of groups spanning vendors
    with PATCHES.temporarily("megatron.groups", [(parallel_state.RankGenerator, "get_ranks", planned_get_ranks(applied)),
                                                 (parallel_state, "create_group", planned_create_group(applied))]):
        with applied.guarding("Megatron-Core's initialize_model_parallel", timeout_s=timeout_s):
            yield applied


def planned_get_ranks(applied: AppliedPlan):
    """``make`` for RankGenerator.get_ranks: Megatron's logical lists -> the plan's physical ranks."""
    plan = applied.plan
    perm = list(plan.rank_of_logical)
    identity = plan.is_identity

    def make(orig_get_ranks):
        def get_ranks(self, token):
            ranks = orig_get_ranks(self, token)
            if identity:
                return ranks
            if self.world_size + self.rank_offset > len(perm):
                raise RuntimeError(f"Megatron asks for ranks up to {self.world_size + self.rank_offset}, "
                                   f"the plan places {len(perm)}")
            return [[perm[r] for r in group] for group in ranks]
        return get_ranks
    return make


def planned_create_group(applied: AppliedPlan):
    """``make`` for parallel_state.create_group: each group through the one group policy, on its own copy of
    Megatron's NCCL options (runtime.nccl_options: the user's settings kept, the plan's network on top)."""
    import torch.distributed as dist
    notes = option_notes(applied)

    def make_create_group(orig_create_group):
        def create_group(ranks=None, timeout=None, backend=None, pg_options=None,
                         use_local_synchronization=False, group_desc=None):
            def make(spec):
                note = notes.check(group_desc, spec.ranks, pg_options, spec.net_name)
                if note:
                    log.warning("het_plugin: %s", note)

                def ordered(orig_new_group):
                    extra = {"sort_ranks": False} if not spec.sort_ranks else {}

                    def new_group(*args, **kwargs):       # Megatron's create_group passes everything by keyword
                        if not spec.sort_ranks:
                            kwargs["ranks"] = list(spec.torch_ranks)
                        return orig_new_group(*args, **kwargs, **extra)
                    return new_group

                with PATCHES.temporarily("megatron.groups.new_group", [(dist, "new_group", ordered)]):
                    return orig_create_group(ranks, timeout=spec.timeout, backend=spec.backend,
                                             pg_options=spec.pg_options,
                                             use_local_synchronization=use_local_synchronization,
                                             group_desc=group_desc)

            return applied.create(make, ranks, backend=backend, pg_options=pg_options, desc=group_desc,
                                  timeout=timeout)
        return create_group
    return make_create_group


def option_notes(applied: AppliedPlan) -> OptionNotes:
    """The run's one :class:`OptionNotes` (kept on the applied plan: a note is said once per group kind,
    whether the group is made in the initialize window or after it)."""
    notes = applied.__dict__.get("_option_notes")
    if notes is None:
        notes = applied.__dict__["_option_notes"] = OptionNotes(applied.rank)
    return notes
