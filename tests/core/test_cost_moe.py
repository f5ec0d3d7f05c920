"""Predictor terms for mixture-of-experts models and context parallelism: the token all-to-all over the
expert-ep group, expert memory and its own gradient reduction, and ring attention's exchanges."""
from pathlib import Path

import pytest

from het_plugin.core import cost
from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.inputs.model import ModelSpec
from het_plugin.core.ranks.placement import Placement, place, cluster_transport
from het_plugin.core.ranks.dims import ParallelDims

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def holmes():
    """4 IB + 4 RoCE nodes of 8 A100, the two clusters joined by 25 GbE."""
    return load_cluster(EXAMPLES / "clusters" / "holmes-ib-roce.yaml")


def moe(**kw) -> ModelSpec:
    base = dict(name="moe", num_layers=8, hidden_size=1024, num_attention_heads=16, vocab_size=1000,
                seq_length=1024, global_batch_size=64, activation="swiglu", num_moe_experts=8, moe_router_topk=2)
    base.update(kw)
    return ModelSpec(**base)


def stages(cluster, model, placement, mb=1):
    analysis = cost.analyze(cluster, placement, cluster_transport)
    return cost.SplitCosts(model, analysis, mb).stages


def spread(dims: ParallelDims, group: int, shuffle) -> Placement:
    """A placement that deals each block of ``group`` consecutive logical ranks by ``shuffle(block, i)``."""
    world = dims.world_size
    perm = [shuffle(r // group, r % group) for r in range(world)]
    assert sorted(perm) == list(range(world))
    return Placement(dims, tuple(perm), ())


# ---- the token all-to-all ------------------------------------------------------------------------------


def test_alltoall_is_zero_for_a_dense_model_and_for_ep_1(holmes):
    dims = ParallelDims(tp=1, pp=1, dp=64, ep=8, etp=1)
    dense = moe(num_moe_experts=None, moe_router_topk=2)
    assert all(st.alltoall_per_layer_s == 0 for st in stages(holmes, dense, place(holmes, dims)))
    assert all(st.alltoall_per_layer_s == 0 for st in stages(holmes, moe(), place(holmes, ParallelDims(dp=64))))
    assert all(st.alltoall_per_layer_s > 0 for st in stages(holmes, moe(), place(holmes, dims)))


def test_alltoall_grows_with_top_k(holmes):
    placement = place(holmes, ParallelDims(tp=1, pp=1, dp=64, ep=8, etp=1))
    times = [stages(holmes, moe(moe_router_topk=k), placement)[0].alltoall_per_layer_s for k in (1, 2, 4)]
    assert times[0] < times[1] < times[2]
    # bytes = tokens * top_k * hidden * dtype: twice the experts per token, about twice the time (latency aside)
    assert times[2] / times[1] == pytest.approx(2, rel=0.05)


def test_alltoall_inside_a_node_beats_one_over_the_fabric_and_one_over_ethernet(holmes):
    dims = ParallelDims(tp=1, pp=1, dp=64, ep=8, etp=1)
    inside = place(holmes, dims)                                          # an ep group = one node's 8 ranks
    # the same ep groups, half on two IB nodes / half on an IB and a RoCE node (25 GbE between them)
    fabric = spread(dims, 8, lambda b, i: (b // 2) * 16 + (b % 2) * 4 + (i % 4) + (8 if i >= 4 else 0)
                    if b < 4 else 32 + ((b - 4) // 2) * 16 + ((b - 4) % 2) * 4 + (i % 4) + (8 if i >= 4 else 0))
    ethernet = spread(dims, 8, lambda b, i: (b * 4 + i) if i < 4 else 32 + b * 4 + (i - 4))
    t = {name: stages(holmes, moe(), p)[0].alltoall_per_layer_s
         for name, p in (("inside", inside), ("fabric", fabric), ("ethernet", ethernet))}
    assert t["inside"] < t["fabric"] < t["ethernet"]
    assert cost.analyze(holmes, ethernet, cluster_transport).transports["expert-ep"] == {"socket"}
    assert cost.analyze(holmes, inside, cluster_transport).transports["expert-ep"] == {"local"}


def test_alltoall_shows_in_the_prediction(holmes):
    dims = ParallelDims(tp=1, pp=2, dp=32, ep=8, etp=1)
    pred = cost.predict(holmes, moe(), place(holmes, dims), [4, 4], 1)
    sts = stages(holmes, moe(), place(holmes, dims))
    m = 64 // 32
    assert pred.alltoall_s == pytest.approx(max(m * 4 * st.alltoall_per_layer_s for st in sts))
    assert 0 < pred.alltoall_s < pred.iteration_s


def test_moe_layer_frequency_scales_the_expert_terms(holmes):
    placement = place(holmes, ParallelDims(tp=1, pp=1, dp=64, ep=8, etp=1))
    every = stages(holmes, moe(), placement)[0]
    half = stages(holmes, moe(moe_layer_freq=2), placement)[0]
    assert half.alltoall_per_layer_s == pytest.approx(every.alltoall_per_layer_s / 2)
    assert half.expert_params_per_layer == pytest.approx(every.expert_params_per_layer / 2)


# ---- expert memory and gradient reduction --------------------------------------------------------------


def test_expert_memory_falls_with_ep(holmes):
    model = moe(moe_ffn_hidden_size=4096)
    memory = []
    for ep in (1, 2, 4, 8):
        dims = ParallelDims(tp=1, pp=1, dp=64, ep=ep, etp=1)
        memory.append(cost.predict(holmes, model, place(holmes, dims), [8], 1).memory_gib_per_stage[0])
    assert memory == sorted(memory, reverse=True) and len(set(memory)) == 4
    # the dense part stays; only the routed experts shrink: 8 -> 1 expert per rank and layer
    per_expert = model.mlp_params(4096) * 8 * (2 + 4 + 12) / 2 ** 30
    assert memory[0] - memory[3] == pytest.approx(7 * per_expert, rel=1e-6)


def test_expert_tp_shards_the_experts_too(holmes):
    model = moe(moe_ffn_hidden_size=4096)
    etp1 = stages(holmes, model, place(holmes, ParallelDims(tp=2, pp=1, dp=32, ep=4, etp=1)))[0]
    etp2 = stages(holmes, model, place(holmes, ParallelDims(tp=2, pp=1, dp=32, ep=4, etp=2)))[0]
    assert etp1.expert_params_per_layer == pytest.approx(2 * etp2.expert_params_per_layer)


def test_expert_gradients_are_reduced_over_expert_dp(holmes):
    model = moe(moe_ffn_hidden_size=4096)
    # ep = the whole stage: expert-dp is 1, the experts' gradients need no reduction
    whole = cost.SplitCosts(model, cost.analyze(holmes, place(holmes, ParallelDims(tp=1, pp=2, dp=32, ep=32, etp=1)),
                                                cluster_transport), 1).stages[0]
    node = cost.SplitCosts(model, cost.analyze(holmes, place(holmes, ParallelDims(tp=1, pp=2, dp=32, ep=8, etp=1)),
                                               cluster_transport), 1).stages[0]
    assert whole.expert_dp == 1 and node.expert_dp == 4
    dense_only = cost.stage._dp_reduce_s(whole, 4, 32, False, None)
    with_experts = cost.stage._dp_reduce_s(node, 4, 32, False, None)
    assert with_experts > dense_only > 0
    # the expert-dp groups (stride 8 over the IB stage's 4 nodes) cross the IB fabric
    assert {lv.tier.kind for p in node.expert_paths for lv in p.levels} == {"ib"}


def test_params_lower_bound_counts_the_experts_split_over_ep(holmes):
    model = moe(moe_ffn_hidden_size=4096)
    one = cost.params_memory_gib(model, ParallelDims(tp=1, pp=1, dp=64, ep=1, etp=1), False)
    eight = cost.params_memory_gib(model, ParallelDims(tp=1, pp=1, dp=64, ep=8, etp=1), False)
    assert one - eight == pytest.approx(model.expert_params * 7 / 8 * 18 / 2 ** 30)


# ---- context parallelism: ring attention ---------------------------------------------------------------


def dense(**kw) -> ModelSpec:
    base = dict(name="cp", num_layers=4, hidden_size=4096, num_attention_heads=32, vocab_size=1000,
                seq_length=1024, global_batch_size=64)
    base.update(kw)
    return ModelSpec(**base)


def test_cp_ring_is_zero_without_cp(holmes):
    st = stages(holmes, dense(), place(holmes, ParallelDims(tp=1, pp=1, dp=64)))[0]
    assert st.cp_ring_per_layer_s == 0


def test_cp_ring_across_nodes_costs_more_than_inside_one(holmes):
    dims = ParallelDims(tp=1, cp=8, pp=1, dp=8)
    inside = place(holmes, dims)                                     # a CP ring = one node's 8 ranks
    across = spread(dims, 8, lambda b, i: (b // 2) * 16 + (b % 2) * 4 + (i % 4) + (8 if i >= 4 else 0)
                    if b < 4 else 32 + ((b - 4) // 2) * 16 + ((b - 4) % 2) * 4 + (i % 4) + (8 if i >= 4 else 0))
    a = stages(holmes, dense(), inside)[0].cp_ring_per_layer_s
    b = stages(holmes, dense(), across)[0].cp_ring_per_layer_s
    assert 0 < a < b
    # the exposed exchanges are part of the layer's time
    st = stages(holmes, dense(), across)[0]
    assert st.layer_fwd_s + st.layer_bwd_s > b


def test_cp_ring_hides_behind_long_attention(holmes):
    """Each exchange overlaps the attention of the chunk in hand: with a long sequence the NVLink ring
    inside a node is hidden, across the fabric it is not."""
    dims = ParallelDims(tp=1, cp=8, pp=1, dp=8)
    long = dense(seq_length=32768, global_batch_size=8)
    assert stages(holmes, long, place(holmes, dims))[0].cp_ring_per_layer_s == 0
    ethernet = spread(dims, 8, lambda b, i: (b * 4 + i) if i < 4 else 32 + b * 4 + (i - 4))
    assert stages(holmes, long, ethernet)[0].cp_ring_per_layer_s > 0


def test_dense_gradients_are_reduced_over_dp_times_cp(holmes):
    model = dense()
    st = stages(holmes, model, place(holmes, ParallelDims(tp=1, cp=8, pp=1, dp=8)))[0]
    assert st.cp == 8
    # the dp-cp group holds all 64 ranks of the stage: 8 per node inside it, then 4 nodes, then 2 clusters
    assert [lv.members for p in st.paths for lv in p.levels] == [8, 4, 2]
    assert cost.stage._dp_reduce_s(st, 4, 8, False, None) > 0
