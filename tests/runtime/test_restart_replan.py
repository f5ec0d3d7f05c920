"""Issue 21, item 3: re-planning at a run's next start from the profile its last attempt wrote, and the one
checkpoint question (het_plugin.core.checkpoint_fit) that decides whether a re-plan is taken. Pure: no processes."""
from __future__ import annotations

import dataclasses

import pytest

from het_plugin.core.checkpoint_fit import (DEEPSPEED, DP_RESHARDABLE, DS_PER_RANK, DS_UNIVERSAL, FULLY_RESHARDABLE,
                                       MEGATRON, TORCH_DIST, TORCH_LEGACY, CheckpointShape, resume_problem)
from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.errors import ConfigError
from het_plugin.core.cost.measured import RankTimes, measured_profile
from het_plugin.core.launch import Launch, resolve_launch
from het_plugin.runtime.restart_replan import (decide, load_last_run, ran_plan_path, resolve_on_restart, restart_count)
from het_plugin.runtime.recorder import ProfileRecorder, ProfileSettings
from het_plugin.core.ranks.dims import Degrees
from tests.core.test_measured import DATA, IB_ROCE_4, FakeClock, run_iteration, tiny_model

IB_ROCE_2 = DATA / "megatron-ib-roce-2.yaml"


def resolver(cluster_file, world, **fixed):
    def resolve(profile=None):
        return resolve_launch(str(cluster_file), launch=Launch(world), model=tiny_model(),
                              degrees=Degrees(world, **fixed), micro_batch_size=2, profile=profile)
    return resolve


@pytest.fixture(scope="module")
def start():
    """The first attempt's plan and a profile in which its A100 stage measured slow."""
    resolve = resolver(IB_ROCE_4, 4, tp=1, pp=2)
    first = resolve().plan
    ranks = []
    for r in range(4):
        slow = 10.0 if first.node_of(r).accelerator == "H100" else 1.0
        ranks.append(RankTimes(r, iterations=4, micro_batches=8, forward_s=0.08 * slow, backward_s=0.16 * slow,
                               iteration_s=4.0, intervals=4))
    return resolve, first, measured_profile(first, ranks, "test")


def shape_of(plan, **kw):
    base = dict(framework=MEGATRON, path="ckpt", format=TORCH_DIST, world_size=plan.world_size, tp=plan.tp,
                pp=plan.pp, dp=plan.dp, layers_per_stage=list(plan.layers_per_stage), distributed_optimizer=True,
                optimizer_sharding=FULLY_RESHARDABLE)
    return CheckpointShape(**{**base, **kw})


def test_no_profile_plans_as_usual(start):
    resolve, first, _ = start
    d = decide(first, load_cluster(IB_ROCE_4), None, None, lambda p: resolve(p).plan)
    assert d.plan is first and not d.replanned and "no measured profile" in d.lines[0]


def test_a_restart_replans_from_the_profile_and_logs_both_plans_and_the_gain(start):
    resolve, first, profile = start
    d = decide(first, load_cluster(IB_ROCE_4), profile, first, lambda p: resolve(p).plan, restart=1)
    assert d.replanned and d.plan.hash != first.hash
    text = "\n".join(d.lines)
    assert "elastic restart 1" in text and f"old plan {first.hash}" in text and f"new plan {d.plan.hash}" in text
    assert "predicted gain +" in text and text.endswith("taken")
    h100 = sum(n for s, n in enumerate(d.plan.layers_per_stage)
               if d.plan.node_of(d.plan.stage_ranks(s)[0]).accelerator == "H100")
    assert h100 < sum(n for s, n in enumerate(first.layers_per_stage)
                      if first.node_of(first.stage_ranks(s)[0]).accelerator == "H100")


def test_a_replan_the_checkpoint_would_not_load_is_not_taken(start):
    resolve, first, profile = start
    ckpt = shape_of(first, optimizer_sharding=DP_RESHARDABLE)
    d = decide(first, load_cluster(IB_ROCE_4), profile, first, lambda p: resolve(p).plan, checkpoint=ckpt,
               distributed_optimizer=True)
    assert d.plan is first and not d.replanned
    assert "not taken" in d.lines[-1] and "dp_reshardable" in d.lines[-1] and \
        "--dist-ckpt-optim-fully-reshardable" in d.lines[-1] and f"Continuing on plan {first.hash}" in d.lines[-1]
    ok = decide(first, load_cluster(IB_ROCE_4), profile, first, lambda p: resolve(p).plan,
                checkpoint=shape_of(first), distributed_optimizer=True)
    assert ok.replanned


def test_below_the_minimum_gain_the_old_plan_stays(start):
    resolve, first, profile = start
    d = decide(first, load_cluster(IB_ROCE_4), profile, first, lambda p: resolve(p).plan, min_gain=100.0)
    assert d.plan is first and "under" in d.lines[-1]


def test_the_plan_is_made_for_the_nodes_that_came_back(start):
    """Two of the four nodes came back: the last plan cannot run, the new one is planned for two ranks."""
    _, first, profile = start
    resolve2 = resolver(IB_ROCE_2, 2, tp=1, pp=2)
    d = decide(resolve2().plan, load_cluster(IB_ROCE_2), profile, first, lambda p: resolve2(p).plan)
    assert d.replanned and d.plan.world_size == 2 and "does not fit the nodes" in "\n".join(d.lines)
    # a checkpoint that cannot follow and no old plan to fall back to: refused before any group
    legacy = shape_of(first, format=TORCH_LEGACY, layers_per_stage=[2, 3])
    with pytest.raises(ConfigError) as exc:
        decide(resolve2().plan, load_cluster(IB_ROCE_2), profile, first, lambda p: resolve2(p).plan,
               checkpoint=legacy)
    assert exc.value.field == "--ckpt-format" and "torch_dist" in exc.value.fix


def test_another_models_profile_is_ignored(start):
    resolve, first, profile = start
    other = dataclasses.replace(first, model={**first.model, "hidden_size": 64})
    d = decide(first, load_cluster(IB_ROCE_4), profile, other, lambda p: resolve(p).plan)
    assert d.plan is first and "another model" in d.lines[0]


def test_restart_count_reads_torchelastic():
    assert restart_count({"TORCHELASTIC_RESTART_COUNT": "3"}) == 3 and restart_count({}) == 0


def test_the_run_writes_what_its_next_start_reads(start, tmp_path):
    """A recorder with replan_on_restart writes the profile and the plan it ran; resolve_on_restart reads both."""
    resolve, first, _ = start
    path = tmp_path / "run.yaml"
    settings = ProfileSettings(str(path), every=100, warmup=1, exit_wait_s=0.1, replan_on_restart=True,
                               warn_above=None)
    rec = ProfileRecorder(first, 0, settings, "test", clock=FakeClock(), exit_handler=False)
    rec.reporters = [0]
    for _ in range(3):
        run_iteration(rec.timer, rec.timer.clock, [("forward", 0.01), ("backward", 0.02)])
    profile, last = load_last_run(str(path))
    assert profile is None and last is None             # nothing written yet
    # one process here, so no store: rank 0 writes from every rank's sums as gather() would hand them over
    rec.write([RankTimes(r, iterations=2, micro_batches=4, forward_s=0.04, backward_s=0.08, iteration_s=1.0,
                         intervals=2) for r in range(4)])
    profile, last = load_last_run(str(path))
    assert profile.measured.plan_hash == first.hash and last.hash == first.hash
    assert ran_plan_path(str(path)).endswith("run.ran-plan.json")
    chosen, decision = resolve_on_restart(resolve, str(path), checkpoint=lambda: shape_of(first))
    assert chosen.cluster is not None and decision.old.hash == first.hash


# ---- would it load: the table of docs/megatron.md and docs/deepspeed.md -----------------------------------

@pytest.fixture(scope="module")
def two_plans():
    a = resolver(IB_ROCE_4, 4, tp=1, pp=2)().plan
    b = dataclasses.replace(a, layers_per_stage=list(reversed(a.layers_per_stage)))
    return a, b


@pytest.mark.parametrize("kw,dist_opt,loads", [
    (dict(format=TORCH_DIST, distributed_optimizer=True, optimizer_sharding=FULLY_RESHARDABLE), True, True),
    (dict(format=TORCH_DIST, distributed_optimizer=True, optimizer_sharding=DP_RESHARDABLE), True, False),
    (dict(format=TORCH_DIST, distributed_optimizer=True, optimizer_sharding=DP_RESHARDABLE, has_optimizer=False),
     True, True),
    (dict(format=TORCH_DIST, distributed_optimizer=False), False, True),
    (dict(format=TORCH_DIST, distributed_optimizer=False), True, False),      # plain Adam -> distributed
    (dict(format=TORCH_LEGACY, distributed_optimizer=False), False, False),   # wrong layers silently otherwise
])
def test_megatron_checkpoint_under_another_split(two_plans, kw, dist_opt, loads):
    a, b = two_plans
    shape = shape_of(a, **kw)
    problem = resume_problem(shape, b, distributed_optimizer=dist_opt)
    assert (problem is None) == loads, problem
    assert resume_problem(shape, a, distributed_optimizer=bool(shape.distributed_optimizer)) is None   # same plan


def test_a_placement_only_change_loads_in_every_format(two_plans):
    a, _ = two_plans
    moved = dataclasses.replace(a, rank_of_logical=list(reversed(a.rank_of_logical)))
    for fmt in (TORCH_DIST, TORCH_LEGACY):
        assert resume_problem(shape_of(a, format=fmt, optimizer_sharding=DP_RESHARDABLE), moved,
                              distributed_optimizer=True) is None


@pytest.mark.parametrize("kw,loads", [
    (dict(format=DS_PER_RANK, zero_stage=0), False),
    (dict(format=DS_PER_RANK, zero_stage=0, has_optimizer=False), True),      # weights: per global layer
    (dict(format=DS_PER_RANK, zero_stage=1), False),
    (dict(format=DS_UNIVERSAL, zero_stage=1), True),
])
def test_deepspeed_checkpoint_under_another_partition(two_plans, kw, loads):
    a, b = two_plans
    shape = shape_of(a, framework=DEEPSPEED, distributed_optimizer=None, optimizer_sharding=None, **kw)
    problem = resume_problem(shape, b)
    assert (problem is None) == loads, problem
    if problem is not None and kw["zero_stage"]:     # the conversion as a command: this checkpoint's path
        command = (f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {shape.path} --output_folder "
                   f"{shape.path}_universal --inject_missing_state")
        assert command in problem.fix and "load_universal" in problem.fix, problem.fix
    elif problem is not None:          # no ZeRO partitions to convert: no command that would fail
        assert "python -m" not in problem.fix and "resume under the plan it was saved with" in problem.fix
        assert "ZeRO partitions only" in problem.fix and "load_module_only=True" in problem.fix
    assert resume_problem(dataclasses.replace(shape, tp=2), a).field == "tp"


def test_deepspeed_engine_files_follow_the_sorted_launch_ranks(two_plans):
    """DeepSpeed names a stage's engine file by its rank's position among its pipeline's sorted launch ranks: a
    placement that puts a later stage on a lower rank reads another stage's optimizer state, and is refused."""
    from het_plugin.core.checkpoint_fit import deepspeed_file_index
    a, _ = two_plans
    index = deepspeed_file_index(a)
    assert all(sorted(i) == list(range(a.pp * a.tp)) for i in index)
    flipped = dataclasses.replace(a, rank_of_logical=list(reversed(a.rank_of_logical)))
    assert deepspeed_file_index(flipped)[0] == list(reversed(index[0]))
    shape = shape_of(a, framework=DEEPSPEED, format=DS_PER_RANK, zero_stage=0, distributed_optimizer=None,
                     optimizer_sharding=None, stage_files=index[0])
    assert resume_problem(shape, a) is None
    problem = resume_problem(shape, flipped)
    assert problem is not None and "sorted launch ranks" in problem.problem
    assert resume_problem(dataclasses.replace(shape, has_optimizer=False), flipped) is None
