"""Model description: a decoder-only transformer, as much as the cost model needs."""
from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, NonNegativeInt, PositiveInt, field_validator, model_validator

from .yamlio import load_validated
from ..errors import ConfigError

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

# Largest value of each numeric field (docs/user-guide.md, "Limits"): beyond these the search would take
# minutes (global_batch_size 10^15 allocated a schedule per micro-batch) or the sizes overflow.
LIMITS = {
    "num_layers": 4_096, "hidden_size": 2 ** 20, "num_attention_heads": 2 ** 16, "num_query_groups": 2 ** 16,
    "ffn_hidden_size": 2 ** 22, "vocab_size": 2 ** 24, "seq_length": 2 ** 24, "global_batch_size": 65_536,
    "micro_batch_size": 65_536, "mtp_layers": 64, "num_moe_experts": 4_096, "moe_router_topk": 4_096,
    "moe_ffn_hidden_size": 2 ** 22, "moe_shared_expert_intermediate_size": 2 ** 22,
}


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "model"
    num_layers: PositiveInt
    hidden_size: PositiveInt
    num_attention_heads: PositiveInt
    num_query_groups: Optional[PositiveInt] = None      # KV heads (GQA); default: = heads
    ffn_hidden_size: Optional[PositiveInt] = None       # default: 4 * hidden (gelu), 8/3 * hidden (swiglu)
    vocab_size: PositiveInt
    seq_length: PositiveInt
    global_batch_size: PositiveInt
    micro_batch_size: Optional[PositiveInt] = None      # None: the planner chooses
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    activation: Literal["gelu", "swiglu"] = "gelu"
    tie_embeddings: bool = True
    mtp_layers: NonNegativeInt = 0                       # multi-token prediction depth (Megatron --mtp-num-layers)
    # Mixture of experts, named as Megatron's arguments (--num-experts is num_moe_experts in its config).
    num_moe_experts: Optional[NonNegativeInt] = None     # None or 0: a dense model
    moe_router_topk: PositiveInt = 2                     # experts each token is routed to (Megatron's default 2)
    moe_ffn_hidden_size: Optional[PositiveInt] = None    # one expert's FFN width; default: the FFN width
    moe_shared_expert_intermediate_size: Optional[PositiveInt] = None   # shared experts' FFN width; None: none
    moe_layer_freq: Union[PositiveInt, tuple[int, ...]] = 1   # every k-th layer is MoE (layer 0 first), or 0/1 per layer

    @field_validator("moe_layer_freq", mode="before")
    @classmethod
    def _freq(cls, v):
        if isinstance(v, str) and v.strip().isdigit():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, (int, list, tuple)):
            raise ValueError(f"moe_layer_freq must be a whole number k (every k-th layer is an MoE layer) or a list "
                             f"of 0/1, one per layer (got {v!r}) | fix: write e.g. 1, 2 or [0, 1, 1, 1] (Megatron's "
                             "pattern strings such as \"([0]+[1]*3)\" are not evaluated: write the list out)")
        if isinstance(v, int):
            if v < 1:
                raise ValueError(f"moe_layer_freq {v} must be at least 1 | fix: use 1 (every layer is an MoE "
                                 "layer) or k > 1 (every k-th)")
            return v
        bad = [x for x in v if isinstance(x, bool) or x not in (0, 1)]
        if bad:
            raise ValueError(f"moe_layer_freq lists {bad[0]!r}; a pattern holds 1 (MoE layer) or 0 (dense layer) "
                             "per layer | fix: write only 0 and 1")
        return tuple(int(x) for x in v)

    @model_validator(mode="before")
    @classmethod
    def _limits(cls, data):
        """Numeric fields: no booleans (YAML's true/yes/on would count as 1), nothing over :data:`LIMITS`."""
        if not isinstance(data, dict):
            return data
        for name, limit in LIMITS.items():
            v = data.get(name)
            if isinstance(v, bool):
                raise ValueError(f"got {v!r}, a boolean (YAML reads true/false/yes/no/on/off as booleans) | field: "
                                 f"{name} | fix: write a whole number")
            if isinstance(v, (int, float)) and v > limit:
                shown = str(v) if len(str(v)) <= 24 else f"{str(v)[:4]}... ({len(str(v))} digits)"
                raise ValueError(f"{name} {shown} is over the limit of {limit:,} | field: {name} | fix: use at most "
                                 f"{limit:,}; more is almost surely a typo (docs/user-guide.md lists the limits)")
        return data

    @model_validator(mode="after")
    def _consistent(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                             f"{self.num_attention_heads} | field: num_attention_heads"
                             " | fix: pick a head count that divides hidden_size")
        if self.num_query_groups and self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of num_query_groups "
                             f"{self.num_query_groups} | field: num_query_groups"
                             " | fix: use a divisor of num_attention_heads")
        if self.micro_batch_size and self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"global_batch_size {self.global_batch_size} is not a multiple of micro_batch_size "
                             f"{self.micro_batch_size} | field: micro_batch_size"
                             " | fix: use a micro_batch_size that divides global_batch_size, or leave it out")
        self._check_moe()
        return self

    def _check_moe(self) -> None:
        moe_fields = ("moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                      "moe_layer_freq")
        if not self.is_moe:
            # Defaults pass (a dumped dense model carries them); a value of its own is a mistake.
            given = [f for f in moe_fields if getattr(self, f) != type(self).model_fields[f].default]
            if given:
                raise ValueError(f"{given[0]} is set, but the model has no experts (num_moe_experts is "
                                 f"{self.num_moe_experts}) | field: {given[0]} | fix: set num_moe_experts (the "
                                 f"number of experts per MoE layer), or remove {', '.join(given)}")
            return
        if self.moe_router_topk > self.num_moe_experts:
            raise ValueError(f"moe_router_topk {self.moe_router_topk} routes each token to more experts than the "
                             f"{self.num_moe_experts} there are | field: moe_router_topk | fix: use moe_router_topk "
                             f"<= num_moe_experts ({self.num_moe_experts})")
        freq = self.moe_layer_freq
        if isinstance(freq, tuple):
            if len(freq) != self.num_layers:
                raise ValueError(f"moe_layer_freq lists {len(freq)} layers, the model has num_layers "
                                 f"{self.num_layers} | field: moe_layer_freq | fix: give one 0/1 per layer "
                                 f"({self.num_layers} entries), or a whole number k (every k-th layer)")
            if not any(freq):
                raise ValueError("moe_layer_freq marks no layer as an MoE layer | field: moe_layer_freq | fix: put "
                                 "a 1 where a layer has experts, or drop num_moe_experts for a dense model")

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return 4 * self.hidden_size if self.activation == "gelu" else int(8 * self.hidden_size / 3)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def mlp_params(self, ffn: int) -> int:
        """Weights of one MLP of width ``ffn`` (three matrices with swiglu, two with gelu)."""
        return (3 if self.activation == "swiglu" else 2) * self.hidden_size * ffn

    @property
    def attention_params(self) -> int:
        h = self.hidden_size
        kv = h * self.kv_heads // self.num_attention_heads
        return h * (h + 2 * kv) + h * h

    @property
    def params_per_layer(self) -> int:
        """Parameters of one dense transformer layer (see :attr:`moe_layer_params` for an MoE layer)."""
        return self.attention_params + self.mlp_params(self.ffn) + 4 * self.hidden_size   # + layernorms

    # ---- mixture of experts ----------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return bool(self.num_moe_experts)

    @property
    def moe_ffn(self) -> int:
        """One expert's FFN width (Megatron: moe_ffn_hidden_size, default ffn_hidden_size)."""
        return self.moe_ffn_hidden_size or self.ffn

    @cached_property
    def moe_pattern(self) -> tuple[int, ...]:
        """1 for each MoE layer, 0 for each dense one (Megatron: layer i is MoE when i % k == 0)."""
        if not self.is_moe:
            return (0,) * self.num_layers
        freq = self.moe_layer_freq
        if isinstance(freq, tuple):
            return freq
        return tuple(1 if i % freq == 0 else 0 for i in range(self.num_layers))

    @cached_property
    def num_moe_layers(self) -> int:
        return sum(self.moe_pattern)

    @property
    def moe_fraction(self) -> float:
        """Share of the decoder layers that are MoE layers (the cost model's per-layer average uses it)."""
        return self.num_moe_layers / self.num_layers

    @property
    def expert_params_per_moe_layer(self) -> int:
        """The routed experts' weights of one MoE layer (split over ep and etp; reduced over expert-dp)."""
        return (self.num_moe_experts or 0) * self.mlp_params(self.moe_ffn)

    @property
    def moe_layer_params(self) -> int:
        """Parameters of one MoE layer outside the routed experts: attention, router, shared experts, norms
        (split over tp, reduced over the dense data-parallel group)."""
        shared = self.mlp_params(self.moe_shared_expert_intermediate_size or 0)
        router = self.hidden_size * (self.num_moe_experts or 0)
        return self.attention_params + router + shared + 4 * self.hidden_size

    @property
    def expert_params(self) -> int:
        """Every routed expert's weights, all MoE layers."""
        return self.num_moe_layers * self.expert_params_per_moe_layer

    @property
    def decoder_params(self) -> int:
        moe = self.num_moe_layers
        return (self.num_layers - moe) * self.params_per_layer + moe * (self.moe_layer_params
                                                                        + self.expert_params_per_moe_layer)

    @property
    def active_params(self) -> int:
        """Parameters one token passes through: the top-k experts of each MoE layer instead of all."""
        routed = self.num_moe_layers * self.moe_router_topk * self.mlp_params(self.moe_ffn) if self.is_moe else 0
        return self.total_params - self.expert_params + routed

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def mtp_params(self) -> int:
        """Multi-token prediction modules: per depth one transformer layer, the projection of
        [hidden; embedding] (2h -> h) and two norms; the embedding and output layer are shared."""
        h = self.hidden_size
        return self.mtp_layers * (self.params_per_layer + 2 * h * h + 4 * h)

    @property
    def total_params(self) -> int:
        out = self.decoder_params + self.embedding_params + self.mtp_params
        return out if self.tie_embeddings else out + self.embedding_params

    def embedding_stages(self, pp: int) -> tuple[int, ...]:
        """Pipeline stages that hold the word embedding and keep its gradient in sync (Megatron's
        embedding group, as Megatron-LM's pretrain_gpt ``get_embedding_ranks`` builds it): the first
        stage, and the last when it ties the output layer to the embedding or runs the MTP modules
        (which read the embedding; het_plugin's layout puts them on the last stage)."""
        if pp > 1 and (self.tie_embeddings or self.mtp_layers):
            return (0, pp - 1)
        return (0,)

    def attention_core_flops_fwd(self, micro_batch: int) -> float:
        """Scores and values of one layer's attention (what ring attention overlaps its exchanges with)."""
        return 4.0 * micro_batch * self.seq_length * self.seq_length * self.hidden_size

    def layer_flops_fwd(self, micro_batch: int) -> float:
        """Forward FLOPs of one dense transformer layer for one micro-batch (matmuls + attention)."""
        tokens = micro_batch * self.seq_length
        matmul = 2 * tokens * (self.attention_params + self.mlp_params(self.ffn))
        return float(matmul + self.attention_core_flops_fwd(micro_batch))

    def moe_layer_flops_fwd(self, micro_batch: int) -> float:
        """Forward FLOPs of one MoE layer: attention, the router, the top-k experts' FFN of every token and
        the shared experts (balanced routing; the all-to-all is communication, in the cost model)."""
        tokens = micro_batch * self.seq_length
        ffn = (self.moe_router_topk * self.mlp_params(self.moe_ffn)
               + self.mlp_params(self.moe_shared_expert_intermediate_size or 0))
        router = self.hidden_size * (self.num_moe_experts or 0)
        matmul = 2 * tokens * (self.attention_params + router + ffn)
        return float(matmul + self.attention_core_flops_fwd(micro_batch))

    def mean_layer_flops_fwd(self, micro_batch: int) -> float:
        """Forward FLOPs of the average decoder layer (dense and MoE layers in the model's proportion)."""
        if not self.is_moe:
            return self.layer_flops_fwd(micro_batch)
        f = self.moe_fraction
        return (1 - f) * self.layer_flops_fwd(micro_batch) + f * self.moe_layer_flops_fwd(micro_batch)

    def decoder_flops_fwd(self, micro_batch: int) -> float:
        """Forward FLOPs of every decoder layer for one micro-batch."""
        return self.num_layers * self.mean_layer_flops_fwd(micro_batch)

    def logits_flops_fwd(self, micro_batch: int) -> float:
        return 2.0 * micro_batch * self.seq_length * self.hidden_size * self.vocab_size

    def mtp_flops_fwd(self, micro_batch: int) -> float:
        """Forward FLOPs of the MTP modules: per depth a layer, the 2h -> h projection and its own logits."""
        tokens = micro_batch * self.seq_length
        proj = 2.0 * tokens * 2 * self.hidden_size * self.hidden_size
        return self.mtp_layers * (self.layer_flops_fwd(micro_batch) + proj + self.logits_flops_fwd(micro_batch))


def load_model(path: str | Path) -> ModelSpec:
    return load_validated(ModelSpec, path)


PRESETS_DIR = Path(__file__).resolve().parent / "presets" / "models"


def preset_model(name: str) -> ModelSpec:
    path = PRESETS_DIR / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))
        raise ConfigError(f"no model preset {name!r}", fix=f"use one of {known} or a model file path")
    return load_model(path)
