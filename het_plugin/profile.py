"""Measured profiles: per-layer compute times and per-link bandwidth that override the analytic estimate.

A profile file (YAML or JSON, validated with pydantic; format in docs/planner.md) holds

* ``compute``: per device type, layer kind (``layer`` = one transformer layer, ``embedding``, ``output`` =
  output layer + loss), micro-batch size and TP degree, the forward and backward seconds of one
  micro-batch on one rank. A ``layer`` entry measured with TP > 1 includes its TP all-reduces.
* ``links``: per link tier (``local``, ``ib``, ``roce``, ``ethernet``, ``socket``, ``host-staged``) or a
  named link between two clusters (``"east/west"``), the latency and the bandwidth by message size.

:class:`Profile` is a plain dataclass so a calibration script can fill it from measurements and ``save``
it; :func:`load_profile` reads one back. The predictor asks it :meth:`Profile.compute_s` and
:meth:`Profile.transfer_s`; ``None`` means "not measured, use the analytic model".
"""
from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

from .yamlio import dump_data, read_data, validate

LayerKind = Literal["layer", "embedding", "output"]
LINK_TIERS = ("local", "ib", "roce", "ethernet", "socket", "host-staged")
FORMAT = "het_plugin-profile/1"


# ---- schema (what a file may contain) -------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ComputeEntry(_Strict):
    device: str                      # accelerator name as in the cluster file / catalog (case-insensitive)
    kind: LayerKind
    micro_batch_size: PositiveInt
    tp: PositiveInt = 1
    forward_s: float = Field(ge=0)
    backward_s: float = Field(ge=0)


class BandwidthPoint(_Strict):
    bytes: PositiveInt
    gbps: PositiveFloat              # achieved Gbit/s for a message of this size


class LinkEntry(_Strict):
    """``tier`` is one of LINK_TIERS, or ``"clusterA/clusterB"`` for one named inter-cluster link."""
    tier: str
    latency_us: float = Field(default=0.0, ge=0)
    bandwidth: list[BandwidthPoint] = Field(min_length=1)

    @model_validator(mode="after")
    def _tier(self):
        if self.tier not in LINK_TIERS and self.tier.count("/") != 1:
            raise ValueError(f"unknown link tier {self.tier!r} | fix: use one of {list(LINK_TIERS)} "
                             "or 'clusterA/clusterB' for a named link")
        sizes = [p.bytes for p in self.bandwidth]
        if len(set(sizes)) != len(sizes):
            raise ValueError("bandwidth lists a message size twice | fix: one point per size")
        return self


class ProfileFile(_Strict):
    format: Literal["het_plugin-profile/1"] = FORMAT
    description: str = ""
    compute: list[ComputeEntry] = []
    links: list[LinkEntry] = []

    @model_validator(mode="after")
    def _unique(self):
        keys = [(c.device.lower(), c.kind, c.micro_batch_size, c.tp) for c in self.compute]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise ValueError(f"compute entries repeat (device, kind, micro_batch_size, tp): {dup}"
                             " | fix: keep one entry per combination")
        tiers = [link.tier for link in self.links]
        dup_t = sorted({t for t in tiers if tiers.count(t) > 1})
        if dup_t:
            raise ValueError(f"links repeat tiers {dup_t} | fix: one entry per tier")
        return self


# ---- the in-memory profile ------------------------------------------------------------------------


@dataclass
class ComputeMeasurement:
    device: str
    kind: str
    micro_batch_size: int
    tp: int
    forward_s: float
    backward_s: float


@dataclass
class LinkMeasurement:
    tier: str
    latency_us: float
    bandwidth: list[tuple[int, float]]          # (message bytes, Gbit/s), any order


@dataclass
class Profile:
    """Measurements; empty by default. Fill with ``add_compute``/``add_link`` and ``save``."""
    compute: list[ComputeMeasurement] = field(default_factory=list)
    links: list[LinkMeasurement] = field(default_factory=list)
    description: str = ""

    def add_compute(self, device: str, kind: str, micro_batch_size: int, tp: int, forward_s: float,
                    backward_s: float) -> None:
        self.compute.append(ComputeMeasurement(device, kind, micro_batch_size, tp, forward_s, backward_s))

    def add_link(self, tier: str, bandwidth: list[tuple[int, float]], latency_us: float = 0.0) -> None:
        self.links.append(LinkMeasurement(tier, latency_us, [(int(b), float(g)) for b, g in bandwidth]))

    # ---- file -----------------------------------------------------------------------------------
    def to_file(self) -> ProfileFile:
        data = {
            "format": FORMAT, "description": self.description,
            "compute": [asdict(c) for c in self.compute],
            "links": [{"tier": link.tier, "latency_us": link.latency_us,
                       "bandwidth": [{"bytes": b, "gbps": g} for b, g in sorted(link.bandwidth)]}
                      for link in self.links],
        }
        return validate(ProfileFile, data, "<profile>")

    def save(self, path: str | Path) -> None:
        """Write YAML (or JSON for a .json path); validated first, so a bad measurement fails here."""
        dump_data(self.to_file().model_dump(), path)

    @classmethod
    def from_file(cls, spec: ProfileFile) -> "Profile":
        return cls(
            compute=[ComputeMeasurement(**c.model_dump()) for c in spec.compute],
            links=[LinkMeasurement(link.tier, link.latency_us, [(p.bytes, p.gbps) for p in link.bandwidth])
                   for link in spec.links],
            description=spec.description)

    # ---- queries (what the predictor asks) ------------------------------------------------------
    def compute_s(self, device: str, kind: str, micro_batch_size: int, tp: int) -> Optional[tuple[float, float]]:
        """(forward_s, backward_s) for one micro-batch, or None when not measured.

        An exact (device, kind, tp, micro-batch) entry wins; otherwise the entry of the same device, kind
        and tp with the nearest micro-batch size is scaled linearly in the micro-batch size.
        """
        same = [c for c in self.compute if c.device.lower() == device.lower() and c.kind == kind and c.tp == tp]
        if not same:
            return None
        best = min(same, key=lambda c: (abs(math.log(c.micro_batch_size / micro_batch_size)), c.micro_batch_size))
        scale = micro_batch_size / best.micro_batch_size
        return best.forward_s * scale, best.backward_s * scale

    def link(self, tier: str) -> Optional[LinkMeasurement]:
        for link in self.links:
            if link.tier == tier:
                return link
        return None

    def transfer_s(self, tiers: Union[str, list[str]], nbytes: float) -> Optional[float]:
        """Seconds to move ``nbytes`` over the first measured tier of ``tiers`` (named link before kind)."""
        for tier in [tiers] if isinstance(tiers, str) else tiers:
            link = self.link(tier)
            if link is not None:
                return link.latency_us * 1e-6 + nbytes * 8 / (bandwidth_at(link.bandwidth, nbytes) * 1e9)
        return None


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


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile file; problems are ConfigErrors naming the field."""
    return Profile.from_file(validate(ProfileFile, read_data(path), str(path)))
