"""The heterogeneous data-parallel benchmark's pure parts (benchmarks/bench_hetdp.py): the cluster's speeds
are 2:1 from the catalog, (iii)'s plan puts the pipeline across the clusters with layers split by speed and
data parallelism on each cluster's fabric, (ii)'s plan gives the fast replicas twice the slow ones'
micro-batches of one global batch, (iv) is make_plan's pick as is, the ratios, goals and loss check come out
of measured numbers, and the speed check says NOT HELD when a node was off."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_hetdp  # noqa: E402
from e2e_setup import TinyShape  # noqa: E402
from het_plugin.emulate import make_layout, node_speeds  # noqa: E402
from het_plugin.plan import Plan  # noqa: E402
from het_plugin.planner import make_plan  # noqa: E402

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
    path, summary = bench_hetdp.pipeline_plan(bench_hetdp.hetdp_cluster(), TinyShape(), None, tmp_path)
    assert path.exists()
    fast = summary["stages"].index("fast")
    assert sorted(summary["stages"]) == ["fast", "slow"]
    assert summary["layers_per_stage"][fast] == 5 and sum(summary["layers_per_stage"]) == 8
    assert summary["transports"]["dp"] == ["ib", "roce"] and summary["transports"]["pp"] == ["socket"]


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
    assert summary["replica_micro_batches"] == plan.replica_counts and summary["transports"]["dp"] == ["socket"]
    even = make_plan(cluster, SHAPE.model_spec(), tp=1, pp=1, dp=4, micro_batch_size=1)
    assert plan.rank_of_logical == even.rank_of_logical          # (i)'s placement, only the split differs


def test_replica_counts_follow_each_replicas_slowest_rank():
    cluster = bench_hetdp.hetdp_cluster()
    plan = make_plan(cluster, SHAPE.model_spec(), tp=1, pp=2, dp=2, micro_batch_size=1)
    # each replica spans both clusters' stages: both run at the slow stage's speed, so the split stays even
    assert bench_hetdp.proportional_counts(cluster, plan) == [3 * SLOW, 3 * SLOW]


def test_the_planner_configuration_is_make_plans_pick_as_is(tmp_path):
    cluster = bench_hetdp.hetdp_cluster()
    path, summary = bench_hetdp.planner_plan(cluster, SHAPE, tmp_path)
    assert Plan.load(path).hash == make_plan(cluster, SHAPE.model_spec(), micro_batch_size=1).hash == summary["hash"]


def test_every_configuration_runs_from_its_plan_with_the_same_global_batch(tmp_path):
    paths, plans, predicted = bench_hetdp.build_plans(bench_hetdp.hetdp_cluster(), SHAPE, None, tmp_path)
    configs = {c["name"]: c for c in bench_hetdp.configurations(SHAPE, paths)}
    assert list(configs) == list(bench_hetdp.CONFIGS)
    assert configs["i-even-dp"]["plan"] is None and configs["i-even-dp"]["pp"] == 1
    for name, path in paths.items():
        plan = Plan.load(configs[name]["plan"])
        assert configs[name]["plan"] == str(path) and configs[name]["pp"] == plan.pp
        assert plan.global_batch_size == bench_hetdp.GLOBAL_BATCH and plans[name]["hash"] == plan.hash
    assert predicted["i-even-dp"] > 0 and predicted["iii-pipeline"] > 0 and predicted["iv-planner"] > 0
    # an uneven plan is predicted only by a planner that modelled its counts, never as the even split
    ii = Plan.load(paths["ii-proportional-dp"])
    assert predicted["ii-proportional-dp"] == (ii.prediction.iteration_s if ii.prediction else None)


def test_an_uneven_plan_without_a_prediction_of_its_own_is_not_predicted(tmp_path):
    cluster = bench_hetdp.hetdp_cluster()
    even = bench_hetdp.even_dp_plan(cluster, SHAPE)
    uneven = dataclasses.replace(even, replica_micro_batches=[2 * SLOW, 2 * SLOW, SLOW, SLOW],
                                 prediction=None)
    assert bench_hetdp.predicted_step(cluster, SHAPE, uneven) is None
    assert bench_hetdp.predicted_step(cluster, SHAPE, even) > 0


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
    assert marks[2].startswith("goal the predictor within 10% of each measured step: missed")
    assert bench_hetdp.goal_marks({})[0].endswith("not assessed (not run)")


def test_the_loss_check_names_a_configuration_whose_losses_are_not_is():
    diff = bench_hetdp.loss_check({"i-even-dp": [5.0, 4.0], "ii-proportional-dp": [5.0, 4.0 + 1e-7],
                                   "iv-planner": [5.0, 4.4]})
    assert diff["ii-proportional-dp"] <= bench_hetdp.LOSS_TOLERANCE < diff["iv-planner"] == pytest.approx(0.1)


def test_the_table_shows_predictions_losses_ratios_and_goals():
    measured = {"i-even-dp": [[9, 3.0, 3.0]], "ii-proportional-dp": [[9, 2.0, 2.0]]}
    out = {"scale": 25.0, "rounds": 1, "steps": 2, "warmup": 1, "started_utc": "now", "load_average": [1.0, 2.0],
           "cores": 2, "shape": SHAPE.to_dict(), "loss_vs_i": {"ii-proportional-dp": 1e-7},
           **_out([2, 2, 1, 1], [2, 2, 1, 1]),
           **bench_hetdp.summarize(measured, 1, {"i-even-dp": 0.003, "ii-proportional-dp": None})}
    text = bench_hetdp.table(out)
    assert "| 3000 | 3000 | 3 | reference |" in text
    assert "| 2000 | 2000 | not modelled | match (max rel. diff 1.0e-07) |" in text
    assert "ratio ii/i: median 0.667" in text and "goal (ii)/(i) <= 0.75 (ideal 0.67): met (0.67)" in text
    assert f"global batch {bench_hetdp.GLOBAL_BATCH} for every configuration" in text


def test_a_global_batch_that_does_not_split_two_to_one_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_hetdp.main(["--global-batch", "16"])
    assert exc.value.code == 2 and "--global-batch 16: needs a positive multiple of 12" in capsys.readouterr().err
