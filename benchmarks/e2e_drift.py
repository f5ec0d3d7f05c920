"""Did the machine move during a benchmark run? The verdict that keeps a drifted run out of the headline.

All ranks share the machine's cores, so anything else that runs (or a CPU that changes speed) changes the
compute time, and with it the proportions the run was set up for (dp_eth, pp_eth scale with 1/compute) and
the step times of whatever configuration ran at that moment. Two signals, both already measured:

* the calibration run (unshaped network, the most compute-bound run) at the start and again first in every
  round: its times should agree;
* each configuration's per-round median step times: they should agree too.

Spread = (max - min) / median. ``DRIFT_MARGIN`` = 0.25, because: on a machine with nothing else running
(docs/benchmark-e2e.md, the 2026-12-01 11:50 run) the calibration spread 23% (185 / 172 / 178 / 213 ms) and
no configuration's rounds more than 13%, and the headline ratios held within +-0.03 of their median over the
rounds; the loaded run of issue 24 spread 50% (calibration 440 / 539 / 708 ms) and 58% (one configuration's
rounds 467 / 852 ms), and its headline ratios moved by 0.3. 0.25 keeps the first and flags the second; it
is a threshold read off those runs, not derived from a model of the noise.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

DRIFT_MARGIN = 0.25
# The compute the proportions are set from (the busiest stage's per-iteration compute, from the single-rank fit
# plus the calibration's pipelined cost) must be most of the calibration step (unshaped network: compute, bubble,
# per-step work). 89% in the idle 2026-12-01 11:50 run and in the loaded full run of 2026-12-01 22:31; 30% and
# ~0% when the fit, under heavy load, put the time into its per-step term (548 and 3673 ms per step): the rate
# set from such a fit is not the real job's proportions.
MIN_COMPUTE_SHARE = 0.5


def spread(values: list[float]) -> float:
    """(max - min) / median; 0 for fewer than two values."""
    if len(values) < 2:
        return 0.0
    return (max(values) - min(values)) / statistics.median(values)


@dataclass(frozen=True)
class Verdict:
    """Whether a run's numbers may be recorded as a headline, and why not."""
    reliable: bool
    margin: float
    calibration_spread: float | None       # None: fewer than two calibration runs
    worst_config: str | None               # "<ratio>:1 <configuration>" with the widest rounds
    worst_config_spread: float
    reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def drift_verdict(calibrations: list[float], config_rounds: dict[str, list[float]],
                  margin: float = DRIFT_MARGIN) -> Verdict:
    """``calibrations``: the calibration run's step time at the start and in each round (seconds);
    ``config_rounds``: per configuration (any label), its per-round median step times."""
    reasons = []
    cal = spread(calibrations) if len(calibrations) >= 2 else None
    if cal is not None and cal > margin:
        reasons.append(f"calibration run drifted: {' / '.join(f'{t * 1e3:.0f}' for t in calibrations)} ms, "
                       f"spread {cal:.1%} > {margin:.0%}")
    worst, worst_spread = None, 0.0
    for name, rounds in config_rounds.items():
        s = spread(rounds)
        if s > worst_spread:
            worst, worst_spread = name, s
        if s > margin:
            reasons.append(f"{name}: rounds {' / '.join(f'{t * 1e3:.0f}' for t in rounds)} ms, "
                           f"spread {s:.1%} > {margin:.0%}")
    return Verdict(not reasons, margin, cal, worst, worst_spread, reasons)


def compute_share_reason(compute_s: float, calibration_step_s: float,
                         minimum: float = MIN_COMPUTE_SHARE) -> str | None:
    """Why the compute the proportions were set from cannot be trusted (None: it can)."""
    share = compute_s / calibration_step_s
    if share < minimum:
        return (f"compute fit unsound: the proportions' compute {compute_s * 1e3:.0f} ms is {share:.0%} of the "
                f"calibration step {calibration_step_s * 1e3:.0f} ms (< {minimum:.0%})")
    return None


def run_verdict(out: dict, margin: float = DRIFT_MARGIN) -> Verdict:
    """The verdict from a results JSON (bench_e2e's ``out``): its calibration times and configurations' rounds,
    and whether the compute the rate was set from is sound."""
    compute = out.get("compute", {})
    calibrations = ([compute["calibration_step_s"]] if "calibration_step_s" in compute else []) \
        + list(compute.get("rounds_calibration_step_s", []))
    rounds = {f"{row['ratio']:g}:1 {c['name']}": c["rounds_s"] for row in out["ratios"] for c in row["configs"]}
    verdict = drift_verdict(calibrations, rounds, margin)
    why = (compute_share_reason(out["scale"]["tiny"]["compute_s"], compute["calibration_step_s"])
           if "calibration_step_s" in compute and "tiny" in out.get("scale", {}) else None)
    if why is None:
        return verdict
    return Verdict(False, verdict.margin, verdict.calibration_spread, verdict.worst_config,
                   verdict.worst_config_spread, [why, *verdict.reasons])


def round_to_repeat(round_calibrations: list[float], config_rounds: dict[str, list[float]]) -> int:
    """The round that strays furthest from the others (``bench_e2e --repeat-drifted``: it is dropped and run
    again): per round, the largest |value / median - 1| over its calibration run and every configuration; the
    later round on a tie. Lists shorter than the round count (a configuration not run every round) are skipped."""
    n = max([len(round_calibrations), *(len(v) for v in config_rounds.values())])
    if n < 2:
        raise ValueError("a round to repeat needs at least two rounds")
    score = [0.0] * n
    for values in [round_calibrations, *config_rounds.values()]:
        if len(values) == n:
            med = statistics.median(values)
            for i, v in enumerate(values):
                score[i] = max(score[i], abs(v / med - 1))
    return max(range(n), key=lambda i: (score[i], i))
