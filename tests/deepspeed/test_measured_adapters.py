"""The adapters' measured-profile settings and hooks, without processes: Megatron-LM's flags, the DeepSpeed
section, and the hooks driven by stand-in schedules and engines."""
from __future__ import annotations

import argparse

import pytest

from het_plugin.deepspeed import SECTION, HetSection, wrap
from het_plugin.core.errors import ConfigError
from het_plugin.megatron import args as hargs
from het_plugin.runtime.recorder import ProfileSettings
from tests.deepspeed.test_deepspeed_config import DS, TINY, cluster_file  # noqa: F401  (fixture)
from tests.core.test_measured import FakeClock


# ---- Megatron-LM flags ---------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    return hargs.add_arguments(argparse.ArgumentParser(allow_abbrev=False))


def test_megatron_lm_flags_parse_and_are_checked_before_planning():
    a = parser().parse_args(["--heterogeneous-nic", "c.yaml", "--heterogeneous-profile-out", "m.yaml",
                             "--heterogeneous-profile-interval", "5"])
    assert (a.heterogeneous_profile_out, a.heterogeneous_profile_interval) == ("m.yaml", 5)
    hargs.check_compatible(a)                        # accepted
    from het_plugin.megatron.lm import launch_profile_settings
    settings = launch_profile_settings(a)
    assert settings.every == 5 and settings.path == "m.yaml"
    a.heterogeneous_profile_out = "m.txt"
    with pytest.raises(ConfigError) as exc:
        hargs.check_compatible(a)
    assert exc.value.field == "--heterogeneous-profile-out"
    a.heterogeneous_profile_out, a.heterogeneous_profile_interval = "m.yaml", 0
    with pytest.raises(ConfigError) as exc:
        hargs.check_compatible(a)
    assert exc.value.field == "--heterogeneous-profile-interval"
    a.heterogeneous_profile_out, a.heterogeneous_profile_interval = None, 5
    with pytest.raises(ConfigError) as exc:
        hargs.check_compatible(a)
    assert exc.value.field == "--heterogeneous-profile-interval" and "--heterogeneous-profile-out" in exc.value.fix
    assert parser().parse_args([]).heterogeneous_profile_out is None
    from het_plugin.megatron.mcore import profile_settings
    with pytest.raises(ConfigError) as exc:
        profile_settings(None, 10)
    assert exc.value.field == "profile_every"
    assert profile_settings(None, None) is None


# ---- the DeepSpeed section -----------------------------------------------------------------------------

def test_wrap_records_the_profile_settings(cluster_file):  # noqa: F811
    out = wrap(DS, cluster_file, TINY, pp=2, profile_out="run.yaml", profile_every=5)
    section = HetSection.from_dict(out[SECTION])
    settings = section.profile_settings()
    assert (settings.path, settings.every) == ("run.yaml", 5)
    assert (settings.cluster, settings.model) == (str(cluster_file), None)   # the model: written beside the profile
    plain = wrap(DS, cluster_file, TINY, pp=2)[SECTION]
    assert "profile_out" not in plain and "profile_every" not in plain       # a section as before
    assert HetSection.from_dict(plain).profile_settings() is None


@pytest.mark.parametrize("keys,field", [({"profile_every": 3}, "heterogeneous.profile_every"),
                                        ({"profile_out": "run.csv"}, "heterogeneous.profile_out"),
                                        ({"profile_out": "run.yaml", "profile_every": 0}, "heterogeneous.profile_every"),
                                        ({"profile_out": "run.yaml", "profile_every": "5"},
                                         "heterogeneous.profile_every")])
def test_bad_profile_keys_in_the_section_are_refused(cluster_file, keys, field):  # noqa: F811
    section = dict(wrap(DS, cluster_file, TINY, pp=2)[SECTION], **keys)
    with pytest.raises(ConfigError) as exc:
        HetSection.from_dict(section)
    assert exc.value.field == field


# ---- Megatron's hooks ------------------------------------------------------------------------------------

@pytest.fixture
def fake_schedules(monkeypatch):
    """Stand-ins for Megatron's schedule functions: each micro-batch calls the module's forward_step and
    backward_step (looked up at call time, as Megatron's do)."""
    pytest.importorskip("megatron.core")
    from megatron.core.pipeline_parallel import schedules
    calls = []

    def forward_step(*a, **kw):
        calls.append("F")

    def backward_step(*a, **kw):
        calls.append("B")

    def schedule(*, num_microbatches, forward_only=False, model=None, **kw):
        chunks = len(model) if isinstance(model, list) else 1
        for _ in range(num_microbatches * chunks):
            schedules.forward_step()
            if not forward_only:
                schedules.backward_step()

    monkeypatch.setattr(schedules, "forward_step", forward_step)
    monkeypatch.setattr(schedules, "backward_step", backward_step)
    for name in ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
                 "forward_backward_pipelining_with_interleaving"):
        monkeypatch.setattr(schedules, name, schedule)
    return schedules, calls


def test_megatron_hooks_time_training_iterations_only_and_come_off(fake_schedules, tmp_path):
    from het_plugin.megatron import recorder_hooks as timing
    from het_plugin.core.inputs.cluster import load_cluster
    from het_plugin.core.planner import make_plan
    from tests.core.test_measured import IB_ROCE_4, tiny_model
    schedules, calls = fake_schedules
    plan = make_plan(load_cluster(IB_ROCE_4), tiny_model(), tp=1, pp=2)
    originals = {n: getattr(schedules, n) for n in timing.STEPS + timing.SCHEDULES}
    rec = timing.install(plan, 0, ProfileSettings(str(tmp_path / "m.yaml"), every=1000, warmup=1))
    try:
        rec.timer.clock = FakeClock()
        fb = schedules.forward_backward_pipelining_without_interleaving
        for _ in range(3):
            fb(num_microbatches=2, model=object(), forward_only=False)
        fb(num_microbatches=2, model=object(), forward_only=True)           # evaluation: not an iteration
        schedules.forward_backward_pipelining_with_interleaving(num_microbatches=2, model=[1, 2])
        t = rec.timer.totals()
        assert (t.iterations, t.micro_batches) == (3, 6)        # the warm-up left out; 2 chunks = 1 micro-batch
        assert calls.count("F") == 3 * 2 + 2 + 4
    finally:
        timing.uninstall()
    assert {n: getattr(schedules, n) for n in originals} == originals
    assert timing.recorder() is None


# ---- DeepSpeed's hooks -------------------------------------------------------------------------------------

class FakeEngine:
    """The parts of a (non-pipeline) DeepSpeed engine the hooks use."""

    def __init__(self, accumulation: int):
        self.training, self.accumulation, self.micro = True, accumulation, 0

    def forward(self, x):
        return x

    def backward(self, loss):
        if self.is_gradient_accumulation_boundary():
            self.allreduce_gradients()           # as DeepSpeed's _backward_epilogue at the boundary
        return loss

    def allreduce_gradients(self):
        pass

    def is_gradient_accumulation_boundary(self):
        return (self.micro + 1) % self.accumulation == 0

    def step(self):
        self.micro += 1


def test_deepspeed_engine_hooks_end_an_iteration_at_the_accumulation_boundary(tmp_path):
    from het_plugin.deepspeed.recorder_hooks import _engine_hooks
    from het_plugin.runtime.recorder import ProfileRecorder
    from het_plugin.core.inputs.cluster import load_cluster
    from het_plugin.core.planner import make_plan
    from tests.core.test_measured import IB_ROCE_4, tiny_model
    plan = make_plan(load_cluster(IB_ROCE_4), tiny_model(), tp=1, pp=2)
    rec = ProfileRecorder(plan, 0, ProfileSettings(str(tmp_path / "m.yaml"), warmup=0), "DeepSpeed",
                          clock=FakeClock(), exit_handler=False)
    engine = FakeEngine(accumulation=3)
    _engine_hooks(engine, rec)
    for _ in range(6):
        engine.backward(engine.forward(1.0))
        engine.step()
    engine.training = False
    engine.forward(1.0)                                     # evaluation
    t = rec.timer.totals()
    assert (t.iterations, t.micro_batches) == (2, 6)


def test_deepspeed_backward_time_leaves_out_the_gradient_reduction(tmp_path):
    """DeepSpeed's backward() all-reduces the gradients at the accumulation boundary: that wait is not compute."""
    from het_plugin.deepspeed.recorder_hooks import _engine_hooks
    from het_plugin.runtime.recorder import ProfileRecorder
    from het_plugin.core.inputs.cluster import load_cluster
    from het_plugin.core.planner import make_plan
    from tests.core.test_measured import IB_ROCE_4, FakeClock, tiny_model
    plan = make_plan(load_cluster(IB_ROCE_4), tiny_model(), tp=1, pp=2)
    clock = FakeClock()
    rec = ProfileRecorder(plan, 0, ProfileSettings(str(tmp_path / "m.yaml"), warmup=0), "DeepSpeed",
                          clock=clock, exit_handler=False)
    engine = FakeEngine(accumulation=2)
    compute, reduction = 1.0, 5.0

    def backward(loss, _inner=engine.backward):
        clock.now += compute                       # autograd
        return _inner(loss)

    def allreduce_gradients():
        clock.now += reduction                     # the wait at the boundary

    engine.backward, engine.allreduce_gradients = backward, allreduce_gradients
    _engine_hooks(engine, rec)
    for _ in range(4):
        engine.backward(engine.forward(1.0))
        engine.step()
    engine.allreduce_gradients()                   # outside a backward: not timed, not subtracted
    t = rec.timer.totals()
    assert t.micro_batches == 4
    assert t.backward_s == pytest.approx(4 * compute), "the reductions (2 x 5 s) must not count as backward"


def test_deepspeed_pipeline_hooks_time_the_forward_and_backward_instructions(tmp_path):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.pipe import schedule
    from het_plugin.deepspeed.recorder_hooks import _pipeline_hooks
    from het_plugin.runtime.recorder import ProfileRecorder
    from het_plugin.core.inputs.cluster import load_cluster
    from het_plugin.core.planner import make_plan
    from tests.core.test_measured import IB_ROCE_4, tiny_model
    plan = make_plan(load_cluster(IB_ROCE_4), tiny_model(), tp=1, pp=2)
    rec = ProfileRecorder(plan, 0, ProfileSettings(str(tmp_path / "m.yaml"), warmup=0), "DeepSpeed",
                          clock=FakeClock(), exit_handler=False)
    ran = []

    class Engine:
        _INSTRUCTION_MAP = {schedule.ForwardPass: lambda self, buffer_id: ran.append("F"),
                            schedule.BackwardPass: lambda self, buffer_id: ran.append("B")}

        def train_batch(self, data_iter=None):
            for i in range(4):
                self._INSTRUCTION_MAP[schedule.ForwardPass](self, i)
            for i in range(4):
                self._INSTRUCTION_MAP[schedule.BackwardPass](self, i)

    engine = Engine()
    _pipeline_hooks(engine, rec)
    engine.train_batch()
    engine.train_batch()
    engine._INSTRUCTION_MAP[schedule.ForwardPass](engine, 0)      # eval_batch: outside an iteration
    assert Engine._INSTRUCTION_MAP is not engine._INSTRUCTION_MAP      # DeepSpeed's class map untouched
    t = rec.timer.totals()
    assert (t.iterations, t.micro_batches) == (2, 8) and ran.count("F") == 9


def test_hds_initialize_times_the_engine_it_returns(monkeypatch, tmp_path):
    """profile_out= of hds.initialize (over the section's): the engine DeepSpeed returns gets the hooks and
    ``engine.het_profile``; without a section the argument is refused (there is no plan to measure)."""
    deepspeed = pytest.importorskip("deepspeed")
    import inspect

    import het_plugin.deepspeed as hds
    from het_plugin.core.inputs.cluster import cluster_from_dict
    from het_plugin.core.ranks.placement import place
    from het_plugin.core.planner import assemble_plan
    from het_plugin.runtime.applied import AppliedPlan
    from het_plugin.core.ranks.dims import ParallelDims
    from tests.deepspeed.test_deepspeed_config import hetero_cluster
    engine = FakeEngine(accumulation=2)

    def fake_initialize(*args, **kwargs):
        return (engine, None, None, None)

    fake_initialize.__signature__ = inspect.signature(deepspeed.initialize)
    monkeypatch.setattr(deepspeed, "initialize", fake_initialize)
    with pytest.raises(ConfigError) as exc:
        hds.initialize(model=object(), config=dict(DS), profile_out=str(tmp_path / "m.yaml"))
    assert exc.value.field == "profile_out"

    cluster = cluster_from_dict(hetero_cluster())
    plan = assemble_plan(cluster, TINY, place(cluster, ParallelDims(pp=2, dp=2)), [5, 3], 2)
    model = object.__new__(hds.PipelineModule)
    object.__setattr__(model, "het_plan", plan)
    object.__setattr__(model, "het_applied", AppliedPlan.start(plan, 0, "gloo"))
    config = hds.wrap(DS, plan, profile_out=str(tmp_path / "section.yaml"))
    out = tmp_path / "m.yaml"
    got, *_ = hds.initialize(model=model, config=config, profile_out=str(out))
    rec = got.het_profile
    try:
        assert got is engine and rec.settings.path == str(out) and rec.framework == "DeepSpeed"
        for _ in range(4):
            engine.backward(engine.forward(1.0))
            engine.step()
        assert rec.timer.seen == 2
    finally:
        rec.close()
    assert not out.exists(), "one rank (stage 0) only: no profile until every stage has reported"
