"""The Megatron schedule wrapper for uneven data-parallel replicas (het_plugin.megatron.replicas), one process:
what a schedule call receives (count, grad_scale_func) and what it refuses; an even plan leaves Megatron's
schedules and sampler as they are. The training math itself: integration_tests/test_megatron_replicas.py."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.errors import ConfigError
from het_plugin.megatron import applied_state
from het_plugin.megatron import mcore as core, replicas
from het_plugin.runtime.patches import PATCHES
from het_plugin.core.planner import make_plan
from het_plugin.runtime.applied import AppliedPlan
from het_plugin.runtime.group_policy import Policy
from tests.megatron_common import DATA, MODEL

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def even():
    return make_plan(load_cluster(DATA / "megatron-ib-roce-4.yaml"), MODEL, tp=1, pp=2, micro_batch_size=2)


@pytest.fixture
def applied(monkeypatch, even):
    """Make ``plan`` the applied plan of this process, on ``rank``."""
    def apply(plan, rank):
        monkeypatch.setattr(applied_state, "_current", AppliedPlan(plan, rank, Policy("gloo")))
        return plan
    return apply


def rank_of_replica(plan, d):
    return next(r for r in range(plan.world_size) if plan.replica_of(r) == d)


class Recorder:
    """A schedule with Megatron's keyword-only arguments; records what it was called with."""

    def __init__(self):
        self.calls = []

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
                 forward_only=False, **kwargs):
        config = model[0].config
        scaled = config.grad_scale_func(2.0) if config.grad_scale_func is not None else None
        steps = [forward_step_func(data_iterator, model) for _ in range(num_microbatches)]
        self.calls.append({"num_microbatches": num_microbatches, "scaled": scaled, "steps": steps})
        return steps


def model(per_token=False, grad_scale_func=None):
    return SimpleNamespace(config=SimpleNamespace(grad_scale_func=grad_scale_func, calculate_per_token_loss=per_token))


def call(schedule, m, n, *, data=None, forward_only=False, mbs=2):
    data = iter(range(100)) if data is None else data
    return schedule(forward_step_func=lambda it, _m: next(it), data_iterator=data, model=[m], num_microbatches=n,
                    seq_length=16, micro_batch_size=mbs, forward_only=forward_only)


@pytest.mark.parametrize("d, count", [(0, 3), (1, 1)])
def test_the_even_count_runs_as_the_replicas_count_with_its_loss_scale(applied, even, d, count):
    plan = applied(dataclasses.replace(even, replica_micro_batches=[3, 1]), rank_of_replica(even, d))
    inner, m = Recorder(), model()
    schedule = replicas.wrap_schedule(inner)
    assert call(schedule, m, plan.num_micro_batches) == list(range(count))
    assert inner.calls[0]["num_microbatches"] == count
    assert inner.calls[0]["scaled"] == pytest.approx(2.0 * count / plan.num_micro_batches)
    assert m.config.grad_scale_func is None, "restored after the call"
    # the optimizer's own loss scale (Megatron-LM sets grad_scale_func = optimizer.scale_loss) is kept under ours
    m2 = model(grad_scale_func=lambda t: t * 1024)
    call(schedule, m2, count)                  # the replica's own count passes as it is
    assert inner.calls[1]["scaled"] == pytest.approx(2.0 * 1024 * count / plan.num_micro_batches)
    assert m2.config.grad_scale_func(1.0) == 1024


def test_evaluation_and_per_token_loss_keep_megatrons_scale(applied, even):
    applied(dataclasses.replace(even, replica_micro_batches=[3, 1]), rank_of_replica(even, 0))
    inner = Recorder()
    schedule = replicas.wrap_schedule(inner)
    call(schedule, model(), 2, forward_only=True)
    call(schedule, model(per_token=True), 2)     # Megatron sums over dp and divides by the global token count
    assert [c["num_microbatches"] for c in inner.calls] == [3, 3] and [c["scaled"] for c in inner.calls] == [None] * 2


def test_a_count_or_micro_batch_size_the_plan_was_not_made_for_is_refused(applied, even):
    applied(dataclasses.replace(even, replica_micro_batches=[3, 1]), rank_of_replica(even, 1))
    schedule = replicas.wrap_schedule(Recorder())
    with pytest.raises(ConfigError, match=r"num_microbatches=4.*replica 1 runs 1 micro-batches"):
        call(schedule, model(), 4)
    with pytest.raises(ConfigError, match=r"micro_batch_size=1.*micro-batches of 2 samples"):
        call(schedule, model(), 2, mbs=1)


def test_a_data_iterator_that_runs_dry_names_the_replica(applied, even):
    applied(dataclasses.replace(even, replica_micro_batches=[3, 1]), rank_of_replica(even, 0))
    schedule = replicas.wrap_schedule(Recorder())
    with pytest.raises(ConfigError, match=r"replica 0's data iterator ran dry at micro-batch 3 of 3"):
        call(schedule, model(), 2, data=iter(range(2)))


def test_an_even_plan_changes_nothing(applied, even):
    applied(even, 0)
    inner, m = Recorder(), model()
    call(replicas.wrap_schedule(inner), m, 2)
    assert inner.calls[0]["num_microbatches"] == 2 and inner.calls[0]["scaled"] is None


def test_install_wraps_megatrons_schedules_for_an_uneven_plan_only(applied, even):
    from megatron.core.pipeline_parallel import schedules
    own = {name: getattr(schedules, name) for name in replicas.SCHEDULES}
    try:
        replicas.install(dataclasses.replace(even, replica_micro_batches=[3, 1]))
        for name in replicas.SCHEDULES:
            assert getattr(schedules, name) is not own[name]
            assert PATCHES.original(schedules, name) is own[name]
            assert PATCHES.labels(schedules, name) == [replicas.PATCH_LABEL]
            assert getattr(schedules, name).__name__ == name
        replicas.install(even)
        assert {name: getattr(schedules, name) for name in replicas.SCHEDULES} == own
    finally:
        for name, fn in own.items():
            setattr(schedules, name, fn)


def test_forget_plan_gives_megatron_its_own_schedules_back(applied, even, tmp_path):
    """Uneven replicas and the measured-profile timing both wrap the schedules; forget_plan takes both off."""
    from megatron.core.pipeline_parallel import schedules

    from het_plugin.megatron import mcore as core, forget_plan, recorder_hooks as timing
    from het_plugin.runtime.recorder import ProfileSettings
    own = {name: getattr(schedules, name) for name in replicas.SCHEDULES + timing.STEPS}
    uneven = dataclasses.replace(even, replica_micro_batches=[3, 1])
    try:
        replicas.install(uneven)
        timing.install(uneven, 0, ProfileSettings(str(tmp_path / "m.yaml")))
        assert any(getattr(schedules, name) is not fn for name, fn in own.items())
        applied_state._current = object()
        forget_plan()
        assert {name: getattr(schedules, name) for name in own} == own
        assert core.current_plan() is None and timing.recorder() is None
    finally:
        for name, fn in own.items():
            setattr(schedules, name, fn)
        applied_state._current = None


@pytest.mark.parametrize("given, flag", [({"global_batch_size": 16}, "--global-batch-size=16"),
                                         ({"micro_batch_size": 1}, "--micro-batch-size=1"),
                                         ({"rampup_batch_size": ["2", "2", "64"]}, "--rampup-batch-size")])
def test_megatron_lm_refuses_a_launch_batch_other_than_the_uneven_plans(even, given, flag):
    from het_plugin.megatron.lm import check_replica_batch
    args = SimpleNamespace(**{"global_batch_size": 8, "micro_batch_size": 2, "rampup_batch_size": None, **given})
    check_replica_batch(args, even)                  # an even plan: its batch is written into args as before
    uneven = dataclasses.replace(even, replica_micro_batches=[3, 1])
    check_replica_batch(SimpleNamespace(global_batch_size=None, micro_batch_size=None), uneven)   # not given
    with pytest.raises(ConfigError) as err:
        check_replica_batch(args, uneven)
    assert flag in str(err.value) and "global batch of 8" in str(err.value) and "fix:" in str(err.value)


def test_the_megatron_core_sampler_reads_each_replicas_range_once_per_iteration(applied, even):
    uneven = dataclasses.replace(even, replica_micro_batches=[3, 1])
    read = {}
    for d in range(uneven.dp):
        applied(uneven, rank_of_replica(uneven, d))
        read[d] = list(replicas.replica_sampler(8 * 3 + 5, consumed_samples=8))   # resume after one global batch
    assert read[0] == [[8, 9], [10, 11], [12, 13], [16, 17], [18, 19], [20, 21]]
    assert read[1] == [[14, 15], [22, 23]]          # the trailing incomplete global batch is dropped
    applied_state._current = None
    with pytest.raises(ConfigError, match="initialize_model_parallel first"):
        replicas.replica_sampler(10)


def test_megatron_lms_sampler_becomes_the_replicas_for_its_micro_batch_size(applied, even):
    samplers = pytest.importorskip("megatron.training.datasets.data_samplers")
    base = samplers.MegatronPretrainingSampler
    cls = replicas.replica_sampler_class(base)
    assert issubclass(cls, base) and cls.__mro__[1] is base
    uneven = applied(dataclasses.replace(even, replica_micro_batches=[3, 1]), rank_of_replica(even, 1))
    megatron_rank = 0                # the replica comes from the plan, whatever Megatron's dp rank says
    mine = cls(total_samples=16, consumed_samples=0, micro_batch_size=2, data_parallel_rank=megatron_rank,
               data_parallel_size=2)
    assert list(mine) == [[6, 7], [14, 15]] and len(mine) == 2 and uneven.replica_of(rank_of_replica(even, 1)) == 1
    other = cls(total_samples=16, consumed_samples=0, micro_batch_size=1, data_parallel_rank=1, data_parallel_size=2)
    assert list(other) == list(base(16, 0, 1, 1, 2)), "another micro-batch size: Megatron's even split"
    with pytest.raises(ConfigError, match="data_parallel_size=4"):
        cls(total_samples=16, consumed_samples=0, micro_batch_size=2, data_parallel_rank=0, data_parallel_size=4)


def test_a_global_aux_loss_across_replicas_is_refused_with_uneven_counts():
    """Megatron's global_aux_loss all-reduces over the data-parallel replicas in every forward: with uneven counts
    the replica with more micro-batches would wait forever, so the schedule call stops first."""
    import types

    from het_plugin.core.errors import ConfigError
    from het_plugin.megatron.replicas import _check_no_cross_replica_collectives
    from het_plugin.runtime.replicas import ReplicaShare
    from het_plugin.core.ranks.batches import ReplicaBatches
    share = ReplicaShare(replica=0, batches=ReplicaBatches((3, 1), 1))
    for kinds in ("global_aux_loss", ["aux_loss", "global_aux_loss"]):
        with pytest.raises(ConfigError) as info:
            _check_no_cross_replica_collectives(types.SimpleNamespace(moe_router_load_balancing_type=kinds), share)
        assert info.value.field == "moe_router_load_balancing_type" and "seq_aux_loss" in info.value.fix
    for fine in ("aux_loss", ["seq_aux_loss"], None):
        _check_no_cross_replica_collectives(types.SimpleNamespace(moe_router_load_balancing_type=fine), share)
