"""Predictor: the 1F1B simulation, communication tiers and transports, memory, overlap."""
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from het_plugin.core import cost
from het_plugin.core.inputs.cluster import cluster_from_dict, load_cluster
from het_plugin.core.inputs.model import preset_model
from het_plugin.core.ranks.placement import baseline_transport, default_placement, place, cluster_transport
from het_plugin.core.ranks.dims import ParallelDims

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def holmes():
    return load_cluster(EXAMPLES / "clusters" / "holmes-ib-roce.yaml")


@pytest.fixture(scope="module")
def gpt7():
    return preset_model("gpt-7.5b")


# ---- 1F1B --------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.integers(1, 24), st.floats(0.1, 5), st.floats(0.1, 5))
def test_simulation_equals_closed_form_on_uniform_stages(pp, m, f, b):
    finish = cost.simulate_1f1b([f] * pp, [b] * pp, [0.0] * pp, m)
    assert max(finish) == pytest.approx((m + pp - 1) * (f + b))


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 6), st.integers(1, 16), st.floats(0.01, 1))
def test_sends_add_at_least_two_hops_per_stage_boundary(pp, m, c):
    f, b = 1.0, 2.0
    base = max(cost.simulate_1f1b([f] * pp, [b] * pp, [0.0] * pp, m))
    with_sends = max(cost.simulate_1f1b([f] * pp, [b] * pp, [c] * pp, m))
    # micro-batch 0 crosses pp-1 hops forward and back before the last stage's work is done
    assert with_sends >= base + 2 * (pp - 1) * c - 1e-9
    assert with_sends >= max(cost.simulate_1f1b([f] * pp, [b] * pp, [c / 2] * pp, m)) - 1e-9


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 16), st.lists(st.tuples(st.floats(0.1, 3), st.floats(0.1, 3)), min_size=1, max_size=6))
def test_uneven_stages_stay_between_the_bottleneck_bounds(m, stages):
    fwd = [f for f, _ in stages]
    bwd = [b for _, b in stages]
    total = max(cost.simulate_1f1b(fwd, bwd, [0.0] * len(stages), m))
    per = [f + b for f, b in stages]
    slow = per.index(max(per))
    lower = sum(fwd[:slow]) + m * per[slow] + sum(bwd[:slow])
    upper = (m + len(stages) - 1) * max(per)
    assert lower - 1e-9 <= total <= upper + 1e-9


def test_a_slower_stage_never_makes_the_pipeline_faster():
    fast = max(cost.simulate_1f1b([1, 1, 1, 1], [2, 2, 2, 2], [0.1] * 4, 8))
    slow = max(cost.simulate_1f1b([1, 1.5, 1, 1], [2, 3, 2, 2], [0.1] * 4, 8))
    assert slow > fast
    # steady state is set by the slowest stage: 8 micro-batches of 4.5 s on stage 1
    assert slow >= 8 * 4.5


def test_schedule_order_is_megatrons_one_f_one_b():
    assert cost.one_f_one_b_order(4, 0, 5) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4),
                                                 ("B", 1), ("B", 2), ("B", 3), ("B", 4)]
    assert cost.one_f_one_b_order(4, 3, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]


# ---- communication ----------------------------------------------------------------------------------


def test_socket_transport_uses_the_ethernet_nic_inside_an_rdma_cluster(holmes):
    dims = ParallelDims(tp=8, pp=2, dp=4)
    right = cost.analyze(holmes, place(holmes, dims), cluster_transport)
    forced = cost.analyze(holmes, default_placement(holmes, dims), baseline_transport)
    ib_level = right.stages[0].dp_paths[0].levels[-1]
    assert ib_level.tier.kind == "ib" and ib_level.tier.gbps == 800
    sock_level = forced.stages[0].dp_paths[0].levels[-1]
    assert sock_level.tier.kind == "socket" and sock_level.tier.gbps == 25     # the node's 25 GbE NIC
    assert forced.transports["dp"] == {"socket"}


def test_socket_without_an_ethernet_nic_falls_back_to_the_slowest_inter_cluster_link():
    cl = cluster_from_dict({"clusters": [
        {"name": "a", "fabric": {"type": "ib", "gbps": 400}, "nodes": [{"count": 2, "accelerator": "H100", "accelerators_per_node": 8}]},
        {"name": "b", "fabric": {"type": "roce", "gbps": 400}, "nodes": [{"count": 2, "accelerator": "H100", "accelerators_per_node": 8}]}],
        "links": [{"between": ["a", "b"], "gbps": 40}]})
    tier = cost.socket_tier(cl, cl.nodes[0])
    assert tier.gbps == 40


def test_dp_group_spanning_two_fabrics_reduces_hierarchically_and_slower(holmes):
    # pp=1, tp=8: every DP group spans all 8 nodes, so it crosses the 25 GbE link between the clusters
    wide = cost.analyze(holmes, place(holmes, ParallelDims(tp=8, dp=8)), cluster_transport)
    levels = wide.stages[0].dp_paths[0].levels
    assert [lv.members for lv in levels] == [4, 2]                       # 4 nodes per cluster, 2 clusters
    assert levels[1].tier.gbps == 25
    narrow = cost.analyze(holmes, place(holmes, ParallelDims(tp=8, pp=2, dp=4)), cluster_transport)
    nbytes = 1e9
    assert wide.stages[0].dp_paths[0].allreduce_s(nbytes) > 5 * narrow.stages[0].dp_paths[0].allreduce_s(nbytes)


def test_host_staged_pays_a_copy_each_way():
    tier = cost.Tier("socket", 100, 10)
    direct = cost.CollectivePath((cost.Level(tier, 2, 1),))
    staged = cost.CollectivePath((cost.Level(tier, 2, 1),), host_staged=True)
    nbytes = 1e8
    assert staged.allreduce_s(nbytes) - direct.allreduce_s(nbytes) == pytest.approx(
        2 * nbytes * 8 / (cost.HOST_COPY_GBPS * 1e9))


def test_ring_allreduce_latency_bandwidth():
    tier = cost.Tier("ib", 80, 5)           # 10 GB/s, 5 us
    path = cost.CollectivePath((cost.Level(tier, 4, 1),))
    # 2(n-1) steps of bytes/n: 6 * (5 us + 0.25 GB / 10 GB/s)
    assert path.allreduce_s(1e9) == pytest.approx(6 * (5e-6 + 0.025))


def test_pipeline_hop_between_clusters_uses_the_ethernet_link(holmes):
    a = cost.analyze(holmes, place(holmes, ParallelDims(tp=8, pp=2, dp=4)), cluster_transport)
    (tier, share, staged), = a.stages[0].hop_next
    assert tier.kind in ("ethernet", "socket") and tier.gbps == 25 and share == 8 and not staged


# ---- prediction ----------------------------------------------------------------------------------


def test_prediction_fills_every_field_and_is_consistent(holmes, gpt7):
    dims = ParallelDims(tp=4, pp=2, dp=8)
    pred = cost.predict(holmes, gpt7, place(holmes, dims), [18, 18], 1, description="x")
    assert pred.iteration_s == pytest.approx(pred.pipeline_s + pred.dp_exposed_s + pred.optimizer_s)
    assert pred.tokens_per_s == pytest.approx(gpt7.global_batch_size * gpt7.seq_length / pred.iteration_s)
    assert 0 < pred.tflops_per_device < 312
    assert 0 <= pred.bubble_fraction < 1
    assert len(pred.stage_compute_s) == len(pred.memory_gib_per_stage) == len(pred.capacity_gib_per_stage) == 2
    assert pred.capacity_gib_per_stage == [80, 80] and pred.fits and pred.description == "x"


def test_overlap_hides_gradient_reduction_behind_the_last_backward(holmes, gpt7):
    placement = place(holmes, ParallelDims(tp=4, pp=2, dp=8))
    on = cost.predict(holmes, gpt7, placement, [18, 18], 1, overlap_grad_reduce=True)
    off = cost.predict(holmes, gpt7, placement, [18, 18], 1, overlap_grad_reduce=False)
    assert on.pipeline_s == off.pipeline_s
    assert on.dp_exposed_s < off.dp_exposed_s


def test_plan_that_does_not_fit_is_rejected_with_the_reason(gpt7):
    small = cluster_from_dict({"clusters": [{"name": "c", "fabric": {"type": "ib", "gbps": 200},
                                             "nodes": [{"count": 1, "accelerator": "A100-40", "accelerators_per_node": 8}]}]})
    pred = cost.predict(small, gpt7, default_placement(small, ParallelDims(dp=8)), [36], 1)
    assert not pred.fits
    assert "does not fit: stage 0 needs" in pred.description and "40.0 GiB" in pred.description
    assert cost.memory_problem(pred) is not None


def test_distributed_optimizer_saves_optimizer_state_across_dp(holmes, gpt7):
    placement = place(holmes, ParallelDims(tp=4, pp=2, dp=8))
    plain = cost.predict(holmes, gpt7, placement, [18, 18], 1)
    dist = cost.predict(holmes, gpt7, placement, [18, 18], 1, distributed_optimizer=True)
    params0 = (18 * gpt7.params_per_layer + gpt7.embedding_params) / 4
    saved = params0 * cost.OPTIMIZER_STATE_BYTES * (1 - 1 / 8) / cost.GIB
    assert plain.memory_gib_per_stage[0] - dist.memory_gib_per_stage[0] == pytest.approx(saved)


def test_first_stage_holds_pp_micro_batches_and_the_last_one(holmes, gpt7):
    a = cost.analyze(holmes, place(holmes, ParallelDims(tp=2, pp=4, dp=8)), cluster_transport)
    sts = cost.SplitCosts(gpt7, a, 1).stages
    assert [st.in_flight for st in sts] == [4, 3, 2, 1]
    assert sts[0].fixed_params > 0 and sts[-1].fixed_params > 0 and sts[1].fixed_params == 0
    assert sts[-1].fixed_fwd_s > sts[0].fixed_fwd_s          # output layer + loss > embedding lookup


def test_faster_devices_predict_faster_layers(gpt7):
    def layer_time(acc):
        cl = cluster_from_dict({"clusters": [{"name": "c", "fabric": {"type": "ib", "gbps": 200},
                                              "nodes": [{"count": 1, "accelerator": acc, "accelerators_per_node": 8}]}]})
        a = cost.analyze(cl, default_placement(cl, ParallelDims(tp=8)), cluster_transport)
        return cost.SplitCosts(gpt7, a, 1).stages[0].layer_fwd_s
    assert layer_time("H100") < layer_time("A100-80")


# ---- the planner's interface ---------------------------------------------------------------------


def test_split_costs_predicts_what_predict_does(holmes, gpt7):
    placement = place(holmes, ParallelDims(tp=4, pp=2, dp=8))
    split = cost.SplitCosts(gpt7, cost.analyze(holmes, placement, cluster_transport), 2, distributed_optimizer=True)
    assert split.num_micro_batches == gpt7.global_batch_size // 16
    assert split.predict([20, 16], "x") == cost.predict(holmes, gpt7, placement, [20, 16], 2,
                                                        distributed_optimizer=True, description="x")
    tables = split.tables()
    assert len(tables) == 2 and all(len(row) == gpt7.num_layers + 1 for row in tables)
    assert all(row == sorted(row) for row in tables)           # more layers never cost less
    caps = split.max_layers()
    assert all(0 < c <= gpt7.num_layers for c in caps)
    assert split.overflow_gib([18, 18]) < 0 and split.overflow_gib([18, 18]) == pytest.approx(
        max(m - c for m, c in zip(split.predict([18, 18]).memory_gib_per_stage, [80, 80])))


def test_split_costs_memory_cap_is_where_overflow_starts(gpt7):
    small = cluster_from_dict({"clusters": [{"name": "c", "fabric": {"type": "ib", "gbps": 200},
                                             "nodes": [{"count": 1, "accelerator": "A100-40", "accelerators_per_node": 8}]}]})
    a = cost.analyze(small, default_placement(small, ParallelDims(pp=2, dp=4)), cluster_transport)
    split = cost.SplitCosts(gpt7, a, 1)
    cap = split.max_layers()[0]
    assert 0 <= cap < gpt7.num_layers
    assert split.overflow_gib([cap, 0]) <= 0 < split.overflow_gib([cap + 1, 0])     # stage 1 empty fits


def test_params_memory_gib_is_a_lower_bound_of_the_stages_memory(holmes, gpt7):
    for dist_opt in (False, True):
        dims = ParallelDims(tp=4, pp=2, dp=8)
        pred = cost.predict(holmes, gpt7, place(holmes, dims), [18, 18], 1, distributed_optimizer=dist_opt)
        bound = cost.params_memory_gib(gpt7, dims, dist_opt)
        assert 0 < bound < min(pred.memory_gib_per_stage)
    assert cost.params_memory_gib(gpt7, dims, True) < cost.params_memory_gib(gpt7, dims, False)
