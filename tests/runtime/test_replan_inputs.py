"""Issue 21, item 5: the imbalance warning's re-plan command is complete (cluster, model, degrees, micro-batch
size as the run had them), a hand-edited plan's prediction is reported stale, and checkpoint saves and evaluation
are left out of the measured iteration time. No processes: fake clocks, an in-memory store, stand-in hooks."""
from __future__ import annotations

import logging
import shlex
import sys
import types

import pytest

from het_plugin.cli import main as cli_main
from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.inputs.model import load_model
from het_plugin.core.plan import Plan
from het_plugin.core.planner import make_plan
from het_plugin.core.inputs.profile import load_profile
from het_plugin.core.replan_command import ReplanInputs, cluster_file, replan_command
from het_plugin.views.report import STALE_NOTE, render_text, startup_summary
from het_plugin.runtime.recorder import ProfileRecorder, ProfileSettings, StageTimer
from test_measured import IB_ROCE_4, FakeClock, MemoryStore, run_iteration, tiny_model


@pytest.fixture(scope="module")
def plan():
    return make_plan(load_cluster(IB_ROCE_4), tiny_model(), tp=1, pp=2)


class FakeWall:
    """The timer's host clock, advanced by hand."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


# ---- the re-plan command --------------------------------------------------------------------------------

def test_command_names_cluster_model_degrees_and_micro_batch(plan):
    cmd = replan_command(plan, "run.yaml", ReplanInputs("c.yaml", "m.yaml"), "run.plan.json")
    words = shlex.split(cmd)
    assert words[:3] == ["het-plugin", "plan", "c.yaml"]
    opts = dict(zip(words[3::2], words[4::2]))
    assert opts == {"--model": "m.yaml", "--tp": str(plan.tp), "--pp": str(plan.pp), "--dp": str(plan.dp),
                    "--micro-batch-size": str(plan.micro_batch_size), "--profile": "run.yaml",
                    "-o": "run.plan.json"}
    unknown = replan_command(plan, "run.yaml", ReplanInputs(), None)
    assert unknown.startswith("het-plugin plan CLUSTER --tp") and "--model" not in unknown


def test_cluster_file_is_named_only_when_it_is_a_cluster_file(plan, tmp_path):
    saved = tmp_path / "plan.json"
    plan.save(saved)
    assert cluster_file(IB_ROCE_4) == str(IB_ROCE_4)
    assert cluster_file(saved) is None and cluster_file("auto") is None and cluster_file(None) is None


def slow_run(plan, path, settings=None, cluster=None):
    """Two ranks, stage 1 five times slower than predicted: rank 0 writes the profile and warns."""
    store = MemoryStore()
    settings = settings or ProfileSettings(str(path), every=100, warmup=1, exit_wait_s=0.2, cluster=str(IB_ROCE_4))
    clocks = [FakeClock() for _ in range(plan.world_size)]
    recs = [ProfileRecorder(plan, r, settings, "test", clock=clocks[r], store=store, exit_handler=False,
                            cluster=cluster) for r in range(plan.world_size)]
    for _ in range(3):
        for r in reversed(range(plan.world_size)):
            f = 0.05 if plan.stage_of(r) == 1 else 0.01
            run_iteration(recs[r].timer, clocks[r], [("forward", f), ("backward", 2 * f)])
    return recs


def test_the_warning_prints_a_command_that_replans_the_run_as_it_was(plan, tmp_path, caplog, capsys):
    """The printed command, run as printed, plans the run's model at its degrees from the measured profile (the
    default 7.5B model before)."""
    path = tmp_path / "run.yaml"
    recs = slow_run(plan, path)
    with caplog.at_level(logging.WARNING, logger="het_plugin"):
        for r in reversed(recs):
            r.close()
    warning = next(r.getMessage() for r in caplog.records if "imbalance" in r.getMessage())
    cmd = warning.split("re-plan with the measured times: ", 1)[1]
    words = shlex.split(cmd)
    model_file = tmp_path / "run.model.yaml"
    assert words[2] == str(IB_ROCE_4) and words[words.index("--model") + 1] == str(model_file)
    assert load_model(model_file).model_dump() == plan.model          # the plan's model, written beside
    capsys.readouterr()
    assert cli_main(words[1:]) == 0
    new = Plan.load(tmp_path / "run.plan.json")
    assert new.model == plan.model and (new.tp, new.pp, new.dp, new.micro_batch_size) == \
        (plan.tp, plan.pp, plan.dp, plan.micro_batch_size)
    assert f"measured run of plan {plan.hash}" in capsys.readouterr().out      # planned with the run's times


def test_a_discovered_cluster_is_written_beside_the_profile(plan, tmp_path):
    cluster = load_cluster(IB_ROCE_4)
    path = tmp_path / "run.json"
    recs = slow_run(plan, path, ProfileSettings(str(path), every=100, warmup=1, exit_wait_s=0.2), cluster=cluster)
    cmd = recs[0].replan_command()
    written = tmp_path / "run.cluster.yaml"
    assert shlex.split(cmd)[2] == str(written)
    assert load_cluster(written).digest == cluster.digest


def test_an_explicit_command_is_kept(plan, tmp_path):
    settings = ProfileSettings(str(tmp_path / "run.yaml"), replan="my-replan")
    rec = ProfileRecorder(plan, 0, settings, "test", clock=FakeClock(), exit_handler=False)
    assert rec.replan_command() == "my-replan" and not (tmp_path / "run.model.yaml").exists()


# ---- a hand-edited plan's prediction ------------------------------------------------------------------------

def test_an_edited_plan_shows_its_prediction_as_stale(plan, tmp_path):
    assert not plan.prediction_stale and plan.current_prediction is plan.prediction
    data = plan.to_dict()
    del data["hash"]                                 # what the hash mismatch message tells an editor to do
    moved = list(data["layers_per_stage"])
    moved[0], moved[1] = moved[0] + 1, moved[1] - 1
    data["layers_per_stage"] = moved
    edited = Plan.from_dict(data)
    assert edited.prediction_stale and edited.current_prediction is None
    assert STALE_NOTE in render_text(edited) and STALE_NOTE in startup_summary(edited, "test")
    assert f"{plan.prediction.iteration_s:.4g} s/iteration" not in startup_summary(edited, "test")
    assert edited.speedup is None
    # only the notes edited (warnings): still this plan's prediction
    notes = plan.to_dict()
    del notes["hash"]
    notes["warnings"] = ["edited note"]
    assert not Plan.from_dict(notes).prediction_stale


def test_a_stale_prediction_is_not_compared_with_the_measured_run(plan):
    from het_plugin.core.cost.measured import RankTimes, measured_run
    data = plan.to_dict()
    del data["hash"]
    data["distributed_optimizer"] = not data["distributed_optimizer"]
    edited = Plan.from_dict(data)
    ranks = [RankTimes(r, iterations=2, micro_batches=8, forward_s=0.1, backward_s=0.2, iteration_s=1.0, intervals=2)
             for r in range(plan.world_size)]
    run = measured_run(edited, ranks)
    assert run.predicted_iteration_s is None and all(st.predicted_s is None for st in run.stages)
    assert measured_run(plan, ranks).predicted_iteration_s == plan.prediction.iteration_s


def test_plans_written_before_the_stamp_keep_their_hash(plan):
    """A plan without ``predicted_for`` (written by an older het_plugin) loads with its hash and is not stale; the
    stamp is left out of the hash (a digest of what the hash covers)."""
    data = plan.to_dict()
    del data["predicted_for"]
    old = Plan.from_dict(data)                      # the stored hash still matches
    assert old.predicted_for == "" and not old.prediction_stale and old.hash == plan.hash


# ---- checkpoint saves and evaluation left out -------------------------------------------------------------

def test_excluded_spans_leave_the_iteration_interval():
    wall, clock = FakeWall(), FakeClock()
    timer = StageTimer(0, clock, warmup=0, wall=wall)

    def iteration(step_s):
        timer.begin_iteration()
        with timer.timing("forward"):
            wall.now += step_s
        timer.end_iteration()

    iteration(1.0)
    iteration(1.0)
    with timer.excluded():                           # a checkpoint save between iterations
        wall.now += 30.0
        with timer.excluded():                       # nested (Megatron-LM's save calls dist_checkpointing.save)
            wall.now += 5.0
    iteration(1.0)
    t = timer.totals()
    assert t.intervals == 2 and t.iteration_s == pytest.approx(2.0) and t.excluded_s == pytest.approx(35.0)


def test_megatron_lm_saves_and_evaluation_are_left_out(tmp_path, monkeypatch, plan):
    """The hooks wrap megatron.training.training's save_checkpoint_and_time / evaluate_and_print_results and
    megatron.core.dist_checkpointing.save (stand-in modules here), and come off again."""
    pytest.importorskip("megatron.core")
    from het_plugin.megatron import recorder_hooks as timing
    wall = FakeWall()
    training = types.ModuleType("megatron.training.training")
    training.save_checkpoint_and_time = lambda *a, **k: setattr(wall, "now", wall.now + 20.0)
    training.evaluate_and_print_results = lambda *a, **k: setattr(wall, "now", wall.now + 7.0)
    monkeypatch.setitem(sys.modules, "megatron.training.training", training)
    originals = (training.save_checkpoint_and_time, training.evaluate_and_print_results)
    rec = timing.install(plan, 0, ProfileSettings(str(tmp_path / "m.yaml"), every=1000, warmup=0))
    try:
        rec.timer.wall = wall
        for i in range(4):
            with rec.timer.iteration():
                wall.now += 1.0
            if i == 1:
                training.save_checkpoint_and_time(i)
                training.evaluate_and_print_results("x")
        t = rec.timer.totals()
        assert t.intervals == 3 and t.iteration_s == pytest.approx(3.0) and t.excluded_s == pytest.approx(27.0)
    finally:
        timing.uninstall()
    assert (training.save_checkpoint_and_time, training.evaluate_and_print_results) == originals


def test_deepspeed_saves_and_eval_batch_are_left_out(tmp_path, plan):
    from het_plugin.deepspeed.recorder_hooks import _left_out
    wall = FakeWall()
    rec = ProfileRecorder(plan, 0, ProfileSettings(str(tmp_path / "m.yaml"), warmup=0), "DeepSpeed",
                          clock=FakeClock(), exit_handler=False)
    rec.timer.wall = wall

    class Engine:
        def save_checkpoint(self, save_dir, tag=None):
            wall.now += 40.0
            return True

        def eval_batch(self, data_iter):
            wall.now += 3.0
            return 0.5

    engine = Engine()
    _left_out(engine, rec, ("save_checkpoint", "eval_batch", "not_there"))
    for i in range(3):
        with rec.timer.iteration():
            wall.now += 2.0
        if i == 0:
            assert engine.save_checkpoint("d", tag="t") is True and engine.eval_batch(None) == 0.5
    t = rec.timer.totals()
    assert t.iteration_s == pytest.approx(4.0) and t.excluded_s == pytest.approx(43.0)
