"""Megatron-Core's groups, built on the plan's placement (the mechanism; see docs/megatron.md).

Megatron-Core 0.16 takes every group's rank list from ``RankGenerator.get_ranks`` and creates every
group through ``parallel_state.create_group``. While :func:`planned_groups` is active:

* ``get_ranks`` returns *physical* ranks: each logical rank ``r`` becomes ``plan.rank_of_logical[r]``
  (one permutation serves the decoder and the expert generator, and every combined group);
* ``create_group`` creates the group with ``sort_ranks=False``, so a member's group rank is its
  position in the list, i.e. its parallel coordinate (tp rank, pp stage, ...). Sorting would make a
  permuted pipeline's group ranks disagree with ``_PIPELINE_GLOBAL_RANKS`` (Megatron then deadlocks,
  seen with PP=4 and tied embeddings) and would shuffle TP shards between stages;
* each creation runs inside ``netselect.gloo_network(transport)`` (gloo picks its interface per group
  from GLOO_SOCKET_IFNAME), and groups whose transport is 'host-staged' (spanning vendors) use the
  cross-vendor backend ``het_shim`` (het_plugin.comm).

The global rank itself is never relabelled: logs, checkpoints and LOCAL_RANK -> device stay the launcher's.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator, Optional, Sequence

from ..netselect import SHIM_BACKEND, gloo_network  # noqa: F401  (SHIM_BACKEND: part of this module's API)
from ..plan import Plan

log = logging.getLogger("het_plugin.megatron")

_lock = threading.Lock()
_warned_no_shim = False


def transport_of(plan: Plan, ranks: Sequence[int]) -> str:
    return plan.transport_of(ranks)


def shim_backend() -> Optional[str]:
    """'het_shim' when the cross-vendor backend is registered, else None (warned once)."""
    global _warned_no_shim
    from ..comm import registered_backend     # registers the backend; imported only for cross-vendor groups
    registered = registered_backend()
    if registered is None and not _warned_no_shim:
        _warned_no_shim = True
        log.warning("a group spans accelerator vendors but the het_shim backend is not available; "
                    "creating it with the default backend")
    return registered


def backend_for(transport: str, backend: Optional[str]) -> Optional[str]:
    """The backend a group is created with: host-staged groups go through the shim (gloo twins stay gloo)."""
    if transport == "host-staged" and backend in (None, "nccl"):
        return shim_backend() or backend
    return backend


@contextlib.contextmanager
def planned_groups(plan: Plan, *, parallel_state=None) -> Iterator[list[dict]]:
    """Patch Megatron-Core's rank generator and group creation for the duration of group building.

    Yields a list that collects one record per created group (ranks, transport, backend, desc) for
    logging and tests.
    """
    import torch.distributed as dist

    if parallel_state is None:
        from megatron.core import parallel_state
    perm = list(plan.rank_of_logical)
    identity = plan.is_identity
    created: list[dict] = []
    RankGenerator = parallel_state.RankGenerator
    orig_get_ranks = RankGenerator.get_ranks
    orig_create_group = parallel_state.create_group

    def get_ranks(self, token):
        ranks = orig_get_ranks(self, token)
        if identity:
            return ranks
        if self.world_size + self.rank_offset > len(perm):
            raise RuntimeError(f"Megatron asks for ranks up to {self.world_size + self.rank_offset}, "
                               f"the plan places {len(perm)}")
        return [[perm[r] for r in group] for group in ranks]

    def create_group(ranks=None, timeout=None, backend=None, pg_options=None,
                     use_local_synchronization=False, group_desc=None):
        transport = transport_of(plan, ranks) if ranks is not None else "socket"
        chosen = backend_for(transport, backend)
        created.append({"ranks": list(ranks) if ranks is not None else None, "transport": transport,
                        "backend": chosen, "desc": group_desc})
        orig_new_group = dist.new_group

        def new_group(*args, **kwargs):
            if not identity:
                kwargs["sort_ranks"] = False
            return orig_new_group(*args, **kwargs)

        with gloo_network(transport):
            dist.new_group = new_group
            try:
                return orig_create_group(ranks, timeout=timeout, backend=chosen, pg_options=pg_options,
                                         use_local_synchronization=use_local_synchronization,
                                         group_desc=group_desc)
            finally:
                dist.new_group = orig_new_group

    with _lock:
        RankGenerator.get_ranks = get_ranks
        parallel_state.create_group = create_group
        try:
            yield created
        finally:
            RankGenerator.get_ranks = orig_get_ranks
            parallel_state.create_group = orig_create_group
