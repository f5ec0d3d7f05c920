"""Plan agreement for the DeepSpeed adapter: a rank whose own input is bad raises *its* ConfigError.

``het_plugin.agreement`` publishes each rank's plan hash (or its error) in the default store and stops
every rank on any difference. Here the rank that failed re-raises its own ConfigError (the file, field
and fix of its problem) after telling the others, who raise PlanMismatchError naming it.
"""
from __future__ import annotations

from typing import Callable

from ..agreement import check_plan_agreement, error_value
from ..errors import PlanMismatchError
from ..plan import Plan


def agree(make: Callable[[], Plan], *, rank: int, world_size: int, store=None) -> Plan:
    try:
        plan = make()
    except Exception as exc:
        try:
            check_plan_agreement(error_value(exc), rank=rank, world_size=world_size, store=store)
        except PlanMismatchError:
            pass            # expected: this rank's own error is the clearer message
        raise
    check_plan_agreement(plan.hash, rank=rank, world_size=world_size, store=store)
    return plan
