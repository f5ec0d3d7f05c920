"""Pure bookkeeping of a shim group: vendor subgroups, their leaders, and how a tensor is chunked."""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

ENV_CHUNK_BYTES = "HET_PLUGIN_SHIM_CHUNK_BYTES"
DEFAULT_CHUNK_BYTES = 512 << 10


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

    # ---- stripes: all-reduce work shared by every member, not only the leaders ----------------
    @property
    def num_stripes(self) -> int:
        """An all-reduce is cut into this many stripes; each crosses vendors over a different 'rail'."""
        return self.max_subgroup

    def stripe_owner(self, stripe: int, subgroup: int) -> int:
        """The group rank of ``subgroup`` that reduces, exchanges and sends back ``stripe``."""
        members = self.subgroups[subgroup]
        return members[stripe % len(members)]

    @cached_property
    def rails(self) -> tuple[tuple[int, ...], ...]:
        """Per stripe, its owners (one per subgroup, in subgroup order): they all-reduce it through host memory.

        Rail 0 is the subgroup leaders. With equal subgroups every member is on one rail, so every
        member's NIC carries 1/k of the cross-vendor traffic instead of the leader's carrying all of it.
        """
        return tuple(tuple(self.stripe_owner(i, j) for j in range(len(self.subgroups)))
                     for i in range(self.num_stripes))


def stripe_pieces(numel: int, num_stripes: int, element_size: int,
                  chunk_bytes: int | None = None) -> list[tuple[int, int, int]]:
    """(stripe, start, stop) pieces: stripes split near-evenly, each cut into chunks, chunk-major order.

    The order (first chunk of every stripe, then the second ...) keeps every rail busy from the start.
    Empty stripes (numel < num_stripes) have no pieces.
    """
    per_stripe = []
    for i in range(num_stripes):
        a, b = i * numel // num_stripes, (i + 1) * numel // num_stripes
        per_stripe.append([(i, a + x, a + y) for x, y in chunk_bounds(b - a, element_size, chunk_bytes)] if b > a
                          else [])
    out = []
    for k in range(max((len(p) for p in per_stripe), default=0)):
        out += [p[k] for p in per_stripe if k < len(p)]
    return out


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
