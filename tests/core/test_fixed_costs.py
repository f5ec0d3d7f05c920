"""Fixed costs the compute curves do not hold (issue 23): the per-pipeline-slot cost and the per-iteration
overhead, in the profile format, measured or defaulted."""
from pathlib import Path

import pytest

from het_plugin.core import cost
from het_plugin.core.cost.fixed_costs import DEFAULT_ITERATION_S, DEFAULT_SLOT_S, iteration_overhead_s, slot_s
from het_plugin.core.errors import ConfigError
from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.inputs.model import preset_model
from het_plugin.core.inputs.profile import Profile, load_profile
from het_plugin.core.ranks.dims import ParallelDims
from het_plugin.core.ranks.placement import place

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "clusters"
A100 = "A100-80"


@pytest.fixture(scope="module")
def setup():
    holmes = load_cluster(EXAMPLES / "holmes-ib-roce.yaml")
    gpt7 = preset_model("gpt-7.5b")
    return holmes, gpt7, place(holmes, ParallelDims(tp=4, pp=2, dp=8))


def layers_profile() -> Profile:
    prof = Profile()
    for mb in (1, 2, 4):
        prof.add_compute(A100, "layer", mb, 4, 0.01 + 0.01 * mb, 0.02 + 0.02 * mb)
    return prof


def test_pipeline_slot_round_trips_and_format_1_cannot_hold_it(tmp_path):
    prof = layers_profile()
    prof.add_pipeline_slot(A100, 0.012)
    prof.save(tmp_path / "p.yaml")
    back = load_profile(tmp_path / "p.yaml")
    assert back.pipeline_slot_s("a100-80") == 0.012 and back.pipeline_slot_s("H100") is None
    old = Profile(format_version=1)
    old.add_pipeline_slot(A100, 0.01)
    with pytest.raises(ConfigError, match="pipeline_slot"):
        old.save(tmp_path / "old.yaml")
    (tmp_path / "dup.yaml").write_text("format: het_plugin-profile/2\npipeline_slot:\n"
                                       "  - {device: A100-80, seconds: 0.1}\n  - {device: a100-80, seconds: 0.2}\n")
    with pytest.raises(ConfigError, match="pipeline_slot repeats devices"):
        load_profile(tmp_path / "dup.yaml")
    (tmp_path / "nofmt.yaml").write_text("pipeline_slot: [{device: A100-80, seconds: 0.1}]\n")
    with pytest.raises(ConfigError, match="format-2 fields"):
        load_profile(tmp_path / "nofmt.yaml")


@pytest.mark.parametrize("vpp", [1, 2])
def test_the_slot_cost_lengthens_each_forward_and_backward_of_the_pipeline(setup, vpp):
    """Every rank runs its 2 m vpp slots one after another (each model chunk's forward and backward); the critical
    path holds at most m + pp - 1 forwards and backwards (1F1B), or every rank's slots (interleaved)."""
    holmes, gpt7, placement = setup
    base = layers_profile()
    base.add_pipeline_slot(A100, 0.0)
    slow = layers_profile()
    slow.add_pipeline_slot(A100, 0.05)
    a = cost.predict(holmes, gpt7, placement, [18, 18], 2, profile=base, vpp=vpp)
    b = cost.predict(holmes, gpt7, placement, [18, 18], 2, profile=slow, vpp=vpp)
    m, pp = gpt7.global_batch_size // (8 * 2), 2
    most = 2 * (m + pp - 1) if vpp == 1 else 2 * m * vpp * pp
    assert 2 * m * vpp * 0.05 * (1 - 1e-9) <= b.pipeline_s - a.pipeline_s <= most * 0.05 * (1 + 1e-9)
    assert b.stage_compute_s == a.stage_compute_s          # the stage's compute (what its timers measure) is not it


def test_the_layer_split_moves_layers_off_a_device_type_with_a_dearer_slot():
    """The exact partition's per-micro-batch cost holds each stage's two slots: where one device type's slot
    costs as much as layers do, it gets fewer of them (the same compute everywhere otherwise)."""
    from het_plugin.core.planner import make_plan
    from het_plugin.core.inputs.model import ModelSpec
    cluster = load_cluster(Path(__file__).resolve().parents[2] / "integration_tests" / "data" / "megatron-ib-roce-4.yaml")
    model = ModelSpec(name="tiny-gpt", num_layers=12, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                      vocab_size=128, seq_length=16, global_batch_size=8, micro_batch_size=2, dtype="fp32",
                      activation="gelu", tie_embeddings=True)
    devices = ["A100-80", "H100"]                        # the cluster's two device types, one per fabric

    def profile(slot_of):
        prof = Profile()
        for dev in devices:
            for kind, t in (("layer", 0.010), ("embedding", 0.0001), ("output", 0.0001)):
                prof.add_compute(dev, kind, 2, 1, t, 2 * t)
            prof.add_pipeline_slot(dev, slot_of.get(dev, 0.0))
            prof.add_overhead(dev, 0.0)
        return prof

    even = make_plan(cluster, model, tp=1, pp=2, profile=profile({}))
    assert sorted(even.layers_per_stage) == [6, 6]
    dear = devices[0]
    skewed = make_plan(cluster, model, tp=1, pp=2, profile=profile({dear: 0.030}))   # two slots = 6 layers' compute
    from het_plugin.core.cost.measured import stage_devices
    on = stage_devices(skewed)
    assert dear in on, on
    assert skewed.layers_per_stage[on.index(dear)] < 6


def test_unmeasured_fixed_costs_default_to_the_analytic_term_only_with_a_format_2_profile(setup):
    holmes, gpt7, placement = setup
    measured = layers_profile()
    measured.add_pipeline_slot(A100, DEFAULT_SLOT_S)
    measured.add_overhead(A100, DEFAULT_ITERATION_S)
    defaulted = cost.predict(holmes, gpt7, placement, [18, 18], 2, profile=layers_profile())
    explicit = cost.predict(holmes, gpt7, placement, [18, 18], 2, profile=measured)
    assert defaulted.iteration_s == explicit.iteration_s
    zero = layers_profile()
    zero.add_pipeline_slot(A100, 0.0)
    zero.add_overhead(A100, 0.0)
    none = cost.predict(holmes, gpt7, placement, [18, 18], 2, profile=zero)
    assert defaulted.iteration_s - none.iteration_s >= DEFAULT_ITERATION_S + 2 * DEFAULT_SLOT_S
    # no profile: the analytic model exactly as before (no fixed costs)
    sc = cost.SplitCosts(gpt7, cost.analyze(holmes, placement), 2)
    assert all(st.slot_s == 0.0 for st in sc.stages)
    accs = [a for st in sc.analysis.stages for a in st.accelerators]
    assert iteration_overhead_s(None, accs) == 0.0 and iteration_overhead_s(Profile(format_version=1), accs) == 0.0
    assert slot_s(Profile(format_version=1), accs) == 0.0 and slot_s(Profile(), accs) == DEFAULT_SLOT_S


def test_the_training_run_recorder_measures_the_iteration_overhead():
    from types import SimpleNamespace

    from het_plugin.core.cost.run_fit import run_overhead_s
    from het_plugin.core.inputs.profile_schema import MeasuredRun, MeasuredStage
    stages = [MeasuredStage(stage=0, layers=2, device=A100, forward_s=0.1, backward_s=0.2)]
    run = MeasuredRun(plan_hash="x", micro_batch_size=1, num_micro_batches=4, layers_per_stage=[2], iterations=3,
                      iteration_s=1.5, schedule_s=1.2, stages=stages)
    plan = SimpleNamespace(prediction=SimpleNamespace(optimizer_s=0.1))
    assert run_overhead_s(run, plan) == pytest.approx(0.2)          # 1.5 - 1.2 (schedule) - 0.1 (optimizer)
    assert run_overhead_s(run.model_copy(update={"schedule_s": None}), plan) is None
    assert run_overhead_s(run, SimpleNamespace(prediction=None)) is None
    assert run_overhead_s(run.model_copy(update={"schedule_s": 1.49}), plan) == 0.0   # never negative
    assert run_overhead_s(run, plan, optimizer_s=0.05) == pytest.approx(0.25)   # the step charged with the profile
    holds = run.model_copy(update={"schedule_holds_step": True})     # DeepSpeed: the step is inside train_batch
    assert run_overhead_s(holds, plan) == pytest.approx(0.3)


def test_a_training_runs_profile_gets_no_default_fixed_costs():
    from het_plugin.core.inputs.profile_schema import MeasuredRun, MeasuredStage
    prof = layers_profile()
    prof.measured = MeasuredRun(plan_hash="x", micro_batch_size=1, num_micro_batches=4, layers_per_stage=[2],
                                iterations=3, iteration_s=1.5, stages=[MeasuredStage(stage=0, layers=2, device=A100,
                                                                                     forward_s=0.1, backward_s=0.2)])
    from types import SimpleNamespace
    accs = [SimpleNamespace(name=A100)]
    assert slot_s(prof, accs) == 0.0 and iteration_overhead_s(prof, accs) == 0.0
    prof.add_overhead(A100, 0.3)
    assert iteration_overhead_s(prof, accs) == 0.3              # what the run measured is used
