"""The training-run recorder writes the fixed costs its run left over (issue 23): the pipeline-slot cost fitted
on the plan's cluster (the Cluster the plan came from, or the cluster file the settings name) and the iteration
overhead; without a cluster that matches the plan, the profile is still written, without a slot cost. No
processes: fake clocks, an in-memory store."""
from __future__ import annotations

import logging

import pytest

from het_plugin.core.cost.run_fit import run_devices
from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.inputs.profile import load_profile
from het_plugin.runtime.recorder import ProfileRecorder, ProfileSettings
from tests.core.test_measured import IB_ROCE_4, FakeClock, MemoryStore, cluster, plan  # noqa: F401 -- fixtures
from tests.runtime.test_replan_inputs import FakeWall
from tests.core.test_run_fit import OVERHEAD, run_at_slot

PER_STAGE = {0: (0.004, 0.009), 1: (0.006, 0.011)}
SLOT = 0.0025


def record(plan, settings, cluster=None, iterations=4):
    """Every rank times ``iterations`` iterations (plus one warm-up) of the run ``run_at_slot`` describes:
    each micro-batch's compute on the fake clock, the schedule call and the iteration on the fake wall."""
    sums, iteration = run_at_slot(plan, load_cluster(IB_ROCE_4), PER_STAGE, SLOT)
    schedule = sums[0].schedule_s / sums[0].iterations
    store = MemoryStore()
    recs = []
    for r in range(plan.world_size):
        rec = ProfileRecorder(plan, r, settings, "test", clock=FakeClock(), store=store, exit_handler=False,
                              cluster=cluster)
        rec.timer.wall = FakeWall()
        recs.append(rec)
    for _ in range(iterations + 1):
        for rec in reversed(recs):
            f, b = PER_STAGE[plan.stage_of(rec.rank)]
            rec.timer.begin_iteration()
            for _ in range(plan.num_micro_batches):
                for kind, seconds in (("forward", f), ("backward", b)):
                    with rec.timer.timing(kind):
                        rec.timer.clock.now += seconds
            rec.timer.wall.now += schedule
            rec.timer.end_iteration()
            rec.timer.wall.now += iteration - schedule
    for rec in reversed(recs):
        rec.close()
    return iteration


@pytest.mark.parametrize("given", ["cluster object", "cluster file"])
def test_the_recorder_writes_the_slot_cost_its_run_left_over(plan, cluster, tmp_path, given):
    path = tmp_path / "run.yaml"
    settings = ProfileSettings(str(path), every=100, warmup=1, exit_wait_s=0.2,
                               cluster=str(IB_ROCE_4) if given == "cluster file" else None, warn_above=None)
    iteration = record(plan, settings, cluster if given == "cluster object" else None)
    prof = load_profile(path)
    for dev in run_devices(plan):
        assert prof.pipeline_slot_s(dev) == pytest.approx(SLOT, rel=2e-3)
        assert prof.iteration_overhead_s(dev) == pytest.approx(OVERHEAD, rel=1e-6)
    assert prof.measured.iteration_s == pytest.approx(iteration)
    assert "fixed costs the run left over (fitted to re-predict it): pipeline slot 2.5 ms per forward or backward, " \
           "iteration overhead 3 ms" in replan_report(plan, path, tmp_path)


def replan_report(plan, profile, tmp_path) -> str:
    """``het-plugin plan --profile`` on the run's profile, at the run's degrees: its printed report."""
    import contextlib
    import io

    import yaml

    from het_plugin.cli import main
    model = tmp_path / "model.yaml"
    model.write_text(yaml.safe_dump(plan.model))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", str(IB_ROCE_4), "--model", str(model), "--tp", "1", "--pp", "2", "--micro-batch-size",
                     str(plan.micro_batch_size), "--profile", str(profile)]) == 0
    return out.getvalue()


def test_a_cluster_that_is_not_the_plans_leaves_the_slot_cost_out_and_says_so(plan, tmp_path, caplog):
    other = IB_ROCE_4.with_name("megatron-ib-roce-4-other.yaml")
    assert load_cluster(other).digest != plan.cluster_digest
    path = tmp_path / "run.yaml"
    with caplog.at_level(logging.WARNING, logger="het_plugin"):
        record(plan, ProfileSettings(str(path), every=100, warmup=1, exit_wait_s=0.2, cluster=str(other),
                                     warn_above=None))
    prof = load_profile(path)
    assert all(prof.pipeline_slot_s(d) is None for d in run_devices(plan))
    assert prof.measured is not None and prof.iteration_overhead_s(run_devices(plan)[0]) is not None
    warnings = [r.getMessage() for r in caplog.records if "pipeline-slot" in r.getMessage()]
    assert len(warnings) == 1 and "digest" in warnings[0]
    assert "pipeline slot not fitted (the run's recorder did not know the plan's cluster)" in \
        replan_report(plan, path, tmp_path)
