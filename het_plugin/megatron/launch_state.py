"""Megatron-LM's plan between its two calls: ``parse_args`` (where a cluster or plan file is planned, before any
process group) and ``initialize_model_parallel`` (where the ranks agree and the groups are built). Megatron-LM
passes nothing between them that het_plugin could use, so the launch's state waits here.

One value per launch, replaced (never edited) by :func:`write`, its only writer: prepare_args writes a new launch
(and the plan or error of a file), planned_initialize_model_parallel the plan the bare flag discovered.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class LaunchState:
    args: Any = None
    source: Optional[str] = None
    argv: tuple = ()
    plan_out: Optional[str] = None
    plan: Any = None
    cluster: Any = None          # the Cluster the plan came from (its nodes' NICs, for the pre-flight)
    error: Optional[BaseException] = None
    changes: tuple = ()          # what the plan changed in Megatron's arguments, for the log


_state = LaunchState()


def current() -> LaunchState:
    """This process's launch state (empty before ``parse_args`` saw ``--heterogeneous-nic``)."""
    return _state


def write(state: LaunchState) -> LaunchState:
    """Replace the launch state; returns it."""
    global _state
    _state = state
    return state
