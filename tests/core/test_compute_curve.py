"""Compute curves that extrapolate like hardware (issue 23): one-point profiles, several points, a TP degree the
profile lacks, the roofline (peak x sustained efficiency) never crossed."""
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from het_plugin.core import cost
from het_plugin.core.cost.stage import _compute_s
from het_plugin.core.inputs.catalog import lookup
from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.inputs.compute_curve import (Analytic, curve_at, extrapolations, fixed_plus_per_sample,
                                                  measured_compute_s, tp_scaled)
from het_plugin.core.inputs.model import preset_model
from het_plugin.core.inputs.profile import Profile
from het_plugin.core.ranks.dims import ParallelDims
from het_plugin.core.ranks.placement import place

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "clusters"
A100 = "A100-80"


@pytest.fixture(scope="module")
def holmes():
    return load_cluster(EXAMPLES / "holmes-ib-roce.yaml")


@pytest.fixture(scope="module")
def gpt7():
    return preset_model("gpt-7.5b")


def roofline_fwd_s(model, mb: int, tp: int) -> float:
    """The analytic forward compute of one layer at the A100's sustained FLOP rate."""
    return model.mean_layer_flops_fwd(mb) / tp / lookup(A100).sustained_flops


# ---- the curve ------------------------------------------------------------------------------------------


def test_one_point_extrapolates_with_the_roofline_slope_and_keeps_the_rest_fixed():
    # 1.0 s at micro-batch 1 against a roofline of 0.25 s per sample: 0.75 s fixed, 0.25 s per sample
    assert fixed_plus_per_sample([1], [1.0], 0.25) == (0.75, 0.25)
    assert curve_at([1], [1.0], 1, 0.25) == 1.0
    assert curve_at([1], [1.0], 8, 0.25) == pytest.approx(0.75 + 8 * 0.25)      # not 8 x 1.0 (linear)
    assert curve_at([4], [2.0], 1, 0.25) == pytest.approx(2.0 - 3 * 0.25)       # below the point: less fixed work
    # a device faster than the catalog says (0.1 s per sample measured): believed, proportional
    assert fixed_plus_per_sample([2], [0.2], 0.25) == (0.0, pytest.approx(0.1))
    assert curve_at([2], [0.2], 8, 0.25) == pytest.approx(0.8)
    # no roofline (0): the old rule, proportional
    assert curve_at([1], [1.0], 8) == 8.0


def test_several_points_interpolate_as_before_and_the_fit_respects_the_roofline():
    sizes, times = [1, 2, 4], [1.0, 1.5, 2.5]
    for floor in (0.0, 0.2, 5.0):
        assert curve_at(sizes, times, 3, floor) == pytest.approx(2.0)          # between: linear, as before
        assert curve_at(sizes, times, 2, floor) == 1.5
    assert curve_at(sizes, times, 8, 0.2) == pytest.approx(4.5)                 # slope 0.5 > roofline: unchanged
    # flatter than the roofline (0.05 s/sample measured slope, roofline 0.2): the slope is the roofline
    flat = [1.0, 1.05, 1.15]
    fixed, per = fixed_plus_per_sample(sizes, flat, 0.2)
    assert per == pytest.approx(0.2) and fixed == pytest.approx(sum(flat) / 3 - 0.2 * 7 / 3)
    assert curve_at(sizes, flat, 16, 0.2) >= 1.15 + 0.2 * 12 - 1e-12
    assert curve_at(sizes, flat, 16) < 1.15 + 0.2 * 12                           # unbounded: it would be faster
    # a roofline above what was measured (0.2875 s/sample at mb 4) is lowered to the measurement
    assert fixed_plus_per_sample(sizes, flat, 0.3)[1] == pytest.approx(1.15 / 4)


def test_a_one_point_profile_predicts_saturating_compute(holmes, gpt7):
    placement = place(holmes, ParallelDims(tp=1, pp=4, dp=16))
    layers = [9, 9, 9, 9]
    roof = roofline_fwd_s(gpt7, 1, 1)
    t1 = 3 * roof                            # measured at mb 1: three times the roofline (launch-bound)
    prof = Profile()
    prof.add_compute(A100, "layer", 1, 1, t1, 2 * t1)
    pred1 = cost.predict(holmes, gpt7, placement, layers, 1, profile=prof)
    pred8 = cost.predict(holmes, gpt7, placement, layers, 8, profile=prof)
    per_layer = lambda pred: (pred.stage_compute_s[1]) / 9                        # a middle stage: layers only
    assert per_layer(pred1) == pytest.approx(3 * t1)
    assert per_layer(pred8) == pytest.approx(3 * (t1 + 7 * roof))                 # fixed + 8 x roofline
    assert per_layer(pred8) < 8 * per_layer(pred1) / 2                            # far below linear
    assert any("micro-batch 8 is extrapolated" in line for line in pred8.description.split("; "))


def test_tp_extrapolation_scales_by_flop_and_communication_shares(holmes, gpt7):
    acc = lookup(A100)
    tier = cost.analyze(holmes, place(holmes, ParallelDims(tp=2, pp=4, dp=8))).stages[0].tp_tier

    def analytic(b, t):
        return Analytic(*_compute_s(acc, "layer", gpt7, b, t, 1, tier, None, apart=True))
    roof1 = analytic(4, 1).compute_fwd_s
    prof = Profile()
    prof.add_compute(A100, "layer", 1, 1, roof1 / 4 * 2, roof1 / 4 * 4)      # mb 1: twice the roofline
    prof.add_compute(A100, "layer", 4, 1, roof1 * 1.2, roof1 * 2.5)          # mb 4: near it
    got = measured_compute_s(prof, A100, "layer", 4, 2, 0.0, analytic)
    fixed = (fixed_plus_per_sample([1, 4], [roof1 / 2, roof1 * 1.2], roof1 / 4)[0],
             fixed_plus_per_sample([1, 4], [roof1, roof1 * 2.5], roof1 / 2)[0])
    assert got == pytest.approx(tp_scaled(roof1 * 1.2, roof1 * 2.5, fixed, 1, 2, analytic(4, 1), analytic(4, 2)))
    comm = analytic(4, 2).comm_s
    assert comm > 0
    # the compute beyond the fixed part halves; the new degree's all-reduces are added
    assert got[0] == pytest.approx(fixed[0] + (roof1 * 1.2 - fixed[0]) / 2 + comm)
    assert got[0] - comm >= analytic(4, 2).compute_fwd_s - 1e-15                # never below the roofline
    notes = [e.line() for e in extrapolations(prof, [A100], 4, 2, ("layer",))]
    assert notes == [f"profile: {A100} layer measured at tp=1 (micro-batch 1..4); tp=2 at micro-batch 4 is "
                     "extrapolated (FLOP and communication shares, roofline bound) -- profile tp=2 for a measured time"]


def test_tp_extrapolation_from_a_measured_tp_removes_its_communication():
    here, there = Analytic(1.0, 0.5), Analytic(2.0, 0.3)          # at tp 4 and the measured tp 2
    fwd, bwd = tp_scaled(3.3, 6.3, (0.3, 0.3), 2, 4, there, here)
    assert fwd == pytest.approx(0.3 + (3.0 - 0.3) / 2 + 0.5)        # 3.3 - 0.3 (comm) = 3.0 of compute
    assert bwd == pytest.approx(max(0.3 + (6.0 - 0.3) / 2, 2.0) + 0.5)
    # a measured time below what the roofline allows at the new degree is lifted to it
    fwd, _ = tp_scaled(2.0, 4.0, (1.9, 3.9), 1, 8, Analytic(1.9), Analytic(0.5))
    assert fwd == pytest.approx(1.9 + 0.1 / 8) and fwd >= 0.5
    fwd, _ = tp_scaled(0.2, 0.4, (0.0, 0.0), 1, 2, Analytic(1.0), Analytic(0.5))
    assert fwd == 0.5                                                # roofline at tp 2


def test_a_device_type_without_entries_is_named(gpt7):
    prof = Profile()
    prof.add_compute(A100, "layer", 1, 1, 1.0, 2.0)
    lines = [e.line() for e in extrapolations(prof, [A100, "H100"], 1, 1, ("layer", "embedding", "output"))]
    assert lines == ["profile: H100 compute has no measured entry; micro-batch 1 tp=1 is the analytic estimate -- "
                     "profile this device type for a measured time"]
    assert extrapolations(Profile(), ["H100"], 1, 1, ("layer",)) == []          # a links-only profile: nothing


# ---- the roofline bound -----------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 64), st.floats(1e-5, 10.0)), min_size=1, max_size=6, unique_by=lambda p: p[0]),
       st.floats(0.0, 1.0), st.integers(1, 512))
def test_the_roofline_is_never_crossed(points, floor, size):
    points = sorted(points)
    sizes, times = [p[0] for p in points], [p[1] for p in points]
    t = curve_at(sizes, times, size, floor)
    low = min([floor] + [y / x for x, y in points]) if floor > 0 else 0.0
    assert t >= low * size * (1 - 1e-9)
    if size in sizes:
        assert t == times[sizes.index(size)]                   # a measured point is the measurement
    if floor > 0 and all(y / x >= floor for x, y in points):   # measurements that respect the roofline
        assert t >= floor * size * (1 - 1e-9)
    fixed, per = fixed_plus_per_sample(sizes, times, floor)
    assert fixed >= 0 and per >= low * (1 - 1e-9)


@settings(max_examples=200, deadline=None)
@given(st.floats(1e-4, 10), st.floats(1e-4, 10), st.floats(0, 1), st.integers(1, 8), st.integers(1, 8),
       st.floats(1e-4, 5), st.floats(0, 1), st.floats(0, 1))
def test_tp_scaling_never_beats_the_roofline(fwd, bwd, share, tpm, tp, roof, comm_m, comm):
    there = Analytic(roof * tp / tpm, comm_m)
    here = Analytic(roof, comm)
    f, b = tp_scaled(fwd, bwd, (share * fwd, share * bwd), tpm, tp, there, here)
    assert f - comm >= roof * (1 - 1e-12) and b - comm >= 2 * roof * (1 - 1e-12)
