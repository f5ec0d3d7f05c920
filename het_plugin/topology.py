"""Logical parallel coordinates <-> logical ranks, exactly as Megatron-Core and DeepSpeed number them.

A *logical* rank is the rank a framework would give a coordinate on a homogeneous cluster:
Megatron-Core's ``RankGenerator`` with order ``tp-cp-ep-dp-pp`` (tp fastest) and DeepSpeed's
``PipeModelDataParallelTopology`` (axes pipe, data, model; model fastest) agree on it. A placement
(``het_plugin.placement``) maps logical ranks to the physical ranks the launcher started, so one
permutation serves both frameworks. Pure Python: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Sequence

ORDER = ("tp", "cp", "ep", "dp", "pp")

# Group kinds Megatron-Core builds from its decoder RankGenerator (plus 'embedding', derived from pp).
GROUP_KINDS = ("tp", "cp", "dp", "pp", "dp-cp", "tp-cp", "tp-pp", "tp-dp", "tp-dp-cp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of one plan; validates itself against a world size."""
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1

    def __post_init__(self):
        for name in ORDER:
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.ep != 1:
            raise ValueError("expert parallelism (ep > 1) is not planned by het_plugin yet; use ep=1")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.ep * self.dp * self.pp

    @property
    def stage_size(self) -> int:
        """Ranks holding one pipeline stage (all its TP, CP and DP replicas)."""
        return self.tp * self.cp * self.ep * self.dp

    def sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, n) for n in ORDER)

    def coord(self, logical_rank: int) -> dict[str, int]:
        out = {}
        r = logical_rank
        for name, size in zip(ORDER, self.sizes()):
            out[name] = r % size
            r //= size
        return out

    def logical_rank(self, **coord: int) -> int:
        rank, stride = 0, 1
        for name, size in zip(ORDER, self.sizes()):
            rank += coord.get(name, 0) * stride
            stride *= size
        return rank

    def groups(self, kind: str) -> list[list[int]]:
        """Logical rank lists of every group of ``kind`` (e.g. 'tp', 'dp-cp', 'tp-pp'), in Megatron's order."""
        if kind == "embedding":
            return [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in self.groups("pp")]
        if kind == "position_embedding":
            return [[g[0]] for g in self.groups("pp")]
        names = kind.split("-")
        unknown = [n for n in names if n not in ORDER]
        if unknown:
            raise ValueError(f"unknown group kind {kind!r}")
        mask = [n in names for n in ORDER]
        return masked_orthogonal_groups(self.sizes(), mask)


def masked_orthogonal_groups(sizes: tuple[int, ...], mask: list[bool]) -> list[list[int]]:
    """Same enumeration as Megatron-Core's ``generate_masked_orthogonal_rank_groups``."""
    strides = [prod(sizes[:i]) for i in range(len(sizes))]
    masked = [(s, st) for s, st, m in zip(sizes, strides, mask) if m]
    unmasked = [(s, st) for s, st, m in zip(sizes, strides, mask) if not m]
    group_size = prod(s for s, _ in masked)
    world = prod(sizes)
    out = []
    for gi in range(world // group_size):
        base = _offset(gi, unmasked)
        out.append([base + _offset(ri, masked) for ri in range(group_size)])
    return out


def _offset(index: int, dims: list[tuple[int, int]]) -> int:
    off = 0
    for size, stride in dims:
        off += (index % size) * stride
        index //= size
    return off


def format_ranks(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8": runs of consecutive ranks, for messages and summaries."""
    ranks = sorted(set(ranks))
    if not ranks:
        return "none"
    out, start = [], ranks[0]
    prev = start
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(out)
