"""Plans over subsets of the node groups (issue 32): leaving out nodes that only slow the job, the record of what
was left out, the launch check, prices and the cost objective."""
from dataclasses import replace
from pathlib import Path

import pytest

from het_plugin.core import subsets
from het_plugin.core.errors import ConfigError
from het_plugin.core.inputs.cluster import cluster_from_dict, load_cluster
from het_plugin.core.inputs.model import preset_model
from het_plugin.core.launch import Launch, resolve_launch
from het_plugin.core.plan import Plan
from het_plugin.core.planner import make_plan
from tests.core.test_subsets_properties import every_subset
from het_plugin.views.report import render_text

CLUSTERS = Path(__file__).resolve().parents[2] / "examples" / "clusters"


@pytest.fixture(scope="module")
def old_nodes():
    """The issue's cluster: eight H100 nodes on InfiniBand, two V100 nodes behind 25 GbE."""
    return load_cluster(CLUSTERS / "h100-old-ethernet.yaml")


@pytest.fixture(scope="module")
def gpt():
    return preset_model("gpt-7.5b")


@pytest.fixture(scope="module")
def searched(old_nodes, gpt):
    calls = []

    def counting(cluster, model, **options):         # the real planner, its calls counted
        calls.append(cluster.world_size)
        return make_plan(cluster, model, **options)
    return subsets.search_subsets(old_nodes, gpt, plan_fn=counting), calls


def test_the_old_nodes_are_left_out_and_the_plan_is_faster(old_nodes, gpt, searched):
    found, _ = searched
    plan, every = found.plan, make_plan(old_nodes, gpt)
    assert plan.left_out["nodes"] == ["annex-0", "annex-1"]
    assert [n.name for n in plan.nodes] == [f"main-{i}" for i in range(8)]
    assert plan.world_size == 64 and every.world_size == 80
    # the 2.8x: every node is much slower than the H100 nodes alone, and the plan is the latter
    assert every.prediction.iteration_s > 2.5 * plan.prediction.iteration_s
    assert plan.left_out["all_nodes"]["iteration_s"] == pytest.approx(every.prediction.iteration_s, rel=1e-6)
    alone = make_plan(subsets.sub_cluster(old_nodes, [f"main-{i}" for i in range(8)]), gpt)
    assert replace(plan, left_out={}).hash == alone.hash       # the plan is the kept nodes' own plan


def test_a_group_that_cannot_shorten_the_iteration_is_not_searched(searched):
    found, calls = searched
    # the whole cluster and the H100 nodes alone are planned; the V100 nodes alone are ruled out by their floor
    assert calls == [80, 64]
    pruned = [t for t in found.tried if not t.searched]
    assert [t.groups for t in pruned] == [(1,)]
    assert pruned[0].floor_s >= found.plan.prediction.iteration_s


def test_every_node_is_used_where_every_node_helps(gpt):
    cluster = load_cluster(CLUSTERS / "h100-a100.yaml")
    plan = subsets.plan_nodes(cluster, gpt)
    assert plan.left_out == {} and plan.hash == make_plan(cluster, gpt).hash
    assert "left_out" not in plan.to_dict() and "price_per_hour" not in plan.to_dict()


def test_use_all_nodes_is_todays_plan(old_nodes, gpt):
    plan = subsets.plan_nodes(old_nodes, gpt, use_all_nodes=True)
    assert plan.hash == make_plan(old_nodes, gpt).hash and plan.world_size == 80


def test_a_plan_that_leaves_nodes_out_survives_a_file(searched, tmp_path):
    plan = searched[0].plan
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded.hash == plan.hash and loaded.left_out == plan.left_out
    assert "left_out" in loaded.to_dict()
    assert not loaded.prediction_stale


def test_sub_cluster_is_the_file_of_the_kept_nodes(old_nodes):
    sub = subsets.sub_cluster(old_nodes, ["main-3", "main-0", "main-1", "main-2"])
    assert [n.name for n in sub.nodes] == ["main-0", "main-1", "main-2", "main-3"]      # launch order kept
    assert [n.index for n in sub.nodes] == [0, 1, 2, 3] and sub.world_size == 32
    assert sub.links == {}
    main = next(c for c in old_nodes.spec.model_dump()["clusters"] if c["name"] == "main")
    main["nodes"][0]["count"] = 4
    assert sub.digest == cluster_from_dict({"name": old_nodes.name, "clusters": [main]}).digest
    with pytest.raises(ConfigError, match="not in the cluster"):
        subsets.sub_cluster(old_nodes, ["main-0", "nowhere"])


def test_the_report_says_what_was_left_out_and_why(searched):
    text = render_text(searched[0].plan)
    assert "left out: 2 of 10 nodes (16 of 80 devices)" in text
    assert "annex/V100-32: 16 devices on annex-0 annex-1: the best plan with them predicts" in text
    assert "with every node (80 ranks): tp 4 pp 5" in text
    assert "--use-all-nodes" in text and "--exclude annex-0@annex-1" in text


def test_the_launch_of_left_out_nodes_is_refused(searched):
    plan = searched[0].plan
    kept = [n.name for n in plan.nodes]
    subsets.check_launch_nodes(plan, kept, world_size=64)
    with pytest.raises(ConfigError) as exc:
        subsets.check_launch_nodes(plan, kept + ["annex-0"])
    assert "annex-0" in exc.value.problem and "--include main-0@main-1" in exc.value.fix
    with pytest.raises(ConfigError) as exc:
        subsets.check_launch_nodes(plan, world_size=80)
    assert "annex-0 annex-1" in exc.value.problem and "--use-all-nodes" in exc.value.fix
    with pytest.raises(ConfigError, match="not the plan's nodes"):
        subsets.check_launch_nodes(plan, list(reversed(kept)))
    subsets.check_launch_nodes(plan, [f"gpu{i}.example" for i in range(8)])     # names the file does not give
    with pytest.raises(ConfigError, match="the plan is for 64 ranks"):
        subsets.check_launch_nodes(plan, [f"gpu{i}.example" for i in range(10)], world_size=80)


def test_a_plan_with_every_node_passes_any_launch_check(gpt):
    plan = subsets.plan_nodes(load_cluster(CLUSTERS / "two-clusters-25gbe.yaml"), gpt)
    subsets.check_launch_nodes(plan, ["whatever"], world_size=1)       # nothing left out: nothing to refuse


def test_hostfile_and_node_list(searched):
    plan = searched[0].plan
    assert subsets.deepspeed_hostfile(plan).splitlines() == [f"main-{i} slots=8" for i in range(8)]
    assert subsets.node_list(plan).split() == [f"main-{i}" for i in range(8)]
    lines = subsets.launch_lines(plan, limit=3)
    assert lines[0] == "nodes (8, in launch order = node_rank): main-0 main-1 main-2 ... (8 in all)"
    assert any("--nnodes 8 --nproc-per-node 8" in line for line in lines)


def test_resolve_launch_plans_every_node_unless_told(old_nodes, gpt):
    every = resolve_launch(old_nodes, launch=Launch(80), model=gpt).plan
    assert every.hash == make_plan(old_nodes, gpt).hash
    # told it may leave nodes out, on a launch of every node (the cluster is what was launched): refused, naming them
    with pytest.raises(ConfigError, match="leaves out 2 of its 10 nodes \\(annex-0 annex-1\\)"):
        resolve_launch(old_nodes, launch=Launch(80), model=gpt, use_all_nodes=False)


# ---- prices ---------------------------------------------------------------------------------------------------


def priced(prices, path="h100-a100.yaml"):
    """An example cluster with a price_per_device_hour per node group (None: none)."""
    spec = load_cluster(CLUSTERS / path).spec.model_dump(exclude_none=True)
    groups = [g for c in spec["clusters"] for g in c["nodes"]]
    for g, price in zip(groups, prices):
        if price is not None:
            g["price_per_device_hour"] = price
    return cluster_from_dict(spec)


def test_prices_change_nothing_when_absent_and_are_checked():
    plain, none = load_cluster(CLUSTERS / "h100-a100.yaml"), priced([None, None])
    assert plain.digest == none.digest
    assert priced([4.0, 2.0]).digest != plain.digest
    for bad, what in ((-1, "outside the range het_plugin takes"), (True, "boolean"), ("cheap", "number")):
        with pytest.raises(ConfigError) as exc:
            priced([bad, 2.0])
        assert "price_per_device_hour" in str(exc.value) and what in str(exc.value)


def test_cost_per_iteration_and_per_million_tokens(gpt):
    plan = subsets.plan_nodes(priced([4.0, 2.0]), gpt)
    assert plan.price_per_hour == 32 * 4.0 + 32 * 2.0
    text = render_text(plan)
    per_iteration = plan.price_per_hour * plan.prediction.iteration_s / 3600
    assert f"cost: {per_iteration:.4g} per iteration" in text
    assert f"{per_iteration / (plan.prediction.tokens_per_s * plan.prediction.iteration_s) * 1e6:.4g} per million" \
        in text
    assert "cost:" not in render_text(subsets.plan_nodes(load_cluster(CLUSTERS / "h100-a100.yaml"), gpt))


def test_the_cost_objective_picks_the_cheapest_plan_meeting_the_floor(gpt):
    cluster = priced([6.0, 1.0])
    options = every_subset(cluster, gpt)
    cost = lambda p, rate: p.prediction.iteration_s * rate      # noqa: E731
    cheapest = min(cost(p, r) for p, r in options)
    plan = subsets.plan_nodes(cluster, gpt, objective="cost")
    assert cost(plan, plan.price_per_hour) == pytest.approx(cheapest, rel=1e-9)
    fastest = max(p.prediction.tokens_per_s for p, _ in options)
    floor = 0.5 * (fastest + min(p.prediction.tokens_per_s for p, _ in options))
    plan = subsets.plan_nodes(cluster, gpt, objective="cost", min_tokens_per_s=floor)
    assert plan.prediction.tokens_per_s >= floor
    assert cost(plan, plan.price_per_hour) == pytest.approx(
        min(cost(p, r) for p, r in options if p.prediction.tokens_per_s >= floor), rel=1e-9)
    with pytest.raises(ConfigError) as exc:
        subsets.plan_nodes(cluster, gpt, objective="cost", min_tokens_per_s=2 * fastest)
    assert exc.value.field == "min_throughput" and f"{fastest:,.0f}" in exc.value.problem


def test_the_cost_objective_needs_every_price(gpt):
    with pytest.raises(ConfigError) as exc:
        subsets.plan_nodes(priced([4.0, None]), gpt, objective="cost")
    assert "east/A100-80 has none" in exc.value.problem
    with pytest.raises(ConfigError, match="constraint of the cost objective"):
        subsets.plan_nodes(priced([4.0, 2.0]), gpt, min_tokens_per_s=1000)
    with pytest.raises(ConfigError, match="not one of time, cost"):
        subsets.plan_nodes(priced([4.0, 2.0]), gpt, objective="money")
