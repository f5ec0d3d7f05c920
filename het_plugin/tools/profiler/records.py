"""What the measuring ranks report, and how rank 0 turns the reports into a :class:`~het_plugin.core.inputs.profile.Profile`
(pure: no torch). The records are plain dataclasses that travel as JSON over the job's store."""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Iterable, Optional, Union

from ...core.inputs.profile import Profile

MIN_TRANSFER_SHARE = 0.05   # a transfer's time beyond its latency is taken as at least this share of the time


@dataclass(frozen=True)
class ComputeRecord:
    """One micro-batch of ``kind`` on one rank: mean seconds forward and backward."""
    device: str
    kind: str
    tp: int
    micro_batch_size: int
    forward_s: float
    backward_s: float


@dataclass(frozen=True)
class OptimizerRecord:
    device: str
    tp: int
    seconds_per_param: float


@dataclass(frozen=True)
class OverheadRecord:
    device: str
    seconds: float


@dataclass(frozen=True)
class SlotRecord:
    """A pipeline slot's own work on one device type (issue 23): seconds per forward or backward hand-off of one
    micro-batch, without a layer's compute or the transfer (compute.slot_record says what it holds)."""
    device: str
    seconds: float


@dataclass(frozen=True)
class LatencyRecord:
    """One-way latency of a link (half a ping-pong of a tiny message)."""
    key: str
    cluster: Optional[str]
    seconds: float


@dataclass(frozen=True)
class TransferRecord:
    """``senders`` ranks of a node each sent messages of ``nbytes`` at once, each acknowledged by a one-byte
    reply: ``seconds`` is the slowest sender's time per message and its acknowledgement."""
    key: str
    cluster: Optional[str]
    senders: int
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class AllReduceRecord:
    """An all-reduce of ``nbytes`` over ``members`` ranks of the link's two nodes took ``seconds``."""
    key: str
    cluster: Optional[str]
    members: int
    nbytes: int
    seconds: float


Record = Union[ComputeRecord, OptimizerRecord, OverheadRecord, SlotRecord, LatencyRecord, TransferRecord,
               AllReduceRecord]
_TYPES = {cls.__name__: cls for cls in (ComputeRecord, OptimizerRecord, OverheadRecord, SlotRecord, LatencyRecord,
                                        TransferRecord, AllReduceRecord)}


def to_json(record: Record) -> dict:
    return {"type": type(record).__name__, **asdict(record)}


def from_json(data: dict) -> Record:
    fields = dict(data)
    return _TYPES[fields.pop("type")](**fields)


# ---- the measuring math ---------------------------------------------------------------------------


def link_gbps(nbytes: float, senders: int, round_s: float, latency_s: float) -> float:
    """The node's total Gbit/s from an acknowledged message's ``round_s`` (the message, then a tiny reply):
    the message alone took ``round_s - latency``, so the profile's transfer time ``latency + senders x bytes /
    rate`` is that when the rate is ``senders x bytes / (round_s - 2 latency)``. The part beyond the two
    latencies is floored at MIN_TRANSFER_SHARE of ``round_s``: a latency-bound point whose time the noise put
    under them still gets a finite rate."""
    rest = max(round_s - 2 * latency_s, MIN_TRANSFER_SHARE * round_s)
    return senders * nbytes * 8 / rest / 1e9


def bus_gbps(nbytes: float, members: int, seconds: float) -> float:
    """A ring all-reduce's bus bandwidth: each member moves ``2 (n-1)/n`` of the bytes (NCCL's busbw)."""
    return 2 * (members - 1) / members * nbytes * 8 / seconds / 1e9


def window_mean(total_s: float, count: int) -> float:
    """Seconds per repetition over a timed window (the mean, not a median of single runs: a throttled or
    preempted stretch belongs to the time a rank really takes)."""
    return total_s / count


def build_profile(records: Iterable[Record], description: str = "") -> Profile:
    """Rank 0: every rank's records -> a format-2 profile. Repeated measurements of one point (several ranks,
    both directions of a tier kind) become their median (compute, optimizer, overhead, slot, latency) or the
    slower one (a transfer or an all-reduce: a ring pays the slower direction)."""
    recs = list(records)
    prof = Profile(description=description)
    grouped: dict[tuple, list] = {}
    for r in recs:
        grouped.setdefault((type(r).__name__,) + _key(r), []).append(r)
    for key, group in sorted(grouped.items(), key=lambda kv: repr(kv[0])):
        if key[0] == "ComputeRecord":
            r = group[0]
            prof.add_compute(r.device, r.kind, r.micro_batch_size, r.tp,
                             statistics.median(g.forward_s for g in group),
                             statistics.median(g.backward_s for g in group))
        elif key[0] == "OptimizerRecord":
            prof.add_optimizer(group[0].device, group[0].tp, statistics.median(g.seconds_per_param for g in group))
        elif key[0] == "OverheadRecord":
            prof.add_overhead(group[0].device, statistics.median(g.seconds for g in group))
        elif key[0] == "SlotRecord":
            prof.add_pipeline_slot(group[0].device, statistics.median(g.seconds for g in group))
    for (name, cluster) in _link_keys(recs):
        mine = [r for r in recs if getattr(r, "key", None) == name and r.cluster == cluster]
        lats = [r.seconds for r in mine if isinstance(r, LatencyRecord)]
        latency_s = statistics.median(lats) if lats else 0.0
        curves: dict[int, dict[int, float]] = {}
        for r in mine:
            if isinstance(r, TransferRecord):
                at = curves.setdefault(r.senders, {})
                at[r.nbytes] = max(at.get(r.nbytes, 0.0), r.seconds)
        if 1 not in curves:
            continue
        rates = {k: [(b, link_gbps(b, k, s, latency_s)) for b, s in sorted(pts.items())] for k, pts in curves.items()}
        reduce: dict[int, float] = {}
        members: dict[int, int] = {}
        for r in mine:
            if isinstance(r, AllReduceRecord):
                reduce[r.nbytes] = max(reduce.get(r.nbytes, 0.0), r.seconds)
                members[r.nbytes] = r.members
        prof.add_link(name, rates[1], latency_us=latency_s * 1e6, cluster=cluster,
                      concurrency={k: v for k, v in rates.items() if k > 1},
                      allreduce=[(b, bus_gbps(b, members[b], s)) for b, s in sorted(reduce.items())])
    return prof


def _key(r: Record) -> tuple:
    if isinstance(r, ComputeRecord):
        return (r.device.lower(), r.kind, r.tp, r.micro_batch_size)
    if isinstance(r, OptimizerRecord):
        return (r.device.lower(), r.tp)
    if isinstance(r, (OverheadRecord, SlotRecord)):
        return (r.device.lower(),)
    return (r.key, r.cluster or "")


def _link_keys(recs: list) -> list[tuple[str, Optional[str]]]:
    """Links in the order they were first reported."""
    seen: list[tuple[str, Optional[str]]] = []
    for r in recs:
        k = (getattr(r, "key", None), getattr(r, "cluster", None))
        if k[0] is not None and k not in seen:
            seen.append(k)
    return seen
