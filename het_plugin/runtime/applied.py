"""What one rank applied: the agreed plan, the group policy's inputs, and a record of every group.

Both adapters build one :class:`AppliedPlan` after the ranks agree on a plan and run the network pre-flight
(:meth:`AppliedPlan.begin` does both), create every group
through :meth:`AppliedPlan.create`, and hand the object to the user (Megatron: returned and kept for
``current_plan()``; DeepSpeed: ``module.het_applied`` / ``engine.het_applied``).

The group-building phase of each adapter runs inside :meth:`AppliedPlan.guarding`
(:mod:`het_plugin.runtime.guard`): a rank that fails or disappears there stops every rank within the bound.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Sequence

from ..core.plan import Plan
from .group_policy import GroupRecord, GroupSpec, Policy, spec_for
from .guard import GroupGuard, bounds_creation, restore_timeout, torch_default_timeout
from .replicas import ReplicaShare
from .preflight import check_network

log = logging.getLogger("het_plugin")


@dataclass
class AppliedPlan:
    plan: Plan
    rank: int
    policy: Policy
    records: list[GroupRecord] = field(default_factory=list)
    guard: Optional[GroupGuard] = None       # set while guarding() is active
    cluster: Any = None                      # the Cluster the plan came from (None for a plan file)

    @classmethod
    def start(cls, plan: Plan, rank: int, default_backend: Optional[str] = None) -> "AppliedPlan":
        """After agreement, before the first group: ``default_backend`` is the world group's (read from
        torch.distributed when None)."""
        if default_backend is None:
            import torch.distributed as tdist
            default_backend = str(tdist.get_backend())
        return cls(plan, rank, Policy(default_backend, native_network=plan.homogeneous and plan.is_identity))

    @classmethod
    def begin(cls, plan: Plan, rank: int, *, cluster=None, timeout_s: Optional[float] = None,
              default_backend: Optional[str] = None) -> "AppliedPlan":
        """What every adapter does between plan agreement and its first group: :meth:`start` the record, then
        the network pre-flight (:meth:`check_network`; ``cluster``: the Cluster the plan came from)."""
        applied = cls.start(plan, rank, default_backend)
        applied.cluster = cluster
        applied.check_network(cluster, timeout_s=timeout_s)
        return applied

    def check_network(self, cluster=None, *, store=None, timeout_s: Optional[float] = None):
        """The mixed-NIC pre-flight (:mod:`het_plugin.runtime.preflight`), after agreement and before the first
        group: under NCCL every rank raises the same ConfigError when the environment contradicts the plan.
        ``cluster``: the Cluster the plan came from (its nodes' ``nics``), None for a plan file."""
        return check_network(self.plan, self.rank, cluster=cluster, native_network=self.policy.native_network,
                             store=store, timeout_s=timeout_s)

    @property
    def replica_share(self) -> ReplicaShare:
        """This rank's data-parallel replica and its share of the global batch (runtime.replicas)."""
        return ReplicaShare.from_plan(self.plan, self.rank)

    def spec(self, ranks: Optional[Sequence[int]], *, backend: Optional[str] = None, pg_options: Any = None,
             ascending_is_launch_order: bool = False) -> GroupSpec:
        return spec_for(self.plan, ranks, self.policy, backend=backend, pg_options=pg_options,
                        ascending_is_launch_order=ascending_is_launch_order)

    @contextlib.contextmanager
    def guarding(self, what: str, *, timeout_s: Optional[float] = None, store=None) -> Iterator[Optional[GroupGuard]]:
        """Bound the group-building phase (:mod:`het_plugin.runtime.guard`); ``what`` names the framework call
        in messages. Nothing is guarded without a store and an initialised torch.distributed, on one rank,
        or on torch's fake backend (Megatron-LM's --fake-process-group: no peers, a store that stores nothing)."""
        if self.guard is not None:
            yield self.guard
            return
        if store is None:
            import torch.distributed as tdist
            if (not (tdist.is_available() and tdist.is_initialized()) or self.plan.world_size <= 1
                    or "fake" in str(tdist.get_backend()).lower()):
                yield None
                return
            from torch.distributed import distributed_c10d
            store = distributed_c10d._get_default_store()
        guard = GroupGuard(store, rank=self.rank, world_size=self.plan.world_size, what=what, timeout=timeout_s)
        self.guard = guard
        try:
            with guard:
                yield guard
        finally:
            self.guard = None

    def create(self, make: Callable[[GroupSpec], Any], ranks: Optional[Sequence[int]], *,
               backend: Optional[str] = None, pg_options: Any = None, desc: Optional[str] = None,
               timeout: Optional[timedelta] = None, ascending_is_launch_order: bool = False) -> Any:
        """Create one group: ``make(spec)`` calls the framework's or torch's creation with the spec; the
        spec's environment is set around it and the group recorded. ``timeout``: what the framework asked
        for (None: torch's default); inside :meth:`guarding` a gloo creation waits at most the bound and
        the group gets ``timeout`` back afterwards (``spec.timeout`` is what the creation uses)."""
        spec = self.spec(ranks, backend=backend, pg_options=pg_options,
                         ascending_is_launch_order=ascending_is_launch_order)
        for warning in self.policy.warnings:
            log.warning("het_plugin: %s", warning)
        self.policy.warnings.clear()
        guard = self.guard
        restore = None
        use = timeout
        if guard is not None and bounds_creation(spec.backend, self.policy.default_backend):
            wanted = timeout if timeout is not None else torch_default_timeout(spec.backend,
                                                                              self.policy.default_backend)
            use = guard.creation_timeout(wanted)
            restore = wanted if use != wanted else None
        spec = dataclasses.replace(spec, timeout=use)
        with (guard.creating(spec.ranks if ranks is not None else None, desc) if guard is not None
              else contextlib.nullcontext()):
            with spec.creating():
                group = make(spec)
        if restore is not None:
            restore_timeout(group, restore)
        self.records.append(GroupRecord(list(spec.ranks), spec.transport, spec.backend, spec.net_name,
                                        spec.gloo_ifname, desc))
        return group
