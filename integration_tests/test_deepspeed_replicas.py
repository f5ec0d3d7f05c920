"""Heterogeneous data parallelism on DeepSpeed (CPU/gloo, 4 ranks): an uneven replica split of the same
global batch trains exactly like the even one (parameters after plain-SGD steps, the reported loss), each
replica reads its own range of every global batch through deepspeed_io, and a data iterator that runs dry
early stops with the numbers. Each launch has a hard timeout."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
import torch  # noqa: E402

from het_plugin.core.inputs.cluster import load_cluster  # noqa: E402
from het_plugin.deepspeed import wrap, write_config  # noqa: E402
from het_plugin.core.inputs.model import load_model  # noqa: E402
from het_plugin.core.ranks.placement import place  # noqa: E402
from het_plugin.core.planner import assemble_plan  # noqa: E402
from het_plugin.core.ranks.dims import ParallelDims  # noqa: E402
from integration_tests.support.deepspeed_cpu import cpu_environment  # noqa: E402
from integration_tests.support.launch import run_ranks  # noqa: E402

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
SCRIPT = HERE / "ranks" / "deepspeed_replicas.py"
ENV = dict(cpu_environment(), HET_PLUGIN_GLOO_IFNAMES="local=lo,ib=lo,roce=lo,socket=lo")
TIMEOUT = 180
STEPS = 2
# Pipeline: 4 counted blocks, pp=2 x dp=2, micro 2, 2 micro-batches per replica on the even split (G = 8).
PIPE_CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "train_batch_size": 8,
               "steps_per_print": 10 ** 6}
# Data parallelism only: dp=4, ZeRO-1, G = 16 (2 micro-batches of 2 per replica when even).
DP_CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "train_batch_size": 16,
             "steps_per_print": 10 ** 6, "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}


def plans(dims: ParallelDims, layers: list[int], global_batch: int, uneven: list[int]):
    cluster = load_cluster(DATA / "ds_hetero_4.yaml")
    model = load_model(DATA / "ds_tiny_model.yaml").model_copy(
        update={"num_layers": sum(layers), "global_batch_size": global_batch})
    even = assemble_plan(cluster, model, place(cluster, dims), layers, 2)
    return even, dataclasses.replace(even, replica_micro_batches=uneven)


def launch(tmp_path: Path, name: str, config: dict, plan, mode: str, *extra, check: bool = True):
    path = tmp_path / f"{name}.json"
    write_config(wrap(config, plan, pp=plan.pp, layer_pattern="Block" if mode == "pipe" else None), path)
    outs = run_ranks(SCRIPT, 4, ["--config", str(path), "--mode", mode, "--steps", str(STEPS), *map(str, extra)],
                     env=ENV, timeout=TIMEOUT, check=check)
    return outs if not check else sorted((o.result for o in outs), key=lambda r: r["rank"])


def assert_same_training(even: list[dict], uneven: list[dict]) -> None:
    for e, u in zip(even, uneven):
        assert e["params"].keys() == u["params"].keys()
        for name in e["params"]:
            assert u["params"][name] == pytest.approx(e["params"][name], rel=1e-5, abs=1e-6), name
        assert u["losses"] == pytest.approx(e["losses"], rel=1e-5, abs=1e-7)
    assert len(set(even[0]["losses"])) == STEPS                     # it trained: the loss moved


def assert_each_sample_once(res: list[dict], plan, global_batch: int, order: list[int]) -> None:
    """Per step, the first-stage ranks together read the step's global batch of the data order exactly once:
    on the even split dealt out round-robin (DeepSpeed's DistributedSampler), on the uneven one each replica
    its own contiguous range of it (plan.replica_samples)."""
    readers = [r for r in res if r["first_stage"]]
    assert sorted(r["replica"] for r in readers) == list(range(plan.dp))
    per_replica = plan.num_micro_batches * plan.micro_batch_size
    for step in range(STEPS):
        batch = order[step * global_batch:(step + 1) * global_batch]
        assert sorted(i for r in readers for i in r["consumed"][step]) == sorted(batch)
        for r in readers:
            d = r["replica"]
            if plan.uneven_replicas:
                start, stop = plan.replica_samples(d)
                assert r["consumed"][step] == batch[start:stop]
            else:
                assert r["consumed"][step] == order[d::plan.dp][step * per_replica:(step + 1) * per_replica]


def test_pipeline_pp2_dp2_uneven_split_trains_like_the_even_one(tmp_path):
    even_plan, uneven_plan = plans(ParallelDims(pp=2, dp=2), [3, 1], 8, [3, 1])
    assert not even_plan.is_identity            # the permuted placement: replicas are not launch order
    even = launch(tmp_path, "pipe_even", PIPE_CONFIG, even_plan, "pipe")
    uneven = launch(tmp_path, "pipe_uneven", PIPE_CONFIG, uneven_plan, "pipe")
    for r in uneven:
        assert r["replica"] == uneven_plan.replica_of(r["rank"])
        assert r["gas"] == r["count"] == [3, 1][r["replica"]]
        assert r["train_batch_size"] == 8 and r["global_samples"] == STEPS * 8
    assert {r["gas"] for r in even} == {2}
    assert_same_training(even, uneven)
    in_order = list(range(64))                  # DeepSpeed's pipeline loader reads in order
    assert_each_sample_once(even, even_plan, 8, in_order)
    assert_each_sample_once(uneven, uneven_plan, 8, in_order)


def test_data_parallel_zero1_uneven_split_trains_like_the_even_one(tmp_path):
    even_plan, uneven_plan = plans(ParallelDims(pp=1, dp=4), [4], 16, [3, 1, 2, 2])
    even = launch(tmp_path, "dp_even", DP_CONFIG, even_plan, "dp")
    uneven = launch(tmp_path, "dp_uneven", DP_CONFIG, uneven_plan, "dp")
    assert [r["gas"] for r in sorted(uneven, key=lambda r: r["replica"])] == [3, 1, 2, 2]
    assert all(r["global_samples"] == STEPS * 16 for r in uneven)
    assert_same_training(even, uneven)
    # DeepSpeed's plain loader: DistributedSampler's default, a permutation (seed 0) dealt out round-robin
    shuffled = torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist()
    assert_each_sample_once(even, even_plan, 16, shuffled)
    assert_each_sample_once(uneven, uneven_plan, 16, shuffled)


def test_data_iterator_running_dry_names_the_replica_and_numbers(tmp_path):
    _, uneven_plan = plans(ParallelDims(pp=2, dp=2), [3, 1], 8, [3, 1])
    outs = launch(tmp_path, "pipe_dry", PIPE_CONFIG, uneven_plan, "pipe", "--dry", 4, check=False)
    failed = [o for o in outs if "ReplicaDataError" in o.stderr]
    assert failed and all(uneven_plan.replica_of(o.rank) == 0 for o in failed)
    assert "replica 0 runs 3 micro-batches of" in failed[0].stderr
    assert "ran dry after 4 micro-batches: 1 full iterations and 1 of the 3 micro-batches of iteration 2" \
        in failed[0].stderr
    assert all(o.returncode != 0 for o in outs)


def test_one_rank_contradicting_the_uneven_plan_stops_every_rank(tmp_path):
    """Rank 0's config (edited after wrapping) claims a global batch of 32 for the plan's 16: rank 0 names the
    key and the numbers, the others stop with PlanMismatchError naming rank 0 -- before any group exists."""
    _, uneven_plan = plans(ParallelDims(pp=1, dp=4), [4], 16, [3, 1, 2, 2])
    good = wrap(DP_CONFIG, uneven_plan)
    write_config(good, tmp_path / "good.json")
    write_config(dict(good, train_batch_size=32, gradient_accumulation_steps=4), tmp_path / "bad.json")
    configs = [tmp_path / "bad.json"] + [tmp_path / "good.json"] * 3
    outs = run_ranks(SCRIPT, 4, ["--mode", "dp"], env=ENV, timeout=TIMEOUT, check=False,
                     rank_env=[{"DS_TEST_CONFIG": str(c)} for c in configs])
    assert all(o.returncode != 0 and o.result is None for o in outs)
    assert "ConfigError" in outs[0].stderr
    assert "train_batch_size is 32, but the plan splits a global batch of 16 samples" in outs[0].stderr
    assert "micro-batches [3, 1, 2, 2]" in outs[0].stderr
    for o in outs[1:]:
        assert "PlanMismatchError: rank(s) 0 could not compute the plan" in o.stderr
