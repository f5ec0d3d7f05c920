"""What het_plugin applied in this Megatron process (docs/architecture.md, "Module-level state").

Megatron-Core keeps its groups in module globals (parallel_state); model code reaches what het_plugin applied the
same way, through :func:`current_plan` (documented as ``het_plugin.megatron.mcore.current_plan``). A module of its
own so that the readers (replicas, collection, group_check) need not import the group building. One writer:
:func:`write`, called by ``mcore.build_groups`` (the plan) and ``mcore.forget_plan`` (None).
"""
from __future__ import annotations

from typing import Optional

from ..runtime.applied import AppliedPlan

_current: Optional[AppliedPlan] = None


def current_plan() -> Optional[AppliedPlan]:
    """What het_plugin applied in this process (None before initialisation or without het_plugin)."""
    return _current


def write(applied: Optional[AppliedPlan]) -> None:
    """Replace what was applied (None: nothing)."""
    global _current
    _current = applied
