"""Per-node compute speed for the emulator (pure data): how fast each emulated node's accelerator is
relative to the fastest, and the CPU quota that emulates it.

Each node's processes run in a cgroup-v1 ``cpu`` cgroup whose CFS quota is proportional to its speed:
the fastest node's ranks get ``cpu_per_rank`` of a core each, a node at half speed half of that. A quota
is a *ceiling*, not a guarantee: on a shared machine the ratio between nodes holds only while every node
can actually get its ceiling, so the default ``cpu_per_rank`` keeps the sum of all quotas at
``CPU_BUDGET`` of the machine's cores. The cgroup's ``cpu.shares`` (the weight when the CPU is
contended) is proportional to the speed as well: a rank of the fastest node weighs what any other process
weighs (1024), a rank at half speed half of that, so under contention the ratio still roughly holds and
the emulator never takes more than its fair share from other users of the machine (docs/emulator.md,
"Compute speed").

Speeds come from the cluster's accelerators (``"catalog"``: sustained FLOP/s, peak x efficiency, the same
numbers the planner uses) or are given per node or per cluster name (any positive unit; only ratios count).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

from ...core.inputs.cluster import Cluster
from ...core.errors import ConfigError

CATALOG = "catalog"
TASK_WEIGHT = 1024            # cpu.shares of one ordinary process (CFS nice 0)
PERIOD_US = 20_000           # CFS period: short, so a throttled rank stalls in slices of ms, not of 100 ms
MIN_QUOTA_US = 1_000         # the kernel refuses a quota under 1 ms
MAX_SPEED_RATIO = 20.0       # fastest / slowest; beyond this the slowest quota is too coarse to mean much
MAX_CPU_PER_RANK = 4.0       # cores per rank of the fastest node
CPU_BUDGET = 0.75            # default: all quotas together get at most this share of the machine's cores

SpeedInput = Union[None, str, Mapping[str, float]]


@dataclass(frozen=True)
class CpuShare:
    """One node's compute shaping: ``speed`` relative to the fastest node (1.0), and its cgroup quota
    (all of the node's processes together get ``quota_us`` of CPU time per ``period_us``)."""
    speed: float
    cores_per_rank: float
    quota_us: int
    period_us: int = PERIOD_US

    shares: int = TASK_WEIGHT

    @property
    def cores(self) -> float:
        return self.quota_us / self.period_us


def _check_value(name: str, v) -> float:
    field = f"speed[{name}]"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{v!r} is not a number", field=field, fix="give a positive relative speed, e.g. 1 or 0.5")
    if not math.isfinite(v) or v <= 0:
        raise ConfigError(f"speed must be a finite number > 0, got {v}", field=field,
                          fix="give a positive relative speed, e.g. 1 for the fastest node and 0.5 for one "
                              "at half speed")
    if v > 1e9:
        raise ConfigError(f"speed {v:g} is absurdly large", field=field,
                          fix="speeds are relative (only ratios count): e.g. 1 and 0.5, or TFLOPS such as 989 and 312")
    return float(v)


def node_speeds(cluster: Cluster, speeds: SpeedInput) -> Optional[tuple[float, ...]]:
    """Each node's speed relative to the fastest (1.0), in node order; None when ``speeds`` is None
    (compute is not shaped). Names may be node names or cluster names; a node name wins."""
    if speeds is None:
        return None
    if isinstance(speeds, str):
        if speeds != CATALOG:
            raise ConfigError(f"{speeds!r} is not a speed source", field="speed",
                              fix=f"pass {CATALOG!r} (from the cluster's accelerators) or a mapping of node or "
                                  "cluster names to relative speeds, e.g. {'ib': 2, 'roce': 1}")
        raw = [n.accelerator.sustained_flops for n in cluster.nodes]
    else:
        if not speeds:
            raise ConfigError("no speeds given", field="speed",
                              fix="name every node or cluster, e.g. {'ib': 2, 'roce': 1}, or use 'catalog'")
        values = {str(k): _check_value(str(k), v) for k, v in speeds.items()}
        known = {n.name for n in cluster.nodes} | set(cluster.cluster_names)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown node or cluster names {unknown}", field="speed",
                              fix="use node names (" + ", ".join(n.name for n in cluster.nodes[:4])
                                  + ") or cluster names (" + ", ".join(cluster.cluster_names) + ")")
        missing = [n.name for n in cluster.nodes if n.name not in values and n.cluster not in values]
        if missing:
            raise ConfigError(f"no speed for nodes {missing}", field="speed",
                              fix="give a speed for every node, by node name or by its cluster's name")
        raw = [values.get(n.name, values.get(n.cluster)) for n in cluster.nodes]
    top, low = max(raw), min(raw)
    if top / low > MAX_SPEED_RATIO:
        slow = cluster.nodes[raw.index(low)].name
        raise ConfigError(f"the fastest node is {top / low:.3g}x as fast as {slow}: the emulator shapes at most "
                          f"{MAX_SPEED_RATIO:g}x", field="speed",
                          fix=f"bring the speeds within {MAX_SPEED_RATIO:g}x of each other")
    return tuple(r / top for r in raw)


def default_cpu_per_rank(speeds: Sequence[float], ranks: Sequence[int], cores: Optional[int] = None) -> float:
    """The fastest rank's share of a core such that all quotas together are ``CPU_BUDGET`` of the
    machine's cores (capped at one core: a rank is one thread that computes)."""
    cores = cores or len(os.sched_getaffinity(0)) or 1     # the cores this process may use (cpuset, taskset)
    demand = sum(s * r for s, r in zip(speeds, ranks))
    return min(1.0, CPU_BUDGET * cores / demand)


def cpu_shares(cluster: Cluster, speeds: SpeedInput, cpu_per_rank: Optional[float] = None,
               cores: Optional[int] = None) -> Optional[tuple[CpuShare, ...]]:
    """Per node (in node order) its speed and quota; None when compute is not shaped. Validated here, before
    anything is created: a quota under the kernel's 1 ms is refused naming the node."""
    rel = node_speeds(cluster, speeds)
    if rel is None:
        if cpu_per_rank is not None:
            raise ConfigError("cpu_per_rank without speeds", field="cpu_per_rank",
                              fix="also give speeds (e.g. 'catalog'), or drop cpu_per_rank")
        return None
    ranks = [n.num_accelerators for n in cluster.nodes]
    if cpu_per_rank is None:
        cpu_per_rank = default_cpu_per_rank(rel, ranks, cores)
    elif isinstance(cpu_per_rank, bool) or not isinstance(cpu_per_rank, (int, float)) \
            or not (math.isfinite(cpu_per_rank) and 0 < cpu_per_rank <= MAX_CPU_PER_RANK):
        raise ConfigError(f"{cpu_per_rank!r} is not a share of a core the emulator takes (0 < x <= "
                          f"{MAX_CPU_PER_RANK:g})", field="cpu_per_rank",
                          fix="give the fastest rank's share of one core, e.g. 0.5")
    out = []
    for node, s, r in zip(cluster.nodes, rel, ranks):
        quota = int(round(s * cpu_per_rank * r * PERIOD_US))
        if quota < MIN_QUOTA_US:
            raise ConfigError(f"node {node.name} would get {quota} us of CPU per {PERIOD_US} us period (speed "
                              f"{s:.3g} x {cpu_per_rank:g} core per rank x {r} ranks); the kernel's minimum is "
                              f"{MIN_QUOTA_US} us", field="cpu_per_rank",
                              fix="raise cpu_per_rank, or bring the speeds closer together")
        out.append(CpuShare(s, s * cpu_per_rank, quota, PERIOD_US, max(2, int(round(TASK_WEIGHT * s * r)))))
    return tuple(out)
