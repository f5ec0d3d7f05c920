"""Megatron-LM's split flags (issue 31, deliverable 4): a homogeneous plan leaves the user's split alone, a
heterogeneous one refuses each flag by name, and the checkpoint reader counts each segment's layers exactly as
Megatron's get_num_layers_to_build places them under every split flag (checked against the installed release)."""
from __future__ import annotations

import argparse
import types

import pytest

from het_plugin.core.errors import ConfigError
from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.inputs.model import ModelSpec
from het_plugin.core.planner import assemble_plan
from het_plugin.core.ranks.dims import ParallelDims
from het_plugin.core.ranks.placement import place
from het_plugin.megatron import args as hargs
from het_plugin.megatron import checkpoints as ck
from het_plugin.megatron.split_flags import ACCOUNT_OPTIONS, LAYOUT_OPTIONS

from megatron_common import DATA

FLAGS = {**LAYOUT_OPTIONS, **ACCOUNT_OPTIONS}
VALUES = {"pipeline_model_parallel_layout": "Et*8|t*7L", "decoder_first_pipeline_num_layers": 7,
          "decoder_last_pipeline_num_layers": 8, "account_for_embedding_in_pipeline_split": True,
          "account_for_loss_in_pipeline_split": True}


def uneven_homogeneous_plan():
    """15 layers over 2 stages of one cluster: the plan's split is uneven (8 + 7), so it would write a layout."""
    cluster = load_cluster(DATA / "megatron-homogeneous-4.yaml")
    model = ModelSpec(name="t", num_layers=15, hidden_size=32, num_attention_heads=4, vocab_size=128,
                      seq_length=16, global_batch_size=8, micro_batch_size=2)
    plan = assemble_plan(cluster, model, place(cluster, ParallelDims(tp=1, pp=2, dp=2)), [8, 7], 2)
    assert plan.homogeneous and plan.is_identity
    return plan


@pytest.mark.parametrize("attr", sorted(FLAGS))
def test_a_homogeneous_plan_leaves_the_users_split_flag_alone(attr):
    plan = uneven_homogeneous_plan()
    args = types.SimpleNamespace(**{**{a: None for a in LAYOUT_OPTIONS}, attr: VALUES[attr]})
    changes = hargs.apply_plan_to_args(args, plan)
    assert getattr(args, attr) == VALUES[attr]
    assert all(getattr(args, a) is None for a in LAYOUT_OPTIONS if a != attr), "no layout of the plan's beside it"
    assert not any("layout" in c for c in changes)
    bare = types.SimpleNamespace(**{a: None for a in LAYOUT_OPTIONS})
    hargs.apply_plan_to_args(bare, plan)
    assert bare.pipeline_model_parallel_layout is not None, "without a flag the plan's uneven split is written"


@pytest.mark.parametrize("attr", sorted(FLAGS))
def test_a_heterogeneous_plan_refuses_each_split_flag_by_name(plan8, attr):
    args = types.SimpleNamespace(**{**{a: None for a in LAYOUT_OPTIONS}, attr: VALUES[attr]})
    hargs.check_compatible(args)                   # judged with the plan, not before it
    with pytest.raises(ConfigError) as e:
        hargs.apply_plan_to_args(args, plan8)
    assert e.value.field == FLAGS[attr] and f"drop {FLAGS[attr]}" in e.value.fix


def megatrons_counts(num_layers, pp, vpp, embedding, loss, first, last):
    """Megatron's own get_num_layers_to_build for every (virtual stage, pipeline rank), in the layout's order."""
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    config = TransformerConfig(num_layers=num_layers, hidden_size=32, num_attention_heads=4,
                               pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                               virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                               account_for_embedding_in_pipeline_split=embedding,
                               account_for_loss_in_pipeline_split=loss,
                               num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
    return tuple(get_num_layers_to_build(config, vp_stage=v if vpp > 1 else None, pp_rank=r)
                 for v in range(vpp) for r in range(pp))


CASES = [(15, 2, 1, False, True, None, None), (22, 4, 1, True, True, None, None), (15, 2, 1, True, False, None, None),
         (15, 2, 2, False, True, None, None), (15, 4, 2, True, False, None, None), (8, 3, 1, False, False, 2, None),
         (10, 3, 1, False, False, None, 4), (12, 2, 2, False, False, None, None), (12, 3, 2, False, False, 2, 6),
         (9, 3, 1, False, False, 1, 2)]


@pytest.mark.parametrize("num_layers,pp,vpp,embedding,loss,first,last", CASES)
def test_the_checkpoint_reader_counts_layers_as_megatron_places_them(num_layers, pp, vpp, embedding, loss, first,
                                                                      last):
    pytest.importorskip("megatron.core")
    args = argparse.Namespace(num_layers=num_layers, pipeline_model_parallel_size=pp,
                              virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                              pipeline_model_parallel_layout=None, decoder_first_pipeline_num_layers=first,
                              decoder_last_pipeline_num_layers=last, account_for_embedding_in_pipeline_split=embedding,
                              account_for_loss_in_pipeline_split=loss)
    want = megatrons_counts(num_layers, pp, vpp, embedding, loss, first, last)
    assert ck.layers_of_args(args) == want
    assert sum(want) == num_layers


def test_the_issues_two_counts():
    """15 layers at pp=2 with the loss counted: 8 + 7 (not 7 + 7); 22 at pp=4 with both: 5, 6, 6, 5 (not 5 x 4)."""
    base = dict(pipeline_model_parallel_layout=None, decoder_first_pipeline_num_layers=None,
                decoder_last_pipeline_num_layers=None, virtual_pipeline_model_parallel_size=None)
    assert ck.layers_of_args(argparse.Namespace(num_layers=15, pipeline_model_parallel_size=2,
                                                account_for_loss_in_pipeline_split=True, **base)) == (8, 7)
    both = dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    assert ck.layers_of_args(argparse.Namespace(num_layers=22, pipeline_model_parallel_size=4, **both,
                                                **base)) == (5, 6, 6, 5)


def test_megatron_lms_validate_args_takes_the_users_account_flag_on_a_homogeneous_plan(monkeypatch):
    """The issue's case: on a homogeneous cluster, --account-for-loss-in-pipeline-split with 15 layers at pp=2 made
    Megatron-LM refuse a layout the user never set; now the plan writes none, Megatron validates the user's split,
    and it builds 8 + 7 layers, what the checkpoint reader counts."""
    pytest.importorskip("megatron.training.arguments", reason="megatron-core 0.16.1's wheel has no megatron.training")
    import sys

    import megatron.training.arguments as margs
    from het_plugin.megatron import hook, launch_state, lm
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    monkeypatch.setattr(sys, "argv", [
        "pretrain_gpt.py", "--num-layers", "15", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "128",
        "--tokenizer-type", "NullTokenizer", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--pipeline-model-parallel-size", "2", "--account-for-loss-in-pipeline-split",
        "--heterogeneous-nic", str(DATA / "megatron-homogeneous-4.yaml")])
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(lm, "install_initialize_wrapper", lambda: None)
    monkeypatch.setattr(launch_state, "_state", launch_state.LaunchState())
    monkeypatch.setattr(margs, "parse_args", margs.parse_args)      # the wrapper goes again after the test
    hook.patch_arguments_module(margs)
    args = margs.parse_args()
    plan = lm.state.plan
    assert lm.state.error is None and plan.homogeneous and len(set(plan.layers_per_stage)) > 1, \
        "an uneven plan: it would have written a layout"
    assert args.pipeline_model_parallel_layout is None and args.account_for_loss_in_pipeline_split
    margs.validate_args(args)
    config = margs.core_transformer_config_from_args(args)
    built = tuple(get_num_layers_to_build(config, pp_rank=r) for r in range(2))
    assert built == (8, 7) == ck.layers_of_args(args)
