"""The heterogeneous data-parallel benchmark's pure parts (benchmarks/bench_hetdp.py): the cluster's speeds
are 2:1 from the catalog, (iii)'s plan puts the pipeline across the clusters with layers split by speed and
data parallelism on each cluster's fabric, and the speed check says NOT HELD when a node was off."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_hetdp  # noqa: E402
from e2e_setup import TinyShape  # noqa: E402
from het_plugin.emulate import make_layout, node_speeds  # noqa: E402


def test_the_cluster_is_two_to_one_by_the_catalog():
    c = bench_hetdp.hetdp_cluster()
    assert node_speeds(c, "catalog") == (1.0, 1.0, 0.5, 0.5)
    lay = make_layout(c, "abcdef", bench_hetdp.DEFAULT_SCALE, (), "catalog", 0.5)
    assert [n.cpu.quota_us for n in lay.nodes] == [10000, 10000, 5000, 5000]


@pytest.mark.parametrize("n,speeds,want", [(8, [1, 2], [3, 5]), (8, [2, 1], [5, 3]), (8, [1, 1], [4, 4]),
                                           (3, [1, 20], [1, 2]), (7, [1, 1, 1], [3, 2, 2])])
def test_layers_split_by_speed(n, speeds, want):
    assert bench_hetdp.split_by_speed(n, speeds) == want


def test_the_pipeline_plan_crosses_the_clusters_with_more_layers_on_the_fast_stage(tmp_path):
    path, summary = bench_hetdp.pipeline_plan(bench_hetdp.hetdp_cluster(), TinyShape(), None, tmp_path)
    assert path.exists()
    fast = summary["stages"].index("fast")
    assert sorted(summary["stages"]) == ["fast", "slow"]
    assert summary["layers_per_stage"][fast] == 5 and sum(summary["layers_per_stage"]) == 8
    assert summary["transports"]["dp"] == ["ib", "roce"] and summary["transports"]["pp"] == ["socket"]


def _out(before, after):
    cpu = [{"node": n, "speed": s} for n, s in (("fast-0", 1.0), ("fast-1", 1.0), ("slow-0", 0.5), ("slow-1", 0.5))]
    return {"cpu": cpu, "compute_rates": {"before": before, "after": after}}


def test_the_speed_check():
    assert "held (every node" in bench_hetdp.speed_check(_out([2, 2, 1, 1.1], [4, 3.8, 2.1, 1.9]))
    text = bench_hetdp.speed_check(_out([2, 2, 1, 1], [4, 4, 2, 3.2]))        # slow-1 at 0.80 after
    assert text.startswith("compute speed check: NOT HELD (slow-1 0.80 after;")
