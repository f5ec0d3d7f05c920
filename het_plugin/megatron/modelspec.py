"""Megatron's own arguments -> ModelSpec, so a Megatron launch needs no separate model file."""
from __future__ import annotations

from typing import Any, Optional

from ..core.errors import ConfigError
from ..core.inputs.model import ModelSpec

# GPT-2's vocabulary padded to a multiple of 128 (Megatron's default make_vocab_size_divisible_by).
# Used when the launch names no vocabulary size: the tokenizer is built after the plan, and the
# embedding is a small share of the cost model's work.
DEFAULT_VOCAB_SIZE = 50304


def _get(args: Any, name: str, default=None):
    value = getattr(args, name, default)
    return default if value is None else value


def model_from_args(args: Any, *, data_parallel_size: Optional[int] = None) -> ModelSpec:
    """Build a ModelSpec from a Megatron-LM ``args`` namespace (or any object with the same fields).

    ``global_batch_size`` left unset by the user becomes ``micro_batch_size * data_parallel_size``
    (Megatron's own rule) when ``data_parallel_size`` is known, else ``micro_batch_size``.
    """
    num_layers = _get(args, "num_layers") or _get(args, "decoder_num_layers")
    missing = [f for f, v in (("num_layers", num_layers), ("hidden_size", _get(args, "hidden_size")),
                              ("num_attention_heads", _get(args, "num_attention_heads")),
                              ("seq_length", _get(args, "seq_length"))) if not v]
    if missing:
        flags = ", ".join("--" + m.replace("_", "-") for m in missing)
        raise ConfigError(f"the model is read from Megatron's arguments, but {missing} are not set",
                          source="command line", field=missing[0], fix=f"pass {flags}")
    micro = _get(args, "micro_batch_size")
    gbs = _get(args, "global_batch_size")
    if gbs is None:
        gbs = (micro or 1) * (data_parallel_size or 1)
    vocab = _get(args, "padded_vocab_size") or _get(args, "vocab_size") or DEFAULT_VOCAB_SIZE
    dtype = "bf16" if _get(args, "bf16", False) else "fp16" if _get(args, "fp16", False) else "fp32"
    query_groups = _get(args, "num_query_groups") if _get(args, "group_query_attention", False) else None
    fields = dict(
        name="megatron-args",
        num_layers=int(num_layers),
        hidden_size=int(args.hidden_size),
        num_attention_heads=int(args.num_attention_heads),
        num_query_groups=query_groups,
        ffn_hidden_size=_get(args, "ffn_hidden_size"),
        vocab_size=int(vocab),
        seq_length=int(args.seq_length),
        global_batch_size=int(gbs),
        micro_batch_size=micro,
        dtype=dtype,
        activation="swiglu" if _get(args, "swiglu", False) else "gelu",
        tie_embeddings=not _get(args, "untie_embeddings_and_output_weights", False),
        mtp_layers=int(_get(args, "mtp_num_layers", 0) or 0),
    )
    fields.update(moe_fields(args))
    try:
        return ModelSpec(**fields)
    except Exception as exc:   # pydantic's ValidationError: re-raise in het_plugin's shape
        raise ConfigError(f"Megatron's model arguments are inconsistent: {exc}", source="command line",
                          fix="check --hidden-size, --num-attention-heads, --num-query-groups, the batch sizes and "
                              "the --num-experts / --moe-* arguments") from None


def moe_fields(args: Any) -> dict:
    """The mixture-of-experts fields of ModelSpec from Megatron-LM's arguments of the same names
    (``--num-experts`` is ``num_experts`` in args, ``num_moe_experts`` in TransformerConfig); none for a
    dense model (no --num-experts, or 0)."""
    experts = _get(args, "num_experts") or _get(args, "num_moe_experts")
    if not experts:
        return {}
    out: dict = {"num_moe_experts": int(experts)}
    for name in ("moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        value = _get(args, name)
        if value is not None:
            out[name] = int(value)
    freq = _get(args, "moe_layer_freq")
    if freq is not None:        # Megatron's argument type already turned a pattern string into a list
        out["moe_layer_freq"] = list(freq) if isinstance(freq, (list, tuple)) else freq
    return out
