"""The emulated Ethernet rate that gives the tiny job the real job's proportions (docs/benchmark-e2e.md).

Both proportions that decide the benchmark's result scale with one knob, the emulated Ethernet rate:
``dp_eth = dp_bytes / (rate * compute)`` and ``pp_eth = pp_bytes / (rate * compute)``. Their quotient is
``act_grad`` (pipeline : gradient bytes), fixed by the model shapes, so one rate can match both exactly only
if the tiny model's ``act_grad`` equals the real job's. It does not quite (0.160 against 0.187), so the rate
is the geometric mean of the two rates that would match each proportion alone: both miss by the same factor,
one high and one low (here +8% and -7%), the smallest worst-case miss a single rate can give. Pure
arithmetic, no measurement: the caller passes the compute it measured.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

PROPORTION_TOLERANCE = 0.10    # issue 24: dp_eth and pp_eth within 10% of the real job's


@dataclass(frozen=True)
class LinkRate:
    """An Ethernet rate and the tiny job's proportions at it, against the real job's."""
    eth_bytes_per_s: float
    dp_eth: float
    pp_eth: float
    dp_error: float           # tiny dp_eth / real dp_eth - 1
    pp_error: float
    tolerance: float
    matched: bool             # both errors within the tolerance

    @property
    def eth_mbit(self) -> float:
        return self.eth_bytes_per_s * 8 / 1e6

    def to_dict(self) -> dict:
        return dict(asdict(self), eth_mbit=self.eth_mbit)


def proportions_at(eth_bytes_per_s: float, dp_bytes: float, pp_bytes: float, compute_s: float,
                   real_dp_eth: float, real_pp_eth: float,
                   tolerance: float = PROPORTION_TOLERANCE) -> LinkRate:
    """The tiny job's dp_eth and pp_eth at ``eth_bytes_per_s`` (bytes per iteration and node, compute seconds per
    iteration on the busiest stage) and how far each is from the real job's."""
    if min(eth_bytes_per_s, compute_s, dp_bytes, pp_bytes, real_dp_eth, real_pp_eth) <= 0:
        raise ValueError("rate, compute, bytes and the real proportions must be positive")
    dp_eth = dp_bytes / eth_bytes_per_s / compute_s
    pp_eth = pp_bytes / eth_bytes_per_s / compute_s
    dp_error, pp_error = dp_eth / real_dp_eth - 1, pp_eth / real_pp_eth - 1
    return LinkRate(eth_bytes_per_s, dp_eth, pp_eth, dp_error, pp_error, tolerance,
                    abs(dp_error) <= tolerance and abs(pp_error) <= tolerance)


def rate_for_proportions(dp_bytes: float, pp_bytes: float, compute_s: float, real_dp_eth: float,
                         real_pp_eth: float, tolerance: float = PROPORTION_TOLERANCE) -> LinkRate:
    """The Ethernet rate whose dp_eth and pp_eth miss the real job's by the same factor, one each way (the
    geometric mean of the rates matching each alone); ``matched`` says whether that is within ``tolerance``
    (it cannot be when the two jobs' act_grad differ by more than (1 + tolerance)**2)."""
    if min(compute_s, dp_bytes, pp_bytes, real_dp_eth, real_pp_eth) <= 0:
        raise ValueError("compute, bytes and the real proportions must be positive")
    for_dp = dp_bytes / (real_dp_eth * compute_s)
    for_pp = pp_bytes / (real_pp_eth * compute_s)
    return proportions_at(math.sqrt(for_dp * for_pp), dp_bytes, pp_bytes, compute_s, real_dp_eth, real_pp_eth,
                          tolerance)
