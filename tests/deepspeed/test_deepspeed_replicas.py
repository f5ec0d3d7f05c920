"""Heterogeneous data parallelism on DeepSpeed, the parts without a process group: each rank's config, the
checks of the config against an uneven plan, the replica's sample order, and the data iterator guards."""
from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

deepspeed = pytest.importorskip("deepspeed")
import torch  # noqa: E402

import het_plugin.deepspeed as hds  # noqa: E402
from het_plugin.core.inputs.cluster import cluster_from_dict  # noqa: E402
from het_plugin.core.ranks.batches import ReplicaSampler  # noqa: E402
from het_plugin.deepspeed import engine as hds_engine  # noqa: E402
from het_plugin.deepspeed.replicas import (CountedIterator, ReplicaDataError, ReplicaSampleOrder,  # noqa: E402
                                           ReplicaShare, _refuse_even_sampler, check_batch_settings, rank_config)
from het_plugin.core.errors import ConfigError  # noqa: E402
from het_plugin.core.ranks.placement import place  # noqa: E402
from het_plugin.core.planner import assemble_plan  # noqa: E402
from het_plugin.core.ranks.dims import ParallelDims  # noqa: E402
from tests.deepspeed.test_deepspeed_config import DS, TINY, hetero_cluster  # noqa: E402


@pytest.fixture
def even():
    """pp=2 x dp=2 on the interleaved cluster (a permuted placement), micro 2, 2 micro-batches each (G = 8)."""
    cluster = cluster_from_dict(hetero_cluster())
    return assemble_plan(cluster, TINY, place(cluster, ParallelDims(pp=2, dp=2)), [5, 3], 2)


@pytest.fixture
def uneven(even):
    return dataclasses.replace(even, replica_micro_batches=[3, 1])


def rank_in(plan, replica: int) -> int:
    return next(r for r in range(plan.world_size) if plan.replica_of(r) == replica)


def test_each_rank_gets_its_replicas_accumulation_steps(uneven):
    assert not uneven.is_identity
    for rank in range(4):
        share = ReplicaShare.from_plan(uneven, rank)
        assert share.replica == uneven.replica_of(rank)
        cfg = rank_config(DS, share)
        count = [3, 1][share.replica]
        assert cfg["gradient_accumulation_steps"] == count and cfg["train_micro_batch_size_per_gpu"] == 2
        # DeepSpeed's check holds locally: train_batch_size = micro * gas * dp
        assert cfg["train_batch_size"] == 2 * count * 2
        assert cfg["zero_optimization"] == DS["zero_optimization"] and cfg is not DS
    assert DS["gradient_accumulation_steps"] == 2           # the input is not modified
    assert ReplicaShare.from_plan(uneven, rank_in(uneven, 0)).global_batch_size == 8


def test_config_contradicting_an_uneven_plan_is_named(even, uneven):
    check_batch_settings(uneven, DS)
    check_batch_settings(uneven, {"steps_per_print": 1})                      # no batch keys: the plan's
    check_batch_settings(even, dict(DS, gradient_accumulation_steps=1, train_batch_size=4))   # even: as before
    with pytest.raises(ConfigError, match=r"train_batch_size: train_batch_size is 16, but the plan splits a global "
                                          r"batch of 8 samples .* micro-batches \[3, 1\] .* must be 8"):
        check_batch_settings(uneven, dict(DS, train_batch_size=16), "cfg.json")
    with pytest.raises(ConfigError, match="gradient_accumulation_steps is 3.*must be 2"):
        check_batch_settings(uneven, dict(DS, gradient_accumulation_steps=3))
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu is 4.*must be 2"):
        check_batch_settings(uneven, dict(DS, train_micro_batch_size_per_gpu=4))
    with pytest.raises(ConfigError, match=r"zero_optimization.stage: ZeRO stage 2 reduces gradients at every "
                                          r"micro-batch.*\[3, 1\]"):
        check_batch_settings(uneven, dict(DS, zero_optimization={"stage": 2}))
    check_batch_settings(uneven, dict(DS, zero_optimization={"stage": 1}))
    with pytest.raises(ConfigError, match="train_batch_size is 16"):           # wrap-config refuses it too
        hds.wrap(dict(DS, train_batch_size=16, gradient_accumulation_steps=4), uneven)


def test_wrap_fills_the_plans_batch(uneven):
    cfg = hds.wrap({"steps_per_print": 1}, uneven)
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) \
        == (8, 2, 2)


def test_replica_sample_order_reads_each_sample_once_per_iteration(uneven):
    orders = [list(ReplicaSampleOrder(20, ReplicaShare.from_plan(uneven, rank_in(uneven, d)))) for d in (0, 1)]
    # 20 samples = 2 whole global batches of 8 (the incomplete third is dropped on every replica)
    assert orders == [[0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13], [6, 7, 14, 15]]
    assert len(ReplicaSampleOrder(20, ReplicaShare.from_plan(uneven, rank_in(uneven, 0)))) == 12
    loader = torch.utils.data.DataLoader(list(range(20)), batch_size=2,
                                         sampler=ReplicaSampleOrder(20, ReplicaShare.from_plan(uneven, rank_in(uneven, 1))))
    assert [b.tolist() for b in loader] == [[6, 7], [14, 15]]
    shuffled = list(reversed(range(20)))        # positions in a data order
    assert list(ReplicaSampleOrder(20, ReplicaShare.from_plan(uneven, rank_in(uneven, 1)), order=shuffled)) == \
        [13, 12, 5, 4]


def test_shuffled_order_follows_set_epoch_like_distributed_sampler(even, uneven):
    """Each epoch's global batches hold the samples DeepSpeed's shuffling DistributedSampler gives the even split
    in that epoch (set_epoch redraws both), whatever the split."""
    samples, gbs = 40, 8
    dp, micro, accum = even.dp, even.micro_batch_size, 2

    def even_split_batches(epoch):
        per_rank = []
        for r in range(dp):
            s = torch.utils.data.DistributedSampler(list(range(samples)), num_replicas=dp, rank=r, shuffle=True, seed=3)
            s.set_epoch(epoch)
            per_rank.append(list(s))
        steps = samples // gbs
        return [sorted(x for rank in per_rank for x in rank[i * micro * accum:(i + 1) * micro * accum])
                for i in range(steps)]

    orders = [ReplicaSampleOrder(samples, ReplicaShare.from_plan(uneven, rank_in(uneven, d)), shuffle_seed=3)
              for d in range(dp)]
    seen_epochs = []
    for epoch in (0, 1, 2):
        for o in orders:
            o.set_epoch(epoch)
        reads = [list(o) for o in orders]
        counts = uneven.replica_counts
        got = [sorted(reads[0][i * counts[0] * micro:(i + 1) * counts[0] * micro] +
                      reads[1][i * counts[1] * micro:(i + 1) * counts[1] * micro]) for i in range(samples // gbs)]
        assert got == even_split_batches(epoch), epoch
        seen_epochs.append(got)
    assert seen_epochs[0] != seen_epochs[1], "set_epoch must redraw the order"


def test_dry_iterator_names_replica_and_numbers(uneven):
    share = ReplicaShare.from_plan(uneven, rank_in(uneven, 0))
    it = CountedIterator(iter(range(4)), share)
    assert [next(it) for _ in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ReplicaDataError) as info:
        next(it)
    text = str(info.value)
    assert "replica 0 runs 3 micro-batches of 2 samples per iteration (samples [0, 6) of each global batch of 8" in text
    assert "ran dry after 4 micro-batches: 1 full iterations and 1 of the 3 micro-batches of iteration 2" in text


def test_loader_over_distributed_sampler_is_refused(uneven):
    share = ReplicaShare.from_plan(uneven, rank_in(uneven, 0))
    data = list(range(16))
    even_loader = torch.utils.data.DataLoader(
        data, batch_size=2, sampler=torch.utils.data.DistributedSampler(data, num_replicas=2, rank=0))
    for given in (even_loader, iter(even_loader), deepspeed.utils.RepeatingLoader(even_loader)):
        with pytest.raises(ConfigError, match="DistributedSampler .*over 2 replicas.*replica 0 runs 3"):
            _refuse_even_sampler(given, share)
    mine = torch.utils.data.DataLoader(data, batch_sampler=ReplicaSampler(16, 0, share.batches, 0))
    for given in (mine, iter(mine), deepspeed.utils.RepeatingLoader(mine), iter([1, 2])):
        _refuse_even_sampler(given, share)


def test_replica_batch_sampler_for_users_own_loader(uneven):
    from het_plugin.runtime.applied import AppliedPlan
    engine = argparse.Namespace(het_plan=uneven, het_applied=AppliedPlan.start(uneven, rank_in(uneven, 1), "gloo"))
    loader = torch.utils.data.DataLoader(list(range(16)), batch_sampler=hds.replica_batch_sampler(engine, 16))
    assert [b.tolist() for b in loader] == [[6, 7], [14, 15]]
    assert hds.ReplicaDataError is ReplicaDataError
    with pytest.raises(ConfigError, match="not built by het_plugin"):
        hds.replica_batch_sampler(argparse.Namespace(), 16)


@pytest.fixture
def recorded(monkeypatch):
    calls, applied = [], []

    def fake_initialize(*args, **kwargs):
        calls.append(kwargs)
        return (argparse.Namespace(training_dataloader="replica loader"), "opt", "deepspeed loader", "sched")

    fake_initialize.__signature__ = inspect.signature(deepspeed.initialize)
    monkeypatch.setattr(deepspeed, "initialize", fake_initialize)
    monkeypatch.setattr(hds_engine, "apply_replica_split", lambda *a: applied.append(a))
    return calls, applied


def pipeline_model_with(plan, rank):
    from het_plugin.runtime.applied import AppliedPlan
    model = object.__new__(hds.PipelineModule)
    object.__setattr__(model, "het_plan", plan)
    object.__setattr__(model, "het_applied", AppliedPlan.start(plan, rank, "gloo"))
    return model


def test_initialize_hands_deepspeed_the_ranks_config(recorded, even, uneven):
    calls, applied = recorded
    rank = rank_in(uneven, 1)
    data = object()
    result = hds.initialize(model=pipeline_model_with(uneven, rank), config=hds.wrap(DS, uneven), training_data=data)
    assert calls[0]["config"]["gradient_accumulation_steps"] == 1 and calls[0]["config"]["train_batch_size"] == 4
    engine, share, training_data = applied[0]
    assert share == ReplicaShare.from_plan(uneven, rank) and share.replica == 1 and training_data is data
    assert result == (engine, "opt", "replica loader", "sched")
    # An even plan: DeepSpeed's config and return value exactly.
    result = hds.initialize(model=pipeline_model_with(even, rank), config=hds.wrap(DS, even))
    assert calls[1]["config"] == DS and result[2] == "deepspeed loader" and len(applied) == 1
