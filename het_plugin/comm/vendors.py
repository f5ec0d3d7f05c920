"""Which vendor each rank of a shim group is on, agreed by every member before any communicator exists.

Sources, strongest first:

1. ``HET_PLUGIN_VENDOR_MAP`` (whole job, per global rank: ``"nvidia,nvidia,amd,amd"`` or ``"nvidia*2,amd*2"``);
2. the group's own :class:`ShimOptions` (``new_group(..., backend="het_shim", pg_options=ShimOptions(...))``;
   the adapters pass ``ShimOptions.from_plan(plan)`` for every cross-vendor group they create);
3. :func:`set_vendor_map` (a process-wide declaration, for groups a user creates by hand);
4. ``HET_PLUGIN_VENDOR`` on each rank (only that rank's own vendor; the group gathers them);
5. what torch reports (ROCm build -> amd, CUDA -> nvidia, XPU -> intel, else cpu).

``HET_PLUGIN_VENDOR`` also overrides a rank's own entry, so a map that contradicts it is an error.
Every member publishes what it believes in the group's store (or the error it hit); group rank 0 compares
them all and publishes one answer every member reads (:meth:`het_plugin.runtime.exchange.Exchange.decide`:
linear in the group's size); any disagreement raises :class:`VendorMapError` on every member instead of
leaving some of them waiting in a collective that will never match.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

from ..core.errors import ConfigError
from ..runtime.exchange import Exchange, ExchangeTimeout
from ..runtime.group_policy import ShimOptions  # noqa: F401   (defined beside the policy that hands it out)

ENV_VENDOR = "HET_PLUGIN_VENDOR"
ENV_VENDOR_MAP = "HET_PLUGIN_VENDOR_MAP"

VendorMapLike = Union[Sequence[str], Mapping[int, str]]


class VendorMapError(ConfigError):
    """The ranks of a shim group do not agree on (or cannot know) who is on which vendor."""

    def __init__(self, message: str, *, fix: Optional[str] = None):
        super().__init__(message, source="het_shim", field="vendor map",
                         fix=fix or f"give every rank the same map: het_plugin.comm.set_vendor_map(...) from the "
                                    f"plan, or {ENV_VENDOR_MAP}=v0,v1,... (one entry per global rank), or "
                                    f"{ENV_VENDOR}=<vendor> on each rank")


# set_vendor_map's process-wide declaration: a user API for groups created by hand (the adapters pass
# ShimOptions per group instead, so nothing of a plan lives here).
_declared: Optional[dict[int, str]] = None


def normalize_vendor(name: object, where: str) -> str:
    text = str(name).strip().lower() if name is not None else ""
    if not text or any(c in text for c in ",*= "):
        raise VendorMapError(f"{where}: {name!r} is not a vendor name (use e.g. 'nvidia', 'amd')")
    return text


def to_rank_map(vendors: VendorMapLike, where: str) -> dict[int, str]:
    """A list (index = global rank) or a mapping {global rank: vendor} -> {rank: normalized vendor}."""
    if isinstance(vendors, str):
        return parse_vendor_map(vendors, where)
    if isinstance(vendors, Mapping):
        out = {}
        for rank, vendor in vendors.items():
            if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
                raise VendorMapError(f"{where}: key {rank!r} is not a global rank (an integer >= 0)")
            out[rank] = normalize_vendor(vendor, f"{where}[{rank}]")
        return out
    return {r: normalize_vendor(v, f"{where}[{r}]") for r, v in enumerate(vendors)}


def parse_vendor_map(text: str, where: str = ENV_VENDOR_MAP) -> dict[int, str]:
    """``"nvidia,nvidia,amd"`` or ``"nvidia*2,amd"`` -> {0: 'nvidia', 1: 'nvidia', 2: 'amd'}."""
    out: dict[int, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, star, count = item.partition("*")
        n = 1
        if star:
            try:
                n = int(count)
            except ValueError:
                n = 0
            if n < 1:
                raise VendorMapError(f"{where}: {item!r}: the count after '*' must be a positive integer")
        vendor = normalize_vendor(name, f"{where} entry {item!r}")
        for _ in range(n):
            out[len(out)] = vendor
    if not out:
        raise VendorMapError(f"{where} is set but empty")
    return out


def set_vendor_map(vendors: Optional[VendorMapLike]) -> None:
    """Declare every rank's vendor (by global rank) for het_shim groups created from now on without
    ShimOptions; None forgets it."""
    global _declared
    _declared = None if vendors is None else to_rank_map(vendors, "set_vendor_map")


def declared_vendor_map() -> Optional[dict[int, str]]:
    return None if _declared is None else dict(_declared)


def detect_vendor() -> str:
    """The vendor torch can see on this process; 'cpu' when there is no accelerator."""
    import torch
    if getattr(torch.version, "hip", None):
        return "amd"
    if torch.cuda.is_available():
        return "nvidia"
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return "intel"
    return "cpu"


@dataclass(frozen=True)
class Belief:
    """What one rank believes before agreement: its own vendor and (maybe) the whole group's map."""
    own: str
    own_source: str
    group_map: Optional[tuple[str, ...]]   # per group rank, or None (this rank only knows itself)
    map_source: Optional[str]

    def to_dict(self) -> dict:
        return {"own": self.own, "own_source": self.own_source,
                "map": list(self.group_map) if self.group_map is not None else None, "map_source": self.map_source}

    @staticmethod
    def from_dict(d: dict) -> "Belief":
        return Belief(d["own"], d["own_source"], tuple(d["map"]) if d["map"] is not None else None, d["map_source"])


def local_belief(global_ranks: Sequence[int], my_global_rank: int, world_size: Optional[int],
                 env: Optional[Mapping[str, str]] = None, options: Optional[ShimOptions] = None) -> Belief:
    """What this rank believes about ``global_ranks`` (the group's members, in group order)."""
    env = os.environ if env is None else env
    rank_map, map_source = None, None
    if env.get(ENV_VENDOR_MAP, "").strip():
        rank_map, map_source = parse_vendor_map(env[ENV_VENDOR_MAP]), ENV_VENDOR_MAP
    elif options is not None:
        rank_map, map_source = to_rank_map(options.vendors, "ShimOptions.vendors"), "the plan"
        world_size = None            # the plan's map may list only what it placed; members must be in it
    elif _declared is not None:
        rank_map, map_source = dict(_declared), "set_vendor_map"
    group_map = None
    if rank_map is not None:
        if world_size is not None:
            outside = sorted(r for r in rank_map if r >= world_size)
            if outside:
                raise VendorMapError(f"{map_source} names rank(s) {outside}, outside the job's {world_size} ranks "
                                     f"(0..{world_size - 1})")
            absent = sorted(set(range(world_size)) - set(rank_map))
            if absent:
                raise VendorMapError(f"{map_source} covers {len(rank_map)} ranks but the job has {world_size}: "
                                     f"no vendor for rank(s) {absent}")
        missing = [r for r in global_ranks if r not in rank_map]
        if missing:
            raise VendorMapError(f"{map_source} has no vendor for rank(s) {missing} of this group {list(global_ranks)}")
        group_map = tuple(rank_map[r] for r in global_ranks)
    if env.get(ENV_VENDOR, "").strip():
        own, own_source = normalize_vendor(env[ENV_VENDOR], ENV_VENDOR), ENV_VENDOR
    elif group_map is not None:
        own, own_source = group_map[list(global_ranks).index(my_global_rank)], map_source
    else:
        own, own_source = detect_vendor(), "torch"
    return Belief(own, own_source, group_map, map_source)


def reconcile(beliefs: Sequence[Belief], global_ranks: Sequence[int]) -> tuple[str, ...]:
    """Every member's belief -> the group's vendors (per group rank); VendorMapError on any disagreement."""
    maps = {i: b.group_map for i, b in enumerate(beliefs) if b.group_map is not None}
    if maps:
        distinct: dict[tuple[str, ...], list[int]] = {}
        for i, m in maps.items():
            distinct.setdefault(m, []).append(global_ranks[i])
        if len(distinct) > 1:
            parts = "; ".join(f"rank(s) {rs} say {_show(m, global_ranks)}" for m, rs in distinct.items())
            raise VendorMapError(f"the ranks of group {list(global_ranks)} declare different vendor maps: {parts}")
        without = [global_ranks[i] for i, b in enumerate(beliefs) if b.group_map is None]
        if without:
            any_source = beliefs[next(iter(maps))].map_source
            raise VendorMapError(f"rank(s) {list(global_ranks[i] for i in maps)} declared a vendor map "
                                 f"({any_source}) but rank(s) {without} did not",
                                 fix="call het_plugin.comm.set_vendor_map(...) on every rank before creating the "
                                     f"group, or set {ENV_VENDOR_MAP} for every rank")
        group_map = next(iter(distinct))
        wrong = [(global_ranks[i], b.own, b.own_source, group_map[i]) for i, b in enumerate(beliefs)
                 if b.own != group_map[i]]
        if wrong:
            parts = "; ".join(f"rank {r} is {own!r} ({src}) but the map says {m!r}" for r, own, src, m in wrong)
            raise VendorMapError(f"the vendor map contradicts the ranks themselves: {parts}",
                                 fix=f"fix the map, or unset {ENV_VENDOR} on those ranks")
        return group_map
    return tuple(b.own for b in beliefs)


def _show(group_map: tuple[str, ...], global_ranks: Sequence[int]) -> str:
    return "{" + ", ".join(f"{r}: {v}" for r, v in zip(global_ranks, group_map)) + "}"


def agree_on_vendors(store, *, group_rank: int, global_ranks: Sequence[int], world_size: Optional[int],
                     timeout_s: Optional[float] = None, env: Optional[Mapping[str, str]] = None,
                     options: Optional[ShimOptions] = None) -> tuple[str, ...]:
    """Publish this rank's belief (or its error) in ``store``; return the agreed vendors, per group rank.

    ``store`` must be private to this group (the group's prefix store). Raises VendorMapError on every
    member when beliefs disagree, a member failed, or a member never arrives within the timeout
    (``HET_PLUGIN_TIMEOUT``).
    """
    error: Optional[VendorMapError] = None
    mine = None
    try:
        mine = local_belief(global_ranks, global_ranks[group_rank], world_size, env, options).to_dict()
    except VendorMapError as exc:
        error = exc
    ex = Exchange(store, "vendors", index=group_rank, members=global_ranks, key="0", timeout=timeout_s, env=env,
                  what="the creation of this het_shim group")
    try:          # group rank 0 reconciles every belief and publishes the one answer (linear in the group)
        answer = ex.decide(mine, error=error, judge=lambda entries: _judge(entries, global_ranks))
    except ExchangeTimeout as exc:
        raise VendorMapError(f"{exc}; group {list(global_ranks)}",
                             fix="every member must call new_group(..., backend='het_shim') for the same ranks, "
                                 "in the same order as the other members") from None
    if error is not None:
        raise error
    if answer.error is not None:
        raise VendorMapError(answer.error.get("problem", "?"), fix=answer.error.get("fix"))
    return tuple(answer.value)


def _judge(entries, global_ranks: Sequence[int]) -> list[str]:
    """Group rank 0: every member's belief (or error) -> the group's vendors; VendorMapError otherwise."""
    failed = [e for e in entries if e.error is not None]
    if failed:
        raise VendorMapError(f"rank(s) {[e.rank for e in failed]} of group {list(global_ranks)} could not build "
                             f"their vendor map; rank {failed[0].rank}: {failed[0].error.get('problem')}")
    return list(reconcile([Belief.from_dict(e.value) for e in entries], global_ranks))
