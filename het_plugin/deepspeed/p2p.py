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

# grid -> the pipeline process group its hops use (grids of applied, non-native plans only)
_routed: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_WRAPPED = "__het_plugin_wrapped__"


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
    if getattr(p2p.send, _WRAPPED, None) is None:
        p2p.send = _wrap_send(p2p.send)
    if getattr(p2p.recv, _WRAPPED, None) is None:
        p2p.recv = _wrap_recv(p2p.recv)


def _wrap_send(original):
    @functools.wraps(original)
    def send(tensor, dest_stage, async_op=False):
        from deepspeed import comm as dist
        from deepspeed.runtime.pipe import p2p
        group = pipeline_group_of(p2p._grid)
        if group is None:
            return original(tensor, dest_stage, async_op=async_op)
        assert async_op is False, "Doesn't support async_op true"       # DeepSpeed's own restriction
        p2p._is_valid_send_recv(p2p._grid.get_stage_id(), dest_stage)
        return dist.send(tensor, p2p._grid.stage_to_global(stage_id=dest_stage), group=group)
    setattr(send, _WRAPPED, original)
    return send


def _wrap_recv(original):
    @functools.wraps(original)
    def recv(tensor, src_stage, async_op=False):
        from deepspeed import comm as dist
        from deepspeed.runtime.pipe import p2p
        group = pipeline_group_of(p2p._grid)
        if group is None:
            return original(tensor, src_stage, async_op=async_op)
        assert async_op is False, "Doesn't support async_op true"
        p2p._is_valid_send_recv(src_stage, p2p._grid.get_stage_id())
        return dist.recv(tensor, p2p._grid.stage_to_global(stage_id=src_stage), group=group)
    setattr(recv, _WRAPPED, original)
    return recv
