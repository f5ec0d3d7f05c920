"""Fixed costs a layer's compute does not hold (issue 23): the per-pipeline-slot cost (the schedule's own work
around each forward or backward of one micro-batch on a stage: p2p set-up and waits' bookkeeping, the loss, the
framework's hooks) and the per-iteration overhead (zero-grad, gradient norm and clipping, the optimizer's
launches, the loss all-reduce, the data loader, logging).

Measured values come from the profile (``pipeline_slot``, ``iteration_overhead``): ``het-plugin profile`` measures
both, and a training run's profile carries what the run left over (:mod:`.run_fit`: the slot cost fitted to the
run's schedule call where the recorder knows the plan's cluster, the overhead from its iteration). Unmeasured, a
format-2 profile's prediction gets a small analytic default: a count of framework launches x one launch's latency
(``DEFAULT_SLOT_S``, ``DEFAULT_ITERATION_S``). Without a profile, and with a format-1 profile, both stay 0: the
analytic model and format-1 predictions are unchanged (a format-1 file predicts as it did; plans keep their
hashes). A training run's profile gets no default either: its re-plan is calibrated on the run's own stage
timers, and a guessed slot cost of 0.2 ms would outweigh a tiny model's whole stage (it flipped the re-planned
split of tests/views/test_timeline.py). The slot cost lengthens every forward and backward the schedule runs (in
the 1F1B simulation, each model chunk's in the interleaved one) and the exact partition's per-micro-batch cost,
not a stage's compute (``stage_compute_s`` stays the compute a run's stage timers compare with).
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

KERNEL_LAUNCH_S = 5e-6          # one framework op's launch and Python dispatch (CUDA launch ~ 3-10 us)
SLOT_LAUNCHES = 40              # per slot: p2p post/wait, loss and grad-scale ops, hook calls
ITERATION_LAUNCHES = 400        # per iteration: zero-grad, grad norm + clip, optimizer foreach kernels, loss reduce
DEFAULT_SLOT_S = SLOT_LAUNCHES * KERNEL_LAUNCH_S              # 0.2 ms
DEFAULT_ITERATION_S = ITERATION_LAUNCHES * KERNEL_LAUNCH_S    # 2 ms


def _measured_or_default(profile, names: Iterable[str], read: Callable[[str], Optional[float]],
                         default: float) -> float:
    if profile is None or profile.legacy:
        return 0.0
    if profile.measured is not None:        # a training run's profile: re-plans are calibrated on its stage timers
        default = 0.0
    values = [read(n) for n in names]
    return max((default if v is None else v for v in values), default=0.0)


def slot_s(profile, accelerators: Sequence) -> float:
    """Seconds per pipeline slot of a stage on these accelerators: the slowest device type's."""
    return _measured_or_default(profile, [a.name for a in accelerators],
                                lambda n: profile.pipeline_slot_s(n), DEFAULT_SLOT_S)


def iteration_overhead_s(profile, accelerators: Iterable) -> float:
    """Seconds per iteration outside the schedule: the slowest device type's of the plan."""
    return _measured_or_default(profile, [a.name for a in accelerators],
                                lambda n: profile.iteration_overhead_s(n), DEFAULT_ITERATION_S)


def with_slots(fwd: Sequence[float], bwd: Sequence[float], sts: Sequence) -> tuple[list[float], list[float]]:
    """Each stage's forward and backward as the 1F1B simulation runs them: compute + the stage's slot cost."""
    return ([f + st.slot_s for f, st in zip(fwd, sts)], [b + st.slot_s for b, st in zip(bwd, sts)])
