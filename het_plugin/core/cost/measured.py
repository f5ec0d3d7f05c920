"""Measured stage times of a training run, turned into a profile the planner reads (docs/planner.md,
"Plans that learn from the run").

The adapters time, on every rank, each micro-batch's forward and backward and each iteration
(:mod:`het_plugin.runtime.recorder`); each rank's sums are a :class:`RankTimes`. Here (pure Python, no
process group):

* :func:`measured_run`: per pipeline stage, the slowest reporting rank's mean forward and backward of one
  micro-batch (the predictor also charges a stage its slowest device), the mean iteration time, and what the
  plan predicted for each stage: a :class:`~het_plugin.core.inputs.profile_schema.MeasuredRun`.
* :func:`measured_profile`: a format-2 :class:`~het_plugin.core.inputs.profile.Profile` holding that run (``measured``) and
  compute curves derived from it, so that ``het-plugin plan --profile`` predicts each measured stage's time:
  a stage's time is shared between its decoder layers and its embedding / output layer in proportion to their
  forward FLOPs (the analytic model's shares: a run times whole stages, not layers). Each decoder layer the run
  held gets a per-layer-index entry (``layer: i``, the global index) on the device type that ran it, with its
  stage's per-layer time: the same split re-predicts every stage at its measured time, even where a device type
  held stages of different per-layer cost. A device type's ``layer`` curve is the mean over its stages, weighted
  by their layers: another split uses it for the layers it moves onto a device type that did not run them (an
  estimate). A device type that held neither end of the pipeline gets ``embedding`` and ``output`` from its layer
  by the same shares. Curves are at the run's micro-batch size and TP only.
* :func:`comparison_lines` and :func:`imbalance_warning`: predicted against measured, for the report and for the
  rank-0 warning during training.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from ..inputs.model import ModelSpec
from ..inputs.profile import Profile
from ..inputs.profile_schema import MeasuredRun, MeasuredStage
from ..plan import Plan
from .run_fit import fit_slot_s, run_devices, run_overhead_s

#: the warning during training fires when the measured imbalance exceeds the predicted one by more than this
DEFAULT_IMBALANCE_THRESHOLD = 0.2


@dataclass
class RankTimes:
    """One rank's sums over the iterations it counted (the warm-up ones left out)."""
    rank: int
    iterations: int = 0            # iterations counted
    micro_batches: int = 0         # micro-batches counted (over those iterations)
    forward_s: float = 0.0         # all forward compute of those micro-batches
    backward_s: float = 0.0
    iteration_s: float = 0.0       # wall time of the iteration intervals counted
    intervals: int = 0
    schedule_s: float = 0.0        # the forward-backward schedule calls (compute, transfers and waits)
    excluded_s: float = 0.0        # checkpoint saves and evaluation, taken out of iteration_s
    final: bool = False            # the rank's last report (at exit)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "RankTimes":
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    @property
    def per_micro_batch(self) -> tuple[float, float]:
        """Mean (forward, backward) of one micro-batch."""
        n = max(1, self.micro_batches)
        return self.forward_s / n, self.backward_s / n


def rank_devices(plan: Plan) -> list[str]:
    """The accelerator name of every physical rank."""
    out = [""] * plan.world_size
    for n in plan.nodes:
        out[n.first_rank:n.first_rank + n.num_ranks] = [n.accelerator] * n.num_ranks
    return out


#: ranks per (stage, device type) that report their times (rank 0 reads them all every N iterations: bounded)
REPORTERS_PER_GROUP = 8


def reporting_ranks(plan: Plan, per_group: int = REPORTERS_PER_GROUP) -> list[int]:
    """The ranks whose times the profile uses: rank 0 and, of each (stage, device type), its first ``per_group``
    ranks in data-parallel order (so a 16,384-rank job has rank 0 read a few dozen entries, not 16,384)."""
    devices = rank_devices(plan)
    chosen = {0}
    for s in range(plan.pp):
        taken: dict[str, int] = {}
        for r in sorted(plan.stage_ranks(s), key=lambda r: (plan.replica_of(r), r)):
            if taken.get(devices[r], 0) < per_group:
                taken[devices[r]] = taken.get(devices[r], 0) + 1
                chosen.add(r)
    return sorted(chosen)


def _slowest_by_stage_and_device(plan: Plan, ranks: Sequence[RankTimes]) -> dict[tuple[int, str], RankTimes]:
    devices = rank_devices(plan)
    out: dict[tuple[int, str], RankTimes] = {}
    for r in ranks:
        if r.micro_batches <= 0 or not 0 <= r.rank < plan.world_size:
            continue
        key = (plan.stage_of(r.rank), devices[r.rank])
        if key not in out or sum(r.per_micro_batch) > sum(out[key].per_micro_batch):
            out[key] = r
    return out


def measured_run(plan: Plan, ranks: Sequence[RankTimes], framework: str = "",
                 schedule_holds_step: bool = False) -> Optional[MeasuredRun]:
    """The run's per-stage times; None until every stage has a rank that counted an iteration
    (``schedule_holds_step``: the framework's timed schedule call includes the optimizer step, DeepSpeed's)."""
    slowest = _slowest_by_stage_and_device(plan, ranks)
    counted = [r for r in ranks if r.iterations > 0]
    stages = []
    prediction = plan.current_prediction          # a stale one (the plan edited after it) is another plan's
    predicted = prediction.stage_compute_s if prediction and prediction.stage_compute_s else None
    for s in range(plan.pp):
        mine = [(dev, r) for (st, dev), r in slowest.items() if st == s]
        if not mine:
            return None
        dev, worst = max(mine, key=lambda dr: sum(dr[1].per_micro_batch))
        f, b = worst.per_micro_batch
        reporting = sum(1 for r in counted if r.micro_batches > 0 and plan.stage_of(r.rank) == s)
        stages.append(MeasuredStage(stage=s, layers=plan.layers_per_stage[s], device=dev, forward_s=f, backward_s=b,
                                    predicted_s=predicted[s] if predicted else None, ranks=max(1, reporting)))
    intervals = [r for r in counted if r.intervals > 0]
    iteration = max((r.iteration_s / r.intervals for r in intervals), default=0.0)
    schedule = max((r.schedule_s / r.iterations for r in counted if r.schedule_s > 0), default=None)
    return MeasuredRun(plan_hash=plan.hash, framework=framework, micro_batch_size=plan.micro_batch_size, tp=plan.tp,
                       num_micro_batches=plan.num_micro_batches, layers_per_stage=list(plan.layers_per_stage),
                       iterations=min(r.iterations for r in counted), iteration_s=iteration, schedule_s=schedule,
                       schedule_holds_step=schedule_holds_step,
                       predicted_iteration_s=prediction.iteration_s if prediction else None, stages=stages)


def flop_shares(model: ModelSpec, micro_batch_size: int) -> tuple[float, float, float]:
    """Forward FLOPs of one micro-batch of (a decoder layer, the embedding, the output layer + loss), as the
    analytic model counts them (cost._compute_s): the shares a measured stage time is split by."""
    layer = model.mean_layer_flops_fwd(micro_batch_size)
    embedding = 2.0 * micro_batch_size * model.seq_length * model.hidden_size
    output = model.logits_flops_fwd(micro_batch_size)
    return layer, embedding, output


def measured_profile(plan: Plan, ranks: Sequence[RankTimes], framework: str = "",
                     description: str = "", *, cluster=None, analysis=None,
                     schedule_holds_step: bool = False) -> Optional[Profile]:
    """The run as a profile: ``measured`` plus compute curves per device type (module docstring), and the fixed
    costs the run leaves over (:mod:`.run_fit`): the per-iteration overhead and, given the ``cluster`` the plan was
    made for (``analysis``: its :func:`~.plan_costs.plan_analysis`, to reuse), the per-pipeline-slot cost."""
    run = measured_run(plan, ranks, framework, schedule_holds_step)
    if run is None:
        return None
    model = ModelSpec.model_validate(plan.model)
    mb, tp, last = plan.micro_batch_size, plan.tp, plan.pp - 1
    layer_w, emb_w, out_w = flop_shares(model, mb)
    layer_sum: dict[str, list[float]] = {}           # device -> [forward, backward, layers]
    fixed: list[tuple[str, str, float, float]] = []   # (device, kind, forward, backward)
    own: list[tuple[str, int, float, float]] = []     # (device, global layer index, forward, backward)
    for (s, dev), r in sorted(_slowest_by_stage_and_device(plan, ranks).items()):
        f, b = r.per_micro_batch
        n = plan.layers_per_stage[s]
        weight = n * layer_w + (emb_w if s == 0 else 0.0) + (out_w if s == last else 0.0)
        if weight <= 0:
            continue
        if n:
            acc = layer_sum.setdefault(dev, [0.0, 0.0, 0])
            acc[0] += f * n * layer_w / weight
            acc[1] += b * n * layer_w / weight
            acc[2] += n
            first = sum(plan.layers_per_stage[:s])
            own.extend((dev, i, f * layer_w / weight, b * layer_w / weight) for i in range(first, first + n))
        if s == 0:
            fixed.append((dev, "embedding", f * emb_w / weight, b * emb_w / weight))
        if s == last:
            fixed.append((dev, "output", f * out_w / weight, b * out_w / weight))
    prof = Profile(description=description or f"measured by het_plugin ({framework or 'training'}): plan {plan.hash}, "
                                              f"{run.iterations} iterations", measured=run)
    for dev, (f, b, n) in sorted(layer_sum.items()):
        prof.add_compute(dev, "layer", mb, tp, f / n, b / n)
    for dev, i, f, b in own:                         # the measured split's own layers, on the device they ran on
        prof.add_compute(dev, "layer", mb, tp, f, b, layer=i)
    seen = set()
    for dev, kind, f, b in fixed:
        if (dev.lower(), kind) not in seen:          # one curve per (device, kind): the first stage's
            seen.add((dev.lower(), kind))
            prof.add_compute(dev, kind, mb, tp, f, b)
    # A device type that held neither end of the pipeline gets its embedding and output from its own layer by the
    # same FLOP shares (a re-plan may put the first or last stage on it).
    for dev, (f, b, n) in sorted(layer_sum.items()):
        for kind, weight in (("embedding", emb_w), ("output", out_w)):
            if (dev.lower(), kind) not in seen and layer_w > 0:
                prof.add_compute(dev, kind, mb, tp, f / n * weight / layer_w, b / n * weight / layer_w)
    optimizer_s = None
    if cluster is not None:
        fit = fit_slot_s(plan, cluster, prof, run, analysis)
        if fit is not None:
            optimizer_s = fit.optimizer_s
            for dev in run_devices(plan):
                prof.add_pipeline_slot(dev, fit.slot_s)
    over = run_overhead_s(run, plan, optimizer_s)
    if over is not None:
        for dev in run_devices(plan):
            prof.add_overhead(dev, over)
    return prof


# ---- predicted against measured ---------------------------------------------------------------------


def imbalance(stage_times: Sequence[float]) -> float:
    """Slowest stage / mean stage (1.0: balanced)."""
    times = [t for t in stage_times]
    if not times or sum(times) <= 0:
        return 1.0
    return max(times) / (sum(times) / len(times))


def imbalances(run: MeasuredRun) -> tuple[Optional[float], float]:
    """(predicted, measured) imbalance of the run's stages (predicted None when the plan had no prediction)."""
    measured = imbalance([st.forward_s + st.backward_s for st in run.stages])
    if any(st.predicted_s is None for st in run.stages):
        return None, measured
    return imbalance([st.predicted_s for st in run.stages]), measured


def imbalance_warning(run: MeasuredRun, threshold: float, replan: str) -> Optional[str]:
    """A warning when the measured stage imbalance exceeds the predicted one by more than ``threshold``
    (a fraction), naming the command that re-plans; None otherwise."""
    predicted, measured = imbalances(run)
    if predicted is None or measured <= predicted * (1 + threshold):
        return None
    slowest = max(run.stages, key=lambda st: st.forward_s + st.backward_s)
    return (f"measured stage imbalance {measured:.2f}x (slowest stage / mean; stage {slowest.stage}, "
            f"{slowest.layers} layers on {slowest.device}, is slowest) exceeds the plan's predicted {predicted:.2f}x "
            f"by more than {threshold:.0%}: re-plan with the measured times: {replan}")


def duration(seconds: Optional[float]) -> str:
    """Three significant digits in s, ms, us or ns (a tiny model's predicted stages take nanoseconds)."""
    if seconds is None:
        return "-"
    if seconds == 0:
        return "0"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def stage_devices(plan: Plan) -> list[str]:
    """Per stage, its device types ('H100', or 'A100-80+H100' for a stage over two)."""
    devices = rank_devices(plan)
    return ["+".join(sorted({devices[r] for r in plan.stage_ranks(s)})) for s in range(plan.pp)]


def _ratio(x: float) -> str:
    return f"{x:.2f}x" if x < 100 else f"{x:,.0f}x"


def fixed_cost_line(profile: Profile) -> str:
    """The report's line on the fixed costs a run's profile carries (core.cost.run_fit)."""
    devices = sorted({st.device for st in profile.measured.stages}, key=str.lower)
    slot = max((v for v in (profile.pipeline_slot_s(d) for d in devices) if v is not None), default=None)
    over = max((v for v in (profile.iteration_overhead_s(d) for d in devices) if v is not None), default=None)
    slot_text = (f"pipeline slot {duration(slot)} per forward or backward" if slot is not None else
                 "pipeline slot not fitted (the run's recorder did not know the plan's cluster)")
    over_text = f"iteration overhead {duration(over)}" if over is not None else "iteration overhead not measured"
    return f"  fixed costs the run left over (fitted to re-predict it): {slot_text}, {over_text}"


def comparison_lines(run: MeasuredRun, plan: Plan, repredicted: Optional[Sequence[float]] = None,
                     profile: Optional[Profile] = None) -> list[str]:
    """The report's section: per stage of the measured plan, its predicted (when planned) and measured forward
    + backward of one micro-batch, ``repredicted`` (the same split predicted with this profile, when the new plan
    has the measured one's degrees), the imbalances, the fixed costs ``profile`` (the run's) carries, and the new
    plan's split if it differs."""
    lines = [f"measured run of plan {run.plan_hash}{f' ({run.framework})' if run.framework else ''}: "
             f"{run.iterations} iterations, micro-batch {run.micro_batch_size} x {run.num_micro_batches}, "
             f"tp={run.tp}; forward + backward of one micro-batch per stage (its slowest rank):"]
    head = f"  {'stage':>5s} {'layers':>6s}  {'device':<14s} {'predicted':>10s} {'measured':>10s} {'ratio':>12s}"
    if repredicted is not None:
        head += f" {'with profile':>12s}"
    lines.append(head)
    for st in run.stages:
        total = st.forward_s + st.backward_s
        ratio = _ratio(total / st.predicted_s) if st.predicted_s else "-"
        row = (f"  {st.stage:>5d} {st.layers:>6d}  {st.device:<14s} {duration(st.predicted_s):>10s} {duration(total):>10s} "
               f"{ratio:>12s}")
        if repredicted is not None:
            row += f" {duration(repredicted[st.stage]):>12s}"
        lines.append(row)
    predicted, measured = imbalances(run)
    lines.append(f"  imbalance (slowest stage / mean): predicted "
                 f"{'-' if predicted is None else f'{predicted:.2f}x'}, measured {measured:.2f}x")
    lines.append(f"  iteration: predicted {duration(run.predicted_iteration_s)}, measured {duration(run.iteration_s)}"
                 + (f" (forward-backward schedule {duration(run.schedule_s)})" if run.schedule_s else ""))
    if profile is not None:
        lines.append(fixed_cost_line(profile))
    same_shape = (plan.pp == len(run.layers_per_stage) and plan.micro_batch_size == run.micro_batch_size
                  and plan.tp == run.tp)
    same_devices = same_shape and all(st.device in devices.split("+")
                                      for st, devices in zip(run.stages, stage_devices(plan)))
    if plan.hash == run.plan_hash or (same_devices and list(plan.layers_per_stage) == list(run.layers_per_stage)):
        lines.append(f"re-planned with the measured times: the split stays {list(run.layers_per_stage)}")
    elif same_shape:
        new = plan.prediction.stage_compute_s if plan.prediction else []
        times = f"; predicted per stage {', '.join(duration(t) for t in new)}" if new else ""
        lines.append(f"re-planned with the measured times: new split {list(plan.layers_per_stage)} over "
                     f"{', '.join(stage_devices(plan))} (was {list(run.layers_per_stage)} over "
                     f"{', '.join(st.device for st in run.stages)}){times}")
    else:
        lines.append(f"re-planned with the measured times: a new plan tp={plan.tp} pp={plan.pp} dp={plan.dp} "
                     f"micro-batch {plan.micro_batch_size}, layers {list(plan.layers_per_stage)} (the run: tp={run.tp} "
                     f"pp={len(run.layers_per_stage)} micro-batch {run.micro_batch_size}, layers "
                     f"{list(run.layers_per_stage)}); the measured curves hold micro-batch {run.micro_batch_size} "
                     f"and tp={run.tp} only")
    return lines
