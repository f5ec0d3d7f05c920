"""Measured compute curves that extrapolate like hardware (issue 23).

A profile measures a layer at a few micro-batch sizes (often one) and TP degrees; the planner asks for others.
An accelerator's time for one micro-batch is a fixed part (kernel launches, weight traffic, the framework's own
work) plus a per-sample part that can never be faster than the device's FLOP rate: peak x sustained efficiency
(the catalog's two numbers; the analytic model's compute time). So a curve here is

* between measured sizes: linear interpolation (as before);
* outside them: ``fixed + per_sample x size`` fitted to the measured points with ``per_sample >= floor``,
  scaled to meet the nearest measured point (as before), and never below ``floor x size`` (nor, past the
  largest size, below the last point plus ``floor`` per extra sample). With one point the per-sample part is the
  floor and the rest of the measured time is the fixed part (the most saturating curve the roofline allows);
  ``floor`` is lowered to the fastest per-sample time measured, so a device that beats the catalog is believed.
* at a TP degree the profile lacks: the nearest measured degree's curve with its compute (minus the fixed
  part) scaled by the FLOP share ``tp_measured / tp`` and its TP communication replaced by the analytic one at
  the new degree, never below the roofline at the new degree.

``floor = 0`` gives exactly the old rule (one point: proportional). Pure Python: no torch.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

__all__ = ["fixed_plus_per_sample", "curve_at", "Analytic", "tp_scaled", "Extrapolation", "nearest_tp"]


def _effective_floor(sizes: Sequence[int], times: Sequence[float], floor: float) -> float:
    """The roofline's per-sample time, lowered to the fastest per-sample time the points measured."""
    if floor <= 0:
        return 0.0
    return min(floor, min(t / s for s, t in zip(sizes, times)))


def fixed_plus_per_sample(sizes: Sequence[int], times: Sequence[float], floor: float = 0.0) -> tuple[float, float]:
    """Least-squares ``time = fixed + per_sample x size`` with ``fixed >= 0`` and ``per_sample >= floor`` (lowered
    to the points' fastest per-sample time). One point: ``per_sample = floor`` and the rest fixed (``floor = 0``:
    no fixed part, proportional)."""
    n = len(sizes)
    low = _effective_floor(sizes, times, floor)
    if n == 1:
        if low <= 0:
            return 0.0, times[0] / sizes[0]
        return max(0.0, times[0] - low * sizes[0]), low
    mx, my = sum(sizes) / n, sum(times) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, times)) / sxx
    if slope < low:                      # flatter than the roofline allows (or falling): the slope is the floor
        return max(0.0, my - low * mx), low
    fixed = my - slope * mx
    if fixed < 0:                        # through the origin (>= low: every point's t/s is)
        return 0.0, sum(x * y for x, y in zip(sizes, times)) / sum(x * x for x in sizes)
    return fixed, slope


def curve_at(sizes: Sequence[int], times: Sequence[float], size: float, floor: float = 0.0) -> float:
    """A measured time at ``size``: linear between the measured (increasing) sizes; outside them the fixed +
    per-sample fit of all points, scaled to meet the nearest measured point (so the curve has no jump), bounded
    below by the roofline (``floor`` seconds per sample, lowered to the fastest measured)."""
    if sizes[0] <= size <= sizes[-1]:
        i = bisect.bisect_left(sizes, size)
        if sizes[i] == size:
            return times[i]
        w = (size - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
        return times[i - 1] + w * (times[i] - times[i - 1])
    fixed, per = fixed_plus_per_sample(sizes, times, floor)
    end = 0 if size < sizes[0] else -1
    at_end = fixed + per * sizes[end]
    t = times[end] * (fixed + per * size) / at_end if at_end > 0 else 0.0
    low = _effective_floor(sizes, times, floor)
    if end == -1:
        return max(t, times[-1] + low * (size - sizes[-1]))
    return max(t, low * size)


@dataclass(frozen=True)
class Analytic:
    """The analytic model's view of one kind at one (micro-batch, TP): the forward's compute at the device's
    sustained FLOP rate (the roofline; backward = 2x) and the TP communication of each direction."""
    compute_fwd_s: float
    comm_s: float = 0.0


def nearest_tp(measured: Sequence[int], tp: int) -> int:
    """The measured TP degree closest to ``tp`` in ratio (ties: the smaller, whose compute share is known
    with less communication in it)."""
    return min(measured, key=lambda t: (abs(math.log(t / tp)), t))


def tp_scaled(measured_fwd: float, measured_bwd: float, fixed: tuple[float, float], tp_measured: int, tp: int,
              at_measured: Analytic, at_tp: Analytic) -> tuple[float, float]:
    """(forward, backward) at degree ``tp`` from a curve measured at ``tp_measured``: the compute beyond the
    fixed part scaled by the FLOP share, the TP communication swapped for the analytic one at ``tp``, never
    below the roofline at ``tp``. ``fixed``: the curve's fitted fixed parts (forward, backward)."""
    out = []
    for t, f, roof in ((measured_fwd, fixed[0], at_tp.compute_fwd_s),
                       (measured_bwd, fixed[1], 2 * at_tp.compute_fwd_s)):
        compute = max(0.0, t - at_measured.comm_s)
        f = min(f, compute)
        scaled = f + (compute - f) * tp_measured / tp
        out.append(max(scaled, roof) + at_tp.comm_s)
    return out[0], out[1]


@dataclass(frozen=True)
class Extrapolation:
    """How far one prediction's compute reaches outside the profile: which device type and layer kind, and
    whether the micro-batch size lies outside the measured ones, the TP degree was not measured (scaled from
    another), or the device type has no compute entry at all (analytic)."""
    device: str
    kind: str
    tp: int
    micro_batch_size: int
    measured_sizes: tuple[int, ...] = ()      # of the curve used ((): none)
    measured_tp: Optional[int] = None         # the degree the curve was measured at (None: none)
    layer: Optional[int] = None

    @property
    def reason(self) -> str:
        if not self.measured_sizes:
            return "no-entry"
        return "tp" if self.measured_tp != self.tp else "micro-batch"

    def line(self) -> str:
        what = f"{self.device} {self.kind}" + (f" (layer {self.layer})" if self.layer is not None else "")
        if not self.measured_sizes:
            return (f"profile: {what} has no measured entry; micro-batch {self.micro_batch_size} tp={self.tp} is "
                    "the analytic estimate -- profile this device type for a measured time")
        s = self.measured_sizes
        measured = f"{s[0]}" if len(s) == 1 else f"{s[0]}..{s[-1]}"
        if self.measured_tp != self.tp:
            return (f"profile: {what} measured at tp={self.measured_tp} (micro-batch {measured}); tp={self.tp} at "
                    f"micro-batch {self.micro_batch_size} is extrapolated (FLOP and communication shares, roofline "
                    f"bound) -- profile tp={self.tp} for a measured time")
        return (f"profile: {what} tp={self.tp} measured at micro-batch {measured}; micro-batch "
                f"{self.micro_batch_size} is extrapolated (fixed + per-sample fit, roofline bound) -- profile that "
                "size for a measured time")


def suggestion(found: Sequence[Extrapolation]) -> Optional[str]:
    """The ``het-plugin profile`` options that would measure what these predictions extrapolated."""
    if not found:
        return None
    sizes = sorted({e.micro_batch_size for e in found} | {s for e in found for s in e.measured_sizes})
    tps = sorted({e.tp for e in found})
    devices = sorted({e.device for e in found})
    return (f"the plan was chosen on extrapolated compute ({', '.join(devices)}: "
            f"{', '.join(sorted({e.reason for e in found}))}); measure those points and plan again: het-plugin "
            f"profile CLUSTER --model MODEL --micro-batch-sizes {','.join(map(str, sizes))} "
            f"--tp {','.join(map(str, tps))} -o PROFILE, then het-plugin plan CLUSTER --profile PROFILE")


def extrapolation_advice(profile, model, devices, mb: int, tp: int) -> Optional[str]:
    """The warning of a plan chosen on extrapolated compute: what it guessed and the points to measure."""
    kinds = ("layer", "embedding", "output") + (("moe_layer",) if model.is_moe else ())
    return suggestion(extrapolations(profile, devices, mb, tp, kinds))


AnalyticFn = Callable[[int, int], Analytic]     # (micro-batch size, tp) -> the analytic view


def _floor(a: Analytic, mb: int) -> tuple[float, float]:
    return a.compute_fwd_s / mb, 2 * a.compute_fwd_s / mb


def _curve_kinds(kind: str, moe_fraction: float) -> tuple[str, ...]:
    return ("layer", "moe_layer") if kind == "layer" and moe_fraction > 0 else (kind,)


def measured_compute_s(profile, device: str, kind: str, mb: int, tp: int, moe_fraction: float,
                       analytic: AnalyticFn) -> Optional[tuple[float, float]]:
    """(forward, backward) of one micro-batch of ``kind`` on ``device`` from a profile, or None (analytic).

    Format 2: the (device, kind, tp) curve bounded by the roofline, else the nearest measured TP degree's
    scaled (:func:`tp_scaled`). Format 1: exactly as format 1 did (:meth:`Profile.compute_s`)."""
    if profile.legacy:
        return profile.compute_s(device, kind, mb, tp, moe_fraction)
    here = analytic(mb, tp)
    t = profile.compute_time(device, kind, mb, tp, moe_fraction, floor=_floor(here, mb))
    if t is not None:
        return t.forward_s, t.backward_s
    kinds = _curve_kinds(kind, moe_fraction)
    tps = profile.measured_tps(device, kinds)
    if not tps:
        return None
    tm = nearest_tp(tps, tp)
    there = analytic(mb, tm)
    floor = _floor(there, mb)
    m = profile.compute_time(device, kind, mb, tm, moe_fraction, floor=floor)
    if m is None:          # an MoE model with only the other kind's curve at that degree
        return None
    points = next(c for c in (profile.curve(device, k, tm) for k in kinds) if c)
    sizes = [c.micro_batch_size for c in points]
    fixed = (fixed_plus_per_sample(sizes, [c.forward_s for c in points], floor[0])[0],
             fixed_plus_per_sample(sizes, [c.backward_s for c in points], floor[1])[0])
    return tp_scaled(m.forward_s, m.backward_s, fixed, tm, tp, there, here)


def extrapolations(profile, devices, mb: int, tp: int, kinds: Sequence[str]) -> list[Extrapolation]:
    """Where a prediction at this micro-batch size and TP on these device types (names) leaves the profile:
    a curve's measured sizes, a TP degree not measured, a device type without compute entries (only when the
    profile measures compute at all). Format 1 (frozen, its plans keep their hashes): none."""
    if profile is None or profile.legacy or not profile.compute:
        return []
    out = []
    names = sorted(set(devices), key=str.lower)
    for device in names:
        if not profile.measured_tps(device, kinds):
            out.append(Extrapolation(device, "compute", tp, mb))
            continue
        for kind in kinds:
            tps = profile.measured_tps(device, (kind,))
            if not tps:
                continue
            tm = tp if tp in tps else nearest_tp(tps, tp)
            sizes = tuple(c.micro_batch_size for c in profile.curve(device, kind, tm))
            if tm != tp or not sizes[0] <= mb <= sizes[-1]:
                out.append(Extrapolation(device, kind, tp, mb, sizes, tm))
        for layer in sorted({c.layer for c in profile.compute if c.layer is not None
                             and c.device.lower() == device.lower() and c.tp == tp}):
            for kind in ("layer", "moe_layer"):
                sizes = tuple(c.micro_batch_size for c in profile.curve(device, kind, tp, layer))
                if sizes and not sizes[0] <= mb <= sizes[-1]:
                    out.append(Extrapolation(device, kind, tp, mb, sizes, tp, layer))
    return out
