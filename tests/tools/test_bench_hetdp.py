"""The heterogeneous data-parallel benchmark's pure parts (benchmarks/bench_hetdp.py, hetdp_profile.py): the
cluster's speeds are 2:1 from the catalog, (iii)'s plan puts the pipeline across the clusters with the planner's
layer split and data parallelism on each cluster's fabric, (ii)'s plan gives the faster replicas more micro-batches
of one global batch, (iv) is make_plan's pick as is, the predictions model each plan's replica counts, the DeepSpeed
configurations mirror Megatron's, the profile built from measurements answers per device type and link, the
ratios, goals and loss check come out of measured numbers, and the speed check says NOT HELD when a node was off."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_hetdp  # noqa: E402
import hetdp_profile  # noqa: E402
from e2e_setup import TinyShape  # noqa: E402
from het_plugin.tools.emulate import make_layout, node_speeds  # noqa: E402
from het_plugin.core.plan import Plan  # noqa: E402
from het_plugin.core.cost.predict import predict  # noqa: E402
from het_plugin.core.planner import make_plan, uniform_layers  # noqa: E402
from het_plugin.core.ranks.dims import ParallelDims  # noqa: E402
from het_plugin.core.ranks.placement import default_placement, stock_multinet_transport  # noqa: E402
from het_plugin.core.inputs.profile import load_profile  # noqa: E402

SHAPE = TinyShape(global_batch_size=bench_hetdp.GLOBAL_BATCH)
SLOW = bench_hetdp.GLOBAL_BATCH // 6          # a slow replica's micro-batches (of 1 sample) at 2:1


def test_the_cluster_is_two_to_one_by_the_catalog():
    c = bench_hetdp.hetdp_cluster()
    assert node_speeds(c, "catalog") == (1.0, 1.0, 0.5, 0.5)
    lay = make_layout(c, "abcdef", bench_hetdp.DEFAULT_SCALE, (), "catalog", 0.5)
    assert [n.cpu.quota_us for n in lay.nodes] == [10000, 10000, 5000, 5000]


@pytest.mark.parametrize("n,speeds,want", [(8, [1, 2], [3, 5]), (8, [2, 1], [5, 3]), (8, [1, 1], [4, 4]),
                                           (3, [1, 20], [1, 2]), (7, [1, 1, 1], [3, 2, 2])])
def test_layers_split_by_speed(n, speeds, want):
    assert bench_hetdp.split_by_speed(n, speeds) == want


def test_the_pipeline_plan_crosses_the_clusters_with_more_layers_on_the_fast_stage(tmp_path):
    path, summary = bench_hetdp.pipeline_plan(bench_hetdp.hetdp_cluster(), SHAPE, None, tmp_path)
    assert path.exists() and Plan.load(path).hash == summary["hash"]
    fast = summary["stages"].index("fast")
    assert sorted(summary["stages"]) == ["fast", "slow"]
    assert summary["layers_per_stage"][fast] == 5 and sum(summary["layers_per_stage"]) == 8
    assert summary["layers_per_stage"] == summary["planner_layers_per_stage"]      # the planner's split, as is
    assert summary["speed_layers_per_stage"][fast] == 5
    assert summary["transports"]["dp"] == ["ib", "roce"] and summary["transports"]["pp"] == ["socket"]
    _, given = bench_hetdp.pipeline_plan(bench_hetdp.hetdp_cluster(), SHAPE, [4, 4], tmp_path)
    assert given["layers_per_stage"] == [4, 4] and given["rank_of_logical"] == summary["rank_of_logical"]


def _out(before, after):
    cpu = [{"node": n, "speed": s} for n, s in (("fast-0", 1.0), ("fast-1", 1.0), ("slow-0", 0.5), ("slow-1", 0.5))]
    return {"cpu": cpu, "compute_rates": {"before": before, "after": after}}


def test_the_speed_check():
    assert "held (every node" in bench_hetdp.speed_check(_out([2, 2, 1, 1.1], [4, 3.8, 2.1, 1.9]))
    text = bench_hetdp.speed_check(_out([2, 2, 1, 1], [4, 4, 2, 3.2]))        # slow-1 at 0.80 after
    assert text.startswith("compute speed check: NOT HELD (slow-1 0.80 after;")


def test_the_proportional_plan_gives_the_fast_replicas_twice_the_slow_ones_micro_batches(tmp_path):
    cluster = bench_hetdp.hetdp_cluster()
    path, summary = bench_hetdp.proportional_plan(cluster, SHAPE, tmp_path)
    plan = Plan.load(path)
    assert (plan.tp, plan.pp, plan.dp) == (1, 1, 4) and plan.global_batch_size == SHAPE.global_batch_size == 6 * SLOW
    by_cluster = {}
    for rank in range(plan.world_size):
        by_cluster.setdefault(cluster.node_of(rank).cluster, []).append(plan.replica_counts[plan.replica_of(rank)])
    assert by_cluster == {"fast": [2 * SLOW, 2 * SLOW], "slow": [SLOW, SLOW]}
    assert sum(plan.replica_counts) == plan.dp * plan.num_micro_batches
    assert summary["replica_micro_batches"] == plan.replica_counts == summary["catalog_counts"]
    # the plans are for the NCCL stock-today assumes: the group across the fabrics on its multi-network rings
    assert summary["transports"]["dp"] == ["multinet"]
    even = make_plan(cluster, SHAPE.model_spec(), tp=1, pp=1, dp=4, micro_batch_size=1)
    assert plan.rank_of_logical == even.rank_of_logical          # (i)'s placement, only the split differs


def test_the_proportional_split_follows_the_measured_speeds(tmp_path):
    """With a profile in which the slow part computes 3x slower (not the catalog's 2x), the counts follow it."""
    cluster = bench_hetdp.hetdp_cluster()
    prof = _profile(cluster, slow_factor=3.0)
    _, summary = bench_hetdp.proportional_plan(cluster, SHAPE, tmp_path, prof)
    counts = summary["replica_micro_batches"]
    assert sum(counts) == GLOBAL and counts[0] == counts[1] and counts[2] == counts[3]
    assert counts[0] / counts[2] == pytest.approx(3.0, rel=0.2) and summary["catalog_counts"] == [16, 16, 8, 8]


def test_replica_counts_follow_each_replicas_slowest_rank():
    cluster = bench_hetdp.hetdp_cluster()
    plan = make_plan(cluster, SHAPE.model_spec(), tp=1, pp=2, dp=2, micro_batch_size=1)
    # each replica spans both clusters' stages: both run at the slow stage's speed, so the split stays even
    assert bench_hetdp.proportional_counts(cluster, plan) == [3 * SLOW, 3 * SLOW]


def test_the_planner_configuration_is_make_plans_pick_as_is(tmp_path):
    cluster = bench_hetdp.hetdp_cluster()
    path, summary = bench_hetdp.planner_plan(cluster, SHAPE, tmp_path)
    want = make_plan(cluster, SHAPE.model_spec(), micro_batch_size=1, nccl=bench_hetdp.STOCK_NCCL)
    assert Plan.load(path).hash == want.hash == summary["hash"]


def test_every_configuration_runs_from_its_plan_with_the_same_global_batch(tmp_path):
    paths, plans, predicted = bench_hetdp.build_plans(bench_hetdp.hetdp_cluster(), SHAPE, None, tmp_path)
    configs = {c["name"]: c for c in bench_hetdp.configurations(SHAPE, paths, stock_pp=plans["s-stock-today"]["pp"])}
    assert list(configs) == list(bench_hetdp.CONFIGS)
    assert configs["i-even-dp"]["plan"] is None and configs["i-even-dp"]["pp"] == 1
    # today's stock stack: no plan (the framework's own groups), bound to the fabric interface
    stock = configs["s-stock-today"]
    assert stock["plan"] is None and stock["ifname"] == "fab0" and configs["i-even-dp"]["ifname"] == "eth0"
    for name, path in paths.items():
        plan = Plan.load(configs[name]["plan"])
        assert configs[name]["plan"] == str(path) and configs[name]["pp"] == plan.pp
        assert plan.global_batch_size == bench_hetdp.GLOBAL_BATCH and plans[name]["hash"] == plan.hash
    assert set(predicted) == set(bench_hetdp.CONFIGS) and all(p["iteration_s"] > 0 for p in predicted.values())
    # (ii) is predicted with its own counts: the slow replicas' 8 micro-batches, not the even split's 12
    assert predicted["ii-proportional-dp"]["iteration_s"] < predicted["i-even-dp"]["iteration_s"]


def test_the_stock_configuration_is_the_fastest_default_on_multinet_routing():
    """(s) is the frameworks' own placement, uniform layers and even split at the pipeline depth predicted fastest
    on NCCL's multi-network routing: no other depth predicts faster, and the planner's pick never predicts slower
    (it may be the stock run itself)."""
    cluster = bench_hetdp.hetdp_cluster()
    spec = SHAPE.model_spec()
    prof = _profile(cluster)          # a measured-style profile: the tiny model's compute in milliseconds, 2:1
    dims, pred = bench_hetdp.stock_today(cluster, SHAPE, prof)
    for pp in (1, 2, 4):
        d = ParallelDims(tp=1, cp=1, pp=pp, dp=4 // pp)
        other = predict(cluster, spec, default_placement(cluster, d), uniform_layers(spec.num_layers, pp), 1,
                        transport_fn=stock_multinet_transport, profile=prof)
        assert pred.iteration_s <= other.iteration_s
    summary = bench_hetdp.stock_summary(cluster, SHAPE, dims, pred)
    assert summary["pp"] * summary["dp"] == 4
    assert sum(summary["replica_micro_batches"]) == SHAPE.global_batch_size // SHAPE.micro_batch_size
    assert summary["stages"] == (["fast", "slow"] if dims.pp == 2 else summary["stages"])
    # on 2:1 devices the planner's pick (uneven layers or replica shares) is predicted faster than stock
    planner = bench_hetdp.predict_plan(cluster, spec, make_plan(cluster, spec, micro_batch_size=1, profile=prof,
                                                                nccl=bench_hetdp.STOCK_NCCL), prof)
    assert planner.iteration_s < pred.iteration_s


def test_the_deepspeed_configurations_mirror_megatrons(tmp_path):
    cluster = bench_hetdp.hetdp_cluster()
    paths, plans, predicted = bench_hetdp.build_plans(cluster, SHAPE, None, tmp_path, framework="deepspeed")
    assert all(p.name.endswith("-ds.json") for p in paths.values())
    configs = bench_hetdp.configurations(SHAPE, paths, "deepspeed", plans["s-stock-today"]["pp"])
    assert [c["name"] for c in configs] == [f"{n}-ds" for n in bench_hetdp.CONFIGS]
    assert all(c["framework"] == "deepspeed" and c["replica_data"] and not c["overlap"] for c in configs)
    assert configs[0]["plan"] is None and configs[0]["pp"] == 1
    assert not Plan.load(paths["iii-pipeline"]).model["tie_embeddings"]     # DeepSpeed's model is untied
    (tmp_path / "m").mkdir()
    mega = bench_hetdp.build_plans(cluster, SHAPE, None, tmp_path / "m")[2]
    # no overlap of the gradient reduction with backward: never faster than Megatron's prediction of the same
    assert predicted["i-even-dp"]["iteration_s"] >= mega["i-even-dp"]["iteration_s"]


def test_an_uneven_plan_is_predicted_with_its_counts():
    cluster = bench_hetdp.hetdp_cluster()
    even = bench_hetdp.even_dp_plan(cluster, SHAPE)
    uneven = dataclasses.replace(even, replica_micro_batches=[2 * SLOW, 2 * SLOW, SLOW, SLOW], prediction=None)
    spec = SHAPE.model_spec()
    e, u = (bench_hetdp.predict_plan(cluster, spec, p) for p in (even, uneven))
    # the catalog's 2:1: evenly the slow replicas take 1.5x the fast ones; 16:8 makes them alike
    assert e.replica_pipeline_s[2] == pytest.approx(2 * e.replica_pipeline_s[0], rel=0.05)
    assert u.replica_pipeline_s[0] == pytest.approx(u.replica_pipeline_s[2], rel=0.05)
    assert u.iteration_s < e.iteration_s


# ---- the measured profile (hetdp_profile.py) ---------------------------------------------------------------

GLOBAL = bench_hetdp.GLOBAL_BATCH
TRUE = dict(per_step=0.05, per_mb=0.016, per_layer=0.004, opt=2e-9, ef=1e-3, eb=2e-3, of=3e-3, ob=4e-3)


def _measured(spec, factor=1.0, node=0, **change):
    """What one node's profile process reports for a device computing ``factor`` x slower than TRUE."""
    t = dict(TRUE, **change)
    m = hetdp_profile.PROFILE_MICRO_BATCHES
    out = {"node": node, "optimizer_s_per_param": t["opt"] * factor,
           **{k: t[k] * factor for k in ("ef", "eb", "of", "ob")}}
    for key, (layers, mult) in hetdp_profile.RUNS.items():
        out[key] = factor * (t["per_step"] + m * mult * (t["per_mb"] + layers * t["per_layer"])
                             + t["opt"] * hetdp_profile.run_params(spec, layers))
    return out


def test_the_fit_recovers_the_layer_the_overheads_and_the_update():
    spec = SHAPE.model_spec()
    c = hetdp_profile.fit_device([_measured(spec), _measured(spec, node=1)], spec, hetdp_profile.PROFILE_MICRO_BATCHES)
    assert sum(c.layer) == pytest.approx(TRUE["per_layer"]) and c.layer[1] == pytest.approx(2 * c.layer[0])
    assert c.overhead_per_step == pytest.approx(TRUE["per_step"]) and c.optimizer_s_per_param == TRUE["opt"]
    overhead = TRUE["per_mb"] - TRUE["ef"] - TRUE["eb"] - TRUE["of"] - TRUE["ob"]
    assert c.overhead_per_micro_batch == pytest.approx(overhead)
    # a single stage pays the measured per-micro-batch cost once: embedding + output = the fit's per_mb
    assert sum(c.embedding) + sum(c.output) == pytest.approx(TRUE["per_mb"])
    assert c.embedding[0] == pytest.approx(TRUE["ef"] + overhead / 6) and c.nodes == 2


def test_the_fit_takes_the_median_node_and_never_a_negative_overhead():
    spec = SHAPE.model_spec()
    m = hetdp_profile.PROFILE_MICRO_BATCHES
    runs = [_measured(spec, 1.0, 0), _measured(spec, 1.1, 1), _measured(spec, 5.0, 2)]
    assert hetdp_profile.fit_device(runs, spec, m).steps_s["t6x2"] == _measured(spec, 1.1)["t6x2"]
    assert sum(hetdp_profile.fit_device(runs, spec, m).layer) == pytest.approx(1.1 * TRUE["per_layer"])
    # direct embedding/output times above what the fit gives per micro-batch: no negative overhead
    c = hetdp_profile.fit_device([_measured(spec, ef=0.02)], spec, m)
    assert c.overhead_per_micro_batch == 0.0 and c.embedding[0] == pytest.approx(0.02)
    with pytest.raises(ValueError, match="no node"):
        hetdp_profile.fit_device([], spec, m)


def test_link_pairs_cover_each_fabric_each_clusters_ethernet_and_both_directions_between():
    pairs = hetdp_profile.link_pairs(bench_hetdp.hetdp_cluster())
    assert pairs == [("fabric:fast", [0, 1], "fab0"), ("eth:fast", [0, 1], "eth0"),
                     ("fabric:slow", [2, 3], "fab0"), ("eth:slow", [2, 3], "eth0"),
                     ("fast->slow", [0, 2], "eth0"), ("slow->fast", [2, 0], "eth0")]


def _links(eth=1.0, fab=8.0, slow_send=0.5):
    curve = lambda g: [[65536, g / 2], [4 << 20, g]]      # noqa: E731
    return {"fabric:fast": {"latency_us": 100, "bandwidth": curve(fab)},
            "eth:fast": {"latency_us": 200, "bandwidth": curve(eth)},
            "fabric:slow": {"latency_us": 150, "bandwidth": curve(fab)},
            "eth:slow": {"latency_us": 300, "bandwidth": curve(eth)},
            "fast->slow": {"latency_us": 250, "bandwidth": curve(eth)},
            "slow->fast": {"latency_us": 250, "bandwidth": curve(slow_send)}}


def _profile(cluster, slow_factor=2.0):
    spec = SHAPE.model_spec()
    m = hetdp_profile.PROFILE_MICRO_BATCHES
    compute = {"A100-80": hetdp_profile.fit_device([_measured(spec)], spec, m),
               "A100-half": hetdp_profile.fit_device([_measured(spec, slow_factor)], spec, m)}
    return hetdp_profile.build_profile(cluster, compute, _links(), 1, "test")


def test_the_profile_holds_each_device_type_and_each_link_and_reads_back(tmp_path):
    cluster = bench_hetdp.hetdp_cluster()
    prof = _profile(cluster)
    fast, slow = (prof.compute_time(d, "layer", 1, 1) for d in ("A100-80", "A100-half"))
    assert slow.forward_s == pytest.approx(2 * fast.forward_s) and not fast.extrapolated
    assert prof.optimizer_s_per_param("A100-half", 1) == pytest.approx(2 * TRUE["opt"])
    assert prof.iteration_overhead_s("A100-80") == pytest.approx(TRUE["per_step"])
    assert prof.link("ib", "fast").latency_us == 100 and prof.link("roce", "slow").latency_us == 150
    assert prof.link("socket", "slow").latency_us == prof.link("ethernet", "slow").latency_us == 300
    assert prof.link("slow->fast").bandwidth[-1] == (4 << 20, 0.5) and prof.directional
    path = tmp_path / "p.yaml"
    prof.save(path)
    back = load_profile(path)
    assert back.compute_time("A100-half", "output", 1, 1) == prof.compute_time("A100-half", "output", 1, 1)
    assert back.link("fast->slow").bandwidth == prof.link("fast->slow").bandwidth


def test_the_profile_drives_the_prediction():
    """(i) with the profile: each replica's pipeline is its device's measured per-micro-batch time x its count, and
    the step adds the slowest device's per-step overhead and the measured update."""
    cluster = bench_hetdp.hetdp_cluster()
    prof = _profile(cluster)
    spec = SHAPE.model_spec()
    even = bench_hetdp.even_dp_plan(cluster, SHAPE, prof)
    pred = bench_hetdp.predict_plan(cluster, spec, even, prof)
    per_mb = TRUE["per_mb"] + spec.num_layers * TRUE["per_layer"]
    m = GLOBAL // 4
    assert pred.replica_pipeline_s == pytest.approx([m * per_mb] * 2 + [2 * m * per_mb] * 2)
    update = 2 * TRUE["opt"] * hetdp_profile.run_params(spec, spec.num_layers)
    assert pred.optimizer_s == pytest.approx(update)
    assert pred.iteration_s >= 2 * m * per_mb + 2 * TRUE["per_step"] + update


def test_by_device_groups_the_nodes_by_accelerator():
    got = hetdp_profile.by_device(bench_hetdp.hetdp_cluster(), [{"node": i} for i in (3, 0, 2, 1)])
    assert got == {"A100-half": [{"node": 3}, {"node": 2}], "A100-80": [{"node": 0}, {"node": 1}]}


def test_ratios_goals_and_the_planners_pick_against_the_best_measured():
    measured = {"i-even-dp": [[9, 3.0, 3.2], [9, 4.0, 4.0]], "ii-proportional-dp": [[9, 2.0, 2.0], [9, 3.2, 3.2]],
                "iii-pipeline": [[9, 2.4, 2.4], [9, 2.8, 2.8]], "iv-planner": [[9, 2.5, 2.5], [9, 2.9, 2.9]]}
    out = bench_hetdp.summarize(measured, 1, {"i-even-dp": 3.1, "iv-planner": 2.0, "ii-proportional-dp": None})
    r = out["ratios"]
    assert out["configs"]["i-even-dp"]["rounds_s"] == [3.1, 4.0] and out["configs"]["i-even-dp"]["median_s"] == 3.6
    assert r["ii/i"]["rounds"] == pytest.approx([2.0 / 3.1, 0.8])
    assert r["iv/best"]["rounds"] == pytest.approx([2.5 / 2.0, 2.9 / 2.8])        # the best differs per round
    assert r["predicted/i-even-dp"]["rounds"] == pytest.approx([1.0, 3.1 / 4.0])
    assert "predicted/ii-proportional-dp" not in r
    marks = bench_hetdp.goal_marks(r)
    assert marks[0].startswith("goal (ii)/(i) <= 0.75 (ideal 0.67): met (0.72)")
    assert marks[1].startswith("goal the planner's pick within 5% of the best measured: missed (1.14)")
    assert marks[2] == "goal the planner's pick <= 0.75 of today's stock stack: not assessed (not run)"
    assert marks[3].startswith("goal the predictor within 10% of each measured step: missed")
    assert bench_hetdp.goal_marks({})[0].endswith("not assessed (not run)")


def test_the_loss_check_names_a_configuration_whose_losses_are_not_is():
    diff = bench_hetdp.loss_check({"i-even-dp": [5.0, 4.0], "ii-proportional-dp": [5.0, 4.0 + 1e-7],
                                   "iv-planner": [5.0, 4.4]})
    assert diff["ii-proportional-dp"] <= bench_hetdp.LOSS_TOLERANCE < diff["iv-planner"] == pytest.approx(0.1)


def _run_out(frameworks=("megatron",)):
    measured = {"i-even-dp": [[9, 3.0, 3.0]], "ii-proportional-dp": [[9, 2.0, 2.0]]}
    res = {**bench_hetdp.summarize(measured, 1, {"i-even-dp": 0.003, "ii-proportional-dp": None}),
           "loss_vs_i": {"ii-proportional-dp": 1e-7}}
    return {"scale": 25.0, "rounds": 1, "steps": 2, "warmup": 1, "started_utc": "now", "load_average": [1.0, 2.0],
            "cores": 2, "shape": SHAPE.to_dict(), **_out([2, 2, 1, 1], [2, 2, 1, 1]),
            "frameworks": {fw: res for fw in frameworks}}


def test_the_table_shows_predictions_losses_ratios_and_goals():
    text = bench_hetdp.table(_run_out())
    assert "| 3000 | 3000 | 3 | reference |" in text
    assert "| 2000 | 2000 | not modelled | match (max rel. diff 1.0e-07) |" in text
    assert "ratio ii/i: median 0.667" in text and "goal (ii)/(i) <= 0.75 (ideal 0.67): met (0.67)" in text
    assert f"global batch {bench_hetdp.GLOBAL_BATCH} for every configuration" in text
    busy = dict(_run_out(), machine_during_training={"busy_share": {"median": 0.8, "max": 0.95},
                                                      "throttled_s": [1.0, 2.0, 30.0, 31.0]})
    assert ("machine busy during training (all cores): median 80%, max 95%; cpu throttled per node: fast-0 1 s, "
            "fast-1 2 s, slow-0 30 s, slow-1 31 s") in bench_hetdp.table(busy)
    both = bench_hetdp.table(_run_out(("megatron", "deepspeed")))
    assert both.index("Megatron-Core:") < both.index("DeepSpeed:") and both.count("goal (ii)/(i)") == 2


def test_the_chart_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    path = bench_hetdp.write_chart(_run_out(("megatron", "deepspeed")), tmp_path / "img" / "hetdp.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_global_batch_that_does_not_split_two_to_one_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_hetdp.main(["--global-batch", "16"])
    assert exc.value.code == 2 and "--global-batch 16: needs a positive multiple of 12" in capsys.readouterr().err


def test_direct_timings_run_in_blocks_of_many_calls():
    torch = pytest.importorskip("torch")
    w = torch.ones(3, requires_grad=True)
    calls = []

    def step():
        calls.append(1)
        return (w * 2).sum()

    fwd, bwd = hetdp_profile._block_times(step, reps=2, block=5)
    assert len(calls) == 3 * 5 and fwd > 0 and bwd > 0
    assert w.grad.tolist() == [2.0 * 15] * 3                  # every call's backward ran
    assert hetdp_profile._timed_update([torch.zeros(1000)], 0.1, reps=1, block=3) > 0
