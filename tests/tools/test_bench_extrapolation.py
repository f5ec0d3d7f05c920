"""The extrapolation benchmark's prediction side (benchmarks/bench_extrapolation.py), on synthetic layer times
that follow the hardware model exactly (a fixed part + the roofline per sample): from a micro-batch-1 profile the
new rule recovers them, the old linear rule does not. No timing here."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_extrapolation as bench  # noqa: E402


def synthetic(efficiency: float = 0.5, fixed: float = 0.004) -> dict:
    peak = 0.05                                           # TFLOPS
    roof = bench.MODEL.mean_layer_flops_fwd(1) / (peak * 1e12 * efficiency)   # forward seconds per sample
    points = {1: {mb: (fixed + roof * mb, 2 * fixed + 2 * roof * mb) for mb in bench.SIZES},
              2: {mb: (fixed + roof * mb / 2, 2 * fixed + roof * mb) for mb in bench.SIZES}}
    link = [(b, 1000.0) for b in bench.LINK_BYTES]        # a fast link: the TP all-reduces are small here
    return {"peak_tflops": peak, "link": link, "profile": points, "measured": points}


def test_a_one_point_profile_recovers_a_fixed_plus_roofline_layer():
    res = bench.errors(synthetic(), 0.5)
    after, before = res["mb1 after"], res["mb1 before"]
    assert max(abs(r["error"]) for k, r in after.items() if k.startswith("tp1 ")) < 1e-9
    assert before["tp1 mb32"]["error"] > 1.0                          # linear: the fixed part 32 times
    assert bench.mean_abs(after, 1) < bench.mean_abs(before, 1)
    # TP 2 from TP 1: the fixed part kept, the per-sample compute halved, plus the (small) all-reduces
    assert all(0 <= r["error"] < 0.05 for k, r in after.items() if k.startswith("tp2 "))
    full = res["full after"]
    assert max(abs(r["error"]) for r in full.values()) < 1e-9          # every point measured: the measurement


def test_the_table_reports_every_profile_and_rule():
    data = synthetic()
    data.update(load_avg_1min={"before": 1.0}, cpus=2, rounds=1)
    text = bench.table(data, {0.5: bench.errors(data, 0.5)})
    assert text.count("\n| ") == 1 + 6 and "mb1 | after | 0.5" in text
