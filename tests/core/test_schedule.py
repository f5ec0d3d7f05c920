"""The interleaved (virtual pipeline) schedule: its simulation, its use in the predictor and the planner."""
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from het_plugin.core import cost
from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.errors import ConfigError
from het_plugin.core.inputs.model import preset_model
from het_plugin.core.ranks.placement import default_placement, domain_orders, place
from het_plugin.core.planner import make_plan
from het_plugin.core.plan import Plan
from het_plugin.core.cost.interleaved import interleaved_order, simulate_interleaved, warmup_count
from het_plugin.core.ranks.dims import ParallelDims

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
DATA = ROOT / "integration_tests" / "data"


def run(pp, vpp, m, f=1.0, b=2.0, s=0.0, overlap=True):
    """Pipeline time of uniform stages (f, b per stage and micro-batch, split evenly over the chunks)."""
    return max(simulate_interleaved([[f / vpp] * vpp] * pp, [[b / vpp] * vpp] * pp, [s] * pp, s, m,
                                    overlap_p2p_comm=overlap).finish)


# ---- the schedule ---------------------------------------------------------------------------------


def test_each_rank_runs_every_chunk_of_every_micro_batch_once_forward_then_backward():
    for pp, vpp, m in [(2, 2, 2), (2, 3, 6), (4, 2, 8), (3, 4, 9)]:
        for r in range(pp):
            ops = interleaved_order(pp, r, m, vpp)
            assert sorted((k, i, c) for k, i, c, _ in ops) == sorted(
                (k, i, c) for k in "FB" for i in range(m) for c in range(vpp))
            seen = set()
            for k, i, c, _ in ops:
                if k == "B":
                    assert ("F", i, c) in seen
                seen.add((k, i, c))
            assert [p for *_, p in ops].count("warmup") == warmup_count(pp, r, m, vpp)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 5), st.integers(2, 4), st.integers(1, 4), st.floats(0.1, 3), st.floats(0.1, 3),
       st.booleans())
def test_the_bubble_shrinks_with_virtual_stages_as_theory_says(pp, vpp, groups, f, b, overlap):
    """Equal chunks, no transfer time: m (f + b) + (pp - 1)(f + b) / vpp exactly (Narayanan et al. 2021: the
    bubble is (pp - 1) / (vpp m) of the ideal time), for either p2p mode; 1F1B's is (pp - 1)(f + b)."""
    m = groups * pp
    t = run(pp, vpp, m, f, b, overlap=overlap)
    assert t == pytest.approx(m * (f + b) + (pp - 1) * (f + b) / vpp)
    assert (t - m * (f + b)) / (m * (f + b)) == pytest.approx((pp - 1) / (vpp * m))
    assert t < max(cost.simulate_1f1b([f] * pp, [b] * pp, [0.0] * pp, m))


def test_overlap_hides_a_slow_hop_up_to_the_compute_available():
    """The steady state's cost per extra micro-batch: with overlap_p2p_comm it stays the compute (f + b) while a
    transfer fits behind the chunk computed meanwhile, then grows with the link's occupancy but stays below
    the blocking schedule's; without overlap every transfer adds to it."""
    f, b = 1.0, 2.0

    def per_micro_batch(pp, vpp, s, overlap):
        return (run(pp, vpp, 16 * pp, f, b, s, overlap) - run(pp, vpp, 8 * pp, f, b, s, overlap)) / (8 * pp)

    for pp, vpp in [(2, 2), (2, 3), (4, 2), (4, 3)]:
        chunk_f = f / vpp
        for s in (0.1 * chunk_f, 0.5 * chunk_f, chunk_f):        # hidden: the steady state pays compute only
            assert per_micro_batch(pp, vpp, s, True) == pytest.approx(f + b)
            assert per_micro_batch(pp, vpp, s, False) > f + b + 0.9 * s
        for s in (2 * chunk_f, 4 * chunk_f):                     # the link is the bottleneck: it shows
            over, blocking = per_micro_batch(pp, vpp, s, True), per_micro_batch(pp, vpp, s, False)
            # messages per micro-batch on the busiest link: pp == 2 carries both directions' chunks on one pair
            link = (2 * vpp - 1) * s if pp == 2 else vpp * s
            assert max(f + b, link) - 1e-9 <= over < blocking
        # the warm-up and cool-down still send blocking: a transfer there costs its time once, not per micro-batch
        assert run(pp, vpp, 8 * pp, f, b, chunk_f, True) > run(pp, vpp, 8 * pp, f, b, 0.0, True)


def test_uneven_chunks_and_a_slow_wrap_hop():
    """The hop from the last rank back to the first is its own link: slowing it slows the pipeline."""
    fwd = [[0.4, 0.6], [0.5, 0.3], [0.7, 0.2]]
    bwd = [[2 * x for x in row] for row in fwd]
    fast = max(simulate_interleaved(fwd, bwd, [0.05, 0.05], 0.05, 6).finish)
    slow_wrap = max(simulate_interleaved(fwd, bwd, [0.05, 0.05], 1.0, 6).finish)
    assert slow_wrap > fast + 0.5
    with pytest.raises(ValueError, match="multiple|>= pp|0 or"):
        simulate_interleaved(fwd, bwd, [0.05, 0.05], 0.05, 4)        # 4 micro-batches, pp 3: Megatron refuses


# ---- the predictor --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def holmes():
    return load_cluster(EXAMPLES / "clusters" / "holmes-ib-roce.yaml")


def test_vpp_1_is_todays_1f1b_prediction_exactly(holmes):
    model = preset_model("gpt-7.5b")
    dims = ParallelDims(tp=4, pp=4, dp=4)
    analysis = cost.analyze(holmes, place(holmes, dims, next(iter(domain_orders(holmes)))))
    for mb in (1, 2):
        today = cost.SplitCosts(model, analysis, mb)
        pred = today.predict([9, 9, 9, 9])
        assert cost.SplitCosts(model, analysis, mb, vpp=1).predict([9, 9, 9, 9]) == pred
        assert cost.SplitCosts(model, analysis, mb, vpp=1).tables() == today.tables()
        sts = today.stages
        assert pred.pipeline_s == max(cost.simulate_1f1b([st.fixed_fwd_s + 9 * st.layer_fwd_s for st in sts],
                                                         [st.fixed_bwd_s + 9 * st.layer_bwd_s for st in sts],
                                                         [st.send_s for st in sts], today.num_micro_batches))
    assert make_plan(holmes, model, vpp=1).hash == make_plan(holmes, model).hash


def test_interleaving_on_a_homogeneous_pipeline_shrinks_the_predicted_bubble():
    cluster = load_cluster(EXAMPLES / "clusters" / "homogeneous-ib.yaml")
    model = preset_model("gpt-39b")
    dims = ParallelDims(tp=8, pp=4, dp=cluster.world_size // 32)
    analysis = cost.analyze(cluster, default_placement(cluster, dims))
    bubbles = []
    for vpp in (1, 2, 4):
        split = cost.SplitCosts(model, analysis, 1, vpp=vpp)
        pred = split.predict([12] * 4)
        m = split.num_micro_batches
        bubbles.append(pred.bubble_fraction)
        # within the transfers' share of the theory's (pp - 1) / (vpp m + pp - 1)
        assert pred.bubble_fraction == pytest.approx(3 / (vpp * m + 3), abs=0.003)
    assert bubbles[0] > bubbles[1] > bubbles[2]


def test_interleaving_keeps_more_activations_in_flight_on_the_first_stage():
    """Megatron's interleaved warm-up holds pp (1 + (pp - 1) / (pp vpp)) stages' worth of activations on the
    first rank, against pp for 1F1B."""
    cluster = load_cluster(EXAMPLES / "clusters" / "homogeneous-ib.yaml")
    model = preset_model("gpt-39b")
    dims = ParallelDims(tp=8, pp=4, dp=cluster.world_size // 32)
    analysis = cost.analyze(cluster, default_placement(cluster, dims))
    assert cost.SplitCosts(model, analysis, 1).stages[0].in_flight == 4
    assert cost.SplitCosts(model, analysis, 1, vpp=2).stages[0].in_flight == pytest.approx(4 * (1 + 3 / 8))


# ---- the planner ----------------------------------------------------------------------------------


def test_the_planner_splits_each_stage_over_its_virtual_stages(holmes):
    model = preset_model("gpt-7.5b")
    plan = make_plan(holmes, model, vpp=2, pp=4)
    assert plan.vpp == 2 and plan.overlap_p2p_comm
    assert [sum(row) for row in plan.layers_per_virtual_stage] == plan.layers_per_stage
    assert all(len(row) == 2 and min(row) >= 1 for row in plan.layers_per_virtual_stage)
    assert plan.num_micro_batches % plan.pp == 0
    again = Plan.from_dict(plan.to_dict())
    assert again.hash == plan.hash and again.virtual_layers == plan.layers_per_virtual_stage
    assert '"vpp":2' in plan.canonical_json() and '"vpp"' not in make_plan(holmes, model, pp=4).canonical_json()
    # the interleaved prediction is the interleaved schedule's: a smaller bubble than 1F1B's here
    assert plan.prediction.bubble_fraction < make_plan(holmes, model, pp=4).prediction.bubble_fraction


def test_a_homogeneous_interleaved_plan_is_megatrons_own_even_split():
    cluster = load_cluster(DATA / "megatron-homogeneous-4.yaml")
    model = preset_model("gpt-7.5b").model_copy(update={"num_layers": 8, "global_batch_size": 16})
    plan = make_plan(cluster, model, tp=1, pp=2, vpp=2)
    assert plan.is_identity and plan.layers_per_virtual_stage == [[2, 2], [2, 2]]


def test_interleaving_that_cannot_run_is_refused_by_field(holmes):
    model = preset_model("gpt-7.5b")
    with pytest.raises(ConfigError) as e:
        make_plan(holmes, model, vpp=2, pp=1)
    assert e.value.field == "vpp" and "pp >= 2" in str(e.value)
    with pytest.raises(ConfigError) as e:
        make_plan(holmes, model, vpp=2, pp=2, overlap_p2p_comm=False)
    assert e.value.field == "vpp" and "pp >= 3" in str(e.value)
    with pytest.raises(ConfigError) as e:
        make_plan(holmes, model, vpp=40)
    assert e.value.field == "vpp" and "smaller vpp" in e.value.fix
    with pytest.raises(ConfigError) as e:
        make_plan(holmes, model.model_copy(update={"global_batch_size": 24}), vpp=2, tp=4, pp=4,
                  micro_batch_size=1)
    assert e.value.field == "global_batch_size"
    with pytest.raises(ConfigError, match="vpp"):
        make_plan(holmes, model, vpp=0)


def test_overlapping_the_warm_up_and_cool_down_too_never_costs_and_needs_overlap():
    """Megatron's overlap_p2p_comm_warmup_flush posts the warm-up and cool-down sends asynchronously as well."""
    for pp, vpp, s in [(2, 2, 0.3), (4, 2, 0.5), (3, 3, 0.2), (4, 3, 1.0)]:
        f = [[1.0 / vpp] * vpp] * pp
        b = [[2.0 / vpp] * vpp] * pp
        plain = max(simulate_interleaved(f, b, [s] * pp, s, 2 * pp).finish)
        flushed = max(simulate_interleaved(f, b, [s] * pp, s, 2 * pp, warmup_flush=True).finish)
        assert flushed <= plain + 1e-9
    # it helps where a warm-up send is slower than the next chunk (the fill's own hops stay on the critical path)
    f, b = [[1 / 3] * 3] * 4, [[2 / 3] * 3] * 4
    assert max(simulate_interleaved(f, b, [1.0] * 4, 1.0, 8, warmup_flush=True).finish) \
        < max(simulate_interleaved(f, b, [1.0] * 4, 1.0, 8).finish)
    with pytest.raises(ValueError, match="overlap_p2p_comm"):
        simulate_interleaved([[0.5] * 2] * 2, [[1.0] * 2] * 2, [0.1] * 2, 0.1, 4, overlap_p2p_comm=False,
                             warmup_flush=True)
