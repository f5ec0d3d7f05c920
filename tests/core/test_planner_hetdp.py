"""Heterogeneous data parallelism on the planning side: replica shares by speed, the per-replica predictor, the
hierarchical reduction of groups across a slow link, the shapes the search compares, bad input."""
import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from het_plugin.core import cost
from het_plugin.cli import main as cli_main
from het_plugin.core.inputs.cluster import cluster_from_dict, load_cluster
from het_plugin.core.errors import ConfigError
from het_plugin.core.inputs.model import preset_model
from het_plugin.core.ranks.placement import place, place_replicas, cluster_transport
from het_plugin.core.plan import Plan
from het_plugin.core.planner import SHAPE_DATA, SHAPE_MIXED, make_plan
from het_plugin.views.report import render_text, replica_rows
from het_plugin.core.ranks.dims import ParallelDims

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _node(acc: str, count: int = 2) -> dict:
    return {"count": count, "accelerator": acc, "accelerators_per_node": 8,
            "nics": [{"type": "ethernet", "gbps": 100, "interfaces": ["eth0"]}]}


@pytest.fixture(scope="module")
def mixed():
    """One IB fabric, 2 H100 nodes and 2 A100 nodes: replicas of two speeds, no slow link."""
    return cluster_from_dict({"name": "mixed", "clusters": [
        {"name": "a", "fabric": {"type": "ib", "gbps": 1600}, "nodes": [_node("H100"), _node("A100-80")]}]})


@pytest.fixture(scope="module")
def two_clusters():
    """H100 cluster on IB, A100 cluster on RoCE, 100 GbE between them."""
    return cluster_from_dict({"name": "two", "clusters": [
        {"name": "h", "fabric": {"type": "ib", "gbps": 1600}, "nodes": [_node("H100")]},
        {"name": "a", "fabric": {"type": "roce", "gbps": 800}, "nodes": [_node("A100-80")]}],
        "links": [{"between": ["h", "a"], "gbps": 100, "latency_us": 50}]})


@pytest.fixture(scope="module")
def gpt7():
    return preset_model("gpt-7.5b")


# ---- shares --------------------------------------------------------------------------------------------------


def _brute_force(sizes, fills, steps, total):
    """Smallest max finish over every split (counts >= 1, inside a group differing by at most one)."""
    best = None
    for q in itertools.product(*(range(z, total + 1) for z in sizes)):
        if sum(q) != total:
            continue
        t = max(f + s * -(-qq // z) for z, f, s, qq in zip(sizes, fills, steps, q))
        best = t if best is None else min(best, t)
    return best


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.floats(0, 5), st.floats(0.1, 4)), min_size=1, max_size=3),
       st.integers(0, 14))
def test_shares_add_up_give_each_replica_one_and_minimise_the_slowest(groups, extra):
    sizes = [z for z, _, _ in groups]
    fills = [f for _, f, _ in groups]
    steps = [s for _, _, s in groups]
    total = sum(sizes) + extra
    q = cost.share_micro_batches(sizes, fills, steps, total)
    assert sum(q) == total and all(qq >= z for qq, z in zip(q, sizes))
    got = max(f + s * -(-qq // z) for z, f, s, qq in zip(sizes, fills, steps, q))
    assert got == pytest.approx(_brute_force(sizes, fills, steps, total))


def test_shares_follow_speed_two_to_one():
    # two replicas twice as fast as two others, no fill: 24 micro-batches go 8, 8, 4, 4
    assert cost.share_micro_batches([2, 2], [0.0, 0.0], [1.0, 2.0], 24) == [16, 8]
    # alike groups: the even split
    assert cost.share_micro_batches([2, 2], [0.5, 0.5], [1.0, 1.0], 24) == [12, 12]


# ---- predictor -----------------------------------------------------------------------------------------------


def test_replicas_on_different_devices_form_classes_and_uneven_counts_shorten_the_slowest(mixed, gpt7):
    dims = ParallelDims(tp=8, pp=1, dp=4)
    analysis = cost.analyze(mixed, place(mixed, dims), cluster_transport)
    classes = {c.accelerators[0][0].name: c.replicas for c in analysis.replica_classes}
    assert classes == {"H100": (0, 1), "A100-80": (2, 3)}
    split = cost.SplitCosts(gpt7, analysis, 1)
    even = split.predict([gpt7.num_layers])
    t = even.replica_pipeline_s
    assert t[0] == t[1] < t[2] == t[3]           # each replica predicted on its own devices
    counts = split.balance([gpt7.num_layers])
    assert sum(counts) == 4 * split.num_micro_batches and counts[0] == counts[1] > counts[2] == counts[3]
    split.set_counts(counts)
    uneven = split.predict([gpt7.num_layers])
    assert max(uneven.replica_pipeline_s) < max(even.replica_pipeline_s)
    assert uneven.iteration_s < even.iteration_s


def test_replicas_predicted_on_their_own_pay_the_profiles_iteration_overhead_once(mixed, gpt7):
    from het_plugin.core.cost.fixed_costs import DEFAULT_ITERATION_S
    from het_plugin.core.inputs.profile import Profile
    analysis = cost.analyze(mixed, place(mixed, ParallelDims(tp=8, pp=1, dp=4)), cluster_transport)
    base = cost.SplitCosts(gpt7, analysis, 1, profile=Profile())
    prof = Profile()
    prof.add_overhead("H100", 0.1)
    prof.add_overhead("A100-80", 0.25)                 # the slowest device type's overhead counts
    split = cost.SplitCosts(gpt7, analysis, 1, profile=prof)
    for counts in ([], split.balance([gpt7.num_layers])):
        base.set_counts(counts)
        split.set_counts(counts)
        got, want = split.predict([gpt7.num_layers]), base.predict([gpt7.num_layers])
        # the base profile measures no overhead: it gets the small default (cost.fixed_costs), 0.25 s replaces it
        assert got.replica_pipeline_s and got.iteration_s - want.iteration_s == pytest.approx(0.25 - DEFAULT_ITERATION_S)


def test_homogeneous_replicas_have_no_classes_and_predict_as_before(gpt7):
    cl = load_cluster(EXAMPLES / "clusters" / "homogeneous-ib.yaml")
    analysis = cost.analyze(cl, place(cl, ParallelDims(tp=8, pp=2, dp=cl.world_size // 16)), cluster_transport)
    assert analysis.replica_classes == ()
    pred = cost.SplitCosts(gpt7, analysis, 1).predict([18, 18])
    assert pred.replica_pipeline_s == []


def test_memory_follows_the_largest_count_when_it_is_below_pp(mixed, gpt7):
    model = gpt7.model_copy(update={"global_batch_size": 8})
    dims = ParallelDims(tp=8, pp=1, dp=4)
    split = cost.SplitCosts(model, cost.analyze(mixed, place(mixed, dims), cluster_transport), 1)
    split.set_counts([3, 3, 1, 1])
    assert split.counts == [3, 3, 1, 1]
    with pytest.raises(ValueError):
        split.set_counts([4, 3, 1, 1])           # 9 micro-batches, the batch holds 8
    split.set_counts([2, 2, 2, 2])
    assert split.counts == []                    # equal counts are the even split


def test_first_stages_hold_up_to_pp_of_the_largest_count(mixed, gpt7):
    # 1F1B keeps min(pp - s, count) micro-batches in flight on stage s: with 2 each and pp = 4 the first stage
    # holds 2, with counts [3, 1] it holds 3 (the activation memory grows by one micro-batch's)
    model = gpt7.model_copy(update={"global_batch_size": 4})
    analysis = cost.analyze(mixed, place(mixed, ParallelDims(tp=4, pp=4, dp=2)), cluster_transport)
    layers = [9, 9, 9, 9]
    split = cost.SplitCosts(model, analysis, 1)
    even = split.predict(layers).memory_gib_per_stage
    split.set_counts([3, 1])
    uneven = split.predict(layers).memory_gib_per_stage
    per_mb = split.stages[0].act_bytes_per_layer * 9 / cost.GIB
    assert uneven[0] - even[0] == pytest.approx(per_mb)
    assert uneven[0] > even[0] and uneven[3] == even[3]       # the last stage holds one either way


# ---- hierarchical reduction across a slow link ---------------------------------------------------------------


def test_same_vendor_group_across_clusters_stays_a_flat_socket_ring(two_clusters):
    # One NCCL communicator on sockets: every inter-node hop on the Ethernet NICs (what the runtime does today).
    dims = ParallelDims(tp=8, pp=1, dp=4)          # every DP group: 2 H100 nodes + 2 A100 nodes
    path = cost.analyze(two_clusters, place(two_clusters, dims), cluster_transport).stages[0].dp_paths[0]
    assert [(lv.members, lv.tier.kind, lv.tier.gbps) for lv in path.levels] == [(2, "socket", 100), (2, "socket", 100)]


def test_cross_vendor_group_reduces_inside_each_fabric_then_between_vendors():
    cl = cluster_from_dict({"name": "vendors", "clusters": [
        {"name": "h", "fabric": {"type": "ib", "gbps": 1600}, "nodes": [_node("H100")]},
        {"name": "m", "fabric": {"type": "roce", "gbps": 800}, "nodes": [_node("MI300X")]}],
        "links": [{"between": ["h", "m"], "gbps": 100, "latency_us": 50}]})
    dims = ParallelDims(tp=8, pp=1, dp=4)          # every DP group: 2 H100 nodes + 2 MI300X nodes
    planned = cost.analyze(cl, place(cl, dims), cluster_transport)
    path = planned.stages[0].dp_paths[0]
    assert planned.transports["dp"] == {"host-staged"}
    assert [(lv.members, lv.tier.kind, lv.tier.gbps) for lv in path.levels] == [(2, "roce", 800),
                                                                               (2, "host-staged", 100)]
    nbytes = 1e9                                 # 2(n-1) ring steps of a halving chunk, 8 ranks per NIC, and
    copy = 2 * nbytes / 2 * 8 / (cost.HOST_COPY_GBPS * 1e9)     # each member copies its half through the host
    by_hand = 2 * path.levels[0].tier.step_s(nbytes / 2, 8) + 2 * path.levels[1].tier.step_s(nbytes / 4, 8) + copy
    assert path.allreduce_s(nbytes) == pytest.approx(by_hand)
    flat = cost.analyze(cl, place(cl, dims), cluster_transport,
                        cost.Network(cl, cluster_transport, hierarchical=False)).stages[0].dp_paths[0]
    assert flat.levels[0].tier.kind == "host-staged" and flat.levels[0].tier.gbps == 100   # all on sockets
    assert path.allreduce_s(nbytes) < flat.allreduce_s(nbytes)


def test_cross_vendor_group_copies_only_its_stripe_through_the_host():
    cl = cluster_from_dict({"name": "vendors", "clusters": [
        {"name": "n", "fabric": {"type": "roce", "gbps": 800}, "nodes": [_node("H100"), _node("MI300X")]}]})
    dims = ParallelDims(tp=8, pp=1, dp=4)
    path = cost.analyze(cl, place(cl, dims), cluster_transport).stages[0].dp_paths[0]
    assert path.host_staged and path.staged_fraction == pytest.approx(1 / 2)   # 2 nodes per vendor, 1 rank each
    assert [lv.tier.kind for lv in path.levels] == ["roce", "host-staged"]


# ---- placement and search ------------------------------------------------------------------------------------


def test_replica_dealing_keeps_each_pipeline_in_one_domain(two_clusters):
    dims = ParallelDims(tp=4, pp=2, dp=4)
    p = place_replicas(two_clusters, dims)
    assert p.dealing == "replica"
    for d in range(4):
        ranks = [p.rank_of_canonical[s * dims.stage_size + d * 4 + j] for s in range(2) for j in range(4)]
        assert len({two_clusters.node_of(r).domain for r in ranks}) == 1
    for s in range(2):                           # every stage spans both clusters
        assert len({two_clusters.node_of(r).cluster for r in p.stage_ranks(s)}) == 2


def _stages_per_node(cluster, p):
    S = p.dims.stage_size
    out: dict = {}
    for logical, rank in enumerate(p.rank_of_canonical):
        out.setdefault(cluster.rank_node[rank], set()).add(logical // S)
    return out


def test_replicas_dealt_together_hold_one_stage_of_several_replicas_per_node(mixed):
    dims = ParallelDims(tp=4, pp=2, dp=4)
    apart, together = place_replicas(mixed, dims), place_replicas(mixed, dims, together=2)
    for p in (apart, together):
        assert sorted(p.rank_of_canonical) == list(range(dims.world_size)) and p.dealing == "replica"
        for d in range(4):                       # each pipeline inside one domain
            ranks = [p.rank_of_canonical[s * dims.stage_size + d * 4 + j] for s in range(2) for j in range(4)]
            assert len({mixed.node_of(r).domain for r in ranks}) == 1
    assert all(len(s) == 2 for s in _stages_per_node(mixed, apart).values())      # a replica's two stages
    assert all(len(s) == 1 for s in _stages_per_node(mixed, together).values())   # one stage of two replicas
    for p, k in ((apart, 1), (together, 2)):     # so each DP group has k members on each node ...
        for g in p.physical_groups("dp"):
            assert sorted({sum(mixed.rank_node[r] == n for r in g) for n in {mixed.rank_node[r] for r in g}}) == [k]
    path = cost.analyze(mixed, together, cluster_transport).stages[0].dp_paths[0]
    assert path.levels[0].tier.kind == "local" and path.levels[0].members == 2     # ... and reduces inside it first
    with pytest.raises(ValueError, match="together=3 must divide dp=4"):
        place_replicas(mixed, dims, together=3)


def test_whole_pipelines_per_vendor_are_weighed_on_the_hethub_mix():
    """Across vendors the shim reduces a DP group inside each vendor's fabric first: the search deals whole
    pipelines per vendor there too, with speed-proportional shares (the report lists the shape's best)."""
    cl = load_cluster(EXAMPLES / "clusters" / "hethub-mix.yaml")
    model = preset_model("llama-140b")
    plan = make_plan(cl, model, tp=4, pp=8, replica_split="uneven")
    assert plan.prediction.shape == SHAPE_DATA and {g.transport for g in plan.groups["dp"]} == {"host-staged"}
    counts = {r.devices: r.count for r in replica_rows(plan)}
    assert max(c for d, c in counts.items() if "MI250X" in d) < min(c for d, c in counts.items() if "other" in d)
    best = make_plan(cl, model)
    dealt = [a for a in best.alternatives if a["shape"] == SHAPE_DATA and a["pp"] > 1]
    assert dealt and dealt[0]["replica_split"] != "even"
    assert {a.get("replicas_per_node", 1) for a in dealt} == {1, 2}       # both dealings, named where they differ
    assert dealt[0]["iteration_s"] >= best.prediction.iteration_s


def test_whole_pipelines_are_not_dealt_across_clusters_of_one_vendor(two_clusters, gpt7):
    """Such a DP group would be one NCCL communicator on sockets (a flat ring over Ethernet): not searched."""
    plan = make_plan(two_clusters, gpt7)
    assert not [a for a in plan.alternatives if a["shape"] == SHAPE_DATA and a["pp"] > 1]
    assert plan.prediction.shape != SHAPE_DATA or plan.pp == 1


def test_search_gives_faster_replicas_more_micro_batches(mixed, gpt7):
    plan = make_plan(mixed, gpt7, pp=1)
    assert plan.uneven_replicas and sum(plan.replica_counts) == plan.dp * plan.num_micro_batches
    rows = {r.devices: r.count for r in replica_rows(plan)}
    assert rows["a/H100"] > rows["a/A100-80"]
    even = make_plan(mixed, gpt7, pp=1, replica_split="even")
    assert not even.uneven_replicas and even.replica_micro_batches == []
    assert plan.prediction.iteration_s < even.prediction.iteration_s
    assert plan.prediction.shape == SHAPE_DATA
    again = Plan.from_dict(plan.to_dict())      # the counts survive a round trip and are hashed
    assert again.replica_micro_batches == plan.replica_micro_batches and again.hash == plan.hash != even.hash


def test_homogeneous_cluster_keeps_the_even_split_and_the_hash(gpt7):
    cl = load_cluster(EXAMPLES / "clusters" / "homogeneous-ib.yaml")
    auto = make_plan(cl, gpt7)
    assert auto.replica_micro_batches == [] and auto.hash == make_plan(cl, gpt7, replica_split="even").hash
    assert "shape" not in auto.to_dict()["prediction"] or auto.prediction.shape == ""
    assert all("shape" not in alt for alt in auto.alternatives)


def test_report_shows_each_replicas_share_and_why_the_shape_won(mixed, gpt7):
    plan = make_plan(mixed, gpt7, pp=1)
    text = render_text(plan)
    assert "data-parallel replicas" in text
    rows = replica_rows(plan)
    for row in rows:
        assert f"on {row.devices}: {row.count} micro-batches each" in text
    assert f"shape: {SHAPE_DATA}, replica split" in text
    assert "of the batch each" in text and "pipeline " in text


def test_h100_a100_example_gets_uneven_shares_and_names_the_shapes(gpt7):
    cl = load_cluster(EXAMPLES / "clusters" / "h100-a100.yaml")
    plan = make_plan(cl, gpt7)
    assert plan.uneven_replicas
    counts = {r.devices: r.count for r in replica_rows(plan)}
    assert counts["east/H100"] > counts["east/A100-80"]
    shapes = {alt.get("shape") for alt in plan.alternatives} | {plan.prediction.shape}
    assert len(shapes) >= 2                      # the other shapes' best plans are listed to compare
    assert "beat pipeline across domains" in render_text(plan, cl)


def test_mixed_shape_is_searched_where_a_stage_spans_two_device_types(gpt7):
    # H100 and A100 nodes on one fabric, an A100 cluster behind 100 GbE: a stage over the first cluster holds
    # replicas of two speeds while the pipeline crosses the slow link.
    cl = cluster_from_dict({"name": "mix", "clusters": [
        {"name": "east", "fabric": {"type": "ib", "gbps": 1600}, "nodes": [_node("H100"), _node("A100-80")]},
        {"name": "west", "fabric": {"type": "roce", "gbps": 800}, "nodes": [_node("A100-80", 4)]}],
        "links": [{"between": ["east", "west"], "gbps": 100, "latency_us": 50}]})
    plan = make_plan(cl, gpt7, pp=2)
    shapes = {alt.get("shape") for alt in plan.alternatives} | {plan.prediction.shape}
    assert SHAPE_MIXED in shapes
    mixed = [a for a in plan.alternatives if a.get("shape") == SHAPE_MIXED] or [None]
    if plan.prediction.shape != SHAPE_MIXED:
        assert mixed[0]["iteration_s"] >= plan.prediction.iteration_s


# ---- bad input -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split, words", [
    ([4, 0, 4, 4], "replica 1 gets 0 micro-batches"),
    ([5, 4, 4, 4], "adds up to 17 micro-batches, not a multiple of its 4 replicas"),
    ([8, 8, 8, 4, 4], "5 counts [8, 8, 8, 4, 4], but dp=4"),
    ("sideways", "is not one of auto, even, uneven"),
])
def test_bad_replica_split_names_the_field_and_the_numbers(mixed, gpt7, split, words):
    with pytest.raises(ConfigError) as info:
        make_plan(mixed, gpt7, pp=1, dp=4, replica_split=split)
    assert info.value.field == "replica_split" and words in str(info.value)


def test_counts_that_miss_the_global_batch_are_refused(mixed, gpt7):
    with pytest.raises(ConfigError) as info:
        make_plan(mixed, gpt7, micro_batch_size=1, replica_split=[6, 6, 2, 2])
    assert "16 micro-batches of micro_batch_size 1 = 16 samples" in str(info.value)
    assert f"global_batch_size is {gpt7.global_batch_size}" in str(info.value)


def test_given_counts_are_planned_as_given(mixed, gpt7):
    n = gpt7.global_batch_size
    counts = [n * 3 // 8, n * 3 // 8, n // 8, n // 8]
    plan = make_plan(mixed, gpt7, replica_split=counts)
    assert plan.dp == 4 and plan.micro_batch_size == 1 and plan.replica_micro_batches == counts


def test_forced_uneven_on_a_homogeneous_cluster_cannot_be_honoured(gpt7):
    cl = load_cluster(EXAMPLES / "clusters" / "homogeneous-ib.yaml")
    with pytest.raises(ConfigError) as info:
        make_plan(cl, gpt7, replica_split="uneven")
    assert info.value.field == "replica_split" and "cannot be honoured" in str(info.value)


def test_forced_uneven_gives_uneven_shares_where_devices_differ(mixed, gpt7):
    plan = make_plan(mixed, gpt7, pp=1, replica_split="uneven")
    assert plan.uneven_replicas


def test_cli_replica_split(capsys, tmp_path):
    cluster = str(EXAMPLES / "clusters" / "homogeneous-ib.yaml")
    assert cli_main(["plan", cluster, "--replica-split", "uneven"]) != 0
    err = capsys.readouterr().err
    assert "--replica-split" in err and "cannot be honoured" in err
    assert cli_main(["plan", cluster, "--replica-split", "3,x"]) != 0
    assert "neither auto, even, uneven nor comma-separated" in capsys.readouterr().err
    assert cli_main(["plan", cluster, "--replica-split", "even", "-o", str(tmp_path / "p.json")]) == 0
    capsys.readouterr()
    assert cli_main(["plan", str(tmp_path / "p.json"), "--replica-split", "even"]) != 0
    assert "a saved plan is shown as it is" in capsys.readouterr().err
