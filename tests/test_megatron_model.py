"""Megatron's own arguments -> ModelSpec."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from het_plugin.errors import ConfigError
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
