"""Measured profiles: compute times, optimizer step, per-iteration overhead and link bandwidths that override the
analytic estimate.

A profile (file format in docs/planner.md; schemas in :mod:`het_plugin.core.inputs.profile_schema`) holds

* ``compute``: per device type, layer kind (``layer`` = one dense transformer layer, ``moe_layer``,
  ``embedding``, ``output`` = output layer + loss) and TP degree, the forward and backward seconds of one
  micro-batch on one rank at several micro-batch sizes; optionally per decoder layer index. A ``layer`` entry
  measured with TP > 1 includes its TP all-reduces.
* ``optimizer`` (seconds per parameter per device type and TP) and ``overhead`` (seconds per iteration).
* ``measured`` (optional): the stage times a training run of one plan measured (:mod:`het_plugin.core.cost.measured`
  writes it together with compute curves derived from them), for ``het-plugin plan --profile`` to compare.
* ``links``: per link tier (``local``, ``ib``, ``roce``, ``ethernet``, ``socket``, ``host-staged``), optionally
  inside one cluster, or a named link between two clusters (``"east/west"``, or one direction ``"east->west"``):
  the latency and the bandwidth by message size, and by the number of ranks of a node sending at once.

:class:`Profile` is a plain dataclass so a calibration script can fill it from measurements and ``save`` it;
:func:`load_profile` reads one back. The predictor asks it (``compute_time``, ``layer_overrides``,
``optimizer_s_per_param``, ``iteration_overhead_s``, ``step_s``); ``None`` means "not measured, use the analytic
model". A profile read from a format-1 file (``format_version == 1``) answers exactly as format 1 did.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

from ..errors import ConfigError
from .compute_curve import curve_at, extrapolations, fixed_plus_per_sample  # noqa: F401 (re-exported)
from .profile_schema import FORMAT_V1, FORMAT_V2, FORMATS, LINK_TIERS, MeasuredRun, ProfileFile, ProfileFileV2
from ..files import dump_data
from .yamlio import read_data, read_text, validate

FORMAT = FORMAT_V2                    # what ``save`` writes for a new profile
__all__ = ["Profile", "ComputeTime", "load_profile", "bandwidth_at", "curve_at", "LINK_TIERS", "FORMAT"]


# ---- the in-memory profile ------------------------------------------------------------------------


@dataclass
class ComputeMeasurement:
    device: str
    kind: str
    micro_batch_size: int
    tp: int
    forward_s: float
    backward_s: float
    layer: Optional[int] = None            # a per-layer-index override (format 2)


@dataclass
class LinkMeasurement:
    tier: str
    latency_us: float
    bandwidth: list[tuple[int, float]]          # (message bytes, Gbit/s) with one sender per node
    cluster: Optional[str] = None               # format 2: the tier inside this cluster only
    concurrency: list[tuple[int, list[tuple[int, float]]]] = field(default_factory=list)
    # ^ format 2: (senders per node, [(each sender's message bytes, the node's total Gbit/s)])
    allreduce: list[tuple[int, float]] = field(default_factory=list)
    # ^ format 2: (message bytes, an all-reduce's bus Gbit/s) over the link, for reference (not predicted from)


@dataclass
class OptimizerMeasurement:
    device: str
    tp: int
    seconds_per_param: float


@dataclass
class OverheadMeasurement:
    device: str
    seconds: float


@dataclass(frozen=True)
class ComputeTime:
    """One micro-batch's forward and backward; ``extrapolated``: the micro-batch size is outside the measured
    ones (format 2 fits fixed + per-sample time on the measured points)."""
    forward_s: float
    backward_s: float
    extrapolated: bool = False


@dataclass
class Profile:
    """Measurements; empty by default. Fill with the ``add_*`` methods and ``save``."""
    compute: list[ComputeMeasurement] = field(default_factory=list)
    links: list[LinkMeasurement] = field(default_factory=list)
    description: str = ""
    optimizer: list[OptimizerMeasurement] = field(default_factory=list)
    overhead: list[OverheadMeasurement] = field(default_factory=list)
    slots: list[OverheadMeasurement] = field(default_factory=list)   # format 2: seconds per pipeline slot
    format_version: int = 2                     # 1: read from a format-1 file, answers as format 1 did
    measured: Optional[MeasuredRun] = None      # format 2: what a training run of one plan measured per stage

    def add_compute(self, device: str, kind: str, micro_batch_size: int, tp: int, forward_s: float,
                    backward_s: float, layer: Optional[int] = None) -> None:
        self.compute.append(ComputeMeasurement(device, kind, micro_batch_size, tp, forward_s, backward_s, layer))

    def add_link(self, tier: str, bandwidth: list[tuple[int, float]], latency_us: float = 0.0,
                 cluster: Optional[str] = None,
                 concurrency: Optional[dict[int, list[tuple[int, float]]]] = None,
                 allreduce: Optional[list[tuple[int, float]]] = None) -> None:
        """``concurrency``: {senders per node: [(each sender's message bytes, the node's total Gbit/s)]};
        ``allreduce``: [(message bytes, bus Gbit/s)] of an all-reduce over the link (kept, not predicted from)."""
        curves = [(int(k), sorted((int(b), float(g)) for b, g in pts)) for k, pts in sorted((concurrency or {}).items())]
        self.links.append(LinkMeasurement(tier, latency_us, [(int(b), float(g)) for b, g in bandwidth], cluster,
                                          curves, sorted((int(b), float(g)) for b, g in (allreduce or []))))

    def add_optimizer(self, device: str, tp: int, seconds_per_param: float) -> None:
        self.optimizer.append(OptimizerMeasurement(device, tp, seconds_per_param))

    def add_overhead(self, device: str, seconds: float) -> None:
        self.overhead.append(OverheadMeasurement(device, seconds))

    def add_pipeline_slot(self, device: str, seconds: float) -> None:
        """The schedule's own seconds per forward or backward of one micro-batch on one stage of ``device``."""
        self.slots.append(OverheadMeasurement(device, seconds))

    @property
    def legacy(self) -> bool:
        """Read from a format-1 file: every answer is format 1's."""
        return self.format_version == 1

    @property
    def directional(self) -> bool:
        """Some link is measured in one direction only (``"a->b"``): the predictor looks both ways."""
        return not self.legacy and any("->" in link.tier for link in self.links)

    # ---- file -----------------------------------------------------------------------------------
    def to_file(self) -> Union[ProfileFile, ProfileFileV2]:
        if self.legacy:
            return validate(ProfileFile, self._format1_data(), "<profile>")
        curves: dict[tuple, dict] = {}
        for c in self.compute:
            curve = curves.setdefault((c.device, c.kind, c.tp, c.layer), {
                "device": c.device, "kind": c.kind, "tp": c.tp, "points": [],
                **({"layer": c.layer} if c.layer is not None else {})})
            curve["points"].append({"micro_batch_size": c.micro_batch_size, "forward_s": c.forward_s,
                                    "backward_s": c.backward_s})
        for curve in curves.values():
            curve["points"].sort(key=lambda p: p["micro_batch_size"])
        data = {
            "format": FORMAT_V2, "description": self.description, "compute": list(curves.values()),
            "optimizer": [asdict(o) for o in self.optimizer],
            "iteration_overhead": [asdict(o) for o in self.overhead],
            **({"pipeline_slot": [asdict(o) for o in self.slots]} if self.slots else {}),
            "links": [{"tier": link.tier, **({"cluster": link.cluster} if link.cluster is not None else {}),
                       "latency_us": link.latency_us, "bandwidth": _points(link.bandwidth),
                       **({"concurrency": [{"senders": k, "bandwidth": _points(pts)} for k, pts in link.concurrency]}
                          if link.concurrency else {}),
                       **({"allreduce": _points(link.allreduce)} if link.allreduce else {})}
                      for link in self.links],
        }
        if self.measured is not None:
            data["measured"] = self.measured.model_dump(exclude_none=True)
        return validate(ProfileFileV2, data, "<profile>")

    def _format1_data(self) -> dict:
        extra = ([f"compute[{i}].layer" for i, c in enumerate(self.compute) if c.layer is not None]
                 + [f"links[{i}].cluster" for i, link in enumerate(self.links) if link.cluster is not None]
                 + [f"links[{i}].concurrency" for i, link in enumerate(self.links) if link.concurrency]
                 + [f"links[{i}].allreduce" for i, link in enumerate(self.links) if link.allreduce]
                 + (["optimizer"] if self.optimizer else []) + (["overhead"] if self.overhead else [])
                 + (["pipeline_slot"] if self.slots else [])
                 + (["measured"] if self.measured is not None else []))
        if extra:
            raise ConfigError(f"a format-1 profile cannot hold {', '.join(extra)}", source="<profile>",
                              field="format_version", fix="set format_version = 2 (format 2 holds them)")
        return {"format": FORMAT_V1, "description": self.description,
                "compute": [{k: v for k, v in asdict(c).items() if k != "layer"} for c in self.compute],
                "links": [{"tier": link.tier, "latency_us": link.latency_us,
                           "bandwidth": _points(link.bandwidth)} for link in self.links]}

    def save(self, path: str | Path) -> None:
        """Write YAML (or JSON for a .json path); validated first, so a bad measurement fails here."""
        dump_data(self.to_file().model_dump(exclude_none=True), path)

    @classmethod
    def from_file(cls, spec: Union[ProfileFile, ProfileFileV2]) -> "Profile":
        if isinstance(spec, ProfileFile):
            return cls(compute=[ComputeMeasurement(**c.model_dump()) for c in spec.compute],
                       links=[LinkMeasurement(link.tier, link.latency_us, [(p.bytes, p.gbps) for p in link.bandwidth])
                              for link in spec.links],
                       description=spec.description, format_version=1)
        return cls(
            compute=[ComputeMeasurement(c.device, c.kind, p.micro_batch_size, c.tp, p.forward_s, p.backward_s, c.layer)
                     for c in spec.compute for p in c.points],
            links=[LinkMeasurement(link.tier, link.latency_us, [(p.bytes, p.gbps) for p in link.bandwidth],
                                   link.cluster, [(c.senders, [(p.bytes, p.gbps) for p in c.bandwidth])
                                                  for c in link.concurrency],
                                   [(p.bytes, p.gbps) for p in link.allreduce])
                   for link in spec.links],
            description=spec.description,
            optimizer=[OptimizerMeasurement(o.device, o.tp, o.seconds_per_param) for o in spec.optimizer],
            overhead=[OverheadMeasurement(o.device, o.seconds) for o in spec.iteration_overhead],
            slots=[OverheadMeasurement(o.device, o.seconds) for o in spec.pipeline_slot],
            format_version=2, measured=spec.measured)

    # ---- compute --------------------------------------------------------------------------------
    def _curve(self, device: str, kind: str, tp: int, layer: Optional[int] = None) -> list[ComputeMeasurement]:
        d = device.lower()
        return sorted((c for c in self.compute if c.device.lower() == d and c.kind == kind and c.tp == tp
                       and c.layer == layer), key=lambda c: c.micro_batch_size)

    def compute_time(self, device: str, kind: str, micro_batch_size: int, tp: int, moe_fraction: float = 0.0,
                     layer: Optional[int] = None, floor: tuple[float, float] = (0.0, 0.0)) -> Optional[ComputeTime]:
        """One micro-batch of ``kind`` on ``device``, or None when not measured.

        Format 2: the curve of (device, kind, tp[, layer]) interpolated linearly between measured micro-batch
        sizes; outside them a fixed + per-sample fit of the measured points (``extrapolated``). ``kind="layer"``
        is the model's average layer: for a model whose layers are ``moe_fraction`` MoE, the mean of the
        ``layer`` and ``moe_layer`` curves weighted by it (with only one of them, the all-MoE model uses
        ``moe_layer``, any other the ``layer`` curve as its average layer).
        ``floor``: the roofline's (forward, backward) seconds per sample, which an extrapolated time never
        beats (:mod:`het_plugin.core.inputs.compute_curve`; 0: unbounded, one point proportional). For the MoE mix the
        mixture is bounded by it.
        Format 1: the exact entry, else the nearest measured size scaled linearly.
        """
        if self.legacy:
            return self._format1_compute(device, kind, micro_batch_size, tp)
        if kind == "layer" and layer is None and moe_fraction > 0:
            dense = self.compute_time(device, "layer", micro_batch_size, tp)
            moe = self.compute_time(device, "moe_layer", micro_batch_size, tp)
            if dense is not None and moe is not None:
                f, out = moe_fraction, dense.extrapolated or moe.extrapolated
                b = micro_batch_size if out else 0     # the roofline bounds an extrapolated mixture only
                return ComputeTime(max((1 - f) * dense.forward_s + f * moe.forward_s, floor[0] * b),
                                   max((1 - f) * dense.backward_s + f * moe.backward_s, floor[1] * b), out)
            one = "moe_layer" if moe_fraction >= 1 and moe is not None else "layer"
            return self.compute_time(device, one, micro_batch_size, tp, floor=floor)
        curve = self._curve(device, kind, tp, layer)
        if not curve:
            return None
        sizes = [c.micro_batch_size for c in curve]
        fwd = curve_at(sizes, [c.forward_s for c in curve], micro_batch_size, floor[0])
        bwd = curve_at(sizes, [c.backward_s for c in curve], micro_batch_size, floor[1])
        return ComputeTime(fwd, bwd, not sizes[0] <= micro_batch_size <= sizes[-1])

    def curve(self, device: str, kind: str, tp: int, layer: Optional[int] = None) -> list[ComputeMeasurement]:
        """The measured points of one (device, kind, tp[, layer]) curve, by micro-batch size ([]: none)."""
        return self._curve(device, kind, tp, layer)

    def measured_tps(self, device: str, kinds: Sequence[str], layer: Optional[int] = None) -> list[int]:
        """The TP degrees some curve of these kinds on ``device`` was measured at."""
        d = device.lower()
        return sorted({c.tp for c in self.compute if c.device.lower() == d and c.kind in kinds and c.layer == layer})

    def _format1_compute(self, device: str, kind: str, micro_batch_size: int, tp: int) -> Optional[ComputeTime]:
        same = [c for c in self.compute if c.device.lower() == device.lower() and c.kind == kind and c.tp == tp]
        if not same:
            return None
        best = min(same, key=lambda c: (abs(math.log(c.micro_batch_size / micro_batch_size)), c.micro_batch_size))
        scale = micro_batch_size / best.micro_batch_size
        return ComputeTime(best.forward_s * scale, best.backward_s * scale, scale != 1)

    def compute_s(self, device: str, kind: str, micro_batch_size: int, tp: int,
                  moe_fraction: float = 0.0) -> Optional[tuple[float, float]]:
        """(forward_s, backward_s) of :meth:`compute_time`, or None when not measured."""
        t = self.compute_time(device, kind, micro_batch_size, tp, moe_fraction)
        return None if t is None else (t.forward_s, t.backward_s)

    def layer_overrides(self, device: str, micro_batch_size: int, tp: int,
                        floor: tuple[float, float] = (0.0, 0.0)) -> dict[int, ComputeTime]:
        """Decoder layers (0-based index) measured on their own for this device and TP (format 2); ``floor`` as
        in :meth:`compute_time`."""
        if self.legacy:
            return {}
        d = device.lower()
        indexes = sorted({c.layer for c in self.compute if c.layer is not None and c.device.lower() == d
                          and c.tp == tp})
        out = {}
        for i in indexes:
            kinds = {c.kind for c in self.compute if c.layer == i and c.device.lower() == d and c.tp == tp}
            kind = "moe_layer" if kinds == {"moe_layer"} else "layer"
            t = self.compute_time(device, kind, micro_batch_size, tp, layer=i, floor=floor)
            if t is not None:
                out[i] = t
        return out

    def extrapolation_notes(self, devices: Iterable[str], micro_batch_size: int, tp: int,
                            kinds: Sequence[str] = ("layer", "moe_layer", "embedding", "output")) -> list[str]:
        """One line per measured curve of these devices that a micro-batch of this size and TP lies outside, or a
        device type with no compute entry (format 2; a format-1 profile gives none, so its plans stay as they
        were): :func:`het_plugin.core.inputs.compute_curve.extrapolations`."""
        return [e.line() for e in extrapolations(self, devices, micro_batch_size, tp, kinds)]

    # ---- optimizer and overhead -----------------------------------------------------------------
    def optimizer_s_per_param(self, device: str, tp: int) -> Optional[float]:
        """Seconds per parameter of one optimizer step: the (device, tp) entry, else the device's entry with
        the nearest TP (the step is elementwise), else None."""
        same = [o for o in self.optimizer if o.device.lower() == device.lower()]
        if not same:
            return None
        return min(same, key=lambda o: (abs(math.log(o.tp / tp)), o.tp)).seconds_per_param

    def pipeline_slot_s(self, device: str) -> Optional[float]:
        """Measured seconds per pipeline slot of ``device`` (None: not measured)."""
        for o in self.slots:
            if o.device.lower() == device.lower():
                return o.seconds
        return None

    def iteration_overhead_s(self, device: str) -> Optional[float]:
        for o in self.overhead:
            if o.device.lower() == device.lower():
                return o.seconds
        return None

    # ---- links ----------------------------------------------------------------------------------
    def link(self, tier: str, cluster: Optional[str] = None) -> Optional[LinkMeasurement]:
        for link in self.links:
            if link.tier == tier and link.cluster == cluster:
                return link
        return None

    def transfer_s(self, tiers: Union[str, list[str]], nbytes: float) -> Optional[float]:
        """Seconds to move ``nbytes`` over the first measured tier of ``tiers`` (named link before kind)."""
        return self.step_s([tiers] if isinstance(tiers, str) else tiers, nbytes)

    def step_s(self, keys: Sequence[str], nbytes: float, senders: int = 1,
               cluster: Optional[str] = None) -> Optional[float]:
        """Seconds for each of ``senders`` ranks of a node to move ``nbytes`` at once over the first measured
        key (a tier inside ``cluster`` before the tier anywhere), or None.

        Format 2 reads the concurrency curve of that many senders (linear between measured sender counts;
        beyond the largest, its curve carries the bytes of all of them); with only the one-sender curve, and
        in format 1, the senders' bytes go as one message of ``senders x nbytes``.
        """
        for key in keys:
            link = (self.link(key, cluster) if cluster is not None and not self.legacy else None) or self.link(key)
            if link is not None:
                gbps = (bandwidth_at(link.bandwidth, nbytes * senders) if self.legacy
                        else _concurrent_gbps(link, nbytes, senders))
                return link.latency_us * 1e-6 + nbytes * senders * 8 / (gbps * 1e9)
        return None


def _points(points: list[tuple[int, float]]) -> list[dict]:
    return [{"bytes": b, "gbps": g} for b, g in sorted(points)]


def _concurrent_gbps(link: LinkMeasurement, nbytes: float, senders: int) -> float:
    """The node's total Gbit/s with ``senders`` ranks each sending ``nbytes``."""
    curves = [(1, link.bandwidth)] + list(link.concurrency)
    counts = [k for k, _ in curves]
    if senders >= counts[-1]:
        k, pts = curves[-1]
        return bandwidth_at(pts, nbytes * senders / k)
    if senders <= counts[0]:
        return bandwidth_at(curves[0][1], nbytes)
    i = bisect.bisect_right(counts, senders)
    (k0, p0), (k1, p1) = curves[i - 1], curves[i]
    w = (senders - k0) / (k1 - k0)
    return (1 - w) * bandwidth_at(p0, nbytes) + w * bandwidth_at(p1, nbytes)


def bandwidth_at(points: list[tuple[int, float]], nbytes: float) -> float:
    """Gbit/s at ``nbytes``: linear in log(size) between measured sizes, clamped outside them."""
    pts = sorted(points)
    sizes = [p[0] for p in pts]
    if nbytes <= sizes[0]:
        return pts[0][1]
    if nbytes >= sizes[-1]:
        return pts[-1][1]
    i = bisect.bisect_right(sizes, nbytes)
    (s0, g0), (s1, g1) = pts[i - 1], pts[i]
    w = (math.log(nbytes) - math.log(s0)) / (math.log(s1) - math.log(s0))
    return g0 + w * (g1 - g0)


def _format2_fields(data: dict) -> list[str]:
    found = [k for k in ("optimizer", "iteration_overhead", "pipeline_slot", "measured") if k in data]
    for section, keys in (("compute", ("points", "layer")), ("links", ("cluster", "concurrency", "allreduce"))):
        items = data.get(section)
        for i, item in enumerate(items if isinstance(items, list) else []):
            found += [f"{section}[{i}].{k}" for k in keys if isinstance(item, dict) and k in item]
    return found[:3]


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile file of either format; problems are ConfigErrors naming the file and field."""
    text = read_text(path, "profile")
    data = read_data(path, text)
    fmt = data.get("format", FORMAT_V1) if isinstance(data, dict) else FORMAT_V1
    if isinstance(data, dict) and "format" not in data and _format2_fields(data):
        raise ConfigError(f"the profile uses format-2 fields ({', '.join(_format2_fields(data))}) but names no format, "
                          "which means format 1", source=str(path), field="format",
                          fix=f"add 'format: {FORMAT_V2}' at the top")
    if fmt not in FORMATS:
        raise ConfigError(f"unknown profile format {fmt!r}", source=str(path), field="format",
                          fix=f"use {FORMAT_V2!r} (this het_plugin also reads {FORMAT_V1!r}); write a profile with "
                              "het_plugin.core.inputs.profile.Profile.save to get the current one")
    return Profile.from_file(validate(ProfileFileV2 if FORMATS[fmt] == 2 else ProfileFile, data, str(path), text))
