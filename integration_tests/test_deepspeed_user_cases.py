"""Issue 33: DeepSpeed pipeline scripts as users write them, on 4 gloo ranks under plans that permute the ranks.

* tied layers (TiedLayerSpec on the first and last stage) start from the first stage's copy, as DeepSpeed's do;
* a data rank the script reads from the topology object it built is the plan's;
* a loader of the script's own under an uneven replica split reads the replica's range (replica_sampler) or is
  refused, whatever its sampler.

The pipeline runs reuse ranks/deepspeed_pipe.py (and its baseline: DeepSpeed's own PipelineModule with the plan's
split forced), the replica runs ranks/deepspeed_replicas.py and test_deepspeed_replicas' plans and checks.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
import torch  # noqa: E402

from het_plugin.core.inputs.cluster import load_cluster  # noqa: E402
from het_plugin.core.planner import assemble_plan  # noqa: E402
from het_plugin.core.ranks.dims import ParallelDims  # noqa: E402
from het_plugin.core.ranks.placement import place  # noqa: E402
from het_plugin.deepspeed import wrap, write_config  # noqa: E402
from integration_tests.test_deepspeed import (DATA, MODEL, PIPE, PIPE_CONFIG, assert_follows_plan,  # noqa: E402
                                              launch, results)
from integration_tests import test_deepspeed_replicas as replicas  # noqa: E402

SAME_SPLIT = ["--parts", "0,6,10", "--pp", 2, "--mp", 1]      # the plan's [5, 3] over InProj, 8 Blocks, Head


def stage0_on_odd_ranks(tmp_path: Path):
    """The 4-rank example cluster (ds_hetero_4.yaml: IB and RoCE nodes launched alternately) with the RoCE
    stage first: stage 0 on launch ranks 1 and 3, so the lowest rank of each pipeline is its last stage."""
    cluster = load_cluster(DATA / "ds_hetero_4.yaml")
    placement = place(cluster, ParallelDims(pp=2, dp=2), domain_order=list(reversed(cluster.domains)))
    plan = assemble_plan(cluster, MODEL, placement, [5, 3], 2)
    assert plan.stage_ranks(0) == [1, 3] and plan.stage_ranks(1) == [0, 2]
    plan.save(tmp_path / "plan.json")
    write_config(wrap(PIPE_CONFIG, tmp_path / "plan.json", layer_pattern="Block", pp=2), tmp_path / "cfg.json")
    return plan, tmp_path / "cfg.json"


def test_tied_layers_start_from_the_first_stage_as_deepspeeds(tmp_path):
    plan, cfg = stage0_on_odd_ranks(tmp_path)
    res = results(launch(PIPE, 4, ["--config", cfg, "--tied", *SAME_SPLIT[2:]]))
    base = results(launch(PIPE, 4, ["--baseline", "--tied", *SAME_SPLIT]))
    assert_follows_plan(res, plan)
    for r in res:
        same_coords = base[plan.logical_of_physical[r["rank"]]]      # DeepSpeed's rank for these coordinates
        assert same_coords["stage"] == r["stage"] and same_coords["data_id"] == r["data_id"]
        assert r["tied"] == same_coords["tied"]                      # before and after training, both stages
        assert r["tied"][0] is not None
    first, last = (next(r for r in base if r["stage"] == s and r["data_id"] == 0) for s in (0, 1))
    assert first["tied"][0] == last["tied"][0]                        # DeepSpeed ties them: one initial value
    assert all(r["losses"] == base[0]["losses"] for r in res)         # bit for bit
    assert len(set(base[0]["losses"])) > 1


def test_activation_checkpointing_and_unseeded_tied_layers_are_deepspeeds(tmp_path):
    """activation_checkpoint_interval=1 and seed_layers=False (each stage builds its layers from torch's own RNG:
    the tied layer's copies start different) under the permuting plan: losses bit-equal to DeepSpeed's."""
    plan, cfg = stage0_on_odd_ranks(tmp_path)
    options = ["--tied", "--checkpoint-interval", 1, "--no-seed-layers"]
    res = results(launch(PIPE, 4, ["--config", cfg, *options, *SAME_SPLIT[2:]]))
    base = results(launch(PIPE, 4, ["--baseline", *options, *SAME_SPLIT]))
    assert_follows_plan(res, plan)
    for r in res:
        assert r["tied"] == base[plan.logical_of_physical[r["rank"]]]["tied"]
    assert all(r["losses"] == base[0]["losses"] for r in res)


def test_a_data_rank_read_from_the_scripts_topology_is_the_plans(tmp_path):
    """The script builds PipeModelDataParallelTopology, hands it to PipelineModule and picks its samples by
    topo.get_coord(rank).data: both stages of a pipeline read the same samples, as with DeepSpeed alone."""
    plan, cfg = stage0_on_odd_ranks(tmp_path)
    res = results(launch(PIPE, 4, ["--config", cfg, "--data-rank", "topology", *SAME_SPLIT[2:]]))
    base = results(launch(PIPE, 4, ["--baseline", "--data-rank", "topology", *SAME_SPLIT]))
    assert_follows_plan(res, plan)            # data_id (read from the script's topology) is the plan's dp coordinate
    assert [r["groups_data_rank"] for r in res] == [plan.coord(r["rank"])["dp"] for r in res]   # deepspeed.utils.groups
    assert all(r["losses"] == base[0]["losses"] for r in res)


def test_a_scripts_own_loader_under_uneven_shares_reads_the_replica_range_or_stops(tmp_path):
    even_plan, uneven_plan = replicas.plans(ParallelDims(pp=2, dp=2), [3, 1], 8, [3, 1])
    assert not uneven_plan.is_identity
    outs = replicas.launch(tmp_path, "strided", replicas.PIPE_CONFIG, uneven_plan, "pipe", "--loader", "strided",
                           check=False)
    assert all(o.returncode != 0 and o.result is None for o in outs)
    for o in outs:                                  # pp=2: every rank is a first or last stage and reads data
        assert "ConfigError" in o.stderr and "reads through a list" in o.stderr
        assert "replica_sampler(engine, len(dataset))" in o.stderr
    even = replicas.launch(tmp_path, "even", replicas.PIPE_CONFIG, even_plan, "pipe")
    mine = replicas.launch(tmp_path, "replica", replicas.PIPE_CONFIG, uneven_plan, "pipe", "--loader", "replica")
    replicas.assert_same_training(even, mine)
    replicas.assert_each_sample_once(mine, uneven_plan, 8, list(range(64)))


def test_deepspeed_io_under_uneven_shares_reads_the_replica_range_of_its_order(tmp_path):
    """engine.deepspeed_io(dataset) (DeepSpeed's shuffling DistributedSampler, seed 0) in the script's own
    RepeatingLoader: on the uneven split each replica reads its range of the same global batches."""
    even_plan, uneven_plan = replicas.plans(ParallelDims(pp=2, dp=2), [3, 1], 8, [3, 1])
    even = replicas.launch(tmp_path, "even_io", replicas.PIPE_CONFIG, even_plan, "pipe", "--loader", "deepspeed_io")
    mine = replicas.launch(tmp_path, "uneven_io", replicas.PIPE_CONFIG, uneven_plan, "pipe", "--loader",
                           "deepspeed_io")
    replicas.assert_same_training(even, mine)
    shuffled = torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist()
    replicas.assert_each_sample_once(even, even_plan, 8, shuffled)
    replicas.assert_each_sample_once(mine, uneven_plan, 8, shuffled)


def bf16_step(x: float) -> float:
    """The spacing of bf16 numbers at |x| (7 stored significand bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 2.0 ** -126))) - 7)


def test_bf16_under_uneven_shares_stays_within_one_bf16_step_of_the_even_split(tmp_path):
    """docs/deepspeed.md's bound: each micro-batch's bf16 gradient is the even split's (loss_weight); DeepSpeed's
    BF16_Optimizer sums them in another grouping (bf16 accumulation, its default) into fp32 master weights, so after
    a plain-SGD step (lr 0.1: lr times the summation bound is far below a bf16 step) every bf16 parameter is within
    one bf16 step of the even split's; the reported loss, a bf16 sum in another grouping, within
    (max count + dp) bf16 roundings."""
    even_plan, uneven_plan = replicas.plans(ParallelDims(pp=2, dp=2), [3, 1], 8, [3, 1])
    bf16 = ["--bf16", "--steps", 1]
    even = replicas.launch(tmp_path, "even_bf16", replicas.PIPE_CONFIG, even_plan, "pipe", *bf16)
    uneven = replicas.launch(tmp_path, "uneven_bf16", replicas.PIPE_CONFIG, uneven_plan, "pipe", *bf16)
    differing = 0
    for e, u in zip(even, uneven):
        for name in e["params"]:
            for a, b in zip(e["params"][name], u["params"][name]):
                assert abs(a - b) <= max(bf16_step(a), bf16_step(b)), name
                differing += a != b
    assert differing < 0.05 * sum(len(p) for r in even for p in r["params"].values())
    rounding = (max(uneven_plan.replica_counts) + uneven_plan.dp) * 2.0 ** -8
    for e, u in zip(even, uneven):
        assert abs(u["losses"][0] - e["losses"][0]) <= rounding * abs(e["losses"][0])
