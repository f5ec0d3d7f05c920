"""The fixed costs a training run measured (issue 23): what its stage timers leave over, per iteration and per
pipeline slot, in the terms the predictor adds them back (:mod:`.fixed_costs`).

A run times each micro-batch's forward and backward (compute), the framework's schedule call and the iteration.
The two costs are fitted so that the predictor, given the run's own profile, re-predicts the run:

* **per pipeline slot** (:func:`fit_slot_s`): the schedule call holds the compute, the sends, the exposed gradient
  reduction and the schedule's own work around every forward and backward. The predictor simulates the first
  three (the plan's placement on its cluster: :mod:`.plan_costs`); the slot cost ``c`` is the one that makes the
  simulated schedule call (its 1F1B or interleaved simulation, every forward and backward lengthened by ``c``)
  last what the run measured. The simulated call grows monotonically with ``c`` (piecewise linearly: by the
  slots on the critical path), so ``c`` is found by bracketing and false position; ``c = 0`` when the model
  already predicts the call at or above the measurement (its sends or reduction are over-predicted: nothing is
  left for the slots). One value for every device type of the run: one schedule call cannot tell them apart.
  What the call holds, checked against the sources: Megatron-Core's three schedules call
  ``config.finalize_model_grads_func`` (the DP reduction's wait, the tied-embedding all-reduce) before they return
  (megatron-core 0.19.2 ``pipeline_parallel/schedules.py``: ``forward_backward_no_pipelining``,
  ``..._with_interleaving``, ``..._without_interleaving``), so the exposed reduction is inside it and the optimizer
  step is not; DeepSpeed's ``TrainSchedule`` ends every batch with ``ReduceTiedGrads``, ``ReduceGrads``,
  ``OptimizerStep`` (deepspeed 0.19.8 ``runtime/pipe/schedule.py``), so ``train_batch`` holds the step too.
* **per iteration** (:func:`run_overhead_s`): the mean iteration minus the schedule call minus the optimizer step
  the predictor charges (DeepSpeed's ``train_batch`` holds the step: then nothing is subtracted for it).

Without the cluster the plan was made for (a run from a plan file with no cluster file named) the slot cost is
not fitted and keeps its rule in :mod:`.fixed_costs` (0 for a run's profile).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from ..inputs.profile import OverheadMeasurement, Profile
from ..inputs.profile_schema import MeasuredRun
from ..plan import Plan
from .analysis import Analysis
from .plan_costs import plan_analysis, split_costs

#: the fit stops when the simulated schedule call is this close to the measured one (relative)
FIT_TOLERANCE = 1e-4
#: at most this many predictions of the plan per fit (each is one schedule simulation)
FIT_EVALUATIONS = 40


def with_slot(profile: Profile, devices, seconds: float) -> Profile:
    """A copy of ``profile`` whose pipeline slot on each of ``devices`` is ``seconds`` (other entries kept)."""
    names = {d.lower() for d in devices}
    kept = [o for o in profile.slots if o.device.lower() not in names]
    return dataclasses.replace(profile, slots=kept + [OverheadMeasurement(d, seconds) for d in sorted(devices)])


@dataclasses.dataclass
class SlotFit:
    """The fitted slot cost and what the fit saw (the report and the tests read them)."""
    slot_s: float
    measured_s: float           # the schedule call the predictor's part is held against (step taken out)
    predicted_without_s: float  # the predictor's schedule call with no slot cost
    optimizer_s: float          # the optimizer step the predictor charges with this profile
    evaluations: int


def run_devices(plan: Plan) -> list[str]:
    """The device types of the plan's ranks."""
    return sorted({n.accelerator for n in plan.nodes}, key=str.lower)


def fit_slot_s(plan: Plan, cluster, profile: Profile, run: MeasuredRun,
               analysis: Optional[Analysis] = None) -> Optional[SlotFit]:
    """The per-slot cost that makes ``plan``'s predicted schedule call (with ``profile``: the run's measured
    compute) equal the run's measured one; None when the run timed no schedule call."""
    if run.schedule_s is None:
        return None
    analysis = plan_analysis(plan, cluster) if analysis is None else analysis
    devices = run_devices(plan)
    evaluations = 0

    def schedule(c: float) -> tuple[float, float]:
        nonlocal evaluations
        evaluations += 1
        pred = split_costs(plan, cluster, with_slot(profile, devices, c), analysis).predict(plan.layers_per_stage)
        return pred.pipeline_s + pred.dp_exposed_s, pred.optimizer_s

    base, opt = schedule(0.0)
    target = run.schedule_s - (opt if run.schedule_holds_step else 0.0)
    if base >= target or target <= 0:
        return SlotFit(0.0, max(0.0, target), base, opt, evaluations)
    c = _solve(lambda c: schedule(c)[0], target, base,
               first_guess=(target - base) / (2.0 * (run.num_micro_batches + len(run.layers_per_stage) - 1)))
    return SlotFit(c, target, base, opt, evaluations)


def _solve(f: Callable[[float], float], target: float, f0: float, first_guess: float) -> float:
    """A ``c >= 0`` with ``f(c)`` within FIT_TOLERANCE of ``target``, for a nondecreasing piecewise-linear ``f``
    with ``f(0) = f0 < target``: bracket by doubling, then false position (exact on one linear piece), falling back
    to bisection when one end stays put twice. Out of evaluations: the bracket's upper end."""
    tol = FIT_TOLERANCE * target
    lo, f_lo = 0.0, f0
    hi = max(first_guess, 1e-12)
    f_hi = f(hi)
    budget = FIT_EVALUATIONS - 2
    while f_hi < target - tol and budget > 0:
        lo, f_lo = hi, f_hi
        hi *= 2.0
        f_hi = f(hi)
        budget -= 1
    last_side, repeats = 0, 0
    while budget > 0 and f_hi - target > tol:
        secant = f_hi > f_lo and repeats < 2
        c = lo + (target - f_lo) * (hi - lo) / (f_hi - f_lo) if secant else 0.5 * (lo + hi)
        fc = f(c)
        budget -= 1
        if abs(fc - target) <= tol:
            return c
        side = -1 if fc < target else 1
        repeats = repeats + 1 if side == last_side else 0
        last_side = side
        if side < 0:
            lo, f_lo = c, fc
        else:
            hi, f_hi = c, fc
    return hi


def run_overhead_s(run: MeasuredRun, plan: Plan, optimizer_s: Optional[float] = None) -> Optional[float]:
    """The run's per-iteration overhead: the mean iteration minus the schedule call minus the optimizer step the
    predictor charges (``optimizer_s``; None: the plan's own prediction's), unless the schedule call holds the step
    (DeepSpeed). The predictor adds the step back, so the measured plan's iteration is re-predicted. None when
    the run timed no schedule call, or no optimizer step is known."""
    if run.schedule_s is None or run.iteration_s <= 0:
        return None
    if optimizer_s is None:
        if plan.prediction is None:
            return None
        optimizer_s = plan.prediction.optimizer_s
    step = 0.0 if run.schedule_holds_step else optimizer_s
    return max(0.0, run.iteration_s - run.schedule_s - step)
