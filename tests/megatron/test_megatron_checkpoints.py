"""Issue 21, item 1: what a Megatron checkpoint holds, checked against the run about to load it, before it loads.

The decision (:func:`check_resume`) on the shapes alone, then the readers on checkpoint directories laid out as
megatron.training 0.19.2 writes them (the tracker file, ``iter_NNNNNNN``, a legacy ``mp_rank_*`` file with the
saved args). Real torch_dist saves and resumes: integration_tests/test_megatron_checkpoints.py.
"""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from het_plugin.core.errors import ConfigError
from het_plugin.megatron import checkpoints as ck

A = ck.TrainingShape(ckpt_format="torch_dist", tp=1, pp=2, ep=1, dp=2, world_size=4, layers=(4, 1),
                     distributed_optimizer=True, optim_sharding="dp_reshardable", plan_hash="a" * 16, iteration=4)
MOVED = dataclasses.replace(A, layers=(1, 4), plan_hash="b" * 16, iteration=None)


def refused(saved, run, load_optim=True) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        ck.check_resume(saved, run, load_optim=load_optim, where="/ckpt")
    return e.value


def test_dp_reshardable_optimizer_state_is_refused_across_a_layer_move_with_the_flag_to_save_with():
    e = refused(A, MOVED)
    assert e.field == ck.RESHARD_FLAG and "'dp_reshardable' format" in e.problem
    assert "layers per stage [4, 1]" in e.problem and "layers per stage [1, 4]" in e.problem
    assert f"plan {'a' * 16}" in e.fix and ck.RESHARD_FLAG in e.fix and "--no-load-optim" in e.fix
    # the same refusal for a TP or PP change (Megatron's own message names another flag)
    assert refused(A, dataclasses.replace(A, tp=2, dp=1)).field == ck.RESHARD_FLAG
    # without the optimizer's state the weights reshard by global layer
    notes = ck.check_resume(A, MOVED, load_optim=False, where="/ckpt")
    assert len(notes) == 1 and "weights reshard by global layer" in notes[0]


def test_what_does_load():
    fully = dataclasses.replace(A, optim_sharding="fully_reshardable")
    notes = ck.check_resume(fully, MOVED, load_optim=True, where="/ckpt")
    assert notes and "optimizer state is fully_reshardable" in notes[0]
    plain = dataclasses.replace(A, distributed_optimizer=False, optim_sharding=None)
    assert ck.check_resume(plain, dataclasses.replace(MOVED, distributed_optimizer=False), load_optim=True,
                           where="/ckpt")
    # dp_reshardable under the same split: another placement (plan hash) or another data-parallel size
    assert ck.check_resume(A, dataclasses.replace(A, plan_hash="c" * 16), load_optim=True, where="/ckpt")
    assert ck.check_resume(A, dataclasses.replace(A, dp=1, world_size=2, plan_hash=None), load_optim=True,
                           where="/ckpt")
    assert ck.check_resume(A, A, load_optim=True, where="/ckpt") == [], "the same plan: nothing to say"


def test_another_optimizer_than_the_one_saved_is_refused():
    e = refused(A, dataclasses.replace(A, distributed_optimizer=False, optim_sharding=None))
    assert e.field == "--use-distributed-optimizer" and "add --use-distributed-optimizer" in e.fix
    plain = dataclasses.replace(A, distributed_optimizer=False, optim_sharding=None)
    assert "drop --use-distributed-optimizer" in refused(plain, A).fix
    assert ck.check_resume(plain, A, load_optim=False, where="/ckpt") is not None    # --no-load-optim: loads


@pytest.mark.parametrize("fmt", ["torch", "torch_dcp", "fsdp_dtensor"])
def test_per_stage_formats_are_refused_across_a_layer_move_even_without_the_optimizer(fmt):
    saved = dataclasses.replace(A, ckpt_format=fmt, distributed_optimizer=False, optim_sharding=None)
    e = refused(saved, dataclasses.replace(MOVED, ckpt_format=fmt, distributed_optimizer=False), load_optim=False)
    assert e.field == "--ckpt-format" and f"'{fmt}' format" in e.problem and "torch_dist" in e.fix
    assert "--ckpt-convert-format torch_dist" in e.fix
    # under its own split (another placement) it loads
    assert ck.check_resume(saved, dataclasses.replace(saved, plan_hash="c" * 16), load_optim=True, where="/ckpt")


def megatron_args(**kw):
    base = dict(num_layers=5, tensor_model_parallel_size=1, pipeline_model_parallel_size=2, context_parallel_size=1,
                data_parallel_size=2, world_size=4, expert_model_parallel_size=1, use_distributed_optimizer=False,
                pipeline_model_parallel_layout=None, decoder_first_pipeline_num_layers=None,
                decoder_last_pipeline_num_layers=None, virtual_pipeline_model_parallel_size=None,
                ckpt_format="torch_dist", dist_ckpt_optim_fully_reshardable=False)
    return argparse.Namespace(**{**base, **kw})


def test_the_split_from_megatrons_args():
    pytest.importorskip("megatron.core")
    assert ck.layers_of_args(megatron_args(num_layers=4)) == (2, 2), "Megatron's even split"
    assert ck.layers_of_args(megatron_args(pipeline_model_parallel_layout="Etttt|tL")) == (4, 1)
    assert ck.layers_of_args(megatron_args(pipeline_model_parallel_layout="Et*3|t|tL",
                                           pipeline_model_parallel_size=3, num_layers=5)) == (3, 1, 1)
    assert ck.layers_of_args(megatron_args(num_layers=8, pipeline_model_parallel_size=3,
                                           decoder_first_pipeline_num_layers=2)) == (2, 3, 3)
    assert ck.layers_of_args(megatron_args(num_layers=8, virtual_pipeline_model_parallel_size=2)) == (2, 2, 2, 2)
    args = megatron_args(use_distributed_optimizer=True, dist_ckpt_optim_fully_reshardable=True,
                         heterogeneous_plan_hash="d" * 16)
    shape = ck.shape_of_args(args, optim_sharding=ck.current_sharding(args))
    assert (shape.optim_sharding, shape.plan_hash, shape.dp) == ("fully_reshardable", "d" * 16, 2)


def write_legacy(root, iteration, args, tracker=None):
    """A legacy ('torch') checkpoint as megatron.training writes it: iter_NNNNNNN/mp_rank_00_000/model_optim_rng.pt."""
    import torch
    rank_dir = root / f"iter_{iteration:07d}" / "mp_rank_00_000"
    rank_dir.mkdir(parents=True)
    torch.save({"args": args, "iteration": iteration, "model": {}}, rank_dir / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(str(tracker if tracker is not None else iteration))


def test_a_legacy_checkpoint_is_read_and_refused_under_another_split(tmp_path):
    pytest.importorskip("megatron.core")
    write_legacy(tmp_path, 4, megatron_args(ckpt_format="torch", pipeline_model_parallel_layout="Etttt|tL",
                                            heterogeneous_plan_hash="a" * 16))
    found = ck.checkpoint_dir(str(tmp_path), argparse.Namespace())
    assert found.iteration == 4
    saved = ck.read_checkpoint(found)
    assert (saved.ckpt_format, saved.layers, saved.plan_hash) == ("torch", (4, 1), "a" * 16)
    moved = megatron_args(ckpt_format="torch", pipeline_model_parallel_layout="Et|ttttL", load=str(tmp_path),
                          no_load_optim=True, finetune=False)
    with pytest.raises(ConfigError) as e:
        ck.check_before_load(moved)
    assert "'torch' format" in e.value.problem and e.value.source == str(tmp_path)
    same = megatron_args(ckpt_format="torch", pipeline_model_parallel_layout="Etttt|tL", load=str(tmp_path),
                         heterogeneous_plan_hash="b" * 16)
    assert ck.check_before_load(same), "another plan on the same split: loads, with a note"


def test_no_checkpoint_no_check(tmp_path):
    assert ck.check_before_load(megatron_args(load=str(tmp_path))) == []          # no tracker: Megatron starts fresh
    assert ck.check_before_load(megatron_args(load=None)) == []
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("8")
    assert ck.checkpoint_dir(str(tmp_path), argparse.Namespace()) is None           # tracker without its directory
    write_legacy(tmp_path / "step", 2, megatron_args(), tracker=6)
    assert ck.checkpoint_dir(str(tmp_path / "step"), argparse.Namespace(ckpt_step=2)).iteration == 2


def test_megatron_lms_load_checkpoint_is_checked_first_and_the_patch_is_labelled(tmp_path, monkeypatch):
    """lm.install_initialize_wrapper routes megatron.training.training.load_checkpoint through the check: a refused
    checkpoint never reaches Megatron's loader; the patch carries lm's label (undone with it)."""
    import sys
    import types

    from het_plugin.megatron import launch_state, lm
    from het_plugin.runtime.patches import PATCHES
    pytest.importorskip("megatron.core")
    calls = []
    training = types.ModuleType("megatron.training.training")
    training.load_checkpoint = lambda *a, **kw: calls.append(kw) or (7, 0)
    monkeypatch.setitem(sys.modules, "megatron.training.training", training)
    write_legacy(tmp_path, 4, megatron_args(ckpt_format="torch", pipeline_model_parallel_layout="Etttt|tL"))
    run = megatron_args(ckpt_format="torch", pipeline_model_parallel_layout="Et|ttttL", load=str(tmp_path),
                        no_load_optim=True, finetune=False, _het_plugin_prepared=True, rank=0)
    monkeypatch.setattr(launch_state, "_state", launch_state.LaunchState(args=run, plan=object()))
    try:
        lm.install_initialize_wrapper()
        assert PATCHES.labels(training, "load_checkpoint") == [lm.PATCH_LABEL]
        with pytest.raises(ConfigError, match="'torch' format"):
            training.load_checkpoint(None, None, None)
        assert calls == [], "Megatron's loader did not run"
        run.pipeline_model_parallel_layout = "Etttt|tL"          # its own split: loads
        assert training.load_checkpoint(None, None, None) == (7, 0) and len(calls) == 1
    finally:
        PATCHES.undo(lm.PATCH_LABEL)
