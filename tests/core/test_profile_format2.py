"""Profile format 2: compute curves over the micro-batch size, the optimizer step and per-iteration overhead,
per-layer overrides, links per cluster, per direction and by concurrent senders; and its validation."""
from pathlib import Path

import pytest

from het_plugin.core import cost
from het_plugin.core.cost.fixed_costs import DEFAULT_ITERATION_S
from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.errors import ConfigError
from het_plugin.core.inputs.model import preset_model
from het_plugin.core.ranks.placement import place
from het_plugin.core.planner import make_plan
from het_plugin.core.inputs.profile import Profile, curve_at, fixed_plus_per_sample, load_profile
from het_plugin.views.report import render_text
from het_plugin.core.ranks.dims import ParallelDims

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "clusters"
A100 = "A100-80"


@pytest.fixture(scope="module")
def holmes():
    return load_cluster(EXAMPLES / "holmes-ib-roce.yaml")


@pytest.fixture(scope="module")
def two():
    return load_cluster(EXAMPLES / "two-clusters-25gbe.yaml")


@pytest.fixture(scope="module")
def gpt7():
    return preset_model("gpt-7.5b")


def curves(sizes=(1, 2, 4)) -> Profile:
    """Sublinear layer times (0.5 s fixed + 0.5 s per sample at 1, 2, 4), embedding and output likewise."""
    prof = Profile()
    for mb in sizes:
        prof.add_compute(A100, "layer", mb, 4, 0.5 + 0.5 * mb, 1.0 + 1.0 * mb)
        prof.add_compute(A100, "embedding", mb, 4, 0.01 * mb, 0.02 * mb)
        prof.add_compute(A100, "output", mb, 4, 0.1 + 0.1 * mb, 0.2 + 0.2 * mb)
    return prof


# ---- compute over the micro-batch size ----------------------------------------------------------------


def test_fixed_plus_per_sample_fit():
    assert fixed_plus_per_sample([1, 2, 4], [1.0, 1.5, 2.5]) == pytest.approx((0.5, 0.5))
    assert fixed_plus_per_sample([2], [3.0]) == (0.0, 1.5)                      # one point: proportional
    assert fixed_plus_per_sample([1, 4], [2.0, 1.0]) == (1.5, 0.0)              # falling: flat, no negative slope
    fixed, per = fixed_plus_per_sample([4, 8], [0.1, 1.0])                      # would need fixed < 0
    assert fixed == 0.0 and per == pytest.approx((0.4 + 8.0) / 80)


def test_curve_interpolates_between_and_extrapolates_outside_the_measured_sizes():
    sizes, times = [1, 2, 4], [1.0, 1.5, 2.5]
    assert curve_at(sizes, times, 2) == 1.5
    assert curve_at(sizes, times, 3) == pytest.approx(2.0)
    assert curve_at(sizes, times, 8) == pytest.approx(4.5)          # 0.5 + 0.5 x 8, not 8 x time(1) = 8.0
    # not on a line: the fit's shape, scaled to meet the nearest measured point (no jump at the edge)
    sizes, times = [2, 4, 8], [1.0, 1.6, 2.4]
    fixed, per = fixed_plus_per_sample(sizes, times)
    assert curve_at(sizes, times, 16) == pytest.approx(2.4 * (fixed + 16 * per) / (fixed + 8 * per))
    assert curve_at(sizes, times, 1) == pytest.approx(1.0 * (fixed + per) / (fixed + 2 * per))
    assert curve_at(sizes, times, 8.0001) == pytest.approx(2.4, rel=1e-4)


def test_compute_time_marks_extrapolation():
    prof = curves()
    inside = prof.compute_time(A100, "layer", 3, 4)
    assert (inside.forward_s, inside.backward_s, inside.extrapolated) == pytest.approx((2.0, 4.0, False))
    outside = prof.compute_time("a100-80", "layer", 8, 4)
    assert (outside.forward_s, outside.backward_s) == pytest.approx((4.5, 9.0)) and outside.extrapolated
    assert prof.compute_time(A100, "layer", 2, 8) is None and prof.compute_time("H100", "layer", 2, 4) is None


def test_the_prediction_uses_the_curve_and_says_when_it_extrapolates(holmes, gpt7):
    placement = place(holmes, ParallelDims(tp=4, pp=2, dp=8))
    pred = cost.predict(holmes, gpt7, placement, [18, 18], 2, profile=curves())
    # 18 layers at micro-batch 2: (1.5 + 3.0) s each; embedding (0.02 + 0.04), output (0.3 + 0.6)
    assert pred.stage_compute_s == pytest.approx([18 * 4.5 + 0.06, 18 * 4.5 + 0.9])
    assert "extrapolated" not in pred.description
    pred8 = cost.predict(holmes, gpt7, placement, [18, 18], 8, profile=curves())
    assert pred8.stage_compute_s[0] == pytest.approx(18 * (4.5 + 9.0) + 0.24)
    assert "A100-80 layer tp=4 measured at micro-batch 1..4; micro-batch 8 is extrapolated" in pred8.description


def test_the_plan_warns_about_extrapolation_and_the_report_shows_it(holmes, gpt7):
    plan = make_plan(holmes, gpt7, tp=4, pp=2, micro_batch_size=8, profile=curves())
    notes = [w for w in plan.warnings if "extrapolated" in w and w.startswith("profile: ")]
    assert {n.split(" tp=")[0] for n in notes} == {"profile: A100-80 layer", "profile: A100-80 embedding",
                                                   "profile: A100-80 output"}
    text = render_text(plan).splitlines()
    assert any("warning: profile: A100-80 layer tp=4" in line for line in text)
    # the plan was chosen on extrapolated numbers: it says so and names the points to measure
    assert plan.prediction.extrapolated == notes
    assert "  extrapolated: 3 compute entries outside the measured profile:" in text
    advice = [w for w in plan.warnings if w.startswith("the plan was chosen on extrapolated compute")]
    assert len(advice) == 1 and "--micro-batch-sizes 1,2,4,8 --tp 4" in advice[0]
    inside = make_plan(holmes, gpt7, tp=4, pp=2, micro_batch_size=2, profile=curves())
    assert not [w for w in inside.warnings if "extrapolated" in w] and inside.prediction.extrapolated == []


def test_moe_and_dense_layer_curves_mix_by_the_models_moe_fraction():
    prof = Profile()
    prof.add_compute(A100, "layer", 1, 1, 1.0, 2.0)
    assert prof.compute_s(A100, "layer", 1, 1, moe_fraction=0.5) == (1.0, 2.0)    # only dense: the average layer
    prof.add_compute(A100, "moe_layer", 1, 1, 3.0, 6.0)
    assert prof.compute_s(A100, "layer", 1, 1, moe_fraction=0.5) == pytest.approx((2.0, 4.0))
    assert prof.compute_s(A100, "layer", 1, 1, moe_fraction=1.0) == pytest.approx((3.0, 6.0))
    assert prof.compute_s(A100, "layer", 1, 1) == (1.0, 2.0)                       # a dense model


# ---- per-layer overrides --------------------------------------------------------------------------------


def test_per_layer_overrides_cost_the_stage_that_holds_the_layer(holmes, gpt7):
    placement = place(holmes, ParallelDims(tp=4, pp=2, dp=8))
    prof = curves()
    prof.add_compute(A100, "layer", 2, 4, 15.0, 30.0, layer=0)      # a 10x slower first layer
    pred = cost.predict(holmes, gpt7, placement, [18, 18], 2, profile=prof)
    assert pred.stage_compute_s == pytest.approx([17 * 4.5 + 45.0 + 0.06, 18 * 4.5 + 0.9])
    # the partition's tables use the mean layer (they cannot depend on which layers a stage holds)
    split = cost.SplitCosts(gpt7, cost.analyze(holmes, placement), 2, profile=prof)
    assert split.stages[1].layer_fwd_s + split.stages[1].layer_bwd_s == pytest.approx((35 * 4.5 + 45.0) / 36)
    # the interleaved schedule: layer 20 is on rank 0's second chunk ([[9, 9], [9, 9]]: v2 = chunk 1 of rank 0)
    prof.add_compute(A100, "layer", 2, 4, 15.0, 30.0, layer=20)
    split = cost.SplitCosts(gpt7, cost.analyze(holmes, placement), 2, profile=prof, vpp=2)
    fwd, bwd = cost.pipeline._virtual_times(split.stages, [[9, 9], [9, 9]])
    assert [f + b for f, b in zip(fwd[0], bwd[0])] == pytest.approx([8 * 4.5 + 45 + 0.06, 8 * 4.5 + 45])
    assert [f + b for f, b in zip(fwd[1], bwd[1])] == pytest.approx([9 * 4.5, 9 * 4.5 + 0.9])


def test_the_planner_moves_layers_off_the_stage_that_holds_a_slow_layer(holmes, gpt7):
    placement = place(holmes, ParallelDims(tp=4, pp=2, dp=8))
    prof = curves()
    prof.add_compute(A100, "layer", 2, 4, 15.0, 30.0, layer=0)      # layer 0 costs 10 average layers
    split = cost.SplitCosts(gpt7, cost.analyze(holmes, placement), 2, profile=prof)
    caps = split.max_layers()
    refined = split.refine([18, 18], caps)
    time = lambda layers: split.predict(layers).iteration_s
    assert refined[0] < 18 and time(refined) < time([18, 18])
    for step in (1, -1):                                             # no single move is better
        assert time([refined[0] - step, refined[1] + step]) >= time(refined)
    same = cost.SplitCosts(gpt7, cost.analyze(holmes, placement), 2, profile=curves())
    assert same.refine([18, 18], caps) == [18, 18] and not same.layers_differ
    plain = make_plan(holmes, gpt7, tp=4, pp=2, micro_batch_size=2, profile=curves())
    planned = make_plan(holmes, gpt7, tp=4, pp=2, micro_batch_size=2, profile=prof)
    assert planned.layers_per_stage[0] <= plain.layers_per_stage[0] - 4         # 40.5 s more: ~4.5 layers


# ---- optimizer and overhead -----------------------------------------------------------------------------


def test_optimizer_time_per_parameter(holmes, gpt7):
    placement = place(holmes, ParallelDims(tp=4, pp=2, dp=8))
    analysis = cost.analyze(holmes, placement)
    prof = curves()
    prof.add_optimizer(A100, 8, 1e-9)                                # another TP: the nearest one is used
    split = cost.SplitCosts(gpt7, analysis, 2, profile=prof)
    params = max(st.fixed_params + 18 * st.params_per_layer for st in split.stages)
    assert split.predict([18, 18]).optimizer_s == pytest.approx(params * 1e-9)
    prof.add_optimizer(A100, 4, 3e-9)
    dist = cost.SplitCosts(gpt7, analysis, 2, profile=prof, distributed_optimizer=True)
    assert dist.predict([18, 18]).optimizer_s == pytest.approx(params / 8 * 3e-9)
    other = Profile()
    other.add_optimizer("H100", 4, 1.0)                              # not this cluster's devices: analytic
    assert (cost.predict(holmes, gpt7, placement, [18, 18], 2, profile=other).optimizer_s
            == cost.predict(holmes, gpt7, placement, [18, 18], 2).optimizer_s)


def test_iteration_overhead_is_added_once(holmes, gpt7):
    placement = place(holmes, ParallelDims(tp=4, pp=2, dp=8))
    base = cost.predict(holmes, gpt7, placement, [18, 18], 2, profile=curves())
    prof = curves()
    prof.add_overhead(A100, 0.25)
    pred = cost.predict(holmes, gpt7, placement, [18, 18], 2, profile=prof)
    # the base profile has no overhead entry: it gets the small analytic default (fixed_costs), which the
    # measured 0.25 s replaces
    assert pred.iteration_s - base.iteration_s == pytest.approx(0.25 - DEFAULT_ITERATION_S)
    assert pred.pipeline_s == base.pipeline_s


# ---- links ----------------------------------------------------------------------------------------------


def test_concurrent_senders_read_their_own_curve():
    prof = Profile()
    prof.add_link("socket", [(1 << 20, 10.0)], latency_us=10, concurrency={8: [(1 << 20, 40.0)]})
    tier = cost.Tier("socket", 1.0, 0.0)
    n = 1 << 20
    assert tier.step_s(n, 1, prof) == pytest.approx(10e-6 + n * 8 / 10e9)
    assert tier.step_s(n, 8, prof) == pytest.approx(10e-6 + 8 * n * 8 / 40e9)           # measured: 40 in total
    assert tier.step_s(n, 4, prof) == pytest.approx(10e-6 + 4 * n * 8 / ((10 + 30 * 3 / 7) * 1e9))   # between
    assert tier.step_s(n, 16, prof) == pytest.approx(10e-6 + 16 * n * 8 / 40e9)         # beyond: the last curve
    one_curve = Profile()
    one_curve.add_link("socket", [(1 << 20, 10.0), (1 << 23, 20.0)], latency_us=10)
    # only one sender measured: the senders' bytes as one message (format 1's rule)
    assert tier.step_s(n, 8, one_curve) == pytest.approx(10e-6 + 8 * n * 8 / 20e9)


def test_dp_reduction_uses_the_curve_of_the_ranks_per_node_sending_at_once(two, gpt7):
    placement = place(two, ParallelDims(tp=8, pp=1, dp=8))           # every node's 8 ranks reduce at once
    analysis = cost.analyze(two, placement)
    alone = Profile()
    alone.add_link("socket", [(1 << 16, 10.0)], latency_us=10)
    crowded = Profile()
    crowded.add_link("socket", [(1 << 16, 10.0)], latency_us=10, concurrency={8: [(1 << 16, 2.0)]})
    path = analysis.stages[0].dp_paths[0]
    nbytes = 1e9
    assert [lv.share for lv in path.levels] == [8, 8]
    expect = 0.0
    chunk = nbytes
    for lv in path.levels:
        step = 10e-6 + 8 * (chunk / lv.members) * 8 / 2e9
        expect += 2 * (lv.members - 1) * step
        chunk /= lv.members
    assert path.allreduce_s(nbytes, crowded) == pytest.approx(expect)
    assert path.allreduce_s(nbytes, crowded) > 4 * path.allreduce_s(nbytes, alone)
    slow = cost.predict(two, gpt7, placement, [36], 2, overlap_grad_reduce=False, profile=crowded)
    fast = cost.predict(two, gpt7, placement, [36], 2, overlap_grad_reduce=False, profile=alone)
    assert slow.dp_exposed_s > 4 * fast.dp_exposed_s


def test_links_inside_one_cluster(two):
    prof = Profile()
    prof.add_link("socket", [(1, 10.0)])
    prof.add_link("socket", [(1, 2.0)], cluster="east")
    n = 1e6
    assert cost.Tier("socket", 1, 0, cluster="east").step_s(n, 1, prof) == pytest.approx(n * 8 / 2e9)
    assert cost.Tier("socket", 1, 0, cluster="west").step_s(n, 1, prof) == pytest.approx(n * 8 / 10e9)
    # a DP level over both clusters' fabrics pays the slower one, whichever the cluster file calls slowest
    path = cost.analyze(two, place(two, ParallelDims(tp=8, pp=1, dp=8))).stages[0].dp_paths[0]
    level = path.levels[0]
    assert {level.tier.cluster} | {t.cluster for t in level.alternatives} == {"east", "west"}
    assert level.step_s(n, prof) == pytest.approx(8 * n * 8 / 2e9)
    west = Profile()
    west.add_link("socket", [(1, 10.0)])
    west.add_link("socket", [(1, 2.0)], cluster="west")
    assert level.step_s(n, west) == pytest.approx(8 * n * 8 / 2e9)


def test_a_link_measured_per_direction(holmes, gpt7):
    placement = place(holmes, ParallelDims(tp=4, pp=2, dp=8))         # stage 0 on ib, stage 1 on roce
    analysis = cost.analyze(holmes, placement)

    def profile(**links) -> Profile:
        prof = curves()
        for name, gbps in links.items():
            prof.add_link(name.replace("_to_", "->").replace("_", "/"), [(1, gbps)], latency_us=50)
        return prof

    both = profile(ib_to_roce=1.0, roce_to_ib=4.0)
    st = cost.SplitCosts(gpt7, analysis, 2, profile=both).stages[0]
    act = 2 * gpt7.seq_length * gpt7.hidden_size * gpt7.dtype_bytes / 4
    assert st.send_s == pytest.approx(50e-6 + 8 * act * 8 / 1e9)       # activations ib -> roce
    assert st.back_s == pytest.approx(50e-6 + 8 * act * 8 / 4e9)       # gradients roce -> ib
    pipe = cost.predict(holmes, gpt7, placement, [18, 18], 2, profile=both).pipeline_s
    slow = cost.predict(holmes, gpt7, placement, [18, 18], 2, profile=profile(ib_roce=1.0)).pipeline_s
    fast = cost.predict(holmes, gpt7, placement, [18, 18], 2, profile=profile(ib_roce=4.0)).pipeline_s
    assert fast < pipe < slow
    # a ring over the link crosses it both ways at once: the slower direction decides
    ring = cost.analyze(holmes, place(holmes, ParallelDims(tp=8, pp=1, dp=8))).stages[0].dp_paths[0]
    assert ring.allreduce_s(1e9, profile(ib_to_roce=1.0, roce_to_ib=4.0)) == pytest.approx(
        ring.allreduce_s(1e9, profile(ib_roce=1.0)))
    assert ring.allreduce_s(1e9, profile(ib_to_roce=4.0, roce_to_ib=1.0)) == pytest.approx(
        ring.allreduce_s(1e9, profile(ib_roce=1.0)))


# ---- the file --------------------------------------------------------------------------------------------


def full() -> Profile:
    prof = curves()
    prof.description = "every format-2 field"
    prof.add_compute(A100, "moe_layer", 2, 4, 3.0, 6.0)
    prof.add_compute(A100, "layer", 2, 4, 15.0, 30.0, layer=0)
    prof.add_optimizer(A100, 4, 2e-11)
    prof.add_overhead(A100, 0.01)
    prof.add_link("ib", [(1 << 16, 90.0), (1 << 24, 700.0)], latency_us=3, cluster="ib",
                  concurrency={4: [(1 << 24, 1400.0)], 8: [(1 << 24, 1500.0)]})
    prof.add_link("ib->roce", [(1 << 20, 18.0)], latency_us=60)
    prof.add_link("roce->ib", [(1 << 20, 12.0)], latency_us=60)
    return prof


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_format2_round_trip(tmp_path, suffix):
    path = tmp_path / f"p{suffix}"
    full().save(path)
    assert "het_plugin-profile/2" in path.read_text()
    back = load_profile(path)
    assert back.to_file() == full().to_file()          # the same content; compute comes back grouped by curve
    key = lambda c: (c.kind, c.layer or -1, c.micro_batch_size)
    assert sorted(back.compute, key=key) == sorted(full().compute, key=key)
    assert (back.links, back.optimizer, back.overhead) == (full().links, full().optimizer, full().overhead)


def test_a_format1_profile_saves_as_format1_and_refuses_format2_fields(tmp_path):
    old = load_profile(Path(__file__).resolve().parents[1] / "data" / "format1" / "documented.yaml")
    assert old.legacy
    old.save(tmp_path / "again.yaml")
    assert "het_plugin-profile/1" in (tmp_path / "again.yaml").read_text()
    assert load_profile(tmp_path / "again.yaml") == old
    old.add_optimizer(A100, 4, 1e-11)
    with pytest.raises(ConfigError, match="format-1 profile cannot hold optimizer"):
        old.save(tmp_path / "mixed.yaml")


BAD = {
    "negative time": ("compute:\n  - {device: H100, kind: layer, points: [{micro_batch_size: 1, forward_s: -1, "
                      "backward_s: 1}]}\n", "compute[0].points[0].forward_s", "greater than or equal to 0"),
    "unsorted sizes": ("compute:\n  - {device: H100, kind: layer, points: [{micro_batch_size: 4, forward_s: 1, "
                       "backward_s: 1}, {micro_batch_size: 2, forward_s: 1, backward_s: 1}]}\n", "compute[0]",
                       "smallest first"),
    "duplicate sizes": ("compute:\n  - {device: H100, kind: layer, points: [{micro_batch_size: 2, forward_s: 1, "
                        "backward_s: 1}, {micro_batch_size: 2, forward_s: 1, backward_s: 1}]}\n", "compute[0]",
                        "each once"),
    "unknown key": ("compute:\n  - {device: H100, kind: layer, micro_batch_size: 1, points: [{micro_batch_size: 1, "
                    "forward_s: 1, backward_s: 1}]}\n", "compute[0].micro_batch_size", "allowed fields"),
    "negative optimizer": ("optimizer: [{device: H100, seconds_per_param: -1e-9}]\n", "optimizer[0].seconds_per_param",
                           "greater than or equal to 0"),
    "unsorted bandwidth": ("links: [{tier: ib, bandwidth: [{bytes: 100, gbps: 1}, {bytes: 10, gbps: 1}]}]\n",
                           "links[0]", "smallest first"),
    "one sender in concurrency": ("links: [{tier: ib, bandwidth: [{bytes: 10, gbps: 1}], concurrency: [{senders: 1, "
                                  "bandwidth: [{bytes: 10, gbps: 1}]}]}]\n", "links[0].concurrency[0].senders",
                                  "greater than or equal to 2"),
    "same link twice": ("links: [{tier: a/b, bandwidth: [{bytes: 10, gbps: 1}]}, {tier: b/a, bandwidth: "
                        "[{bytes: 10, gbps: 1}]}]\n", "links", "'a->b' and 'b->a'"),
    "cluster on a named link": ("links: [{tier: a->b, cluster: a, bandwidth: [{bytes: 10, gbps: 1}]}]\n", "links[0]",
                                "drop 'cluster'"),
    "bad tier": ("links: [{tier: a=>b, bandwidth: [{bytes: 10, gbps: 1}]}]\n", "links[0]", "clusterA->clusterB"),
    "override of the embedding": ("compute:\n  - {device: H100, kind: embedding, layer: 3, points: "
                                  "[{micro_batch_size: 1, forward_s: 1, backward_s: 1}]}\n", "compute[0]",
                                  "kind 'layer' or 'moe_layer'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_format2_files_are_config_errors_naming_file_field_and_fix(tmp_path, case):
    body, field, words = BAD[case]
    path = tmp_path / "bad.yaml"
    path.write_text("format: het_plugin-profile/2\n" + body)
    with pytest.raises(ConfigError) as err:
        load_profile(path)
    text = str(err.value)
    assert str(path) in text and field in text and words in text, text
    assert "fix" in text


def test_the_documented_example_and_snippet_work(tmp_path, monkeypatch):
    import re
    text = (Path(__file__).resolve().parents[2] / "docs" / "planner.md").read_text()
    section = text[text.index("## Measured profiles"):]
    example = next(b for b in re.findall(r"```yaml\n(.*?)```", section, re.S) if "het_plugin-profile/2" in b)
    (tmp_path / "example.yaml").write_text(example)
    prof = load_profile(tmp_path / "example.yaml")
    assert prof.compute_time(A100, "layer", 2, 4).forward_s == pytest.approx(0.0104 + (0.0290 - 0.0104) / 3)
    assert prof.layer_overrides(A100, 4, 4)[0].forward_s == 0.0410
    assert prof.step_s(["ib->roce", "ib/roce"], 1 << 20) != prof.step_s(["roce->ib", "roce/ib"], 1 << 20)
    snippet = next(b for b in re.findall(r"```python\n(.*?)```", section, re.S) if "Profile(" in b)
    monkeypatch.chdir(tmp_path)
    exec(snippet, {})
    assert load_profile(tmp_path / "profile.yaml").compute_time(A100, "layer", 2, 1) is not None


def test_an_unknown_format_is_refused_naming_the_field(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("format: het_plugin-profile/3\ncompute: []\n")
    with pytest.raises(ConfigError) as err:
        load_profile(path)
    assert err.value.field == "format" and str(path) in str(err.value) and "het_plugin-profile/2" in err.value.fix
    path.write_text("compute:\n  - {device: H100, kind: layer, points: []}\n")    # no format: a format-1 file
    with pytest.raises(ConfigError) as err:
        load_profile(path)
    assert err.value.field == "format" and "compute[0].points" in str(err.value)
    assert err.value.fix == "add 'format: het_plugin-profile/2' at the top"
