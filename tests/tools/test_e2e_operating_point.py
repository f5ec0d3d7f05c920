"""The end-to-end benchmark's pure parts from issue 24 (benchmarks/e2e_proportions.py, e2e_drift.py,
e2e_headline.py): the Ethernet rate that puts dp_eth and pp_eth within 10% of the real job's, the drift
verdict that keeps a moved machine's run out of the headline, and README's headline agreeing with the
recorded results and docs/benchmark-e2e.md."""
from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import e2e_headline  # noqa: E402
from e2e_drift import DRIFT_MARGIN, drift_verdict, run_verdict, spread  # noqa: E402
from e2e_proportions import PROPORTION_TOLERANCE, proportions_at, rate_for_proportions  # noqa: E402
from e2e_report import END, START  # noqa: E402
from e2e_setup import TinyShape, derive_scale, real_job  # noqa: E402

RECORDED = json.loads((REPO / "benchmarks" / "results" / "e2e.json").read_text())


# ---- the proportion-matched rate ---------------------------------------------------------------------

def test_the_rate_matches_both_proportions_when_the_byte_mix_matches():
    real = real_job()
    # a job with the real act_grad: both proportions exact at one rate
    lr = rate_for_proportions(1e6, 1e6 * real.act_grad, 0.2, real.dp_eth, real.pp_eth)
    assert lr.dp_error == pytest.approx(0, abs=1e-12) and lr.pp_error == pytest.approx(0, abs=1e-12)
    assert lr.eth_bytes_per_s == pytest.approx(1e6 / (real.dp_eth * 0.2))
    assert lr.matched


def test_the_rate_splits_a_byte_mix_mismatch_evenly_one_high_one_low():
    lr = rate_for_proportions(3.0e6, 0.48e6, 0.15, 1.40, 0.26)     # act_grad 0.16 against 0.186
    assert lr.dp_error > 0 > lr.pp_error
    assert (1 + lr.dp_error) * (1 + lr.pp_error) == pytest.approx(1.0)
    assert 1 + lr.dp_error == pytest.approx(math.sqrt((0.26 / 1.40) / 0.16))
    assert lr.matched
    # the same miss as the rate each would need alone: neither end is closer than the geometric mean
    for rate in (lr.eth_bytes_per_s * 0.97, lr.eth_bytes_per_s * 1.03):
        other = proportions_at(rate, 3.0e6, 0.48e6, 0.15, 1.40, 0.26)
        assert max(abs(other.dp_error), abs(other.pp_error)) > max(abs(lr.dp_error), abs(lr.pp_error))


def test_a_mismatch_beyond_the_tolerance_is_said():
    lr = rate_for_proportions(3.0e6, 0.3e6, 0.15, 1.40, 0.26)      # act_grad 0.10 against 0.186
    assert not lr.matched and lr.dp_error > PROPORTION_TOLERANCE


def test_slower_compute_gives_a_slower_link_at_the_same_proportions():
    fast = rate_for_proportions(3.0e6, 0.5e6, 0.10, 1.40, 0.26)
    slow = rate_for_proportions(3.0e6, 0.5e6, 0.40, 1.40, 0.26)
    assert slow.eth_bytes_per_s == pytest.approx(fast.eth_bytes_per_s / 4)
    assert (slow.dp_eth, slow.pp_eth) == pytest.approx((fast.dp_eth, fast.pp_eth))


def test_bad_numbers_are_refused():
    with pytest.raises(ValueError):
        rate_for_proportions(3.0e6, 0.5e6, 0.0, 1.40, 0.26)


@pytest.mark.parametrize("stage_ms", [2.0, 10.0, 40.0])
def test_the_benchmark_default_is_within_ten_percent_at_any_machine_speed(stage_ms):
    s = derive_scale(TinyShape(), stage_ms / 1e3)
    assert s["mode"] == "proportions" and s["matched"]
    for k in ("dp_eth", "pp_eth"):
        assert abs(s["tiny"][k] / s["real"][k] - 1) <= 0.10
    assert s["eth_mbit"] == pytest.approx(s["matched_eth_mbit"])


def test_a_fixed_rate_keeps_its_rate_and_says_its_proportions():
    s = derive_scale(TinyShape(), 0.04, eth_mbit=100.0)
    assert s["mode"] == "fixed" and s["eth_mbit"] == pytest.approx(100.0) and s["scale"] == pytest.approx(250.0)
    assert s["matched_eth_mbit"] < 100.0 and not s["matched"]     # slow compute: 100 Mbit/s is too fast a link


# ---- drift ---------------------------------------------------------------------------------------------

def test_spread():
    assert spread([1.0]) == 0 and spread([]) == 0
    assert spread([0.2, 0.3, 0.4]) == pytest.approx(0.2 / 0.3)


def test_the_loaded_run_of_issue_24_is_unreliable():
    v = drift_verdict([0.440, 0.539, 0.708], {"10:1 4-het_plugin": [0.467, 0.852], "10:1 3": [0.8, 0.81]})
    assert not v.reliable and len(v.reasons) == 2
    assert "calibration" in v.reasons[0] and "10:1 4-het_plugin" in v.reasons[1]
    assert v.worst_config == "10:1 4-het_plugin"


def test_a_steady_run_is_reliable_and_the_margin_is_the_callers():
    cal, cfg = [0.185, 0.172, 0.178, 0.213], {"a": [0.227, 0.261, 0.253]}
    assert drift_verdict(cal, cfg).reliable and DRIFT_MARGIN == 0.25
    v = drift_verdict(cal, cfg, margin=0.10)
    assert not v.reliable and len(v.reasons) == 2


def test_one_calibration_run_is_no_drift_signal_but_configurations_still_are():
    v = drift_verdict([0.2], {"a": [0.2, 0.4, 0.3]})
    assert v.calibration_spread is None and not v.reliable


def test_the_verdict_reads_a_results_file():
    assert run_verdict(RECORDED).reliable
    moved = copy.deepcopy(RECORDED)
    moved["compute"]["rounds_calibration_step_s"][-1] *= 2
    assert not run_verdict(moved).reliable
    moved = copy.deepcopy(RECORDED)
    moved["ratios"][0]["configs"][0]["rounds_s"][0] *= 1.5
    v = run_verdict(moved)
    assert not v.reliable and v.worst_config == f"{moved['ratios'][0]['ratio']:g}:1 1-all-fast"


# ---- README, docs and the recorded results agree ---------------------------------------------------------

def test_readme_headline_is_the_recorded_results():
    readme = (REPO / "README.md").read_text()
    assert e2e_headline.readme_headline(readme) == e2e_headline.headline_for(REPO), \
        "README's headline disagrees with benchmarks/results/: run python benchmarks/e2e_headline.py --write"


def test_docs_results_section_is_the_recorded_results():
    docs = (REPO / "docs" / "benchmark-e2e.md").read_text()
    section = docs[docs.index(START):docs.index(END) + len(END)]
    assert section == e2e_headline.docs_section_for(REPO), \
        "docs/benchmark-e2e.md's RESULTS section disagrees with benchmarks/results/e2e.json"
    row = next(r for r in RECORDED["ratios"] if r["ratio"] == 10)
    headline = e2e_headline.headline_for(REPO)
    assert f"{row['ratios']['4/3']:.2f}" in headline and RECORDED["started_utc"] in headline


def test_an_unreliable_run_is_never_a_headline(tmp_path):
    moved = copy.deepcopy(RECORDED)
    moved["compute"]["rounds_calibration_step_s"] = [0.44, 0.54, 0.71]
    moved.pop("reliability", None)          # the verdict bench_e2e stored: recomputed from the moved numbers
    text = e2e_headline.headline(moved, None, None)
    row = next(r for r in RECORDED["ratios"] if r["ratio"] == e2e_headline.HEADLINE_RATIO)
    assert "no reliable run" in text and RECORDED["started_utc"] not in text
    assert f"{row['ratios']['4/3']:.2f} [" not in text


def test_the_latest_reliable_run_of_a_kind_is_picked(tmp_path):
    def run(stamp, factor, ratio_value):
        out = copy.deepcopy(RECORDED)
        out["started_utc"] = stamp
        out.pop("reliability", None)        # recomputed from the rounds below
        headline_row = next(r for r in out["ratios"] if r["ratio"] == e2e_headline.HEADLINE_RATIO)
        out["ratios"] = [dict(headline_row, ratios={"5v/1": ratio_value, "5v/1v": 1.0})]
        out["ratios"][0]["configs"] = [dict(c, rounds_s=[c["rounds_s"][0], c["rounds_s"][0] * factor])
                                       for c in out["ratios"][0]["configs"]]
        d = tmp_path / stamp.replace(" ", "-")
        d.mkdir()
        (d / "e2e-interleaved.json").write_text(json.dumps(out))
    run("2026-12-01 04:00 UTC", 1.0, 1.11)
    run("2026-12-01 05:00 UTC", 1.0, 1.22)
    run("2026-12-01 06:00 UTC", 1.6, 1.33)     # the newest, but its rounds spread 46%
    best = e2e_headline.latest_reliable([(tmp_path, "e2e-interleaved.json")])
    assert best["started_utc"] == "2026-12-01 05:00 UTC"
    assert "1.22" in e2e_headline.headline(None, None, best)


def test_the_round_to_repeat_is_the_one_that_strays():
    from e2e_drift import round_to_repeat
    # the calibration says round 2; a configuration agrees
    assert round_to_repeat([0.44, 0.45, 0.71], {"a": [0.47, 0.48, 0.85], "b": [0.30, 0.31, 0.30]}) == 2
    # no calibration rounds (--no-calibration): the configurations decide; round 0 strays in one of them
    assert round_to_repeat([], {"a": [0.90, 0.50, 0.52], "b": [0.30, 0.31, 0.30]}) == 0
    # two rounds stray equally from their median: the later one
    assert round_to_repeat([0.4, 0.6], {}) == 1
    with pytest.raises(ValueError):
        round_to_repeat([0.4], {"a": [0.3]})


def test_a_drifted_run_repeats_its_worst_round_and_records_it():
    import argparse
    import bench_e2e

    class FakeEmu:
        def __init__(self):
            self.rates = []

        def set_rate(self, ifname, mbit):
            self.rates.append((ifname, mbit))

    args = argparse.Namespace(rounds=3, ratios=[10.0], no_calibration=False, repeat_drifted=1,
                              drift_margin=DRIFT_MARGIN, warmup=1, calibration_rounds=1)
    scale = derive_scale(TinyShape(), 0.02)
    parent = bench_e2e.Parent(FakeEmu(), args, TinyShape(), Path("."), {"calibration_step_s": 0.44}, scale)
    parent.visits = []                        # the three planned rounds have run:
    parent.round_calibrations = [0.44, 0.45, 0.71]
    parent.measured = {10.0: {"4-het_plugin": [[9, 0.47], [9, 0.48], [9, 0.85]], "3": [[9, 0.9]] * 3}}
    step = parent.handle("next", {})
    assert step == {"calibrate": None, "round": 3}                     # a new round, calibration first
    assert parent.round_calibrations == [0.44, 0.45]                   # round #3 (index 2) dropped
    assert parent.measured[10.0]["4-het_plugin"] == [[9, 0.47], [9, 0.48]]
    assert parent.repeated[0]["dropped_round_index"] == 2 and parent.repeated[0]["calibration_s"] == 0.71
    assert parent.handle("next", {})["round"] == 3 and not parent.visits   # then the ratio, then done
    parent.round_calibrations.append(0.70)
    for runs in parent.measured[10.0].values():
        runs.append([9, 0.86])
    assert parent.handle("next", {}) == {"done": True}                 # no repeat left: report the drift


def test_a_compute_fit_that_lost_the_compute_is_unreliable():
    from e2e_drift import compute_share_reason
    assert compute_share_reason(0.164, 0.185) is None                     # the idle recorded run: 89%
    assert "unsound" in compute_share_reason(0.28, 0.823)                 # the per-step term took the time
    broken = copy.deepcopy(RECORDED)
    broken["scale"]["tiny"]["compute_s"] = 0.001
    v = run_verdict(broken)
    assert not v.reliable and v.reasons[0].startswith("compute fit unsound")
