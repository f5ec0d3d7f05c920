"""Model files and presets: derived sizes, and clear errors for bad inputs."""
from __future__ import annotations

import pytest

from het_plugin.core.errors import ConfigError
from het_plugin.core.inputs.model import ModelSpec, load_model, preset_model

GOOD = """\
name: tiny
num_layers: 4
hidden_size: 64
num_attention_heads: 4
vocab_size: 100
seq_length: 16
global_batch_size: 8
"""


def error_of(tmp_path, text: str) -> ConfigError:
    path = tmp_path / "model.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_model(path)
    assert info.value.source == str(path) and info.value.fix
    return info.value


def test_defaults_and_derived_sizes(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(GOOD)
    m = load_model(path)
    assert (m.kv_heads, m.ffn, m.dtype_bytes, m.micro_batch_size) == (4, 256, 2, None)
    h, f = 64, 256
    assert m.params_per_layer == 4 * h * h + 2 * h * f + 4 * h
    assert m.total_params == 4 * m.params_per_layer + 100 * 64          # tied embeddings: counted once
    # one layer forward: 2 FLOPs per weight per token, plus attention scores and values (4*s*h per token)
    tokens = 2 * 16
    assert m.layer_flops_fwd(2) == 2 * tokens * (4 * h * h + 2 * h * f) + 4 * tokens * 16 * h


def test_gqa_and_swiglu():
    m = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2, vocab_size=10,
                  seq_length=4, global_batch_size=2, activation="swiglu", tie_embeddings=False)
    assert m.kv_heads == 2 and m.ffn == int(8 * 64 / 3)
    kv = 64 * 2 // 8
    assert m.params_per_layer == 64 * (64 + 2 * kv) + 64 * 64 + 3 * 64 * m.ffn + 4 * 64
    assert m.total_params == 2 * m.params_per_layer + 2 * 10 * 64


def test_presets_match_the_published_shapes():
    assert preset_model("gpt-39b").num_layers == 48 and preset_model("gpt-39b").hidden_size == 8192
    assert 6.5e9 < preset_model("llama2-7b").total_params < 7.0e9
    assert 7.0e9 < preset_model("gpt-7.5b").total_params < 8.0e9
    assert 3.3e9 < preset_model("gpt-3.6b").total_params < 3.9e9
    with pytest.raises(ConfigError) as info:
        preset_model("gpt-5")
    assert "gpt-7.5b" in info.value.fix and "llama-140b" in info.value.fix


def test_misspelled_field(tmp_path):
    err = error_of(tmp_path, GOOD.replace("hidden_size", "hiden_size"))
    assert err.field == "hiden_size (line 3)"
    assert "did you mean 'hidden_size'" in err.fix


@pytest.mark.parametrize("old,new,field,words", [
    ("num_attention_heads: 4", "num_attention_heads: 5", "num_attention_heads (line 4)", "divides hidden_size"),
    ("global_batch_size: 8", "global_batch_size: 8\nmicro_batch_size: 3", "micro_batch_size (line 8)", "divides"),
    ("global_batch_size: 8", "global_batch_size: 8\nnum_query_groups: 3", "num_query_groups (line 8)", "divisor"),
    ("global_batch_size: 8", "global_batch_size: 8\ndtype: bf8", "dtype (line 8)", "'bf16'"),
    ("num_layers: 4", "num_layers: four", "num_layers (line 2)", "whole number"),
    ("num_layers: 4", "num_layers: -4", "num_layers (line 2)", "positive"),
])
def test_bad_values(tmp_path, old, new, field, words):
    err = error_of(tmp_path, GOOD.replace(old, new))
    assert err.field == field
    assert words in err.fix


def test_missing_field(tmp_path):
    err = error_of(tmp_path, GOOD.replace("vocab_size: 100\n", ""))
    assert err.field == "vocab_size" and "missing" in err.problem


def test_malformed_yaml(tmp_path):
    err = error_of(tmp_path, GOOD.replace("seq_length: 16", "seq_length: [16"))
    assert "malformed YAML at line" in err.problem


# ---- mixture of experts -----------------------------------------------------------------------------

MOE = GOOD + "num_moe_experts: 8\nmoe_router_topk: 2\n"


def test_moe_fields_and_derived_sizes(tmp_path):
    path = tmp_path / "moe.yaml"
    path.write_text(MOE + "moe_ffn_hidden_size: 32\nmoe_shared_expert_intermediate_size: 16\nmoe_layer_freq: 2\n")
    m = load_model(path)
    h = 64
    assert m.is_moe and m.moe_pattern == (1, 0, 1, 0) and m.num_moe_layers == 2      # Megatron: i % k == 0
    expert = 2 * h * 32                       # gelu: two matrices per expert
    assert m.expert_params_per_moe_layer == 8 * expert
    assert m.moe_layer_params == m.attention_params + h * 8 + 2 * h * 16 + 4 * h   # router + shared expert
    assert m.total_params == 2 * m.params_per_layer + 2 * (m.moe_layer_params + 8 * expert) + 100 * 64
    # a token passes through its top-2 experts only
    assert m.active_params == m.total_params - 2 * 8 * expert + 2 * 2 * expert
    tokens = 2 * 16
    assert m.moe_layer_flops_fwd(2) == 2 * tokens * (m.attention_params + h * 8 + 2 * expert + 2 * h * 16) \
        + m.attention_core_flops_fwd(2)
    assert m.decoder_flops_fwd(2) == pytest.approx(2 * m.layer_flops_fwd(2) + 2 * m.moe_layer_flops_fwd(2))


def test_moe_defaults_follow_megatron():
    m = ModelSpec(num_layers=3, hidden_size=64, num_attention_heads=4, vocab_size=10, seq_length=8,
                  global_batch_size=4, num_moe_experts=4)
    assert m.moe_router_topk == 2 and m.moe_ffn == m.ffn and m.moe_pattern == (1, 1, 1)
    assert ModelSpec(**m.model_dump()) == m          # a dumped MoE model reads back
    dense = ModelSpec(num_layers=3, hidden_size=64, num_attention_heads=4, vocab_size=10, seq_length=8,
                      global_batch_size=4, num_moe_experts=0)
    assert not dense.is_moe and dense.expert_params == 0 and dense.active_params == dense.total_params
    assert ModelSpec(**dense.model_dump()) == dense  # defaults of the MoE fields pass on a dense model


def test_mixtral_preset_has_the_published_size():
    m = preset_model("mixtral-8x7b")
    assert m.num_moe_layers == 32 and m.num_moe_experts == 8 and m.moe_router_topk == 2
    assert 46.0e9 < m.total_params < 47.5e9          # "46.7B total parameters"
    assert 12.5e9 < m.active_params < 13.3e9         # "12.9B active parameters per token"


@pytest.mark.parametrize("extra,field,words", [
    ("moe_router_topk: 9\n", "moe_router_topk (line 9)", "<= num_moe_experts (8)"),
    ("moe_layer_freq: [1, 0]\n", "moe_layer_freq (line 9)", "one 0/1 per layer (4 entries)"),
    ("moe_layer_freq: [0, 0, 0, 0]\n", "moe_layer_freq (line 9)", "put a 1 where a layer has experts"),
    ("moe_layer_freq: [1, 2, 0, 1]\n", "moe_layer_freq (line 9)", "only 0 and 1"),
    ("moe_layer_freq: 0\n", "moe_layer_freq (line 9)", "use 1"),
    ("moe_layer_freq: \"([1]*4)\"\n", "moe_layer_freq (line 9)", "write the list out"),
])
def test_bad_moe_values(tmp_path, extra, field, words):
    err = error_of(tmp_path, MOE.replace("moe_router_topk: 2\n", "") + extra)
    assert err.field == field
    assert words in err.fix


def test_moe_fields_on_a_dense_model_are_refused(tmp_path):
    err = error_of(tmp_path, GOOD + "moe_ffn_hidden_size: 128\n")
    assert err.field == "moe_ffn_hidden_size (line 8)"
    assert "set num_moe_experts" in err.fix and "no experts" in err.problem
