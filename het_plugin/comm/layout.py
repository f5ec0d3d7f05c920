"""Pure bookkeeping of a shim group: vendor subgroups, their leaders, and how a tensor is chunked."""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

ENV_CHUNK_BYTES = "HET_PLUGIN_SHIM_CHUNK_BYTES"
DEFAULT_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class ShimLayout:
    """``vendors[i]`` is group rank i's vendor; subgroups keep group-rank order, by first appearance."""
    vendors: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(self.vendors)

    @cached_property
    def subgroups(self) -> tuple[tuple[int, ...], ...]:
        order: list[str] = []
        for v in self.vendors:
            if v not in order:
                order.append(v)
        return tuple(tuple(r for r, v in enumerate(self.vendors) if v == name) for name in order)

    @property
    def subgroup_vendors(self) -> tuple[str, ...]:
        return tuple(self.vendors[s[0]] for s in self.subgroups)

    @cached_property
    def leaders(self) -> tuple[int, ...]:
        """Group rank of each subgroup's leader (its first member); leader i serves subgroup i."""
        return tuple(s[0] for s in self.subgroups)

    @property
    def single_vendor(self) -> bool:
        return len(self.subgroups) == 1

    @property
    def max_subgroup(self) -> int:
        return max(len(s) for s in self.subgroups)

    def subgroup_index(self, rank: int) -> int:
        return next(i for i, s in enumerate(self.subgroups) if rank in s)

    def local_rank(self, rank: int) -> int:
        return self.subgroups[self.subgroup_index(rank)].index(rank)

    def same_vendor(self, a: int, b: int) -> bool:
        return self.vendors[a] == self.vendors[b]


def chunk_bounds(numel: int, element_size: int, chunk_bytes: int | None = None) -> list[tuple[int, int]]:
    """[start, stop) element ranges of at most ``chunk_bytes`` each; one empty range for an empty tensor."""
    if chunk_bytes is None:
        chunk_bytes = int(os.environ.get(ENV_CHUNK_BYTES, DEFAULT_CHUNK_BYTES))
    per = max(1, chunk_bytes // max(1, element_size))
    if numel == 0:
        return [(0, 0)]
    return [(a, min(numel, a + per)) for a in range(0, numel, per)]


def describe(layout: ShimLayout, global_ranks: Sequence[int]) -> str:
    return ", ".join(f"{layout.vendors[s[0]]}: ranks {[global_ranks[r] for r in s]}" for s in layout.subgroups)
