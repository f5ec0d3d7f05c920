"""The training settings a plan assumed, and the user's own: het_plugin offers them, it does not flip them.

The planner predicts with ``overlap_grad_reduce`` (gradient reduction hidden behind backward) and, where
plain optimizer state does not fit, the distributed optimizer (``Plan.distributed_optimizer``). Both change
Megatron's numerics or its checkpoints (a distributed-optimizer checkpoint does not load into a plain
optimizer, and the other way round), so they stay what the command line says. Where the plan assumed one
the command line lacks, rank 0 says so once and names the flags; ``--heterogeneous-take-plan-settings``
applies them (the old behaviour, now an opt-in).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..core.plan import Plan
from .dist_opt import instances_note

TAKE_FLAG = "--heterogeneous-take-plan-settings"


@dataclass(frozen=True)
class Setting:
    attr: str          # Megatron's args / DDP config / optimizer config field
    flag: str          # Megatron-LM's command-line flag
    why: str           # what the plan's prediction counts on it for


SETTINGS = (
    Setting("use_distributed_optimizer", "--use-distributed-optimizer",
            "its memory fit counts on optimizer state sharded over data-parallel ranks"),
    Setting("overlap_grad_reduce", "--overlap-grad-reduce",
            "its iteration time hides gradient reduction behind backward"),
)


def planned_settings(plan: Plan) -> dict[str, bool]:
    """The settings the plan assumed on (a homogeneous plan assumes no overlap of its own: it is Megatron's run)."""
    wanted = {}
    if plan.distributed_optimizer:
        wanted["use_distributed_optimizer"] = True
    if plan.overlap_grad_reduce and not plan.homogeneous:
        wanted["overlap_grad_reduce"] = True
    return wanted


def take_plan_settings(args: Any) -> bool:
    """``--heterogeneous-take-plan-settings`` on the command line."""
    return bool(getattr(args, "heterogeneous_take_plan_settings", False))


def missing_settings(args: Any, plan: Plan) -> list[Setting]:
    """The plan's assumed settings the run does not have."""
    wanted = planned_settings(plan)
    return [s for s in SETTINGS if wanted.get(s.attr) and not getattr(args, s.attr, False)]


def offer(args: Any, plan: Plan) -> Optional[str]:
    """One line for rank 0 where the run lacks a setting the plan assumed (None where it has them all), and one where
    the optimizer instances differ from the plan's (a user's count kept, or 1 without the distributed optimizer)."""
    instances = instances_note(args, plan)     # applied already (args.py): what is kept or left at 1 is said
    missing = missing_settings(args, plan)
    if not missing:
        return instances
    said = "; ".join(f"{s.flag} ({s.why})" for s in missing)
    flags = " ".join(s.flag for s in missing)
    return (f"het_plugin: plan {plan.hash} assumed {said}; this run keeps the command line's settings, so its "
            f"prediction does not hold as made. To run as planned add {flags} (or {TAKE_FLAG}); a run resumed "
            f"from a checkpoint keeps the optimizer it was saved with" + (f"\n{instances}" if instances else ""))
