"""Model description: a decoder-only transformer, as much as the cost model needs."""
from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, NonNegativeInt, PositiveInt, model_validator

from .yamlio import load_validated

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


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
        return self

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

    @property
    def params_per_layer(self) -> int:
        h = self.hidden_size
        kv = h * self.kv_heads // self.num_attention_heads
        attn = h * (h + 2 * kv) + h * h
        mlp = (3 if self.activation == "swiglu" else 2) * h * self.ffn
        return attn + mlp + 4 * h   # + layernorms

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
        out = self.num_layers * self.params_per_layer + self.embedding_params + self.mtp_params
        return out if self.tie_embeddings else out + self.embedding_params

    def embedding_stages(self, pp: int) -> tuple[int, ...]:
        """Pipeline stages that hold the word embedding and keep its gradient in sync (Megatron's
        embedding group, as Megatron-LM's pretrain_gpt ``get_embedding_ranks`` builds it): the first
        stage, and the last when it ties the output layer to the embedding or runs the MTP modules
        (which read the embedding; het_plugin's layout puts them on the last stage)."""
        if pp > 1 and (self.tie_embeddings or self.mtp_layers):
            return (0, pp - 1)
        return (0,)

    def layer_flops_fwd(self, micro_batch: int) -> float:
        """Forward FLOPs of one transformer layer for one micro-batch (matmuls + attention)."""
        tokens = micro_batch * self.seq_length
        h = self.hidden_size
        kv = h * self.kv_heads // self.num_attention_heads
        mlp = (3 if self.activation == "swiglu" else 2) * h * self.ffn
        matmul = 2 * tokens * (h * (h + 2 * kv) + h * h + mlp)
        attention = 4 * tokens * self.seq_length * h
        return float(matmul + attention)

    def logits_flops_fwd(self, micro_batch: int) -> float:
        return 2.0 * micro_batch * self.seq_length * self.hidden_size * self.vocab_size

    def mtp_flops_fwd(self, micro_batch: int) -> float:
        """Forward FLOPs of the MTP modules: per depth a layer, the 2h -> h projection and its own logits."""
        tokens = micro_batch * self.seq_length
        proj = 2.0 * tokens * 2 * self.hidden_size * self.hidden_size
        return self.mtp_layers * (self.layer_flops_fwd(micro_batch) + proj + self.logits_flops_fwd(micro_batch))


def load_model(path: str | Path) -> ModelSpec:
    return load_validated(ModelSpec, path)


PRESETS_DIR = Path(__file__).resolve().parent / "data" / "models"


def preset_model(name: str) -> ModelSpec:
    path = PRESETS_DIR / f"{name}.yaml"
    if not path.exists():
        from .errors import ConfigError
        known = sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))
        raise ConfigError(f"no model preset {name!r}", fix=f"use one of {known} or a model file path")
    return load_model(path)
