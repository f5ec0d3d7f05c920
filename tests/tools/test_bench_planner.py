"""The planner benchmark's HETHUB reference (benchmarks/bench_planner.py): the sub-clusters sharing one global
batch as one job -- the best split, each sub-cluster with its own best plan, the iteration as long as the slower."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_planner  # noqa: E402
from het_plugin.core.inputs.cluster import cluster_from_dict  # noqa: E402
from het_plugin.core.inputs.model import preset_model  # noqa: E402
from het_plugin.core.planner import plan_candidates  # noqa: E402


def _sub(name: str, acc: str, count: int):
    return cluster_from_dict({"name": name, "clusters": [{"name": name, "fabric": {"type": "ib", "gbps": 800},
                                                          "nodes": [{"count": count, "accelerator": acc,
                                                                     "accelerators_per_node": 8}]}]})


def test_shared_batch_reference_is_the_best_split_of_one_batch():
    subs = [_sub("fast", "H100", 1), _sub("slow", "A100-80", 2)]
    model = preset_model("gpt-3.6b").model_copy(update={"global_batch_size": 48})
    B, seq = model.global_batch_size, model.seq_length

    def time_s(sub, b):
        best = plan_candidates(sub, model.model_copy(update={"global_batch_size": b}))
        return best[0].prediction.iteration_s

    full = [plan_candidates(s, model)[0].prediction.tokens_per_s for s in subs]
    bound, split, parts = bench_planner.shared_batch_reference(subs, model)
    every = {b: B * seq / max(time_s(subs[0], b), time_s(subs[1], B - b)) for b in range(1, B)}
    assert bound == max(every.values()) == every[split]
    assert parts[0][0] == time_s(subs[0], split) and parts[1][0] == time_s(subs[1], B - split)
    assert bound < sum(full)        # each alone with the whole batch: twice the sequences per step between them
    # the compute floor is below every part's planned time, so the split search skips no better split
    for sub in subs:
        floor = bench_planner._compute_floor_s(sub, model)
        assert all(floor * b < time_s(sub, b) for b in (1, B // 2, B - 1))
