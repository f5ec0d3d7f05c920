"""The fixed costs a training run leaves over (core.cost.run_fit): the per-pipeline-slot cost fitted to the run's
schedule call, the per-iteration overhead, and a run's profile that re-predicts the run (no processes: the
runs' sums are made from the predictor's own schedule at a known slot cost)."""
from __future__ import annotations

from pathlib import Path

import pytest

from het_plugin.core.cost.measured import RankTimes, measured_profile
from het_plugin.core.cost.plan_costs import plan_analysis, split_costs
from het_plugin.core.cost.run_fit import fit_slot_s, run_devices, with_slot
from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.planner import make_plan
from tests.core.test_measured import tiny_model as measured_tiny_model

DATA = Path(__file__).resolve().parents[2] / "integration_tests" / "data"
ITERATIONS, OVERHEAD = 4, 0.003


def tiny_model():
    """test_measured's tiny GPT with 8 layers and 16 micro-batches of 1 (the interleaved schedule's m % pp)."""
    return measured_tiny_model(num_layers=8, global_batch_size=16, micro_batch_size=1)


@pytest.fixture(scope="module")
def cluster():
    return load_cluster(DATA / "megatron-ib-roce-8.yaml")     # H100 on IB and A100-80 on RoCE, one rank per node


def stage_sums(plan, per_stage, schedule_s=0.0, iteration_s=0.0) -> list[RankTimes]:
    """Every rank's sums over ITERATIONS iterations: the stage's (forward, backward) per micro-batch."""
    m = plan.num_micro_batches
    return [RankTimes(rank=r, iterations=ITERATIONS, micro_batches=ITERATIONS * m,
                      forward_s=ITERATIONS * m * per_stage[plan.stage_of(r)][0],
                      backward_s=ITERATIONS * m * per_stage[plan.stage_of(r)][1],
                      iteration_s=ITERATIONS * iteration_s, intervals=ITERATIONS, schedule_s=ITERATIONS * schedule_s)
            for r in range(plan.world_size)]


def run_at_slot(plan, cluster, per_stage, slot_s, holds_step=False):
    """The sums a run with this slot cost would time: its schedule call as the predictor simulates it (the run's
    compute, the plan's sends and reductions, every forward and backward lengthened by ``slot_s``)."""
    compute_only = measured_profile(plan, stage_sums(plan, per_stage))
    pred = split_costs(plan, cluster, with_slot(compute_only, run_devices(plan), slot_s)).predict(plan.layers_per_stage)
    schedule = pred.pipeline_s + pred.dp_exposed_s + (pred.optimizer_s if holds_step else 0.0)
    iteration = schedule + (0.0 if holds_step else pred.optimizer_s) + OVERHEAD
    return stage_sums(plan, per_stage, schedule, iteration), iteration


@pytest.mark.parametrize("vpp", [1, 2])
@pytest.mark.parametrize("holds_step", [False, True], ids=["megatron", "deepspeed"])
def test_the_slot_cost_a_run_left_over_is_recovered_and_the_run_is_re_predicted(cluster, vpp, holds_step):
    plan = make_plan(cluster, tiny_model(), tp=1, pp=2, vpp=vpp)
    assert plan.vpp == vpp and plan.dp > 1
    per_stage = {0: (0.004, 0.009), 1: (0.006, 0.011)}
    for true_slot in (0.0007, 0.004):
        ranks, iteration = run_at_slot(plan, cluster, per_stage, true_slot, holds_step)
        prof = measured_profile(plan, ranks, "test", cluster=cluster, schedule_holds_step=holds_step)
        assert prof.measured.schedule_holds_step is holds_step
        for dev in run_devices(plan):
            assert prof.pipeline_slot_s(dev) == pytest.approx(true_slot, rel=2e-3)
            assert prof.iteration_overhead_s(dev) == pytest.approx(OVERHEAD, rel=1e-6, abs=1e-9)
        again = split_costs(plan, cluster, prof).predict(plan.layers_per_stage)
        assert again.iteration_s == pytest.approx(iteration, rel=1e-3)
        assert again.stage_compute_s == pytest.approx([f + b for f, b in per_stage.values()], rel=1e-9)


def test_a_schedule_call_the_model_already_over_predicts_leaves_no_slot_cost(cluster):
    plan = make_plan(cluster, tiny_model(), tp=1, pp=2)
    per_stage = {0: (0.004, 0.009), 1: (0.006, 0.011)}
    ranks, _ = run_at_slot(plan, cluster, per_stage, 0.0)
    short = [RankTimes(**{**r.to_dict(), "schedule_s": 0.8 * r.schedule_s}) for r in ranks]
    prof = measured_profile(plan, short, "test", cluster=cluster)
    fit = fit_slot_s(plan, cluster, measured_profile(plan, short), prof.measured)
    assert fit.slot_s == 0.0 and fit.predicted_without_s > fit.measured_s
    assert all(prof.pipeline_slot_s(d) == 0.0 for d in run_devices(plan))


def test_without_the_plans_cluster_no_slot_cost_is_written(cluster):
    """A run from a plan file with no cluster named: the slot cost keeps its rule (0 for a run's profile)."""
    plan = make_plan(cluster, tiny_model(), tp=1, pp=2)
    ranks, _ = run_at_slot(plan, cluster, {0: (0.004, 0.009), 1: (0.006, 0.011)}, 0.002)
    prof = measured_profile(plan, ranks, "test")
    assert all(prof.pipeline_slot_s(d) is None for d in run_devices(plan))
    assert prof.iteration_overhead_s(run_devices(plan)[0]) is not None


def test_the_fit_predicts_the_plan_a_bounded_number_of_times(cluster):
    """Rank 0 fits at every profile write: the plan is analyzed once and predicted a few dozen times at most."""
    from het_plugin.core.cost import run_fit
    plan = make_plan(cluster, tiny_model(), tp=1, pp=2)
    ranks, _ = run_at_slot(plan, cluster, {0: (0.004, 0.009), 1: (0.006, 0.011)}, 0.0031)
    run = measured_profile(plan, ranks).measured
    fit = fit_slot_s(plan, cluster, measured_profile(plan, ranks), run, plan_analysis(plan, cluster))
    assert fit.slot_s == pytest.approx(0.0031, rel=2e-3)
    # the simulated call is piecewise linear in the slot cost: a bracket and one or two false-position steps
    assert fit.evaluations <= 8 < run_fit.FIT_EVALUATIONS
