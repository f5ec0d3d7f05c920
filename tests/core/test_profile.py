"""Measured profiles: file format, look-ups, and overriding the analytic estimate."""
from pathlib import Path

import pytest

from het_plugin.core import cost
from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.errors import ConfigError
from het_plugin.core.inputs.model import preset_model
from het_plugin.core.ranks.placement import place
from het_plugin.core.inputs.profile import Profile, bandwidth_at, load_profile
from het_plugin.core.ranks.dims import ParallelDims

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def sample() -> Profile:
    prof = Profile(description="test")
    prof.add_compute("A100-80", "layer", 1, 4, 0.010, 0.021)
    prof.add_compute("A100-80", "embedding", 1, 4, 0.001, 0.002)
    prof.add_compute("A100-80", "output", 1, 4, 0.004, 0.009)
    prof.add_link("socket", [(1 << 20, 8.0), (1 << 26, 20.0)], latency_us=40)
    return prof


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_save_and_load_round_trip(tmp_path, suffix):
    prof = sample()
    path = tmp_path / f"profile{suffix}"
    prof.save(path)
    back = load_profile(path)
    assert back == prof


def test_bad_files_are_config_errors_naming_the_field(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("links:\n  - {tier: infiniband-ish, bandwidth: [{bytes: 10, gbps: 1}]}\n")
    with pytest.raises(ConfigError) as err:
        load_profile(path)
    assert "links[0]" in str(err.value) and "unknown link tier" in str(err.value)
    path.write_text("compute:\n  - {device: H100, kind: layer, micro_batch_size: 1, forward_s: -1, backward_s: 1}\n")
    with pytest.raises(ConfigError) as err:
        load_profile(path)
    assert "compute[0].forward_s" in str(err.value)
    path.write_text("compute:\n  - {device: H100, kind: attention, micro_batch_size: 1, forward_s: 1, backward_s: 1}\n")
    with pytest.raises(ConfigError, match="kind"):
        load_profile(path)
    prof = sample()
    prof.add_compute("a100-80", "layer", 1, 4, 1, 1)          # same entry again (case-insensitive device)
    with pytest.raises(ConfigError, match="repeat"):
        prof.save(tmp_path / "dup.yaml")


def test_lookups_exact_then_scaled_by_micro_batch():
    prof = sample()
    assert prof.compute_s("a100-80", "layer", 1, 4) == (0.010, 0.021)
    assert prof.compute_s("A100-80", "layer", 4, 4) == pytest.approx((0.040, 0.084))
    assert prof.compute_s("A100-80", "layer", 1, 2) is None          # another TP: not measured
    assert prof.compute_s("H100", "layer", 1, 4) is None


def test_bandwidth_interpolates_in_log_size_and_clamps():
    pts = [(1 << 20, 8.0), (1 << 26, 20.0)]
    assert bandwidth_at(pts, 10) == 8.0 and bandwidth_at(pts, 1 << 30) == 20.0
    assert bandwidth_at(pts, 1 << 23) == pytest.approx(14.0)          # halfway in log(size)
    prof = sample()
    assert prof.transfer_s(["nope", "socket"], 1 << 26) == pytest.approx(40e-6 + (1 << 26) * 8 / 20e9)
    assert prof.transfer_s("ib", 100) is None


def test_profile_overrides_the_analytic_compute_estimate():
    holmes = load_cluster(EXAMPLES / "clusters" / "holmes-ib-roce.yaml")
    model = preset_model("gpt-7.5b")
    placement = place(holmes, ParallelDims(tp=4, pp=2, dp=8))
    analytic = cost.predict(holmes, model, placement, [18, 18], 1)
    measured = cost.predict(holmes, model, placement, [18, 18], 1, profile=sample())
    # stage 0: 18 layers + embedding, stage 1: 18 layers + output layer and loss (fwd + bwd)
    assert measured.stage_compute_s[0] == pytest.approx(18 * 0.031 + 0.003)
    assert measured.stage_compute_s[1] == pytest.approx(18 * 0.031 + 0.013)
    assert measured.stage_compute_s != analytic.stage_compute_s


def test_profile_overrides_link_bandwidth():
    holmes = load_cluster(EXAMPLES / "clusters" / "holmes-ib-roce.yaml")
    model = preset_model("gpt-7.5b")
    placement = place(holmes, ParallelDims(tp=4, pp=2, dp=8))
    slow = Profile()
    slow.add_link("ib/roce", [(1, 0.5)], latency_us=100)        # the named link between the two clusters
    base = cost.predict(holmes, model, placement, [18, 18], 1)
    worse = cost.predict(holmes, model, placement, [18, 18], 1, profile=slow)
    assert worse.pipeline_s > 2 * base.pipeline_s
    assert worse.stage_compute_s == base.stage_compute_s


def test_link_lookup_order_named_link_then_kind_then_fallback():
    prof = Profile()
    prof.add_link("ethernet", [(1, 1.0)])
    prof.add_link("socket", [(1, 2.0)])
    staged = cost.Tier("host-staged", 1000, 0, names=("amd/other",))
    assert staged.step_s(1e9, 1, prof) == pytest.approx(1e9 * 8 / 2e9)      # no host-staged entry: socket
    prof.add_link("host-staged", [(1, 4.0)])
    assert staged.step_s(1e9, 1, prof) == pytest.approx(1e9 * 8 / 4e9)
    prof.add_link("amd/other", [(1, 8.0)])
    assert staged.step_s(1e9, 1, prof) == pytest.approx(1e9 * 8 / 8e9)
    assert cost.Tier("ib", 800, 0).step_s(1e9, 1, prof) == pytest.approx(1e9 * 8 / 800e9)   # not measured
