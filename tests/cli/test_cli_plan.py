"""`het-plugin plan` run in-process: the report, JSON/YAML output, the picture, and errors."""
from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

import pytest

from het_plugin.cli import main
from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.inputs.model import preset_model
from het_plugin.core.ranks.placement import place
from het_plugin.core.plan import FORMAT_VERSION, Plan, Prediction
from het_plugin.core.planner import assemble_plan
from het_plugin.views.report import node_rows, render_text, spans
from het_plugin.views.svg import PALETTE, draw_plan
from het_plugin.core.ranks.dims import ParallelDims


def run(capsys, *argv):
    rc = main(["plan", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def holmes_json():
    """The default command's plan as JSON (planned once for the module)."""
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["plan", "--format", "json"]) == 0
    return json.loads(buf.getvalue())


def test_default_plans_the_bundled_holmes_example(capsys, holmes_json):
    rc, out, err = run(capsys)
    assert rc == 0, err
    plan = Plan.from_dict(holmes_json)
    assert plan.cluster_name == "holmes-ib-roce" and plan.model["name"] == "gpt-7.5b"
    assert f"het_plugin plan {plan.hash}" in out           # the text report and the JSON are the same plan
    for heading in ("where the ranks live", "layers per stage", "communicators", "prediction (this plan)",
                    "baseline (framework-default placement"):
        assert heading in out
    for c in ("cluster ib [ib]", "cluster roce [roce]"):
        assert c in out
    assert f"layers: {plan.layers_per_stage}" in out


def test_holmes_plan_meets_the_issue(capsys, holmes_json):
    """TP inside a node and the gradients' reduce-scatter inside one fabric (a DP group in one, or one optimizer
    instance per fabric: then only the shards cross), otherwise only pipeline traffic over Ethernet, IB stages >=
    RoCE stages, faster than the baseline, and the report shows that ratio."""
    plan = Plan.from_dict(holmes_json)
    cluster = load_cluster(plan_cluster_path())
    assert {g.transport for g in plan.groups["tp"]} <= {"local"}
    instances = plan.distributed_optimizer_instances
    for g in plan.groups["dp"]:
        size = len(g.ranks) // instances
        for i in range(instances):
            assert len({plan.node_of(r).cluster for r in g.ranks[i * size:(i + 1) * size]}) == 1, g
    if instances == 1:
        assert {g.transport for g in plan.groups["dp"]} <= {"local", "ib", "roce"}
    for kind, groups in plan.groups.items():
        if "pp" not in kind and kind != "embedding" and not ("dp" in kind.split("-") and instances > 1):
            assert "socket" not in {g.transport for g in groups}, kind
    stage_cluster = [cluster.node_of(plan.rank_of_logical[s * (plan.world_size // plan.pp)]).cluster
                     for s in range(plan.pp)]
    ib = [n for n, c in zip(plan.layers_per_stage, stage_cluster) if c == "ib"]
    roce = [n for n, c in zip(plan.layers_per_stage, stage_cluster) if c == "roce"]
    if ib and roce:
        assert min(ib) >= max(roce)
    assert plan.prediction is not None and plan.baseline is not None
    assert plan.speedup > 1.0
    rc, out, _ = run(capsys)
    m = re.search(r"speed-up over the baseline: ([0-9.]+)x", out)
    assert m and float(m.group(1)) == pytest.approx(plan.baseline.iteration_s / plan.prediction.iteration_s, abs=0.006)
    assert plan.baseline.description.split(",")[0] in out


def plan_cluster_path():
    from het_plugin.cli.plan import DEFAULT_CLUSTER
    return DEFAULT_CLUSTER


def test_json_output_is_the_plan(capsys, holmes_json):
    plan = Plan.from_dict(holmes_json)
    assert holmes_json["hash"] == plan.hash
    assert holmes_json["format_version"] == FORMAT_VERSION
    assert sorted(holmes_json["rank_of_logical"]) == list(range(64))


@pytest.mark.parametrize("suffix", ["json", "yaml"])
def test_output_file_round_trips(capsys, tmp_path, suffix, examples_dir):
    path = tmp_path / f"plan.{suffix}"
    rc, out, err = run(capsys, examples_dir / "clusters" / "two-clusters-25gbe.yaml", "--model", "gpt-3.6b",
                       "-o", path)
    assert rc == 0, err
    loaded = Plan.load(path)
    assert f"plan written to {path} (hash {loaded.hash})" in out
    assert f"het_plugin plan {loaded.hash}" in out
    assert loaded.cluster_name == "two-clusters-25gbe"


def test_output_with_unknown_suffix_is_refused(capsys, tmp_path):
    rc, out, err = run(capsys, "-o", tmp_path / "plan.txt")
    assert rc == 2
    assert "-o/--output" in err and ".json or .yaml" in err
    assert not (tmp_path / "plan.txt").exists()


def test_fixed_degrees_and_model_file(capsys, tmp_path, examples_dir):
    model = examples_dir / "models" / "gpt-3.6b.yaml"
    rc, out, err = run(capsys, examples_dir / "clusters" / "homogeneous-ib.yaml", "--model", model,
                       "--tp", 8, "--pp", 2, "--format", "json")
    assert rc == 0, err
    plan = Plan.from_dict(json.loads(out))
    assert (plan.tp, plan.pp, plan.dp) == (8, 2, 4)
    assert plan.is_identity and plan.homogeneous
    rc, out, err = run(capsys, examples_dir / "clusters" / "homogeneous-ib.yaml", "--model", model, "--tp", 8,
                       "--pp", 2)
    assert "identity (logical rank = launch rank)" in out and "homogeneous" in out



def test_order_and_p2p_overlap_reach_the_plan(capsys, examples_dir):
    """--order (Megatron-LM's --use-tp-pp-dp-mapping) and --no-overlap-p2p-comm: what the adapters' refusals
    tell a user to re-plan with."""
    model = examples_dir / "models" / "gpt-3.6b.yaml"
    cluster = examples_dir / "clusters" / "homogeneous-ib.yaml"
    rc, out, err = run(capsys, cluster, "--model", model, "--tp", 8, "--pp", 2, "--vpp", 2, "--format", "json")
    assert rc == 0, err
    default = Plan.from_dict(json.loads(out))
    assert default.order == "tp-cp-ep-dp-pp" and default.overlap_p2p_comm
    rc, out, err = run(capsys, cluster, "--model", model, "--tp", 8, "--pp", 4, "--vpp", 2, "--order",
                       "tp-cp-ep-pp-dp", "--no-overlap-p2p-comm", "--format", "json")
    assert rc == 0, err
    plan = Plan.from_dict(json.loads(out))
    assert plan.order == "tp-cp-ep-pp-dp" and not plan.overlap_p2p_comm and plan.vpp == 2
    assert plan.groups["dp"][0].ranks == [0, 32], "pp before dp: data-parallel replicas 32 ranks apart"


@pytest.mark.parametrize("args,words", [
    (["--tp", "3"], ["tp", "[1, 2, 4, 8]", "holmes-ib-roce.yaml"]),
    (["--pp", "64"], ["pp", "36"]),
    (["missing.yaml"], ["missing.yaml", "file not found"]),
    (["--model", "gpt-5"], ["no model preset 'gpt-5'", "gpt-7.5b"]),
])
def test_bad_arguments_give_one_clear_error(capsys, args, words):
    rc, out, err = run(capsys, *args)
    assert rc == 2
    assert err.startswith("het-plugin plan: error:")
    assert "fix:" in err
    for w in words:
        assert w in err
    assert "Traceback" not in err


def test_memory_that_cannot_hold_any_plan(capsys, tmp_path):
    path = tmp_path / "small.yaml"
    path.write_text("clusters:\n  - name: a\n    fabric: {type: ib, gbps: 100}\n"
                    "    nodes: [{count: 1, accelerator: A100-40, accelerators_per_node: 2}]\n")
    rc, out, err = run(capsys, path, "--model", "llama-140b")
    assert rc == 2
    assert "memory" in err and "40 GiB" in err and "fix:" in err


# ---- the picture ---------------------------------------------------------------------------

def test_svg_draws_every_rank_coloured_by_stage(capsys, tmp_path, holmes_json):
    path = tmp_path / "placement.svg"
    rc, out, err = run(capsys, "--svg", path, "--format", "json")
    assert rc == 0, err
    plan = Plan.from_dict(json.loads(out))
    root = ET.fromstring(path.read_text())
    ns = "{http://www.w3.org/2000/svg}"
    cells = {}
    for rect in root.iter(f"{ns}rect"):
        title = rect.find(f"{ns}title")
        if title is not None:
            rank = int(title.text.split(":")[0].split()[1])
            cells[rank] = (rect.get("fill"), title.text)
    assert sorted(cells) == list(range(plan.world_size))
    for rank, (fill, title) in cells.items():
        stage = plan.stage_of(rank)
        assert fill == PALETTE[stage % len(PALETTE)]
        assert f"stage {stage} " in title
    texts = " | ".join(t.text for t in root.iter(f"{ns}text"))
    assert "cluster ib" in texts and "cluster roce" in texts
    assert "ib <-> roce: ethernet 25 Gbit/s  (slow)" in texts
    for s, n in enumerate(plan.layers_per_stage):
        assert f"stage {s}: {n} layers" in texts
    dashed = [p for p in root.iter(f"{ns}polyline") if p.get("stroke-dasharray")]
    assert len(dashed) == 2    # the slow link itself and its legend entry


def test_png_through_matplotlib(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "placement.png"
    rc, out, err = run(capsys, "--svg", path)
    assert rc == 0, err
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert f"placement picture written to {path}" in out


def test_picture_needs_a_known_suffix(capsys, tmp_path):
    rc, out, err = run(capsys, "--svg", tmp_path / "p.gif")
    assert rc == 2 and ".svg or .png" in err


# ---- the report from a Plan alone ----------------------------------------------------------

def small_plan(examples_dir, cluster_file="holmes-ib-roce.yaml", tp=8, pp=2, **kw):
    cluster = load_cluster(examples_dir / "clusters" / cluster_file)
    model = preset_model("gpt-7.5b").model_copy(update={"global_batch_size": 768})
    dims = ParallelDims(tp=tp, pp=pp, dp=cluster.world_size // (tp * pp))
    layers = [model.num_layers // pp] * pp
    layers[0] += model.num_layers - sum(layers)
    return cluster, assemble_plan(cluster, model, place(cluster, dims), layers, 1, **kw)


def test_report_without_prediction_renders(examples_dir):
    _, plan = small_plan(examples_dir)
    text = render_text(plan)
    assert "prediction (this plan):\n  not available" in text
    assert "speed-up" not in text
    assert "stage  0:  18 layers + embedding" in text and "stage  1:  18 layers + output" in text


def test_report_with_prediction_shows_memory_against_capacity(examples_dir):
    pred = Prediction(2.0, 1000.0, 100.0, memory_gib_per_stage=[50.0, 90.5], capacity_gib_per_stage=[80.0, 80.0])
    base = Prediction(3.0, 700.0, 70.0, description="default placement, sockets everywhere")
    _, plan = small_plan(examples_dir, prediction=pred, baseline=base,
                         alternatives=[{"tp": 4, "pp": 4, "dp": 4, "iteration_s": 2.5}])
    text = render_text(plan)
    assert "stage 0:   50.0 / 80 GiB (62%)" in text
    assert "stage 1:   90.5 / 80 GiB (113%)  DOES NOT FIT" in text
    assert "speed-up over the baseline: 1.50x" in text
    assert "default placement, sockets everywhere" in text
    assert "100.0 TFLOPS per device" in text
    assert "1. tp=4 pp=4 dp=4, -> 2.500 s (1.250x the plan's time)" in text


def test_report_names_transports_per_group_kind(examples_dir):
    _, plan = small_plan(examples_dir)
    text = render_text(plan)
    lines = {ln.split()[0]: ln for ln in text.splitlines() if re.match(r"  \S+ +\d+ x ", ln)}
    assert lines["tp"].endswith("local")
    assert "ib (8), roce (8)" in lines["dp"]
    assert lines["pp"].endswith("socket")
    assert "cp" not in lines      # cp=1: no communicator to show


def test_big_clusters_are_summarised(examples_dir):
    _, plan = small_plan(examples_dir, "hethub-mix.yaml", tp=2, pp=4)
    rows = node_rows(plan)
    assert len(rows) <= 2 * plan.pp                       # not 96 lines
    assert sum(len(r.names) for r in rows) == 96
    text = render_text(plan)
    assert "amd-0 .. amd-15 (16 nodes)" in text
    for r in rows:
        assert {plan.stage_of(x) for x in r.ranks} == set(r.stages)


def test_picture_of_a_big_cluster_is_compact(tmp_path, examples_dir):
    from het_plugin.core.inputs.cluster import cluster_from_dict
    cluster = cluster_from_dict({"name": "big", "clusters": [
        {"name": "a", "fabric": {"type": "ib", "gbps": 400},
         "nodes": [{"count": 300, "accelerator": "H100", "accelerators_per_node": 8}]},
        {"name": "b", "fabric": {"type": "roce", "gbps": 400},
         "nodes": [{"count": 100, "accelerator": "MI300X", "accelerators_per_node": 8}]}],
        "links": [{"between": ["a", "b"], "type": "roce", "gbps": 400}]})
    model = preset_model("llama-140b").model_copy(update={"global_batch_size": 400})
    plan = assemble_plan(cluster, model, place(cluster, ParallelDims(tp=8, pp=8, dp=50)), [10] * 8, 1)
    path = tmp_path / "big.svg"
    draw_plan(plan, path, cluster)
    text = path.read_text()
    assert text.count("<title>") < 200      # boxes for runs of nodes, not 3200 cells
    assert "a-0 .. a-49 (50 nodes)" in text
    assert "a &lt;-&gt; b: roce 400 Gbit/s" in text and "(slow)" not in text


def test_spans():
    assert spans([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert spans([3]) == "3" and spans([]) == "-"


def test_a_saved_plan_is_shown_without_planning(capsys, tmp_path, monkeypatch):
    saved = tmp_path / "plan.yaml"
    rc, out, err = run(capsys, "-o", saved)
    assert rc == 0, err
    original = Plan.load(saved)

    def no_planning(*a, **k):
        raise AssertionError("planned again")
    monkeypatch.setattr("het_plugin.core.planner.make_plan", no_planning)
    picture = tmp_path / "p.svg"
    rc, out, err = run(capsys, saved, "--svg", picture)
    assert rc == 0, err
    assert f"het_plugin plan {original.hash}" in out
    assert "inter-cluster" in picture.read_text()     # no cluster file: link speeds unknown
    rc, out, err = run(capsys, saved, "--format", "json")
    assert json.loads(out)["hash"] == original.hash


def test_report_names_the_links_and_what_crosses_them(examples_dir):
    cluster, plan = small_plan(examples_dir)          # tp=8 pp=2: stage 0 on IB, stage 1 on RoCE
    text = render_text(plan, cluster)
    assert "ib <-> roce: ethernet 25 Gbit/s, 50 us (slow); crossed by: pp, tp-pp, embedding" in text
    assert "crosses a cluster/vendor boundary 1 time(s): stage 0 -> 1 (ib/nvidia -> roce/nvidia)" in text
    # pp=1: every stage spans both clusters, so data-parallel groups cross the slow link too
    cluster, plan = small_plan(examples_dir, tp=8, pp=1)
    line = next(ln for ln in render_text(plan, cluster).splitlines() if ln.startswith("  ib <-> roce"))
    assert "dp" in line.split("crossed by:")[1]
    assert "links between clusters" not in render_text(plan)     # without the cluster: no link speeds


def test_profile_flag_feeds_measured_layer_times_to_the_planner(capsys, tmp_path):
    import yaml
    from het_plugin.core.inputs.profile import Profile
    nodes = lambda acc: [{"count": 2, "accelerator": acc, "accelerators_per_node": 8,
                          "nics": [{"type": "ethernet", "gbps": 100}]}]
    cluster = tmp_path / "two-devices.yaml"
    cluster.write_text(yaml.safe_dump({"clusters": [
        {"name": "old", "fabric": {"type": "ib", "gbps": 800}, "nodes": nodes("A100-80")},
        {"name": "new", "fabric": {"type": "ib", "gbps": 800}, "nodes": nodes("H100")}],
        "links": [{"between": ["old", "new"], "gbps": 100}]}))
    prof = Profile()
    prof.add_compute("A100-80", "layer", 1, 8, 0.0001, 0.0002)   # "measured" far faster than the H100 estimate
    profile = tmp_path / "profile.yaml"
    prof.save(profile)
    args = [cluster, "--model", "gpt-7.5b", "--tp", 8, "--pp", 2, "--micro-batch-size", 1, "--format", "json"]
    _, plain, _ = run(capsys, *args)
    _, profiled, _ = run(capsys, *args, "--profile", profile)

    def a100_layers(text):
        plan = Plan.from_dict(json.loads(text))
        stage = plan.stage_of(next(n.first_rank for n in plan.nodes if n.accelerator == "A100-80"))
        return plan.layers_per_stage[stage]

    assert a100_layers(profiled) > a100_layers(plain)


def test_progress_line_shows_on_a_terminal_only_after_a_while(capsys, monkeypatch):
    import io
    from het_plugin.cli import plan as cli_plan
    quiet = cli_plan.ProgressLine(io.StringIO())
    quiet(1, 4, None)                                  # under a second: nothing
    quiet.close()
    assert quiet.stream.getvalue() == ""
    monkeypatch.setattr(cli_plan, "PROGRESS_AFTER_S", 0.0)
    line = cli_plan.ProgressLine(io.StringIO())
    line(1, 4, None)
    line.last = float("-inf")                          # no throttling between the two updates
    line(2, 4, 1.23456)
    line.close()
    text = line.stream.getvalue()
    assert "planning: 1/4 degree combinations" in text
    assert "planning: 2/4 degree combinations, best so far 1.235 s/iteration" in text
    assert "planning: done in" in text and text.endswith("\n")
    rc, out, err = run(capsys)                         # stderr is no terminal here: no progress line
    assert rc == 0 and "planning:" not in err


def test_plan_on_a_terminal_passes_the_progress_line_to_the_planner(capsys, monkeypatch):
    from het_plugin.cli import plan as cli_plan
    monkeypatch.setattr(cli_plan, "PROGRESS_AFTER_S", 0.0)
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    rc, out, err = run(capsys)
    assert rc == 0 and "planning: " in err and "planning: done in" in err
