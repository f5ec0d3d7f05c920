"""The start-up benchmark's two ways of holding the ranks (benchmarks/bench_startup.py, startup_procs.py) run the
same protocol: with the ranks as threads of one process and spread over worker processes, every phase makes the
same store requests and moves the same bytes, rank 0 and the busiest other rank included (32 ranks, 4 nodes)."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_startup  # noqa: E402

N = 32


def counts(phases):
    return {p.name: (p.requests, p.bytes, p.max_rank_requests, p.root_requests) for p in phases if p.name != "plan"}


def test_threads_and_processes_make_the_same_requests(monkeypatch):
    monkeypatch.setattr(bench_startup, "REPEATS", 1)
    sysfs = bench_startup.fake_sysfs()
    try:
        threads, sizes = bench_startup.het_plugin_phases(N, sysfs, "gpt-7.5b")
        pooled, pooled_sizes, ref = bench_startup.pooled_run(N, sysfs, "gpt-7.5b", True, processes=2)
    finally:
        shutil.rmtree(sysfs, ignore_errors=True)
    assert [p.name for p in pooled] == list(bench_startup.PHASES)
    assert all("2 processes" in p.notes for p in pooled if p.name != "plan")
    a, b = counts(threads), counts(pooled)
    guard_a, guard_b = a.pop("guard"), b.pop("guard")
    assert a == b and a["agreement"][2] == 4                 # bounded per rank, whoever holds the ranks
    # the guard's heartbeats follow the wall time: its start and end requests are the same, beats may differ
    assert guard_b[0] >= 3 * N and abs(guard_a[0] - guard_b[0]) <= 2 * N
    assert sizes == pooled_sizes
    assert [p.name for p in ref] == list(bench_startup.TORCH) and ref[1].requests >= 4 * N
