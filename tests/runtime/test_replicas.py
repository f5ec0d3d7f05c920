"""This rank's share of the global batch (het_plugin.runtime.replicas): count, weight, loss scale, and the
checks both adapters make of a launch's batch."""
from __future__ import annotations

import dataclasses

import pytest

from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.errors import ConfigError
from het_plugin.core.planner import make_plan
from het_plugin.runtime.replicas import ReplicaShare
from tests.megatron_common import DATA, MODEL


@pytest.fixture(scope="module")
def plan():
    even = make_plan(load_cluster(DATA / "megatron-ib-roce-4.yaml"), MODEL, tp=1, pp=2, micro_batch_size=2)
    assert (even.dp, even.num_micro_batches) == (2, 2)
    return even


def test_each_rank_gets_its_replicas_count_range_and_weight(plan):
    uneven = dataclasses.replace(plan, replica_micro_batches=[3, 1])
    for rank in range(uneven.world_size):
        share = ReplicaShare.from_plan(uneven, rank)
        d = uneven.replica_of(rank)
        assert share.replica == d and share.count == [3, 1][d] and share.uneven
        assert share.samples == uneven.replica_samples(d) and share.global_batch_size == 8
        assert share.weight == pytest.approx(uneven.replica_weight(d))
        # the framework divides by the replica's count and averages over dp: this factor restores the weight
        # (each of the global batch's dp * N = 4 micro-batch losses weighs 1/4, as on the even split)
        assert share.loss_scale / (share.count * share.dp) == pytest.approx(1 / (share.dp * share.even_count))
        assert "replica" in share.describe() and f"{share.count} micro-batches" in share.describe()


def test_the_even_split_scales_nothing(plan):
    for rank in range(plan.world_size):
        share = ReplicaShare.from_plan(plan, rank)
        assert not share.uneven and share.loss_scale == 1.0 and share.weight == 1 / plan.dp
        assert share.count_for(plan.num_micro_batches, source="s") == plan.num_micro_batches


def test_the_even_count_becomes_the_replicas_and_other_counts_are_refused(plan):
    uneven = dataclasses.replace(plan, replica_micro_batches=[3, 1])
    rank = next(r for r in range(uneven.world_size) if uneven.replica_of(r) == 1)
    share = ReplicaShare.from_plan(uneven, rank)
    assert share.count_for(2, source="s") == 1 and share.count_for(1, source="s") == 1
    with pytest.raises(ConfigError) as err:
        share.count_for(4, source="schedule")
    text = str(err.value)
    assert "num_microbatches=4" in text and "replica 1 runs 1 micro-batches" in text and "global batch of 8" in text
    assert "fix:" in text


@pytest.mark.parametrize("gbs, mbs, field", [(16, 2, "global_batch_size"), (8, 4, "micro_batch_size"),
                                             (None, 1, "micro_batch_size")])
def test_a_launch_batch_other_than_the_plans_is_refused_naming_the_numbers(plan, gbs, mbs, field):
    share = ReplicaShare.from_plan(dataclasses.replace(plan, replica_micro_batches=[3, 1]), 0)
    share.check_batch(8, 2, source="launch")             # the plan's own: fine
    share.check_batch(None, None, source="launch")       # nothing given: nothing to compare
    with pytest.raises(ConfigError) as err:
        share.check_batch(gbs, mbs, source="launch")
    assert err.value.field == field and f"{field}={gbs if field == 'global_batch_size' else mbs}" in str(err.value)
    assert f"replica {share.replica} runs" in str(err.value)


def test_a_dry_replica_is_named_with_the_micro_batch_and_its_count(plan):
    share = ReplicaShare.from_plan(dataclasses.replace(plan, replica_micro_batches=[3, 1]), 0)
    error = share.ran_dry(3)
    assert f"replica {share.replica}'s data iterator ran dry at micro-batch 3 of {share.count}" in str(error)
    assert "ReplicaSampler" in error.fix
