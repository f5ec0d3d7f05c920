"""Plans that learn from the run: the stage timer, the measured-profile writer, the profile it writes, and
re-planning with it (no processes: fake clocks and an in-memory store)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.errors import ConfigError
from het_plugin.core.cost.measured import (
    RankTimes,
    comparison_lines,
    imbalance,
    imbalance_warning,
    measured_profile,
    measured_run,
    rank_devices,
    stage_devices,
)
from het_plugin.core.inputs.model import ModelSpec
from het_plugin.core.planner import make_plan
from het_plugin.core.inputs.profile import Profile, load_profile
from het_plugin.runtime.recorder import ProfileRecorder, ProfileSettings, StageTimer
from het_plugin.core.cost.plan_costs import split_costs

DATA = Path(__file__).resolve().parents[2] / "integration_tests" / "data"
IB_ROCE_4 = DATA / "megatron-ib-roce-4.yaml"      # 2 x H100 on IB, 2 x A100-80 on RoCE, one rank per node


def tiny_model(**kw) -> ModelSpec:
    base = dict(name="tiny-gpt", num_layers=5, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                vocab_size=128, seq_length=16, global_batch_size=8, micro_batch_size=2, dtype="fp32",
                activation="gelu", tie_embeddings=True)
    return ModelSpec(**{**base, **kw})


@pytest.fixture(scope="module")
def cluster():
    return load_cluster(IB_ROCE_4)


@pytest.fixture(scope="module")
def plan(cluster):
    return make_plan(cluster, tiny_model(), tp=1, pp=2)


class FakeClock:
    """mark() returns the next preset time; seconds() records which spans were read."""

    def __init__(self):
        self.now = 0.0
        self.read = []

    def mark(self):
        return self.now

    def seconds(self, start, end):
        self.read.append((start, end))
        return end - start


def run_iteration(timer: StageTimer, clock: FakeClock, spans, chunks: int = 1):
    """One iteration with (kind, seconds) spans back to back."""
    timer.begin_iteration(chunks)
    for kind, seconds in spans:
        with timer.timing(kind):
            clock.now += seconds
    timer.end_iteration()


# ---- the timer ---------------------------------------------------------------------------------------

def test_timer_sums_forward_and_backward_per_micro_batch_after_the_warm_up():
    clock = FakeClock()
    timer = StageTimer(rank=3, clock=clock, warmup=1)
    run_iteration(timer, clock, [("forward", 5.0), ("backward", 9.0)])           # warm-up: not counted
    for _ in range(3):
        run_iteration(timer, clock, [("forward", 1.0), ("forward", 1.5), ("backward", 2.0), ("backward", 3.0)])
    t = timer.totals()
    assert (t.rank, t.iterations, t.micro_batches) == (3, 3, 6)
    assert t.forward_s == pytest.approx(7.5) and t.backward_s == pytest.approx(15.0)
    assert t.per_micro_batch == (pytest.approx(1.25), pytest.approx(2.5))
    assert t.intervals == 3 and t.iteration_s >= 0 and t.schedule_s >= 0


def test_timer_reads_an_iterations_spans_one_iteration_later():
    """A GPU's events are read when the next iteration ends (finished by then), or when totals are asked."""
    clock = FakeClock()
    timer = StageTimer(rank=0, clock=clock, warmup=0)
    run_iteration(timer, clock, [("forward", 1.0), ("backward", 2.0)])
    assert clock.read == []                         # not read yet: the stream may still run it
    run_iteration(timer, clock, [("forward", 1.0), ("backward", 2.0)])
    assert len(clock.read) == 2                     # the first iteration's two spans
    assert timer.totals().iterations == 2 and len(clock.read) == 4


def test_timer_counts_micro_batches_over_model_chunks_and_ignores_work_outside_an_iteration():
    clock = FakeClock()
    timer = StageTimer(rank=0, clock=clock, warmup=0)
    with timer.timing("forward"):                   # evaluation, or before training: not timed
        clock.now += 100.0
    run_iteration(timer, clock, [("forward", 1.0)] * 4 + [("backward", 2.0)] * 4, chunks=2)
    t = timer.totals()
    assert t.micro_batches == 2 and t.forward_s == pytest.approx(4.0)
    assert t.per_micro_batch == (pytest.approx(2.0), pytest.approx(4.0))     # both chunks of one micro-batch


def test_rank_times_round_trip_through_json():
    t = RankTimes(rank=2, iterations=3, micro_batches=6, forward_s=1.5, backward_s=3.0, iteration_s=2.0,
                  intervals=3, schedule_s=1.8, final=True)
    assert RankTimes.from_dict(json.loads(json.dumps(t.to_dict()))) == t


# ---- the measured run and its profile ------------------------------------------------------------------

def times_for(plan, per_stage: dict[int, tuple[float, float]], slower_rank: int | None = None) -> list[RankTimes]:
    """Every rank's sums for 4 iterations of 2 micro-batches with the stage's (forward, backward)."""
    out = []
    for r in range(plan.world_size):
        f, b = per_stage[plan.stage_of(r)]
        if r == slower_rank:
            f, b = 1.5 * f, 1.5 * b
        out.append(RankTimes(rank=r, iterations=4, micro_batches=8, forward_s=8 * f, backward_s=8 * b,
                             iteration_s=4 * 0.5, intervals=4, schedule_s=4 * 0.4))
    return out


def test_measured_run_takes_each_stages_slowest_rank(plan):
    first_rank_of_1 = plan.stage_ranks(1)[0]
    run = measured_run(plan, times_for(plan, {0: (0.01, 0.02), 1: (0.01, 0.02)}, slower_rank=first_rank_of_1),
                       "Megatron")
    assert run.plan_hash == plan.hash and run.layers_per_stage == plan.layers_per_stage
    assert [st.layers for st in run.stages] == plan.layers_per_stage
    assert run.stages[0].forward_s == pytest.approx(0.01) and run.stages[1].forward_s == pytest.approx(0.015)
    devices = rank_devices(plan)
    assert run.stages[1].device == devices[first_rank_of_1]
    assert [st.predicted_s for st in run.stages] == plan.prediction.stage_compute_s
    assert run.iteration_s == pytest.approx(0.5) and run.iterations == 4 and run.schedule_s == pytest.approx(0.4)


def test_no_run_until_every_stage_reported(plan):
    only_stage_0 = [t for t in times_for(plan, {0: (0.01, 0.02), 1: (0.01, 0.02)}) if plan.stage_of(t.rank) == 0]
    assert measured_run(plan, only_stage_0) is None
    assert measured_profile(plan, only_stage_0) is None


def test_the_profile_predicts_each_measured_stage(plan, cluster):
    """plan --profile with a run's profile predicts that run's split at its measured stage times."""
    measured = {0: (0.012, 0.025), 1: (0.031, 0.058)}
    prof = measured_profile(plan, times_for(plan, measured), "Megatron")
    kinds = {(c.device, c.kind) for c in prof.compute}
    devices = set(rank_devices(plan))
    assert kinds == {(d, k) for d in devices for k in ("layer", "embedding", "output")}   # every kind on each
    # the embedding of the device that did not hold stage 0 follows from its layer by the FLOP shares
    from het_plugin.core.cost.measured import flop_shares
    layer_w, emb_w, _ = flop_shares(tiny_model(), plan.micro_batch_size)
    other = next(d for d in devices if d != prof.measured.stages[0].device)
    layer = prof.compute_time(other, "layer", plan.micro_batch_size, 1)
    emb = prof.compute_time(other, "embedding", plan.micro_batch_size, 1)
    assert emb.forward_s == pytest.approx(layer.forward_s * emb_w / layer_w)
    assert all(c.micro_batch_size == plan.micro_batch_size and c.tp == plan.tp for c in prof.compute)
    predicted = split_costs(plan, cluster, prof).predict(plan.layers_per_stage).stage_compute_s
    assert predicted == pytest.approx([f + b for f, b in measured.values()], rel=1e-9)


def test_the_same_split_is_exact_with_two_stages_per_device_type(cluster, tmp_path):
    """pp=4, two stages on each device type with different per-layer costs and a loss above its FLOP share on the
    last stage: the per-layer-index entries make the same split re-predict every measured stage; another split
    keeps a layer's measured time on the device type that ran it and uses the mean layer elsewhere."""
    model = tiny_model(num_layers=10)
    plan4 = make_plan(cluster, model, tp=1, pp=4)
    devices = rank_devices(plan4)
    on = [devices[plan4.stage_ranks(s)[0]] for s in range(4)]
    assert sorted(on) == ["A100-80", "A100-80", "H100", "H100"] and on[0] == on[1] and on[2] == on[3]
    assert plan4.layers_per_stage == [2, 1, 1, 6]
    measured = {0: (0.008 / 3, 0.016 / 3), 1: (0.001, 0.002), 2: (0.001, 0.002), 3: (0.010, 0.020)}
    prof = measured_profile(plan4, times_for(plan4, measured))
    mb = plan4.micro_batch_size
    firsts = [0, 2, 3, 4]
    for dev in set(on):       # each layer's override only on the device type that ran it
        held = {i for s in range(4) if on[s] == dev for i in range(firsts[s], firsts[s] + plan4.layers_per_stage[s])}
        assert set(prof.layer_overrides(dev, mb, 1)) == held
    want = [f + b for f, b in measured.values()]
    prof.save(tmp_path / "m.yaml")
    for p in (prof, load_profile(tmp_path / "m.yaml")):
        assert split_costs(plan4, cluster, p).predict([2, 1, 1, 6]).stage_compute_s == pytest.approx(want, rel=1e-9)
    # another split: stage 1 (A100) takes layer 3 (measured on the H100 stage 2) at the A100 mean layer; stage 2
    # (H100) takes layer 4 at its time measured on the H100 stage 3, whose remaining layers keep their own time
    other = split_costs(plan4, cluster, prof).predict([2, 2, 1, 5]).stage_compute_s
    mean = prof.compute_time(on[1], "layer", mb, 1)
    layer3 = prof.layer_overrides(on[2], mb, 1)[3]
    assert mean.forward_s + mean.backward_s != pytest.approx(layer3.forward_s + layer3.backward_s)
    assert other[0] == pytest.approx(want[0])
    assert other[1] == pytest.approx(want[1] + mean.forward_s + mean.backward_s)
    layer4 = prof.layer_overrides(on[3], mb, 1)[4]
    assert layer4.forward_s + layer4.backward_s != pytest.approx(want[2])
    assert other[2] == pytest.approx(layer4.forward_s + layer4.backward_s)
    assert other[3] == pytest.approx(want[3] - layer4.forward_s - layer4.backward_s)


def test_replanning_moves_layers_off_the_stage_measured_slow(plan, cluster):
    """The analytic plan gives the H100 stage more layers; measured H100 layers twice as slow as A100 ones
    move layers to the A100 stage (Holmes' self-adapting partition, across a restart)."""
    devices = rank_devices(plan)
    fast = {s: devices[plan.stage_ranks(s)[0]] for s in range(plan.pp)}
    h100_stage = next(s for s, d in fast.items() if d == "H100")
    assert plan.layers_per_stage[h100_stage] > plan.layers_per_stage[1 - h100_stage]
    per_layer = {s: (0.02 if s == h100_stage else 0.01) for s in range(plan.pp)}
    measured = {s: (per_layer[s] * n, 2 * per_layer[s] * n) for s, n in enumerate(plan.layers_per_stage)}
    prof = measured_profile(plan, times_for(plan, measured))
    new = make_plan(cluster, tiny_model(), tp=1, pp=2, micro_batch_size=2, profile=prof)
    assert h100_layers(new) < h100_layers(plan)
    lines = comparison_lines(prof.measured, new)
    was = ", ".join(st.device for st in prof.measured.stages)
    assert (f"new split {new.layers_per_stage} over {', '.join(stage_devices(new))} (was {plan.layers_per_stage} "
            f"over {was})") in lines[-1]
    assert any(line.startswith("  imbalance") for line in lines)


def h100_layers(plan) -> int:
    devices = rank_devices(plan)
    return next(n for s, n in enumerate(plan.layers_per_stage) if devices[plan.stage_ranks(s)[0]] == "H100")


def test_the_split_stays_when_the_run_matched_the_prediction(plan):
    measured = {s: (t / 3, 2 * t / 3) for s, t in enumerate(plan.prediction.stage_compute_s)}
    prof = measured_profile(plan, times_for(plan, measured))
    lines = comparison_lines(prof.measured, plan)
    assert lines[-1] == f"re-planned with the measured times: the split stays {plan.layers_per_stage}"
    assert " 1.00x" in lines[2] and " 1.00x" in lines[3]        # measured / predicted per stage


def test_imbalance_warning_names_the_replan_command(plan):
    balanced = {s: (t / 3, 2 * t / 3) for s, t in enumerate(plan.prediction.stage_compute_s)}
    run = measured_profile(plan, times_for(plan, balanced)).measured
    assert imbalance_warning(run, 0.2, "het-plugin plan c.yaml --profile m.yaml") is None
    skewed = dict(balanced)
    skewed[0] = (balanced[0][0] * 4, balanced[0][1] * 4)
    run = measured_profile(plan, times_for(plan, skewed)).measured
    message = imbalance_warning(run, 0.2, "het-plugin plan c.yaml --profile m.yaml")
    assert "stage 0" in message and message.endswith("het-plugin plan c.yaml --profile m.yaml")
    assert imbalance([1.0, 1.0]) == 1.0 and imbalance([3.0, 1.0]) == pytest.approx(1.5)


# ---- the file ----------------------------------------------------------------------------------------

def test_measured_profile_round_trips_through_format_2(plan, tmp_path):
    prof = measured_profile(plan, times_for(plan, {0: (0.01, 0.02), 1: (0.03, 0.05)}), "DeepSpeed")
    path = tmp_path / "measured.yaml"
    prof.save(path)
    text = path.read_text()
    assert "format: het_plugin-profile/2" in text and "measured:" in text
    back = load_profile(path)
    assert back.measured == prof.measured and back.format_version == 2
    assert back.compute_time("H100", "layer", plan.micro_batch_size, 1) is not None


def test_profiles_without_measured_load_as_before(tmp_path):
    prof = Profile(description="calibration")
    prof.add_compute("A100-80", "layer", 1, 1, 0.01, 0.02)
    path = tmp_path / "p.yaml"
    prof.save(path)
    assert "measured" not in path.read_text()
    back = load_profile(path)
    assert back.measured is None and back.compute_s("A100-80", "layer", 1, 1) == (0.01, 0.02)


def test_measured_needs_format_2(plan, tmp_path):
    prof = measured_profile(plan, times_for(plan, {0: (0.01, 0.02), 1: (0.03, 0.05)}))
    data = prof.to_file().model_dump(exclude_none=True)
    data.pop("format")
    path = tmp_path / "noformat.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as exc:
        load_profile(path)
    assert exc.value.field == "format" and "measured" in str(exc.value)
    prof.format_version = 1
    with pytest.raises(ConfigError, match="measured"):
        prof.to_file()


def test_measured_stages_out_of_order_are_refused(plan, tmp_path):
    prof = measured_profile(plan, times_for(plan, {0: (0.01, 0.02), 1: (0.03, 0.05)}))
    data = prof.to_file().model_dump(exclude_none=True)
    data["measured"]["stages"].reverse()
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="one entry per stage"):
        load_profile(path)


# ---- the writer ----------------------------------------------------------------------------------------

class MemoryStore:
    """The parts of torch.distributed.Store the recorder uses."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)


def recorders(plan, path, every=2, store=None):
    store = store if store is not None else MemoryStore()
    settings = ProfileSettings(str(path), every=every, warmup=1, exit_wait_s=0.5,
                               replan=f"het-plugin plan c.yaml --profile {path}")
    clocks = [FakeClock() for _ in range(plan.world_size)]
    recs = [ProfileRecorder(plan, r, settings, "test", clock=clocks[r], store=store, exit_handler=False)
            for r in range(plan.world_size)]
    return recs, clocks, store


def train(plan, recs, clocks, iterations, slow_stage=None):
    for _ in range(iterations):
        for r in reversed(range(plan.world_size)):      # rank 0 last: it reads what the others published
            stage = plan.stage_of(r)
            factor = 5.0 if stage == slow_stage else 1.0
            run_iteration(recs[r].timer, clocks[r], [("forward", 0.01 * factor), ("forward", 0.01 * factor),
                                                     ("backward", 0.02 * factor), ("backward", 0.02 * factor)])
            recs[r].after_iteration()


def test_rank_0_writes_the_profile_every_n_iterations_from_every_ranks_sums(plan, tmp_path):
    path = tmp_path / "run.yaml"
    recs, clocks, store = recorders(plan, path, every=2)
    train(plan, recs, clocks, 2)
    assert not path.exists()                        # 1 counted iteration after the warm-up
    train(plan, recs, clocks, 1)
    assert path.exists() and len(store.data) == plan.world_size
    run = load_profile(path).measured
    assert run.iterations == 2 and [st.ranks for st in run.stages] == [2, 2]
    assert run.stages[0].forward_s == pytest.approx(0.01) and run.stages[0].backward_s == pytest.approx(0.02)


def test_at_exit_rank_0_waits_for_the_others_final_sums_and_warns_once(plan, tmp_path, caplog):
    path = tmp_path / "run.json"
    recs, clocks, _ = recorders(plan, path, every=100)
    train(plan, recs, clocks, 3, slow_stage=1)
    for r in reversed(range(plan.world_size)):
        with caplog.at_level(logging.WARNING, logger="het_plugin"):
            recs[r].close()
    assert path.exists()
    run = load_profile(path).measured
    assert run.iterations == 2 and run.stages[1].forward_s == pytest.approx(0.05)
    warnings = [r.getMessage() for r in caplog.records if "imbalance" in r.getMessage()]
    assert len(warnings) == 1 and f"het-plugin plan c.yaml --profile {path}" in warnings[0]
    assert recs[0].close() is None                  # once


def test_rank_0_writes_what_it_has_when_a_rank_never_reports(plan, tmp_path):
    """A rank that is gone: rank 0 waits at most exit_wait_s, then writes from the other ranks' sums."""
    path = tmp_path / "run.yaml"
    recs, clocks, store = recorders(plan, path, every=100)
    train(plan, recs, clocks, 3)
    missing = plan.stage_ranks(1)[0]
    for r in reversed(range(plan.world_size)):
        if r != missing:
            recs[r].close()
    run = load_profile(path).measured
    assert run.stages[1].ranks == 1


def test_profile_settings_refuse_bad_names_and_intervals(tmp_path):
    with pytest.raises(ConfigError, match="format"):
        ProfileSettings(str(tmp_path / "run.txt"))
    with pytest.raises(ConfigError) as exc:
        ProfileSettings(str(tmp_path / "run.yaml"), every=0)
    assert exc.value.field == "profile_every"
    assert ProfileSettings("m.yaml").replan == ""          # made from the plan (tests/runtime/test_replan_inputs.py)


def test_reporting_ranks_are_bounded_per_stage_and_device():
    """Rank 0 reads at most 8 ranks per (stage, device type): a large job's store reads stay few."""
    from het_plugin.core.inputs.cluster import cluster_from_dict
    from het_plugin.core.cost.measured import reporting_ranks

    def node(acc):
        return {"count": 8, "accelerator": acc, "accelerators_per_node": 8}
    big = cluster_from_dict({"name": "big", "clusters": [
        {"name": "a", "fabric": {"type": "ib", "gbps": 1600}, "nodes": [node("H100"), node("A100-80")]}]})
    plan = make_plan(big, tiny_model(num_layers=4, global_batch_size=64, micro_batch_size=1), tp=1, pp=2)
    chosen = reporting_ranks(plan)
    devices = rank_devices(plan)
    groups = {}
    for r in chosen:
        groups.setdefault((plan.stage_of(r), devices[r]), []).append(r)
    assert 0 in chosen and len(chosen) <= 1 + 8 * len(groups)
    assert {(s, d) for s in range(plan.pp) for d in {devices[r] for r in plan.stage_ranks(s)}} == set(groups)
    assert all(len(v) <= 8 + (0 in v) for v in groups.values())
    assert reporting_ranks(plan, per_group=1000) == list(range(plan.world_size))


def test_cuda_event_clock_reads_event_pairs_in_seconds(monkeypatch):
    """On a GPU a span is two CUDA events on the current stream; reading one synchronises on its end event only
    (stand-in events: this machine has no GPU)."""
    torch = pytest.importorskip("torch")
    from het_plugin.runtime.recorder import CudaEventClock
    log = []

    class Event:
        count = 0

        def __init__(self, enable_timing=False):
            assert enable_timing
            Event.count += 1
            self.at = Event.count * 5.0          # ms

        def record(self):
            log.append(("record", self.at))

        def synchronize(self):
            log.append(("sync", self.at))

        def elapsed_time(self, end):
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", Event)
    clock = CudaEventClock()
    timer = StageTimer(rank=0, clock=clock, warmup=0)
    run_iteration(timer, FakeClock(), [])                  # no spans
    timer.begin_iteration()
    with timer.timing("forward"):
        pass
    timer.end_iteration()
    assert [k for k, _ in log] == ["record", "record"]     # recorded, not read: no synchronisation yet
    t = timer.totals()
    assert log[-1] == ("sync", 10.0) and t.forward_s == pytest.approx(0.005) and t.micro_batches == 1


def test_iterations_without_timed_micro_batches_are_named_once(tmp_path, caplog):
    """A schedule that bypasses the hooked calls leaves the profile empty: said once, not silently."""
    plan = make_plan(load_cluster(IB_ROCE_4), tiny_model(), tp=1, pp=2)
    rec = ProfileRecorder(plan, 0, ProfileSettings(str(tmp_path / "m.yaml"), warmup=0), "Megatron-Core",
                          clock=FakeClock(), exit_handler=False)
    with caplog.at_level(logging.WARNING, logger="het_plugin"):
        for _ in range(3):
            with rec.timer.iteration():
                pass                                  # no forward/backward went through the hooks
            rec.publish()
    said = [r.getMessage() for r in caplog.records if "no micro-batch" in r.getMessage()]
    assert len(said) == 1 and "forward_step" in said[0]


def test_the_default_clock_is_chosen_at_the_first_timed_span():
    from het_plugin.runtime.recorder import FirstUseClock, WallClock, default_clock
    clock = default_clock()
    assert isinstance(clock, FirstUseClock) and clock.chosen is None
    start = clock.mark()
    assert isinstance(clock.chosen, WallClock)          # no CUDA here
    assert clock.seconds(start, clock.mark()) >= 0.0
