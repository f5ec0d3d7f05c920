"""The model's layer kinds as plain torch modules of its shape, tensor-parallel like Megatron-Core's (column-
parallel in, row-parallel out, one all-reduce per block each way; a vocabulary-parallel embedding and loss).

Used where Megatron-Core's own layers cannot run (no megatron.core, or no CUDA: its layers assume CUDA and the
CPU shims live in the tests only). The profile's description says which layers were timed.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ...core.inputs.model import ModelSpec


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient backward (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward, identity backward (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x, group):
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    return x if group is None else _ReduceFromTP.apply(x, group)


class MLP(nn.Module):
    """One FFN of width ``ffn`` split over TP (gelu: two matrices; swiglu: three)."""

    def __init__(self, hidden: int, ffn: int, swiglu: bool):
        super().__init__()
        self.swiglu = swiglu
        self.fc1 = nn.Linear(hidden, ffn * (2 if swiglu else 1), bias=False)
        self.fc2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        y = self.fc1(x)
        if self.swiglu:
            a, b = y.chunk(2, dim=-1)
            y = F.silu(a) * b
        else:
            y = F.gelu(y)
        return self.fc2(y)


class MoE(nn.Module):
    """Router (replicated) and all experts on this rank (ep = 1; each expert split over TP), top-k routing."""

    def __init__(self, model: ModelSpec, tp: int):
        super().__init__()
        h, swiglu = model.hidden_size, model.activation == "swiglu"
        self.topk = model.moe_router_topk
        self.router = nn.Linear(h, model.num_moe_experts, bias=False)
        self.experts = nn.ModuleList(MLP(h, model.moe_ffn // tp, swiglu) for _ in range(model.num_moe_experts))
        shared = model.moe_shared_expert_intermediate_size
        self.shared = MLP(h, shared // tp, swiglu) if shared else None

    def forward(self, x, router_input):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.router(router_input.reshape(-1, shape[-1])).float(), dim=-1)
        weights, chosen = probs.topk(self.topk, dim=-1)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel():
                out = out.index_add(0, rows, expert(tokens[rows]) * weights[rows, slot].unsqueeze(-1).to(tokens.dtype))
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.reshape(shape)


class Block(nn.Module):
    """One decoder layer: pre-norm causal self-attention (GQA as the model says) and an MLP or MoE."""

    def __init__(self, model: ModelSpec, tp: int, group, moe: bool):
        super().__init__()
        h = model.hidden_size
        self.group = group
        self.head_dim = h // model.num_attention_heads
        self.heads, self.kv = model.num_attention_heads // tp, model.kv_heads // tp
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv = nn.Linear(h, (self.heads + 2 * self.kv) * self.head_dim, bias=False)
        self.proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.moe = MoE(model, tp) if moe else None
        self.mlp = None if moe else MLP(h, model.ffn // tp, model.activation == "swiglu")

    def forward(self, x):                       # x: [micro-batch, sequence, hidden]
        mb, s, _ = x.shape
        y = self.ln1(x)
        q, k, v = self.qkv(copy_to_tp(y, self.group)).split(
            [self.heads * self.head_dim, self.kv * self.head_dim, self.kv * self.head_dim], dim=-1)
        q = q.view(mb, s, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(mb, s, self.kv, self.head_dim).transpose(1, 2)
        v = v.view(mb, s, self.kv, self.head_dim).transpose(1, 2)
        if self.kv != self.heads:
            k = k.repeat_interleave(self.heads // self.kv, dim=1)
            v = v.repeat_interleave(self.heads // self.kv, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(mb, s, -1)
        x = x + reduce_from_tp(self.proj(a), self.group)
        y = self.ln2(x)
        z = copy_to_tp(y, self.group)
        out = self.moe(z, y) if self.moe is not None else self.mlp(z)
        return x + reduce_from_tp(out, self.group)


def _shard(vocab: int, tp: int, rank: int) -> tuple[int, int]:
    per = math.ceil(vocab / tp)
    return rank * per, per


class Embedding(nn.Module):
    """Vocabulary-parallel word embedding (each TP rank holds a slice of the rows; the lookups are summed)."""

    def __init__(self, model: ModelSpec, tp: int, tp_rank: int, group):
        super().__init__()
        self.start, per = _shard(model.vocab_size, tp, tp_rank)
        self.group = group
        self.weight = nn.Parameter(torch.randn(per, model.hidden_size) * 0.02)

    def forward(self, tokens):
        local = tokens - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        if self.group is not None:
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)


class OutputLoss(nn.Module):
    """Final norm, the (vocabulary-parallel) output layer and the cross-entropy loss across the TP slices."""

    def __init__(self, model: ModelSpec, tp: int, tp_rank: int, group):
        super().__init__()
        self.start, per = _shard(model.vocab_size, tp, tp_rank)
        self.group = group
        self.norm = nn.LayerNorm(model.hidden_size)
        self.weight = nn.Parameter(torch.randn(per, model.hidden_size) * 0.02)

    def forward(self, x, labels):
        logits = F.linear(copy_to_tp(self.norm(x), self.group), self.weight).float()
        if self.group is None:
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        top = logits.detach().amax(dim=-1)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.group)
        shifted = logits - top.unsqueeze(-1)
        total = reduce_from_tp(shifted.exp().sum(dim=-1), self.group)
        local = labels - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        picked = shifted.gather(-1, local.clamp(0, self.weight.shape[0] - 1).unsqueeze(-1)).squeeze(-1)
        target = reduce_from_tp(picked * inside, self.group)
        return (total.log() - target).mean()


def build(kind: str, model: ModelSpec, tp: int, tp_rank: int, group: Optional[object]) -> nn.Module:
    """The module timed for ``kind`` (``group``: the TP group, None for tp = 1)."""
    if kind in ("layer", "moe_layer"):
        return Block(model, tp, group, moe=kind == "moe_layer")
    if kind == "embedding":
        return Embedding(model, tp, tp_rank, group)
    if kind == "output":
        return OutputLoss(model, tp, tp_rank, group)
    raise ValueError(f"unknown layer kind {kind!r}")
