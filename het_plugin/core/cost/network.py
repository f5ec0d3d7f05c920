"""Link tiers: latency-bandwidth per hop kind, the collective paths a group's members form, and the
placement's network (which transport each group gets, which tier each hop rides). Constants of the cost
model (documented in docs/planner.md) live here too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

from ..inputs.cluster import Cluster, Link, Node, RDMA
from ..ranks.placement import baseline_transport, cluster_transport, stock_multinet_transport
from ..inputs.profile import Profile
from ..ranks.transport import OVER_SOCKETS, Transport

TransportFn = Callable[[Cluster, Sequence[int]], str]

# ---- constants (documented in docs/planner.md) ----------------------------------------------------
HOST_COPY_GBPS = 200.0          # device <-> host copy of the host-staged shim (PCIe Gen4 x16, one way)
DEFAULT_SOCKET_GBPS = 25.0      # sockets on a node with no Ethernet NIC listed and no inter-cluster link
SOCKET_LATENCY_US = 30.0        # TCP latency of one socket step inside a cluster
LOCAL_LATENCY_US = 1.0
GRAD_BYTES = 4                  # Megatron-LM keeps and reduces bf16 models' gradients in fp32
WEIGHT_BYTES = 2
OPTIMIZER_STATE_BYTES = 12      # fp32 master weights + Adam m and v
OPTIMIZER_BYTES_MOVED = 32      # per parameter in one Adam step (read grad/master/m/v, write back, bf16 copy)
HBM_BYTES_PER_S = 1.5e12        # memory bandwidth assumed for the optimizer step
FRAMEWORK_OVERHEAD_GIB = 2.0    # CUDA/ROCm context, communicator buffers, allocator slack
LOGITS_BYTES = 10               # per logit on the last stage: bf16 logits, fp32 softmax and its gradient
GIB = 1024 ** 3


# Transports whose groups reduce hierarchically at run time when they span a slow boundary: the shim's
# 'host-staged' groups (vendor subgroups on their own fabric, stripes between them over host memory). A 'socket'
# group (one vendor, across clusters) is one NCCL communicator on sockets: a flat ring over the Ethernet NICs,
# charged so; add "socket" here once the runtime reduces such groups inside each fabric first.
SECTIONED_TRANSPORTS: tuple[str, ...] = (Transport.HOST_STAGED,)


# ---- link tiers -----------------------------------------------------------------------------------


# Profile tiers tried after a hop's own kind: the shim and sockets both ride on Ethernet.
FALLBACK_TIERS = {Transport.HOST_STAGED: ["socket", "ethernet"], Transport.SOCKET: ["ethernet"]}


@dataclass(frozen=True)
class Tier:
    """One kind of hop: ``kind`` is a profile tier name, ``names`` profile keys tried before it (a named link
    between clusters, this direction first), ``back_names`` the same for the opposite direction, ``cluster`` the
    cluster the hop runs inside (None: between clusters) for per-cluster profile entries."""
    kind: str
    gbps: float
    latency_us: float
    names: tuple[str, ...] = ()
    cluster: Optional[str] = None
    back_names: tuple[str, ...] = ()

    def step_s(self, nbytes: float, share: int = 1, profile: Optional[Profile] = None) -> float:
        """One transfer of ``nbytes`` while ``share`` streams use the same node NIC."""
        if nbytes <= 0:
            return 0.0
        if profile is not None:
            keys = list(self.names) + [self.kind] + FALLBACK_TIERS.get(self.kind, [])
            measured = profile.step_s(keys, nbytes, share, self.cluster)
            if measured is not None:
                return measured
        return self.latency_us * 1e-6 + nbytes * share * 8 / (self.gbps * 1e9)

    def flipped(self) -> "Tier":
        """The same hop the other way."""
        return replace(self, names=self.back_names, back_names=self.names)

    def both_ways_s(self, nbytes: float, share: int = 1, profile: Optional[Profile] = None) -> float:
        """A ring step over this hop, which carries data both ways at once: the slower direction."""
        t = self.step_s(nbytes, share, profile)
        if profile is not None and profile.directional and self.back_names:
            t = max(t, self.flipped().step_s(nbytes, share, profile))
        return t


@dataclass(frozen=True)
class Level:
    """One level of a hierarchical collective: ``members`` ring participants over ``tier`` (the slowest by the
    cluster file); ``alternatives``: the level's other hop tiers, which a format-2 profile may measure slower."""
    tier: Tier
    members: int
    share: int
    alternatives: tuple[Tier, ...] = ()

    def step_s(self, nbytes: float, profile: Optional[Profile]) -> float:
        if profile is None or profile.legacy:
            return self.tier.step_s(nbytes, self.share, profile)
        return max(t.both_ways_s(nbytes, self.share, profile) for t in (self.tier,) + self.alternatives)


@dataclass(frozen=True)
class CollectivePath:
    levels: tuple[Level, ...]
    host_staged: bool = False
    staged_fraction: float = 1.0    # share of the bytes each rank copies to and from the host (shim stripes)

    def allreduce_s(self, nbytes: float, profile: Optional[Profile] = None, fraction: float = 1.0) -> float:
        """Hierarchical ring all-reduce (``fraction`` 0.5: a reduce-scatter or an all-gather alone)."""
        total, chunk = 0.0, float(nbytes)
        for lv in self.levels:
            if lv.members > 1:
                total += 2 * (lv.members - 1) * fraction * lv.step_s(chunk / lv.members, profile)
                chunk /= lv.members
        if self.host_staged and nbytes > 0:
            total += 2 * nbytes * fraction * self.staged_fraction * 8 / (HOST_COPY_GBPS * 1e9)
        return total


# NCCL's tuner (src/graph/tuning.cc): the tree's all-reduce bus bandwidth is 0.92 of the ring's; it picks the
# algorithm its own model predicts faster, which sees latencies and bandwidths but not which hop is slow.
TREE_BW_FACTOR = 0.92


@dataclass(frozen=True)
class MultinetPath:
    """A one-vendor group across fabrics on NCCL's multi-network communicator (NCCL_ALLNET_ENABLE=1; NVIDIA/nccl
    cross-dc branch, src/graph/connect.cc): one flat ring of all ``members``, ordered fabric by fabric, so each
    ring leaves every fabric once (2*(n_dc-1) crossings for two fabrics, n_dc in general) and carries the ring's
    bytes on every link; the crossings of its channels are spread over the fabrics' nodes (NCCL_SCATTER_XDC=1,
    the default), so each crossing NIC carries 1/``scatter`` of them. ``fabric``: the slowest link inside a
    fabric (RDMA) or node; ``cross``: TCP between fabrics; ``share``: the group's streams on one node's NIC.
    All-reduce: the ring, or the hierarchical tree (trees built inside each fabric, roots chained across:
    depth (n_dc-1) + log2(nodes per fabric)) where NCCL's tuner would pick it."""
    members: int
    fabric: Tier
    cross: Tier
    share: int
    scatter: int
    n_dc: int
    nodes_per_dc: int

    def ring_s(self, nbytes: float, profile: Optional[Profile] = None, fraction: float = 1.0) -> float:
        n = self.members
        if n < 2 or nbytes <= 0:
            return 0.0
        chunk = nbytes / n
        step = max(self.fabric.step_s(chunk, self.share, profile),
                   self.cross.step_s(chunk / self.scatter, self.share, profile))
        return 2 * (n - 1) * fraction * step

    def tree_s(self, nbytes: float, profile: Optional[Profile] = None) -> float:
        """Reduce up and broadcast down the chained trees: every node's NIC carries the bytes each way, a
        crossing root 1/``scatter`` of them over TCP; latency per level of the tree's depth."""
        if self.members < 2 or nbytes <= 0:
            return 0.0
        levels = (self.n_dc - 1) + max(1, math.ceil(math.log2(max(2, self.nodes_per_dc))))
        bw = max(self.fabric.step_s(nbytes / TREE_BW_FACTOR, self.share, profile) - self.fabric.latency_us * 1e-6,
                 self.cross.step_s(nbytes / self.scatter / TREE_BW_FACTOR, self.share, profile)
                 - self.cross.latency_us * 1e-6)
        lat = 2 * ((self.n_dc - 1) * self.cross.latency_us + (levels - self.n_dc + 1) * self.fabric.latency_us) * 1e-6
        return 2 * bw + lat

    def nccl_picks_tree(self, nbytes: float) -> bool:
        """NCCL's tuner view: the same link for every hop (the fabric's), ring latency per step, tree per level."""
        n = self.members
        gbps, lat = self.fabric.gbps, self.fabric.latency_us * 1e-6
        ring = 2 * (n - 1) / n * nbytes * 8 / (gbps * 1e9) + 2 * (n - 1) * lat
        levels = (self.n_dc - 1) + max(1, math.ceil(math.log2(max(2, self.nodes_per_dc))))
        tree = 2 * nbytes * 8 / (TREE_BW_FACTOR * gbps * 1e9) + 2 * levels * lat
        return tree < ring

    def allreduce_s(self, nbytes: float, profile: Optional[Profile] = None, fraction: float = 1.0) -> float:
        """All-reduce (``fraction`` 1: ring or tree as NCCL picks) or reduce-scatter / all-gather (0.5: ring)."""
        if fraction == 1.0 and self.nccl_picks_tree(nbytes):
            return self.tree_s(nbytes, profile)
        return self.ring_s(nbytes, profile, fraction)


def socket_tier(cluster: Cluster, node: Node) -> Tier:
    """Ethernet as sockets see it: the node's Ethernet NIC, else the slowest inter-cluster link."""
    eth = [nic.gbps for nic in node.nics if nic.type == "ethernet"]
    if eth:
        return Tier("socket", max(eth), SOCKET_LATENCY_US)
    if node.fabric.type == "ethernet":
        return Tier("socket", node.fabric.gbps, max(node.fabric.latency_us, SOCKET_LATENCY_US))
    links = [link.gbps for link in cluster.links.values()]
    return Tier("socket", min(links) if links else DEFAULT_SOCKET_GBPS, SOCKET_LATENCY_US)


def hop_tier(cluster: Cluster, a: Node, b: Node, transport: str, link: Optional[Link] = None) -> Tier:
    """The tier one message between nodes ``a`` and ``b`` crosses for a group of ``transport``."""
    if a.index == b.index:
        return Tier("local", min(a.accelerator.intra_node_gbps, b.accelerator.intra_node_gbps), LOCAL_LATENCY_US,
                    cluster=a.cluster)
    # a multi-network communicator crosses between fabrics over TCP (NCCL's Socket network), RDMA inside each
    sockets = transport in OVER_SOCKETS or (transport == Transport.MULTINET and a.cluster != b.cluster)
    link = link or cluster.link(a, b)
    names: tuple[str, ...] = ()
    back: tuple[str, ...] = ()
    inside = a.cluster if a.cluster == b.cluster else None
    if a.cluster != b.cluster:
        names = (f"{a.cluster}->{b.cluster}", f"{a.cluster}/{b.cluster}", f"{b.cluster}/{a.cluster}")
        back = (f"{b.cluster}->{a.cluster}", f"{b.cluster}/{a.cluster}", f"{a.cluster}/{b.cluster}")
    kind = (Transport.SOCKET if transport == Transport.MULTINET else transport) if sockets else link.kind
    if sockets and link.kind in RDMA:
        sa, sb = socket_tier(cluster, a), socket_tier(cluster, b)
        return Tier(kind, min(sa.gbps, sb.gbps), max(sa.latency_us, sb.latency_us), names, inside, back)
    return Tier(kind, link.gbps, link.latency_us, names, inside, back)


class Network:
    """Cached look-ups over a cluster for one transport function (a cluster's own ``link`` scans its nodes,
    too slow for 16k ranks).

    ``transport_fn`` is assumed to depend only on which (cluster, vendor) pairs a group touches, whether
    it spans more than one node and whether one of those pairs holds two of its nodes -- true of ``placement.cluster_transport`` and ``placement.baseline_transport`` --
    so one call per such shape is enough.
    """

    def __init__(self, cluster: Cluster, transport_fn: TransportFn = cluster_transport,
                 hierarchical: Optional[bool] = None):
        self.cluster, self.fn = cluster, transport_fn
        # Groups of these transports reduce hierarchically by section (:func:`_sectioned_path`) under a plan;
        # the baseline (the frameworks' own flat rings, its transport function) charges every group flat.
        if hierarchical is None:
            hierarchical = transport_fn not in (baseline_transport, stock_multinet_transport)
        self.sectioned: tuple[str, ...] = SECTIONED_TRANSPORTS if hierarchical else ()
        self.fabric: dict[str, Link] = {}
        for n in cluster.nodes:
            self.fabric.setdefault(n.cluster, Link(n.fabric.type, n.fabric.gbps, n.fabric.latency_us))
        self.node_key = [(n.cluster, n.vendor) for n in cluster.nodes]
        self._transport: dict = {}
        self._hop: dict = {}
        self._tiers: dict = {}
        self.paths: dict = {}       # analysis._collective_path's results by members per node

    def link(self, a: Node, b: Node) -> Link:
        if a.index == b.index:
            return Link("local", a.accelerator.intra_node_gbps, LOCAL_LATENCY_US)
        if a.cluster == b.cluster:
            return self.fabric[a.cluster]
        return self.cluster.links[frozenset((a.cluster, b.cluster))]

    def nodes_transport(self, node_ids) -> str:
        """The transport of a group on these nodes (node indices), cached per shape of the set."""
        reps: dict = {}
        first = second = None
        deep = None          # a second node on some (cluster, vendor): the multi-network rule reads it
        for n in node_ids:
            rep = reps.setdefault(self.node_key[n], n)
            if deep is None and rep != n:
                deep = n
            if first is None:
                first = n
            elif second is None and n != first:
                second = n
        key = (first if second is None else -1, frozenset(reps), deep is not None)
        t = self._transport.get(key)
        if t is None:
            picked = set(reps.values()) | ({second} if second is not None else set()) | ({deep} if deep is not None else set())
            first_rank = self.cluster.node_first_rank
            t = self.fn(self.cluster, sorted(first_rank[n] for n in picked))
            self._transport[key] = t
        return t

    def hop(self, a: int, b: int, transport: str) -> Tier:
        key = (a, b, transport)
        tier = self._hop.get(key)
        if tier is None:
            na, nb = self.cluster.nodes[a], self.cluster.nodes[b]
            tier = hop_tier(self.cluster, na, nb, transport, self.link(na, nb))
            # one object per distinct tier (equal tiers are interchangeable: frozen), so that callers may tell
            # tiers apart by identity (analysis: the pipeline hops of O(world size) rank pairs)
            tier = self._hop[key] = self._tiers.setdefault(tier, tier)
        return tier


def _slowest(tiers: Sequence[Tier]) -> Tier:
    # ties broken by the undirected link names, as before directed names existed
    return min(tiers, key=lambda t: (t.gbps, -t.latency_us, t.kind, tuple(n for n in t.names if "->" not in n)))


def _level(tiers: Sequence[Tier], members: int, share: int) -> Level:
    """A collective level over ``tiers`` (one per pair of nodes it spans): the slowest, and the others."""
    slow = _slowest(tiers)
    return Level(slow, members, share, tuple(dict.fromkeys(t for t in tiers if t != slow)))


def _hops_s(hops: Sequence[tuple[Tier, int, bool]], nbytes: float, profile: Optional[Profile]) -> float:
    """One message over the slowest of ``hops`` (as a stage's send to the next: ``_stage_models``)."""
    worst = 0.0
    for tier, share, staged in hops:
        t = tier.step_s(nbytes, share, profile)
        if staged:
            t += 2 * nbytes * 8 / (HOST_COPY_GBPS * 1e9)
        worst = max(worst, t)
    return worst
