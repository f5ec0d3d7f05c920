"""What one rank applied: the agreed plan, the group policy's inputs, and a record of every group.

Both adapters build one :class:`AppliedPlan` after the ranks agree on a plan, create every group
through :meth:`AppliedPlan.create`, and hand the object to the user (Megatron: returned and kept for
``current_plan()``; DeepSpeed: ``module.het_applied`` / ``engine.het_applied``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from ..plan import Plan
from .groups import GroupRecord, GroupSpec, Policy, spec_for

log = logging.getLogger("het_plugin")


@dataclass
class AppliedPlan:
    plan: Plan
    rank: int
    policy: Policy
    records: list[GroupRecord] = field(default_factory=list)

    @classmethod
    def start(cls, plan: Plan, rank: int, default_backend: Optional[str] = None) -> "AppliedPlan":
        """After agreement, before the first group: ``default_backend`` is the world group's (read from
        torch.distributed when None)."""
        if default_backend is None:
            import torch.distributed as tdist
            default_backend = str(tdist.get_backend())
        return cls(plan, rank, Policy(default_backend, native_network=plan.homogeneous and plan.is_identity))

    def spec(self, ranks: Optional[Sequence[int]], *, backend: Optional[str] = None, pg_options: Any = None,
             ascending_is_launch_order: bool = False) -> GroupSpec:
        return spec_for(self.plan, ranks, self.policy, backend=backend, pg_options=pg_options,
                        ascending_is_launch_order=ascending_is_launch_order)

    def create(self, make: Callable[[GroupSpec], Any], ranks: Optional[Sequence[int]], *,
               backend: Optional[str] = None, pg_options: Any = None, desc: Optional[str] = None,
               ascending_is_launch_order: bool = False) -> Any:
        """Create one group: ``make(spec)`` calls the framework's or torch's creation with the spec; the
        spec's environment is set around it and the group recorded."""
        spec = self.spec(ranks, backend=backend, pg_options=pg_options,
                         ascending_is_launch_order=ascending_is_launch_order)
        for warning in self.policy.warnings:
            log.warning("het_plugin: %s", warning)
        self.policy.warnings.clear()
        with spec.creating():
            group = make(spec)
        self.records.append(GroupRecord(list(spec.ranks), spec.transport, spec.backend, spec.net_name,
                                        spec.gloo_ifname, desc))
        return group
