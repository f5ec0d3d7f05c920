"""Issue 21, item 3 for Megatron-LM: ``--heterogeneous-replan-on-restart`` (with ``--heterogeneous-profile-out``)
re-plans at the next start from the profile the last attempt wrote, and keeps the old plan where the checkpoint
in ``--load`` would not load under the new one. Through the argument hook on a parser built as Megatron-LM's."""
from __future__ import annotations

import dataclasses

import pytest

from het_plugin.core.checkpoint_fit import MEGATRON, TORCH_LEGACY, CheckpointShape
from het_plugin.core.cost.measured import RankTimes, measured_profile
from het_plugin.core.errors import ConfigError
from het_plugin.megatron import checkpoints, hook, launch_state, lm
from het_plugin.megatron.args import REPLAN_FLAG
from het_plugin.runtime.restart_replan import ran_plan_path
from tests.core.test_measured import IB_ROCE_4
from tests.megatron.test_megatron_args import MODEL, argv, fake_arguments_module  # noqa: F401 - argv: fixture


def start(argv, monkeypatch, *extra):
    """One start of the same command line (a fresh process: fresh launch state)."""
    monkeypatch.setattr(launch_state, "_state", launch_state.LaunchState())
    argv(*MODEL, "--pipeline-model-parallel-size", "2", "--heterogeneous-nic", str(IB_ROCE_4), *extra)
    mod = fake_arguments_module()
    hook.patch_arguments_module(mod)
    return mod.parse_args(None), lm.state


def slow_h100_profile(plan):
    """What the last attempt measured: its H100 stage 10x slower than the model says."""
    ranks = [RankTimes(r, iterations=4, micro_batches=8, forward_s=0.08 * (10.0 if plan.node_of(r).accelerator ==
                                                                            "H100" else 1.0),
                       backward_s=0.16 * (10.0 if plan.node_of(r).accelerator == "H100" else 1.0), iteration_s=4.0,
                       intervals=4) for r in range(plan.world_size)]
    return measured_profile(plan, ranks, "test")


def test_the_next_start_replans_from_the_profile_and_keeps_the_old_plan_where_the_checkpoint_cannot_follow(
        argv, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    profile = tmp_path / "run.yaml"
    flags = ["--heterogeneous-profile-out", str(profile), REPLAN_FLAG]
    _, first = start(argv, monkeypatch, *flags)
    assert first.error is None and "no measured profile from a previous attempt" in capsys.readouterr().out
    settings = lm.launch_profile_settings(first.args)
    assert settings.replan_on_restart                     # the run writes the plan it ran beside the profile
    # what the first attempt's recorder leaves (tests/runtime/test_restart_replan.py writes it through the recorder)
    slow_h100_profile(first.plan).save(profile)
    first.plan.save(ran_plan_path(str(profile)))

    args, second = start(argv, monkeypatch, *flags)
    out = capsys.readouterr().out
    assert second.error is None and second.plan.hash != first.plan.hash
    assert f"old plan {first.plan.hash}" in out and "predicted gain +" in out and out.rstrip().endswith("taken")
    assert args.heterogeneous_plan_hash == second.plan.hash       # what Megatron builds and saves with

    # a legacy checkpoint of the first plan in --load: another split would load the wrong layers
    legacy = CheckpointShape(framework=MEGATRON, path=str(tmp_path / "ckpt"), format=TORCH_LEGACY, world_size=4,
                             tp=1, pp=2, dp=2, layers_per_stage=list(first.plan.layers_per_stage))
    monkeypatch.setattr(checkpoints, "checkpoint_shape", lambda a: legacy)
    _, third = start(argv, monkeypatch, *flags)
    out = capsys.readouterr().out
    assert third.error is None and third.plan.hash == first.plan.hash
    assert "not taken" in out and "torch_dist" in out and f"Continuing on plan {first.plan.hash}" in out


def test_the_switch_needs_a_profile_path(argv, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    _, state = start(argv, monkeypatch, REPLAN_FLAG)
    assert isinstance(state.error, ConfigError) and state.error.field == REPLAN_FLAG   # raised at the agreement
    assert "--heterogeneous-profile-out" in state.error.fix


def test_without_the_switch_a_profile_path_alone_changes_no_plan(argv, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "4")
    profile = tmp_path / "run.yaml"
    _, first = start(argv, monkeypatch, "--heterogeneous-profile-out", str(profile))
    slow_h100_profile(first.plan).save(profile)
    _, again = start(argv, monkeypatch, "--heterogeneous-profile-out", str(profile))
    assert again.plan.hash == first.plan.hash and not lm.launch_profile_settings(again.args).replan_on_restart


def test_a_megatron_checkpoint_reads_as_the_shape_the_decision_takes(tmp_path, monkeypatch):
    """checkpoint_shape converts what read_checkpoint found (Megatron's saved args) without loss."""
    saved = checkpoints.TrainingShape(ckpt_format="torch_dist", tp=1, pp=2, ep=1, dp=2, world_size=4, layers=(3, 2),
                                      distributed_optimizer=True, optim_sharding="dp_reshardable", plan_hash="abc",
                                      iteration=4)
    found = checkpoints.CheckpointDir(str(tmp_path / "iter_0000004"), 4)
    monkeypatch.setattr(checkpoints, "checkpoint_dir", lambda d, a: found)
    monkeypatch.setattr(checkpoints, "read_checkpoint", lambda f: saved)
    args = type("Args", (), {"load": str(tmp_path), "no_load_optim": False, "finetune": False})()
    shape = checkpoints.checkpoint_shape(args)
    assert (shape.format, shape.tp, shape.pp, shape.dp, list(shape.layers_per_stage), shape.distributed_optimizer,
            shape.optimizer_sharding, shape.plan_hash, shape.iteration, shape.has_optimizer) == \
        ("torch_dist", 1, 2, 2, [3, 2], True, "dp_reshardable", "abc", 4, True)
    args.no_load_optim = True
    assert not checkpoints.checkpoint_shape(args).has_optimizer
    assert dataclasses.replace(shape, path="x").framework == MEGATRON
