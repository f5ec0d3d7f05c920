"""`het-plugin plan --timeline`: the predicted 1F1B schedule per stage, and the measured comparison in the
report (structure of the SVG, not a golden image)."""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from het_plugin.cli import main
from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.cost.pipeline import simulate_1f1b
from het_plugin.core.errors import ConfigError
from het_plugin.core.cost.measured import RankTimes, duration, measured_profile, stage_devices
from het_plugin.core.planner import make_plan
from het_plugin.core.cost.plan_costs import split_costs
from het_plugin.views.timeline import bubbles, layout, plan_timeline, simulate_1f1b_ops
from het_plugin.views.svg import to_svg
from tests.core.test_measured import IB_ROCE_4, tiny_model, times_for

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def cluster():
    return load_cluster(IB_ROCE_4)


@pytest.fixture(scope="module")
def plan(cluster):
    return make_plan(cluster, tiny_model(global_batch_size=16), tp=1, pp=2)


def titles(svg: str) -> list[str]:
    root = ET.fromstring(svg)
    return [t.text for t in root.iter(f"{SVG}title")]


@pytest.mark.parametrize("pp,m", [(1, 3), (2, 4), (4, 6), (3, 2)])
def test_the_recorded_schedule_is_the_predictors(pp, m):
    fwd = [0.010 + 0.002 * s for s in range(pp)]
    bwd = [0.021 - 0.001 * s for s in range(pp)]
    send = [0.003] * pp
    back = [0.004] * pp
    ops, finish = simulate_1f1b_ops(fwd, bwd, send, m, back)
    assert finish == pytest.approx(simulate_1f1b(fwd, bwd, send, m, back))
    for s in range(pp):
        mine = [o for o in ops if o.stage == s]
        assert sorted(o.micro_batch for o in mine if o.kind == "forward") == list(range(m))
        assert sorted(o.micro_batch for o in mine if o.kind == "backward") == list(range(m))
        sends = [o for o in mine if o.kind == "send"]
        assert len(sends) == m * ((s + 1 < pp) + (s > 0))
        spans = sorted((o.start, o.end) for o in mine)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:])), "a stage does one thing at a time"


def test_timeline_is_the_plans_prediction(plan, cluster):
    tl = plan_timeline(plan, cluster)
    assert tl.iteration_s == pytest.approx(plan.prediction.iteration_s, rel=1e-9)
    assert tl.per_micro_batch_s == pytest.approx(plan.prediction.stage_compute_s, rel=1e-9)
    assert tl.pipeline_s == pytest.approx(plan.prediction.pipeline_s, rel=1e-9)
    m = plan.num_micro_batches
    for s in range(plan.pp):
        kinds = [o.kind for o in tl.ops if o.stage == s]
        assert kinds.count("forward") == m and kinds.count("backward") == m
        assert kinds.count("reduction") == 1 and kinds.count("optimizer") == 1      # dp = 2: gradients reduced
    idle = bubbles(tl)
    assert idle and all(b.end > b.start for b in idle)
    # the pipeline's fill: the last stage waits for the first forward, the first for the first gradient
    assert any(b.stage == plan.pp - 1 and b.start == 0.0 for b in idle)


def test_timeline_svg_has_a_row_per_stage_and_each_kind_of_box(plan, cluster, tmp_path, capsys):
    out = tmp_path / "schedule.svg"
    rc = main(["plan", str(IB_ROCE_4), "--model", str(model_file(tmp_path)), "--pp", "2", "--tp", "1",
               "--use-all-nodes", "--timeline", str(out)])
    assert rc == 0
    assert f"schedule picture written to {out}" in capsys.readouterr().out
    svg = out.read_text()
    names = titles(svg)
    for s in range(2):
        assert f"stage {s}: " in svg                                    # the row's label
        for kind in ("forward", "backward", "send", "bubble", "reduction", "optimizer"):
            assert any(t.startswith(f"stage {s} {kind}") for t in names), (s, kind)
        assert sum(t.startswith(f"stage {s} forward, micro-batch") for t in names) == 4
    assert "predicted 1F1B schedule" in svg and "legend" in svg
    assert "measured" not in svg


def model_file(tmp_path: Path) -> Path:
    import yaml
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_model(global_batch_size=16).model_dump(exclude_none=True)))
    return path


def test_with_a_measured_profile_the_measured_stage_times_are_drawn_beside(plan, cluster):
    measured = {0: (0.004, 0.009), 1: (0.020, 0.041)}
    prof = measured_profile(plan, times_for(plan, measured))
    tl = plan_timeline(plan, cluster, prof)
    svg = to_svg(*layout(tl, prof.measured))
    names = titles(svg)
    for s in range(2):
        got = [t for t in names if t.startswith(f"stage {s} measured per micro-batch")]
        assert len(got) == 1 and duration(sum(measured[s])) in got[0]
        assert any(t.startswith(f"stage {s} predicted per micro-batch") for t in names)
    assert f"run of plan {plan.hash}" in svg


def report(capsys, tmp_path, plan, prof) -> str:
    path = tmp_path / "measured.yaml"
    prof.save(path)
    rc = main(["plan", str(IB_ROCE_4), "--model", str(model_file(tmp_path)), "--pp", "2", "--tp", "1",
               "--use-all-nodes", "--micro-batch-size", str(plan.micro_batch_size), "--profile", str(path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert f"measured run of plan {plan.hash} (Megatron)" in out
    return out


T = r"([\d.]+ (?:s|ms|us|ns))"


def test_the_report_shows_predicted_against_measured_per_stage(plan, tmp_path, capsys):
    """Measured 9x the prediction on stage 0 (nanoseconds: the tiny model's sends still dominate, the split
    stays): the report lists each stage's predicted and measured time, and the run's split predicted with the
    profile, which is the measured time (the calibration)."""
    pred = plan.prediction.stage_compute_s
    prof = measured_profile(plan, times_for(plan, {0: (pred[0] * 3, pred[0] * 6), 1: (pred[1] / 3, pred[1] * 2 / 3)}),
                            "Megatron")
    out = report(capsys, tmp_path, plan, prof)
    rows = re.findall(rf"^\s+(\d)\s+(\d+)\s+(\S+)\s+{T}\s+{T}\s+([\d.]+)x\s+{T}$", out, re.M)
    assert [int(r[0]) for r in rows] == [0, 1] and [int(r[1]) for r in rows] == plan.layers_per_stage
    assert [float(r[5]) for r in rows] == pytest.approx([9.0, 1.0], rel=0.01)     # measured / predicted
    assert all(r[6] == r[4] for r in rows), "the profile predicts the measured stage"
    assert "imbalance (slowest stage / mean): predicted" in out
    assert f"re-planned with the measured times: the split stays {plan.layers_per_stage}" in out


def test_the_report_names_the_new_split(plan, cluster, tmp_path, capsys):
    """Stage 0 (H100) measured 10x slower per layer than stage 1 (A100), in milliseconds: the re-plan gives
    the H100s fewer layers, and the report says so with each stage's devices."""
    prof = measured_profile(plan, times_for(plan, {0: (0.010, 0.020), 1: (0.001, 0.002)}), "Megatron")
    out = report(capsys, tmp_path, plan, prof)
    new = make_plan(cluster, tiny_model(global_batch_size=16), tp=1, pp=2, micro_batch_size=plan.micro_batch_size,
                    profile=prof)
    was = ", ".join(st.device for st in prof.measured.stages)
    assert (f"new split {new.layers_per_stage} over {', '.join(stage_devices(new))} (was {plan.layers_per_stage} "
            f"over {was})") in out
    layers_on = dict(zip(stage_devices(new), new.layers_per_stage))
    assert layers_on[prof.measured.stages[0].device] < plan.layers_per_stage[0]


def test_timeline_refusals(plan, cluster, tmp_path, capsys):
    saved = tmp_path / "plan.json"
    plan.save(saved)
    assert main(["plan", str(saved), "--timeline", str(tmp_path / "t.svg")]) == 2
    err = capsys.readouterr().err
    assert "--timeline" in err and "needs the cluster file" in err
    assert main(["plan", str(IB_ROCE_4), "--timeline", str(tmp_path / "t.pdf")]) == 2
    err = capsys.readouterr().err
    assert "--timeline" in err and ".svg or .png" in err
    assert not (tmp_path / "t.svg").exists()
    other = load_cluster(Path(IB_ROCE_4).with_name("megatron-homogeneous-4.yaml"))
    with pytest.raises(ConfigError, match="digest"):
        split_costs(plan, other)


def test_an_interleaved_plan_is_refused(cluster):
    interleaved = make_plan(cluster, tiny_model(num_layers=8, global_batch_size=16), tp=1, pp=2, vpp=2)
    with pytest.raises(ConfigError) as exc:
        plan_timeline(interleaved, cluster)
    assert exc.value.field == "--timeline" and "--vpp 1" in exc.value.fix


def test_rank_times_for_a_plan_helper_is_consistent(plan):
    assert all(isinstance(t, RankTimes) for t in times_for(plan, {0: (1, 1), 1: (1, 1)}))


def test_uneven_replicas_draw_the_slowest_replica_groups_pipeline():
    """Data parallelism across H100 and A100 replicas with uneven micro-batch counts: the picture is the
    pipeline that finishes last (its own count), and its iteration is the plan's."""
    from het_plugin.core.inputs.cluster import cluster_from_dict
    from het_plugin.core.inputs.model import preset_model
    from tests.core.test_planner_hetdp import _node
    mixed = cluster_from_dict({"name": "mixed", "clusters": [
        {"name": "a", "fabric": {"type": "ib", "gbps": 1600}, "nodes": [_node("H100"), _node("A100-80")]}]})
    plan = make_plan(mixed, preset_model("gpt-7.5b"), pp=2, replica_split="uneven")
    assert plan.uneven_replicas
    tl = plan_timeline(plan, mixed)
    assert tl.iteration_s == pytest.approx(plan.prediction.iteration_s, rel=1e-9)
    assert tl.pipeline_s == pytest.approx(plan.prediction.pipeline_s, rel=1e-9)
    assert tl.num_micro_batches in set(plan.replica_counts) and "slowest replica group" in tl.note
    assert sum(o.kind == "forward" and o.stage == 0 for o in tl.ops) == tl.num_micro_batches
