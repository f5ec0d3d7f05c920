"""The plan's layers per stage as DeepSpeed ``PipelineModule.parts`` boundaries (pure Python).

DeepSpeed partitions a flat layer list (``uniform``, ``parameters``, ``type:regex``); the plan counts
*transformer layers*. A regex on layer class names (``layer_pattern``) says which entries of the list the
plan counts; the rest (embedding, final norm, head, lambdas) stay with the counted layer before them, and
those before the first counted layer go to stage 0. Without a pattern every entry counts.
"""
from __future__ import annotations

import re
from typing import Optional, Sequence

from ..core.errors import ConfigError
from .config import SECTION


def counted_layers(names: Sequence[Optional[str]], pattern: Optional[str]) -> list[int]:
    """Indices of the entries the plan counts (``names``: class name of each entry, None if it has none)."""
    if pattern is None:
        return list(range(len(names)))
    rx = re.compile(pattern, re.IGNORECASE)
    return [i for i, n in enumerate(names) if n is not None and rx.search(n)]


def plan_parts(num_entries: int, counted: Sequence[int], layers_per_stage: Sequence[int],
               source: str = "<config>") -> list[int]:
    """``parts`` (stage s holds entries ``parts[s]:parts[s+1]``) giving stage s ``layers_per_stage[s]``
    counted layers."""
    if len(counted) != sum(layers_per_stage):
        raise ConfigError(f"the plan splits {sum(layers_per_stage)} layers {list(layers_per_stage)}, but the layer "
                          f"list has {len(counted)} counted layers (of {num_entries} entries)", source=source,
                          field=f"{SECTION}.model.num_layers",
                          fix=f"re-wrap with a model of {len(counted)} layers, or set layer_pattern to your "
                              "transformer block's class name so only those layers count")
    if any(n < 1 for n in layers_per_stage):
        raise ConfigError(f"the plan leaves a stage empty {list(layers_per_stage)}", source=source,
                          field=f"{SECTION}.plan.layers_per_stage", fix="use fewer pipeline stages")
    parts = [0]
    done = 0
    for n in layers_per_stage[:-1]:
        done += n
        parts.append(counted[done])
    parts.append(num_entries)
    return parts


def layers_in_parts(parts: Sequence[int], counted: Sequence[int]) -> list[int]:
    """Counted layers per stage for given boundaries (the inverse view, for checks and reports)."""
    return [sum(1 for i in counted if parts[s] <= i < parts[s + 1]) for s in range(len(parts) - 1)]
