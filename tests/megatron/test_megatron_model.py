"""Megatron's own arguments -> ModelSpec."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from het_plugin.core.errors import ConfigError
from het_plugin.megatron.modelspec import DEFAULT_VOCAB_SIZE, model_from_args


def args(**kw):
    base = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=4096, micro_batch_size=1,
                global_batch_size=512, ffn_hidden_size=None, group_query_attention=False, num_query_groups=1,
                vocab_size=None, padded_vocab_size=None, bf16=False, fp16=False, swiglu=False,
                untie_embeddings_and_output_weights=False)
    base.update(kw)
    return SimpleNamespace(**base)


def test_llama_like_arguments():
    m = model_from_args(args(ffn_hidden_size=11008, group_query_attention=True, num_query_groups=8, bf16=True,
                             swiglu=True, untie_embeddings_and_output_weights=True, padded_vocab_size=32000))
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.kv_heads) == (32, 4096, 32, 8)
    assert (m.ffn, m.vocab_size, m.seq_length) == (11008, 32000, 4096)
    assert (m.dtype, m.activation, m.tie_embeddings) == ("bf16", "swiglu", False)
    assert (m.global_batch_size, m.micro_batch_size) == (512, 1)


def test_gpt_defaults():
    m = model_from_args(args(fp16=True, vocab_size=50257))
    assert m.kv_heads == 32, "num_query_groups counts only with --group-query-attention"
    assert m.ffn == 4 * 4096 and m.activation == "gelu" and m.tie_embeddings and m.dtype == "fp16"
    assert m.vocab_size == 50257
    assert model_from_args(args()).vocab_size == DEFAULT_VOCAB_SIZE
    assert model_from_args(args()).dtype == "fp32"


def test_padded_vocab_wins_over_vocab_size():
    assert model_from_args(args(vocab_size=50257, padded_vocab_size=50304)).vocab_size == 50304


def test_global_batch_defaults_like_megatron():
    assert model_from_args(args(global_batch_size=None, micro_batch_size=2), data_parallel_size=4).global_batch_size == 8


def test_missing_model_arguments_name_the_flags():
    with pytest.raises(ConfigError) as e:
        model_from_args(args(num_layers=None, seq_length=None))
    assert "--num-layers" in str(e.value) and "--seq-length" in str(e.value)


def test_inconsistent_arguments_are_a_config_error():
    with pytest.raises(ConfigError) as e:
        model_from_args(args(hidden_size=4000, num_attention_heads=3))
    assert "num_attention_heads" in str(e.value)


def test_moe_arguments_of_the_same_names():
    m = model_from_args(args(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=14336, swiglu=True,
                             moe_shared_expert_intermediate_size=None, moe_layer_freq=[0] + [1] * 31))
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_ffn, m.num_moe_layers) == (8, 2, 14336, 31)
    assert m.moe_shared_expert_intermediate_size is None
    # Megatron's defaults on a dense launch (num_experts None, topk 2, freq 1) leave the model dense
    dense = model_from_args(args(num_experts=None, moe_router_topk=2, moe_layer_freq=1))
    assert not dense.is_moe


def test_moe_arguments_that_do_not_fit_name_the_field():
    with pytest.raises(ConfigError) as e:
        model_from_args(args(num_experts=2, moe_router_topk=4))
    assert "moe_router_topk" in str(e.value)


def test_real_megatron_parser_gives_the_moe_fields(monkeypatch):
    """megatron.training's own parse_args (0.19 pass): --num-experts, --moe-* reach the ModelSpec."""
    arguments = pytest.importorskip("megatron.training.arguments")
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", "--num-layers", "4", "--hidden-size", "64",
                                     "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings",
                                     "32", "--micro-batch-size", "1", "--global-batch-size", "8", "--num-experts", "8",
                                     "--moe-router-topk", "2", "--moe-ffn-hidden-size", "128",
                                     "--moe-shared-expert-intermediate-size", "64", "--moe-layer-freq", "([0]+[1]*3)"])
    m = model_from_args(arguments.parse_args())
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size) == (8, 2, 128)
    assert m.moe_shared_expert_intermediate_size == 64 and m.moe_pattern == (0, 1, 1, 1)
