"""Which vendor each rank of a shim group is on, agreed by every member before any communicator exists.

Sources, strongest first:

1. ``HET_PLUGIN_VENDOR_MAP`` (whole job, per global rank: ``"nvidia,nvidia,amd,amd"`` or ``"nvidia*2,amd*2"``);
2. :func:`set_vendor_map` (the adapters pass ``[plan.vendor_of(r) for r in range(world)]``);
3. ``HET_PLUGIN_VENDOR`` on each rank (only that rank's own vendor; the group gathers them);
4. what torch reports (ROCm build -> amd, CUDA -> nvidia, XPU -> intel, else cpu).

``HET_PLUGIN_VENDOR`` also overrides a rank's own entry, so a map that contradicts it is an error.
Every member publishes what it believes in the group's store (or the error it hit) and then compares
with every other member; any disagreement raises :class:`VendorMapError` on every member instead of
leaving some of them waiting in a collective that will never match.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping, Optional, Sequence, Union

from ..errors import ConfigError

ENV_VENDOR = "HET_PLUGIN_VENDOR"
ENV_VENDOR_MAP = "HET_PLUGIN_VENDOR_MAP"
ENV_AGREE_TIMEOUT = "HET_PLUGIN_SHIM_AGREE_TIMEOUT"
DEFAULT_AGREE_TIMEOUT_S = 300.0

VendorMapLike = Union[Sequence[str], Mapping[int, str]]


class VendorMapError(ConfigError):
    """The ranks of a shim group do not agree on (or cannot know) who is on which vendor."""

    def __init__(self, message: str, *, fix: Optional[str] = None):
        super().__init__(message, source="het_shim", field="vendor map",
                         fix=fix or f"give every rank the same map: het_plugin.comm.set_vendor_map(...) from the "
                                    f"plan, or {ENV_VENDOR_MAP}=v0,v1,... (one entry per global rank), or "
                                    f"{ENV_VENDOR}=<vendor> on each rank")


_declared: Optional[dict[int, str]] = None   # set_vendor_map(...), by global rank
_networks: Optional[dict[int, "RankNetwork"]] = None   # where each global rank sits (picks subgroup interfaces)


@dataclass(frozen=True)
class RankNetwork:
    """Where a rank runs: its node, cluster and that cluster's fabric (ib | roce | ethernet)."""
    node: str
    cluster: str
    fabric: str


def subgroup_transport(networks: Sequence[RankNetwork]) -> str:
    """The transport of one vendor subgroup, as the planner names it: its gloo interface comes from it."""
    if len({n.node for n in networks}) <= 1:
        return "local"
    if len({n.cluster for n in networks}) == 1 and networks[0].fabric in ("ib", "roce"):
        return networks[0].fabric
    return "socket"


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


def set_vendor_map(vendors: Optional[VendorMapLike], *,
                   networks: Optional[Sequence[RankNetwork]] = None) -> None:
    """Declare every rank's vendor (by global rank) for the shim groups created from now on.

    The adapters call this with the plan's view before creating host-staged groups; None forgets it.
    ``networks`` (per global rank, optional) lets each vendor subgroup's gloo communicator use its own
    fabric's interface (``HET_PLUGIN_GLOO_IFNAMES``) while the leaders use the host-staged one.
    """
    global _declared, _networks
    _declared = None if vendors is None else to_rank_map(vendors, "set_vendor_map")
    _networks = None if networks is None else dict(enumerate(networks))


def set_vendor_map_from_plan(plan) -> None:
    """``set_vendor_map`` with ``plan.vendor_of(rank)`` (and each rank's node and fabric) for every rank."""
    world = sum(n.num_ranks for n in plan.nodes)
    nodes = [plan.node_of(r) for r in range(world)]
    set_vendor_map([n.vendor for n in nodes], networks=[RankNetwork(n.name, n.cluster, n.fabric) for n in nodes])


def declared_networks() -> Optional[dict[int, RankNetwork]]:
    return None if _networks is None else dict(_networks)


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

    def to_json(self) -> str:
        return json.dumps({"own": self.own, "own_source": self.own_source,
                           "map": list(self.group_map) if self.group_map is not None else None,
                           "map_source": self.map_source})

    @staticmethod
    def from_json(text: str) -> "Belief":
        d = json.loads(text)
        return Belief(d["own"], d["own_source"], tuple(d["map"]) if d["map"] is not None else None, d["map_source"])


def local_belief(global_ranks: Sequence[int], my_global_rank: int, world_size: Optional[int],
                 env: Optional[Mapping[str, str]] = None) -> Belief:
    """What this rank believes about ``global_ranks`` (the group's members, in group order)."""
    env = os.environ if env is None else env
    rank_map, map_source = None, None
    if env.get(ENV_VENDOR_MAP, "").strip():
        rank_map, map_source = parse_vendor_map(env[ENV_VENDOR_MAP]), ENV_VENDOR_MAP
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
                     timeout_s: Optional[float] = None, env: Optional[Mapping[str, str]] = None) -> tuple[str, ...]:
    """Publish this rank's belief (or its error) in ``store``; return the agreed vendors, per group rank.

    ``store`` must be private to this group (the group's prefix store). Raises VendorMapError on every
    member when beliefs disagree, a member failed, or a member never arrives within the timeout.
    """
    env = os.environ if env is None else env
    if timeout_s is None:
        timeout_s = float(env.get(ENV_AGREE_TIMEOUT, DEFAULT_AGREE_TIMEOUT_S))
    my_global = global_ranks[group_rank]
    error: Optional[VendorMapError] = None
    try:
        mine = local_belief(global_ranks, my_global, world_size, env).to_json()
    except VendorMapError as exc:
        error = exc
        mine = "error:" + str(exc)
    store.set(f"het_shim/vendor/{group_rank}", mine)
    keys = [f"het_shim/vendor/{i}" for i in range(len(global_ranks))]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception:
        missing = [global_ranks[i] for i, k in enumerate(keys) if not store.check([k])]
        raise VendorMapError(f"rank(s) {missing} of group {list(global_ranks)} never reached the creation of this "
                             f"het_shim group within {timeout_s:.0f}s ({ENV_AGREE_TIMEOUT})",
                             fix="every member must call new_group(..., backend='het_shim') for the same ranks, "
                                 "in the same order as the other members") from None
    if error is not None:
        raise error
    values = [store.get(k).decode() for k in keys]
    failed = [(global_ranks[i], v[len("error:"):]) for i, v in enumerate(values) if v.startswith("error:")]
    if failed:
        r, msg = failed[0]
        raise VendorMapError(f"rank(s) {[f[0] for f in failed]} of group {list(global_ranks)} could not build "
                             f"their vendor map; rank {r}: {msg}")
    return reconcile([Belief.from_json(v) for v in values], global_ranks)
