"""The predicted 1F1B schedule of a plan as a picture (``het-plugin plan --timeline FILE``): one row per pipeline
stage with its forwards, backwards, the sends it is busy with, the gradient reduction (the part overlap hides
drawn under the last backward, the rest after it), the optimizer step and the bubbles; with a measured profile,
each stage's measured forward + backward per micro-batch beside its predicted one.

The times are the predictor's (:mod:`het_plugin.core.cost`): the plan's placement is analyzed again on the cluster
file, and the 1F1B order is simulated as :func:`het_plugin.core.cost.simulate_1f1b` does, keeping every operation's
start and end. Drawn with the placement picture's shapes and back-ends (:mod:`het_plugin.views.svg`: SVG, or PNG
through matplotlib).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

from ..core import cost
from ..core.errors import ConfigError
from ..core.cost.measured import duration
from ..core.cost.plan_costs import split_costs
from ..core.plan import Plan
from ..core.inputs.profile import Profile
from ..core.inputs.profile_schema import MeasuredRun
from .svg import Line, Rect, Shape, Text, to_png, to_svg
from .report import stage_summary

COLORS = {"forward": "#4e79a7", "backward": "#f28e2b", "send": "#9d9d9d", "reduction": "#59a14f",
          "optimizer": "#b07aa1", "bubble": "#f2f2f2", "other": "#d4a6c8", "measured": "#e15759"}
LABELS = {"forward": "forward", "backward": "backward", "send": "send (the sender waits for it)",
          "reduction": "gradient reduction (hidden under the last backward, then exposed)",
          "optimizer": "optimizer step", "bubble": "bubble (idle)", "other": "embedding all-reduce + overhead",
          "measured": "measured forward + backward of one micro-batch"}


@dataclass
class Op:
    """One drawn span of a stage's row (seconds from the iteration's start)."""
    stage: int
    kind: str            # forward | backward | send | reduction | optimizer | other | bubble
    start: float
    end: float
    micro_batch: Optional[int] = None


@dataclass
class Timeline:
    """A plan's predicted iteration, span by span."""
    plan_hash: str
    layers: list[int]
    devices: list[str]                  # per stage: its device types
    num_micro_batches: int
    ops: list[Op]
    per_micro_batch_s: list[float]      # forward + backward of one micro-batch per stage
    pipeline_s: float
    iteration_s: float
    note: str = ""
    title: str = ""
    stages: int = 0


def simulate_1f1b_ops(fwd: Sequence[float], bwd: Sequence[float], send: Sequence[float], m: int,
                      send_back: Optional[Sequence[float]] = None) -> tuple[list[Op], list[float]]:
    """:func:`het_plugin.core.cost.simulate_1f1b` keeping every forward, backward and send; returns the spans and each
    stage's finish time (simulate_1f1b's own)."""
    spans: list = []
    finish = cost.simulate_1f1b(fwd, bwd, send, m, send_back, record=spans)
    return [Op(*span) for span in spans], finish


def plan_timeline(plan: Plan, cluster, profile: Optional[Profile] = None) -> Timeline:
    """The plan's predicted iteration: the 1F1B schedule of its slowest replica group, reductions, optimizer."""
    if plan.vpp > 1:
        raise ConfigError(f"the plan interleaves {plan.vpp} virtual stages per rank; --timeline draws the "
                          "non-interleaved 1F1B schedule only", field="--timeline",
                          fix="drop --timeline, or plan with --vpp 1 to see that schedule")
    sc = split_costs(plan, cluster, profile)
    layers = list(plan.layers_per_stage)
    pred = sc.predict(layers)
    # the slowest replica group's pipeline, exactly as the prediction ran it (spans recorded)
    g = max(cost.group_pipelines(sc, layers, record=True), key=lambda g: max(g.finish))
    ops, finish, fwd, bwd, m, reps = [Op(*span) for span in g.spans], g.finish, g.fwd, g.bwd, g.micro_batches, g.replicas
    for s, red in enumerate(cost.stage_reductions(sc, layers)):
        if red > 0:       # with overlap it starts with the last backward (the exposed part: g.ends)
            last = max((o for o in ops if o.stage == s and o.kind == "backward"), key=lambda o: o.start)
            start = last.start if plan.overlap_grad_reduce else finish[s]
            ops.append(Op(s, "reduction", start, start + red))
    ends = g.ends
    done = max(ends)
    other = max(0.0, pred.iteration_s - done - pred.optimizer_s)
    for s in range(plan.pp):
        if other > 1e-12:
            ops.append(Op(s, "other", done, done + other))
        if pred.optimizer_s > 0:
            ops.append(Op(s, "optimizer", done + other, done + other + pred.optimizer_s))
    devices = [", ".join(sorted(st["where"])) for st in stage_summary(plan)]
    note = ""
    if len(sc.replica_groups) > 1 or plan.uneven_replicas:
        note = (f"the slowest replica group's pipeline ({m} micro-batches; replicas "
                f"{', '.join(map(str, reps[:8]))}{' ...' if len(reps) > 8 else ''})")
    return Timeline(plan.hash, layers, devices, m, ops, [f + b for f, b in zip(fwd, bwd)], max(finish),
                    pred.iteration_s, note, stages=plan.pp,
                    title=(f"het_plugin plan {plan.hash}: predicted 1F1B schedule, {plan.model.get('name', 'model')} on "
                           f"{plan.cluster_name}, tp={plan.tp} pp={plan.pp} dp={plan.dp}, micro-batch "
                           f"{plan.micro_batch_size} x {m}"))


def bubbles(tl: Timeline) -> list[Op]:
    """Idle spans of each stage between the start and its last forward, backward or send."""
    out = []
    for s in range(tl.stages):
        busy = sorted((o.start, o.end) for o in tl.ops if o.stage == s and o.kind in ("forward", "backward", "send"))
        t = 0.0
        for a, b in busy:
            if a > t + 1e-12:
                out.append(Op(s, "bubble", t, a))
            t = max(t, b)
        if t < tl.pipeline_s - 1e-12:
            out.append(Op(s, "bubble", t, tl.pipeline_s))
    return out




ROW_H, GAP, LEFT, TOP, PLOT_W, SIDE_W = 28, 10, 190, 70, 900, 260


def layout(tl: Timeline, measured: Optional[MeasuredRun] = None) -> tuple[list[Shape], float, float]:
    """Shapes of the picture: a time axis, one row per stage, the legend; ``measured``: the side panel."""
    shapes: list[Shape] = [Text(10, 22, tl.title, 14, bold=True)]
    sub = f"iteration {duration(tl.iteration_s)} predicted (pipeline {duration(tl.pipeline_s)})"
    if tl.note:
        sub += f"; {tl.note}"
    shapes.append(Text(10, 40, sub, 11))
    total = max(tl.iteration_s, max((o.end for o in tl.ops), default=0.0)) or 1.0
    scale = PLOT_W / total
    # time axis
    axis_y = TOP - 8
    shapes.append(Line([(LEFT, axis_y), (LEFT + PLOT_W, axis_y)], "#333333", 1))
    ticks = 8
    for k in range(ticks + 1):
        x = LEFT + PLOT_W * k / ticks
        shapes.append(Line([(x, axis_y - 4), (x, axis_y)], "#333333", 1))
        shapes.append(Text(x, axis_y - 7, duration(total * k / ticks), 9, anchor="middle"))
    for s in range(tl.stages):
        y = TOP + s * (ROW_H + GAP)
        shapes.append(Text(10, y + 12, f"stage {s}: {tl.layers[s]} layers", 11, bold=True))
        shapes.append(Text(10, y + 25, tl.devices[s][:30], 9, color="#444444"))
        shapes.append(Rect(LEFT, y, PLOT_W, ROW_H, fill="#ffffff", stroke="#cccccc", width=0.5))
        for o in [b for b in bubbles(tl) if b.stage == s] + [o for o in tl.ops if o.stage == s]:
            x, w = LEFT + o.start * scale, max(0.5, (o.end - o.start) * scale)
            what = o.kind + (f", micro-batch {o.micro_batch}" if o.micro_batch is not None else "")
            title = f"stage {s} {what}: {duration(o.start)} - {duration(o.end)}"
            if o.kind == "reduction":      # under the compute row: it overlaps the last backward
                shapes.append(Rect(x, y + ROW_H - 6, w, 6, fill=COLORS[o.kind], stroke="none", width=0, title=title))
                continue
            shapes.append(Rect(x, y + 2, w, ROW_H - 10, fill=COLORS[o.kind],
                               stroke="#dddddd" if o.kind == "bubble" else "#ffffff", width=0.5, title=title))
            if o.micro_batch is not None and w >= 12 and o.kind in ("forward", "backward"):
                shapes.append(Text(x + w / 2, y + 15, str(o.micro_batch), 8, anchor="middle", color="#ffffff"))
    height = TOP + tl.stages * (ROW_H + GAP)
    width = LEFT + PLOT_W + 20
    if measured is not None:
        width += _measured_panel(shapes, tl, measured, LEFT + PLOT_W + 30)
    # legend
    y = height + 10
    shapes.append(Text(10, y + 4, "legend", 12, bold=True))
    y += 14
    kinds = ["forward", "backward", "send", "reduction", "other", "optimizer", "bubble"] + (
        ["measured"] if measured is not None else [])
    x = 10.0
    for kind in kinds:
        text = LABELS[kind]
        w = 24 + 6.2 * len(text)
        if x + w > width:
            x, y = 10.0, y + 18
        shapes.append(Rect(x, y, 14, 12, fill=COLORS[kind], stroke="#999999", width=0.5))
        shapes.append(Text(x + 18, y + 10, text, 10))
        x += w
    return shapes, width, y + 24


def _measured_panel(shapes: list[Shape], tl: Timeline, run: MeasuredRun, x0: float) -> float:
    """Per stage, bars of the predicted and the measured forward + backward of one micro-batch (one scale)."""
    shapes.append(Text(x0, TOP - 30, f"per micro-batch: predicted / measured (run of plan {run.plan_hash}, "
                                     f"layers {list(run.layers_per_stage)})", 10, bold=True))
    if len(run.stages) != tl.stages:
        shapes.append(Text(x0, TOP + 12, f"the run had {len(run.stages)} stages, this plan {tl.stages}: not compared",
                           10))
        return SIDE_W + 260
    biggest = max(tl.per_micro_batch_s + [st.forward_s + st.backward_s for st in run.stages]) or 1.0
    bar = SIDE_W - 70
    for s, st in enumerate(run.stages):
        y = TOP + s * (ROW_H + GAP)
        pred, meas = tl.per_micro_batch_s[s], st.forward_s + st.backward_s
        shapes.append(Rect(x0, y + 2, max(0.5, bar * pred / biggest), 10, fill=COLORS["forward"], stroke="none",
                           width=0, title=f"stage {s} predicted per micro-batch: {duration(pred)}"))
        shapes.append(Text(x0 + bar * pred / biggest + 4, y + 11, duration(pred), 9))
        shapes.append(Rect(x0, y + 14, max(0.5, bar * meas / biggest), 10, fill=COLORS["measured"], stroke="none",
                           width=0, title=f"stage {s} measured per micro-batch: {duration(meas)} ({st.layers} layers on "
                                          f"{st.device})"))
        shapes.append(Text(x0 + bar * meas / biggest + 4, y + 23,
                           f"{duration(meas)} measured ({st.layers} layers on {st.device})", 9))
    return SIDE_W + 260


def draw_timeline(plan: Plan, path: Union[str, Path], cluster, profile: Optional[Profile] = None) -> Timeline:
    """Write the timeline picture: SVG, or PNG when the path ends in .png; returns what was drawn."""
    path = Path(path)
    tl = plan_timeline(plan, cluster, profile)
    shapes, width, height = layout(tl, profile.measured if profile is not None else None)
    if path.suffix.lower() == ".png":
        to_png(shapes, width, height, path)
    elif path.suffix.lower() == ".svg":
        path.write_text(to_svg(shapes, width, height))
    else:
        raise ConfigError(f"cannot draw into {path.name!r}", field="--timeline", fix="give a file name ending in .svg or .png")
    return tl
