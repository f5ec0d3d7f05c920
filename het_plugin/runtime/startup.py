"""The start-up sequence, written once for every entry point of both adapters (Megatron-Core's
``initialize_model_parallel``, Megatron-LM's, DeepSpeed's ``PipelineModule`` and ``initialize``):

  the launch's timeout -> plan resolution -> re-plan on restart -> the adapter's checks of the plan ->
  agreement of every rank on the plan's hash (with, for a plan that leaves nodes out, every rank's host:
  :mod:`het_plugin.runtime.launch_hosts`) -> :meth:`AppliedPlan.begin` (the network pre-flight)

and then the adapter creates its groups. A rank whose planning or checks fail publishes its error at the agreement,
so every rank stops with it before any group exists (:mod:`het_plugin.runtime.agreement`).

Megatron-LM plans a cluster or plan file at ``parse_args``, before any process group (its arguments must carry the
plan before Megatron validates them): it runs :func:`resolve_start` there and hands the outcome (a Resolved or the
error) to :func:`startup` later, as :attr:`Planning.earlier`; the bare flag (discovery) plans inside startup.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from ..core.launch import Resolved
from ..core.plan import Plan
from ..core.request import LaunchRequest
from . import agreement, restart_replan
from .applied import AppliedPlan
from .exchange import configured_timeout
from .launch_hosts import HostCheck, this_host

#: ``resolve(profile) -> Resolved``: the adapter's plan resolution; ``profile`` None: as usual, else a measured
#: profile to plan with (re-planning on restart)
Resolve = Callable[[Any], Resolved]


@dataclass(frozen=True)
class Replan:
    """Re-plan on restart (:mod:`het_plugin.runtime.restart_replan`): where the last attempt's measured profile is,
    the checkpoint to resume (a CheckpointShape, or a callable reading it; None: nothing to resume), and whether it
    was saved with the distributed optimizer."""
    profile_path: str
    checkpoint: Any = None
    distributed_optimizer: Optional[bool] = None


@dataclass(frozen=True)
class Planning:
    """How this start gets its plan: ``resolve`` (with ``replan``: re-planned on restart), or ``earlier``, the
    outcome of :func:`resolve_start` run before any process group (a Resolved, or the error it raised);
    ``check(resolved)``: the adapter's checks of the plan against what it is about to build (a ConfigError
    there stops every rank, like a planning error)."""
    resolve: Optional[Resolve] = None
    replan: Optional[Replan] = None
    check: Optional[Callable[[Resolved], None]] = None
    earlier: Union[Resolved, BaseException, None] = None


@dataclass(frozen=True)
class Started:
    """What the caller builds on: the agreed plan, the cluster it came from (None for a plan file), and the
    AppliedPlan that records its groups."""
    plan: Plan
    cluster: Any
    applied: AppliedPlan


def resolve_start(planning: Planning, rank: int) -> Resolved:
    """The plan this start runs, re-planned on restart when asked (rank 0 prints the reasoning). Needs no process
    group: Megatron-LM calls it at ``parse_args``."""
    if planning.replan is None:
        return planning.resolve(None)
    replan = planning.replan
    chosen, decision = restart_replan.resolve_on_restart(planning.resolve, replan.profile_path,
                                                         checkpoint=replan.checkpoint,
                                                         distributed_optimizer=replan.distributed_optimizer)
    if rank == 0:
        print("\n".join(f"het_plugin: {line}" for line in decision.lines), flush=True)
    return chosen


def bounded(request: LaunchRequest) -> contextlib.AbstractContextManager:
    """The launch's timeout over every wait inside (``configured_timeout``): startup's, and the adapter's group
    creation after it."""
    t = request.timeout
    return configured_timeout(t.seconds, t.field, t.source)


def startup(request: LaunchRequest, planning: Planning, *, store=None,
            default_backend: Optional[str] = None) -> Started:
    """Run the start-up sequence (module docstring) on ``request.launch.rank``. ``store``: the agreement's
    (None: torch.distributed's default store); ``default_backend``: the world group's (None: torch.distributed's)."""
    launch, seconds = request.launch, request.timeout.seconds
    with bounded(request):
        resolved = agreement.agree_on_plan(lambda: _planned(planning, launch.rank), rank=launch.rank,
                                           world_size=launch.world_size, store=store, timeout_s=seconds,
                                           hash_of=lambda r: r.plan.hash, fact=HostCheck(this_host(launch)))
        applied = AppliedPlan.begin(resolved.plan, launch.rank, cluster=resolved.cluster, timeout_s=seconds,
                                    default_backend=default_backend)
    return Started(resolved.plan, resolved.cluster, applied)


def _planned(planning: Planning, rank: int) -> Resolved:
    if isinstance(planning.earlier, BaseException):
        raise planning.earlier
    resolved = planning.earlier if planning.earlier is not None else resolve_start(planning, rank)
    if planning.check is not None:
        planning.check(resolved)
    return resolved

