"""DeepSpeed's pipeline hops over the plan's pipeline groups.

``deepspeed.runtime.pipe.p2p.send/recv`` (0.19.8) send to a global rank with no group
(``dist.send(tensor, dest_rank)``, the per-pair broadcast groups being for torch < 1.8 only), so pipeline
traffic would run on the world group's communicator -- the launcher's transport, not the one the plan
gave the ``pp`` groups (a fabric inside a cluster, sockets across, ``het_shim`` across vendors).

:func:`route_pipeline_hops` registers a grid whose plan is applied; while it is the grid the engine gave
``p2p.init_process_groups``, ``p2p.send``/``p2p.recv`` send over the grid's pipeline group (the plan's
``pp`` group holding this rank: both ends of every hop are in it, since a hop changes only the stage).
Every other grid -- DeepSpeed's own, or a homogeneous identity plan's -- keeps DeepSpeed's functions'
behaviour, which is why they are wrapped (once, process-wide) and not replaced.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any

from ..runtime.patches import PATCHES

# grid -> the pipeline process group its hops use (grids of applied, non-native plans only)
_routed: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
PATCH_LABEL = "deepspeed.p2p"       # DeepSpeed's pipeline send/recv, over the plan's pipeline groups


def route_pipeline_hops(grid, applied) -> bool:
    """Send this grid's pipeline hops over its pipeline group when the plan is applied; returns whether it
    does. A homogeneous identity plan (``applied.policy.native_network``) keeps DeepSpeed's world-group hops."""
    if applied is None or applied.policy.native_network or grid.pipe_parallel_size <= 1:
        return False
    _install()
    _routed[grid] = grid.get_pipe_parallel_group()
    return True


def pipeline_group_of(grid):
    """The group this grid's hops go through (None: DeepSpeed's own, the world group)."""
    return _routed.get(grid) if grid is not None else None


def _install() -> None:
    from deepspeed.runtime.pipe import p2p
    for name in ("send", "recv"):
        PATCHES.apply(p2p, name, functools.partial(_wrap, name=name), label=PATCH_LABEL)


def _wrap(original, name: str):
    """DeepSpeed's p2p.send / p2p.recv (``name``), over the plan's pipeline group when one is applied."""
    @functools.wraps(original)
    def hop(tensor, peer_stage, async_op=False):
        from deepspeed import comm as dist
        from deepspeed.runtime.pipe import p2p
        group = pipeline_group_of(p2p._grid)
        if group is None:
            return original(tensor, peer_stage, async_op=async_op)
        assert async_op is False, "Doesn't support async_op true"       # DeepSpeed's own restriction
        here = p2p._grid.get_stage_id()
        p2p._is_valid_send_recv(*((here, peer_stage) if name == "send" else (peer_stage, here)))
        return getattr(dist, name)(tensor, p2p._grid.stage_to_global(stage_id=peer_stage), group=group)
    return hop
