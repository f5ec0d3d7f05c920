"""What one launch asks for, as one value: built once per adapter from the framework's own names and passed
unchanged to plan resolution (:func:`het_plugin.core.launch.resolve_launch`), the launch checks and the planner
(:func:`het_plugin.core.planner.make_plan`).

Adding a degree or a setting changes this value and its readers, not a chain of signatures.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Union

from .ranks.dims import DEFAULT_ORDER, Degrees

DEGREE_FIELDS = ("tp", "pp", "dp", "cp", "ep", "etp", "order")


@dataclass(frozen=True)
class Launch:
    """What the launcher started (WORLD_SIZE, RANK, LOCAL_WORLD_SIZE) and, where known, the hostnames of its
    nodes in node_rank order (``nodes``, None: not known; a plan file that leaves nodes out is then checked by
    world size at resolution) and the host this rank runs on (``host``, None: ``HET_PLUGIN_NODE_NAME`` or the
    hostname). The adapters' start-up gathers every rank's host at the plan agreement
    (:mod:`het_plugin.runtime.launch_hosts`): no rank knows the others' before it."""
    world_size: int
    rank: Optional[int] = None
    local_world_size: Optional[int] = None
    nodes: Optional[tuple[str, ...]] = None
    host: Optional[str] = None


class Schedule(NamedTuple):
    """The pipeline schedule: ``vpp`` virtual stages per pipeline rank (None: not set, 1: not interleaved) and
    whether the interleaved schedule overlaps its p2p with compute (None: the planner's default, on with vpp > 1).
    A named tuple, so that the planner's (vpp, overlap) pairs stay one type."""
    vpp: Optional[int] = None
    overlap_p2p_comm: Optional[bool] = None


@dataclass(frozen=True)
class Timeout:
    """The bound on every start-up wait (None: ``HET_PLUGIN_TIMEOUT``, else the default) and the name its
    error messages give it (the user's flag or config key, and where it came from)."""
    seconds: Optional[float] = None
    field: str = "timeout_s"
    source: Optional[str] = None


@dataclass(frozen=True)
class LaunchRequest:
    """One launch's request: the degrees the user fixed (None: the planner's to choose; ``names`` and
    ``source`` inside for messages), the schedule, the micro-batch size (None: the planner's), the replica split
    ("auto", "even", "uneven" or counts per replica), the start-up timeout, and what the user calls each field."""
    launch: Launch
    degrees: Degrees
    schedule: Schedule = Schedule()
    micro_batch_size: Optional[int] = None
    replica_split: Union[str, Sequence[int]] = "auto"
    timeout: Timeout = Timeout()
    names: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)
    use_all_nodes: bool = True           # False: the planner may leave node groups out (core.subsets); the
    #                                      adapters set it from the user's ask (runtime.all_nodes)
    optimizer_instances: bool = True     # False: no partial distributed optimizer (DeepSpeed has none)

    @classmethod
    def of(cls, world_size: int, *, rank: Optional[int] = None, local_world_size: Optional[int] = None,
           nodes: Optional[Sequence[str]] = None, host: Optional[str] = None,
           names: Optional[Mapping[str, str]] = None, source: Optional[str] = None, timeout: Timeout = Timeout(),
           **fields: Any) -> "LaunchRequest":
        """Built from flat fields: the degrees (``tp`` ... ``order``; ``cp``/``order`` None: 1 and Megatron's
        order), ``vpp``, ``overlap_p2p_comm``, ``micro_batch_size``, ``replica_split``. The degrees are checked
        here (a ConfigError names the user's field)."""
        names = dict(names or {})
        degrees = {k: fields.pop(k) for k in DEGREE_FIELDS if k in fields}
        degrees["cp"] = degrees.get("cp") or 1
        degrees["order"] = degrees.get("order") or DEFAULT_ORDER
        schedule = Schedule(fields.pop("vpp", None), fields.pop("overlap_p2p_comm", None))
        return cls(Launch(world_size, rank, local_world_size, tuple(nodes) if nodes is not None else None, host),
                   Degrees(world_size, **degrees, names=names, source=source), schedule, timeout=timeout,
                   names=names, **fields)

    def planner_options(self) -> dict[str, Any]:
        """The request as the planner's keyword form reads it (``make_plan(cluster, model, **options)``; vpp None:
        1, not interleaved): what a search over node subsets, each its own world size, passes on."""
        d, sched = self.degrees, self.schedule
        return {"tp": d.tp, "pp": d.pp, "dp": d.dp, "cp": d.cp, "ep": d.ep, "etp": d.etp, "order": d.order,
                "micro_batch_size": self.micro_batch_size, "vpp": 1 if sched.vpp is None else sched.vpp,
                "overlap_p2p_comm": sched.overlap_p2p_comm, "replica_split": self.replica_split,
                "optimizer_instances": self.optimizer_instances}

    def settings(self) -> dict[str, Any]:
        """The schedule as :func:`het_plugin.core.launch.check_launch_settings` reads it."""
        return self.schedule._asdict()
