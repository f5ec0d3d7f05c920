"""The layer kinds as Megatron-Core builds them: a one-layer ``GPTModel`` on Megatron's local layer spec (dense,
or MoE with all experts on the rank), its embedding, decoder layer and output layer + loss timed apart, so the
times are the framework's own. Megatron-Core's layers assume CUDA (its CPU shims are test-only, in
integration_tests/support), so ``auto`` picks them on CUDA only.

Each TP degree is one ``parallel_state.initialize_model_parallel(tp)`` over the whole world (every rank calls
it): Megatron's TP groups are runs of ``tp`` consecutive ranks, so the measuring ranks (the first ``tp`` of a
node) must start at a multiple of ``tp`` (:func:`aligned`).
"""
from __future__ import annotations

import importlib.util
from typing import Sequence

import torch
from torch import nn

from ...core.inputs.model import ModelSpec
from ...megatron.collection import collection_kwargs     # explicit process groups where GPTModel takes them

SEED = 1234


def importable() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):
        return False


def aligned(world_size: int, ranks_of_jobs: Sequence[tuple[int, ...]]) -> bool:
    """Every measuring TP group is one of Megatron's (consecutive ranks from a multiple of its size)."""
    for ranks in ranks_of_jobs:
        t = len(ranks)
        if world_size % t or ranks[0] % t or tuple(ranks) != tuple(range(ranks[0], ranks[0] + t)):
            return False
    return True


def set_tp(tp: int, timeout_s: float = 600.0) -> None:
    """Every rank: Megatron's groups for tensor-parallel size ``tp`` (the previous ones destroyed), their waits
    bounded by ``timeout_s`` (the profile's --timeout; Megatron takes whole minutes)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp,
                                 distributed_timeout_minutes=max(1, int(-(-timeout_s // 60))))
    model_parallel_cuda_manual_seed(SEED)


def shutdown() -> None:
    from megatron.core import parallel_state as ps
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


def _gpt(model: ModelSpec, tp: int, moe: bool, dtype, on_cuda: bool):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    swiglu = model.activation == "swiglu"
    kwargs = dict(num_layers=1, hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
                  num_query_groups=model.kv_heads, ffn_hidden_size=model.ffn, hidden_dropout=0.0,
                  attention_dropout=0.0, add_bias_linear=False,    # the cost model counts no biases
                  tensor_model_parallel_size=tp, use_cpu_initialization=not on_cuda,
                  params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
                  fp16=dtype == torch.float16, gated_linear_unit=swiglu,
                  activation_func=F.silu if swiglu else F.gelu)
    if moe:
        kwargs.update(num_moe_experts=model.num_moe_experts, moe_router_topk=model.moe_router_topk,
                      moe_ffn_hidden_size=model.moe_ffn, moe_token_dispatcher_type="allgather",
                      moe_grouped_gemm=False, moe_permute_fusion=False,
                      moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size)
    spec = get_gpt_layer_local_spec(num_experts=model.num_moe_experts if moe else None, moe_grouped_gemm=False)
    gpt = GPTModel(TransformerConfig(**kwargs), spec, vocab_size=model.vocab_size,
                   max_sequence_length=model.seq_length, pre_process=True, post_process=True,
                   share_embeddings_and_output_weights=model.tie_embeddings, **collection_kwargs(GPTModel))
    return gpt.to(dtype)


class _Layer(nn.Module):
    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, x):                       # [b, s, h] as the plain layers take it; Megatron's is [s, b, h]
        s = x.shape[1]
        if getattr(self, "mask", None) is None or self.mask.shape[-1] != s:
            # the causal mask Megatron-LM's pretrain_gpt passes (True = masked), made once per sequence length
            self.mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=x.device), diagonal=1)[None, None]
        out, _ = self.gpt.decoder.layers[0](x.transpose(0, 1), attention_mask=self.mask)
        return out.transpose(0, 1)


class _Embedding(nn.Module):
    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, tokens):
        pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        return self.gpt.embedding(input_ids=tokens, position_ids=pos).transpose(0, 1)


class _OutputLoss(nn.Module):
    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, x, labels):
        g = self.gpt
        weight = g.shared_embedding_or_output_weight() if g.share_embeddings_and_output_weights else None
        logits, _ = g.output_layer(g.decoder.final_layernorm(x.transpose(0, 1)), weight=weight)
        return g.compute_language_model_loss(labels, logits).float().mean()


def build(kind: str, model: ModelSpec, tp: int, dtype, on_cuda: bool) -> nn.Module:
    """The Megatron-Core module timed for ``kind`` (after :func:`set_tp` with this ``tp`` on every rank)."""
    gpt = _gpt(model, tp, kind == "moe_layer", dtype, on_cuda)
    if kind in ("layer", "moe_layer"):
        return _Layer(gpt)
    if kind == "embedding":
        return _Embedding(gpt)
    if kind == "output":
        return _OutputLoss(gpt)
    raise ValueError(f"unknown layer kind {kind!r}")
