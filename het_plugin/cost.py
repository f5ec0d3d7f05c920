"""Predictor: iteration time, throughput and memory per stage of one plan (HETHUB's performance predictor).

The model, in short (details and constants in docs/planner.md):

* Compute: a transformer layer's forward FLOPs / TP / (peak x efficiency) of the slowest device in the
  stage; backward = 2 x forward. With TP > 1 (sequence parallel) each layer pays 2 all-reduce-equivalents
  of its activations forward and 2 backward over the node's intra-node link. A measured profile
  (:mod:`het_plugin.profile`) replaces these per (device, layer kind, TP) as a curve over the micro-batch size,
  per layer index where it has overrides, and the optimizer step, a per-iteration overhead and link rates
  (per cluster, direction and concurrent senders) too.
* Communication: latency-bandwidth per link tier. A collective over ``n`` members is ``2(n-1)`` ring steps
  of ``bytes/n``; a group spanning tiers reduces hierarchically (inside the node, then over the cluster
  fabric, then across clusters), each step paying its tier's latency and its bandwidth shared by all
  accelerators of the node that talk at once. A group whose transport is ``socket`` uses Ethernet even
  inside an RDMA cluster; ``host-staged`` (cross-vendor shim) reduces inside each vendor's fabric first, then
  over sockets between vendors, and pays a device-host copy of its share each way.
* Replicas: data-parallel replicas on different devices (:class:`ReplicaClass`) are simulated each on its own
  devices with its own micro-batch count (heterogeneous data parallelism; :meth:`SplitCosts.balance`).
* Pipeline: 1F1B with per-stage forward/backward times and per-hop send times, simulated op by op; with
  ``vpp`` virtual stages per rank Megatron's interleaved 1F1B (:mod:`het_plugin.schedule`), its extra hop from
  the last stage back to the first, and ``overlap_p2p_comm`` (sends hidden behind compute).
* Data parallel: gradient reduction per stage (dense parameters over dp x cp, routed experts over expert-dp);
  with ``overlap_grad_reduce`` (Megatron's bucketed overlap) only the last micro-batch's backward can hide
  it. Tied embeddings (or MTP on the last stage) add the first/last-stage all-reduce.
* Mixture of experts: per MoE layer the router and the top-k experts' FFN per token (plus shared experts) as
  compute, token dispatch and combine as all-to-alls over the expert-ep group forward and backward
  (:class:`AllToAll`: own node, cluster fabric, other clusters), expert weights split over ep x etp. A
  model whose layers mix dense and MoE is costed per average layer.
* Context parallel: ring attention's cp - 1 K/V exchanges per layer over the CP group's slowest hop, each
  hidden behind the attention of one chunk as far as it goes.
* Memory per rank: bf16 weights, fp32 gradients, fp32 master + Adam moments (divided by dp x cp, or
  expert-dp, with the distributed optimizer), activations of the in-flight micro-batches, logits on the
  last stage.

The expensive part (walking every group of a placement) is :func:`analyze`; the rest is cheap, so the
planner analyzes a placement once and evaluates it for many micro-batch sizes and layer splits, and
:func:`analyze_experts` re-does only the expert groups for each (ep, etp) on an analyzed placement.

What the planner uses: :class:`Network` and :func:`analyze` (once per placement), :class:`SplitCosts` (per
micro-batch size and optimizer setting: the exact partition's cost tables and memory caps, a split's memory
excess, its prediction) and :func:`params_memory_gib` (a lower bound to skip degrees that cannot fit).
:func:`predict` is the one-call form for everyone else.
"""
from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from itertools import groupby
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

from .catalog import Accelerator
from .compute_curve import Analytic, measured_compute_s
from .cluster import RDMA, Cluster, Link, Node
from .model import ModelSpec
from .placement import Placement, baseline_transport, transport as placement_transport
from .plan import Prediction
from .profile import Profile
from .topology import ParallelDims

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
SECTIONED_TRANSPORTS: tuple[str, ...] = ("host-staged",)


# ---- link tiers -----------------------------------------------------------------------------------


# Profile tiers tried after a hop's own kind: the shim and sockets both ride on Ethernet.
FALLBACK_TIERS = {"host-staged": ["socket", "ethernet"], "socket": ["ethernet"]}


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
    sockets = transport in ("socket", "host-staged")
    link = link or cluster.link(a, b)
    names: tuple[str, ...] = ()
    back: tuple[str, ...] = ()
    inside = a.cluster if a.cluster == b.cluster else None
    if a.cluster != b.cluster:
        names = (f"{a.cluster}->{b.cluster}", f"{a.cluster}/{b.cluster}", f"{b.cluster}/{a.cluster}")
        back = (f"{b.cluster}->{a.cluster}", f"{b.cluster}/{a.cluster}", f"{a.cluster}/{b.cluster}")
    kind = transport if sockets else link.kind
    if sockets and link.kind in RDMA:
        sa, sb = socket_tier(cluster, a), socket_tier(cluster, b)
        return Tier(kind, min(sa.gbps, sb.gbps), max(sa.latency_us, sb.latency_us), names, inside, back)
    return Tier(kind, link.gbps, link.latency_us, names, inside, back)


class Network:
    """Cached look-ups over a cluster for one transport function (a cluster's own ``link`` scans its nodes,
    too slow for 16k ranks).

    ``transport_fn`` is assumed to depend only on which (cluster, vendor) pairs a group touches and whether
    it spans more than one node -- true of ``placement.transport`` and ``placement.baseline_transport`` --
    so one call per such shape is enough.
    """

    def __init__(self, cluster: Cluster, transport_fn: TransportFn = placement_transport,
                 hierarchical: Optional[bool] = None):
        self.cluster, self.fn = cluster, transport_fn
        # Groups of these transports reduce hierarchically by section (:func:`_sectioned_path`) under a plan;
        # the baseline (the frameworks' own flat rings, its transport function) charges every group flat.
        hierarchical = (transport_fn is not baseline_transport) if hierarchical is None else hierarchical
        self.sectioned: tuple[str, ...] = SECTIONED_TRANSPORTS if hierarchical else ()
        self.fabric: dict[str, Link] = {}
        for n in cluster.nodes:
            self.fabric.setdefault(n.cluster, Link(n.fabric.type, n.fabric.gbps, n.fabric.latency_us))
        self.node_key = [(n.cluster, n.vendor) for n in cluster.nodes]
        self._transport: dict = {}
        self._hop: dict = {}

    def link(self, a: Node, b: Node) -> Link:
        if a.index == b.index:
            return Link("local", a.accelerator.intra_node_gbps, LOCAL_LATENCY_US)
        if a.cluster == b.cluster:
            return self.fabric[a.cluster]
        return self.cluster.links[frozenset((a.cluster, b.cluster))]

    def transport(self, node_ids) -> str:
        reps: dict = {}
        first = second = None
        for n in node_ids:
            reps.setdefault(self.node_key[n], n)
            if first is None:
                first = n
            elif second is None and n != first:
                second = n
        key = (first if second is None else -1, frozenset(reps))
        t = self._transport.get(key)
        if t is None:
            picked = set(reps.values()) | ({second} if second is not None else set())
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
            self._hop[key] = tier
        return tier


def _slowest(tiers: Sequence[Tier]) -> Tier:
    # ties broken by the undirected link names, as before directed names existed
    return min(tiers, key=lambda t: (t.gbps, -t.latency_us, t.kind, tuple(n for n in t.names if "->" not in n)))


def _level(tiers: Sequence[Tier], members: int, share: int) -> Level:
    """A collective level over ``tiers`` (one per pair of nodes it spans): the slowest, and the others."""
    slow = _slowest(tiers)
    return Level(slow, members, share, tuple(dict.fromkeys(t for t in tiers if t != slow)))


# ---- placement analysis ---------------------------------------------------------------------------


@dataclass(frozen=True)
class AllToAll:
    """One expert-ep group's all-to-all as one member sees it: the shares of its bytes that go to members on
    its own node, on other nodes of its cluster and to other clusters, each over its tier (the legs run at
    once; the slowest decides)."""
    legs: tuple[tuple[Tier, float, int], ...]       # (tier, fraction of the bytes, streams sharing the NIC)
    host_staged: bool = False

    def time_s(self, nbytes: float, profile: Optional[Profile] = None) -> float:
        t = max((tier.step_s(nbytes * frac, share, profile) for tier, frac, share in self.legs), default=0.0)
        if self.host_staged and self.legs:
            remote = sum(frac for tier, frac, _ in self.legs if tier.kind != "local")
            t += 2 * nbytes * remote * 8 / (HOST_COPY_GBPS * 1e9)
        return t


@dataclass(frozen=True)
class ExpertInfo:
    """The expert layers' groups of one stage for one (ep, etp): the all-to-all shapes of its expert-ep groups
    and the paths of its expert-dp groups (the expert gradients' own reduction)."""
    alltoalls: tuple[AllToAll, ...]
    dp_paths: tuple[CollectivePath, ...]


@dataclass
class StageInfo:
    accelerators: tuple[Accelerator, ...]          # distinct device types in the stage
    capacity_gib: float                            # smallest device memory in the stage
    tp_tier: Tier                                  # intra-node link of the TP group
    dp_paths: tuple[CollectivePath, ...]           # distinct dp-cp group shapes of the stage (gradient reduction)
    hop_next: tuple[tuple[Tier, int, bool], ...] = ()   # (tier, share, host_staged) to stage s+1
    cp_hops: tuple[tuple[Tier, int, bool], ...] = ()    # slowest ring hop of each CP group shape (cp > 1)
    expert: Optional[ExpertInfo] = None            # None: the expert groups are the dense ones (ep 1, etp = tp)


@dataclass(frozen=True)
class ReplicaClass:
    """Data-parallel replicas (one pipeline each) that run on the same device types stage by stage."""
    replicas: tuple[int, ...]                       # dp coordinates, ascending
    accelerators: tuple[tuple[Accelerator, ...], ...]   # per stage: the device types under the replica's ranks


@dataclass
class Analysis:
    """What a placement means for communication; independent of micro-batch size and layer split."""
    placement: Placement
    stages: list[StageInfo]
    embedding_paths: tuple[CollectivePath, ...] = ()
    transports: dict[str, set[str]] = field(default_factory=dict)   # kind -> transports seen
    node_of_logical: tuple[int, ...] = ()          # node index of each default-order logical rank
    node_runs: tuple[tuple[int, int], ...] = ()    # (first logical rank, node) of each run on one node
    expert_span: Optional[str] = None              # why an expert group leaves one domain (None: none does)
    wrap_hops: tuple[tuple[Tier, int, bool], ...] = ()   # last stage -> first (interleaved)
    # Replicas grouped by the devices their stages run on; () when every replica runs on the same ones.
    replica_classes: tuple[ReplicaClass, ...] = ()


def _collective_path(net: Network, members_nodes: Sequence[int]) -> tuple[CollectivePath, str]:
    """The hierarchical ring of a group whose members sit on ``members_nodes`` (one entry per member)."""
    nodes = net.cluster.nodes
    node_set = frozenset(members_nodes)
    t = net.transport(node_set)
    per_node: dict[int, int] = {}
    for n in members_nodes:
        per_node[n] = per_node.get(n, 0) + 1
    if t in net.sectioned:
        sectioned = _sectioned_path(net, per_node, t)
        if sectioned is not None:
            return sectioned, t
    by_cluster: dict[str, list[int]] = {}
    for n in sorted(per_node):
        by_cluster.setdefault(nodes[n].cluster, []).append(n)
    share = max(nodes[n].num_accelerators for n in per_node)
    levels = []
    k = max(per_node.values())
    if k > 1:
        levels.append(_level([net.hop(n, n, t) for n in per_node], k, 1))
    n_nodes = max(len(v) for v in by_cluster.values())
    if n_nodes > 1:
        tiers = [net.hop(v[0], v[1], t) for v in by_cluster.values() if len(v) > 1]
        levels.append(_level(tiers, n_nodes, share))
    if len(by_cluster) > 1:
        reps = [v[0] for v in by_cluster.values()]
        tiers = [net.hop(a, b, t) for i, a in enumerate(reps) for b in reps[i + 1:]]
        levels.append(_level(tiers, len(by_cluster), share))
    return CollectivePath(tuple(levels), t == "host-staged"), t


def _sectioned_path(net: Network, per_node: dict[int, int], t: str) -> Optional[CollectivePath]:
    """A group across a slow boundary (sockets between clusters, or the shim between vendors) reduced
    hierarchically: inside each *section* (the members on one cluster fabric and one vendor) over the node and
    the section's own fabric, then between sections over the slow link (every member carries its 1/(k n) share,
    the shim's stripes), then back. None when the members sit in one section (the flat ring applies)."""
    nodes = net.cluster.nodes
    sections: dict[tuple[str, str], list[int]] = {}
    for n in sorted(per_node):
        sections.setdefault((nodes[n].cluster, nodes[n].vendor), []).append(n)
    if len(sections) < 2:
        return None
    share = max(nodes[n].num_accelerators for n in per_node)
    levels = []
    k = max(per_node.values())
    if k > 1:
        levels.append(Level(_slowest([net.hop(n, n, t) for n in per_node]), k, 1))
    n_nodes = max(len(v) for v in sections.values())
    if n_nodes > 1:
        tiers = [net.hop(v[0], v[1], net.transport(frozenset(v))) for v in sections.values() if len(v) > 1]
        levels.append(Level(_slowest(tiers), n_nodes, share))
    leaders = [v[0] for v in sections.values()]
    tiers = [net.hop(a, b, t) for i, a in enumerate(leaders) for b in leaders[i + 1:]]
    levels.append(Level(_slowest(tiers), len(sections), share))
    return CollectivePath(tuple(levels), t == "host-staged", 1.0 / (k * n_nodes))


def _ring_hop(net: Network, ring_nodes: Sequence[int]) -> tuple[Tier, int, bool]:
    """Slowest hop of a ring (member i sends to i+1, the last to the first) whose members sit on
    ``ring_nodes``: its tier, how many ranks of the sending node send off it at once, host-staged or not."""
    nodes = net.cluster.nodes
    t = net.transport(frozenset(ring_nodes))
    per_node: dict[int, int] = {}
    for n in ring_nodes:
        per_node[n] = per_node.get(n, 0) + 1
    worst = None
    for a, b in zip(ring_nodes, list(ring_nodes[1:]) + [ring_nodes[0]]):
        share = 1 if a == b else max(1, nodes[a].num_accelerators // per_node[a])
        cand = (net.hop(a, b, t), share)
        if worst is None or (cand[0].gbps / cand[1], -cand[0].latency_us) < (worst[0].gbps / worst[1],
                                                                             -worst[0].latency_us):
            worst = cand
    return worst[0], worst[1], t == "host-staged"


def _alltoall(net: Network, members_nodes: Sequence[int]) -> tuple[AllToAll, str]:
    """The all-to-all of a group whose members sit on ``members_nodes``: for the member that has the most to
    send off its node, the shares of its bytes per leg (own node, its cluster's fabric, other clusters)."""
    nodes = net.cluster.nodes
    size = len(members_nodes)
    t = net.transport(frozenset(members_nodes))
    per_node: dict[int, int] = {}
    for n in members_nodes:
        per_node[n] = per_node.get(n, 0) + 1
    per_cluster: dict[str, int] = {}
    for n, k in per_node.items():
        per_cluster[nodes[n].cluster] = per_cluster.get(nodes[n].cluster, 0) + k
    worst: Optional[tuple] = None
    for n, k in per_node.items():
        c = nodes[n].cluster
        legs = []
        if k > 1:
            legs.append((net.hop(n, n, t), (k - 1) / size, 1))
        same = [m for m in per_node if m != n and nodes[m].cluster == c]
        if same:
            legs.append((_slowest([net.hop(n, m, t) for m in same]), (per_cluster[c] - k) / size,
                         nodes[n].num_accelerators))
        other = [m for m in per_node if nodes[m].cluster != c]
        if other:
            legs.append((_slowest([net.hop(n, m, t) for m in other]), (size - per_cluster[c]) / size,
                         nodes[n].num_accelerators))
        cand = AllToAll(tuple(legs), t == "host-staged")
        cost = cand.time_s(1 << 24)
        if worst is None or cost > worst[0]:
            worst = (cost, cand)
    return worst[1], t


def analyze(cluster: Cluster, placement: Placement, transport_fn: TransportFn = placement_transport,
            network: Optional[Network] = None) -> Analysis:
    """Walk every DP, pipeline and embedding group of a placement once (O(world size))."""
    net = network if network is not None and network.fn is transport_fn else Network(cluster, transport_fn)
    dims = placement.dims
    rank_node = cluster.rank_node
    node_of_logical = [rank_node[r] for r in placement.rank_of_logical]
    nodes = cluster.nodes
    path_cache: dict[frozenset, CollectivePath] = {}

    def dp_path(members_nodes: list[int]) -> tuple[CollectivePath, str]:
        node_set = frozenset(members_nodes)
        cached = path_cache.get(node_set)
        if cached is None:
            cached = path_cache[node_set] = _collective_path(net, members_nodes)
        return cached

    S = dims.stage_size
    tc = dims.tp * dims.cp
    transports: dict[str, set[str]] = {"dp": set(), "pp": set(), "embedding": set()}
    # Pipeline groups: one per position inside a stage; their transport decides every hop's network.
    columns: dict[tuple, str] = {}
    pp_transport = []
    for i in range(S):
        col = tuple(node_of_logical[i::S])
        t = columns.get(col)
        if t is None:
            t = columns[col] = net.transport(col)
        pp_transport.append(t)
    transports["pp"] = set(pp_transport)
    stages: list[StageInfo] = []
    for s in range(dims.pp):
        base = s * S
        stage_nodes = sorted(set(node_of_logical[base:base + S]))
        accs = tuple(sorted({nodes[n].accelerator for n in stage_nodes}, key=lambda a: a.name))
        capacity = min(nodes[n].accelerator.memory_gib for n in stage_nodes)
        one_cluster = {nodes[n].cluster for n in stage_nodes}
        tp_tier = Tier("local", min(nodes[n].accelerator.intra_node_gbps for n in stage_nodes), LOCAL_LATENCY_US,
                       cluster=one_cluster.pop() if len(one_cluster) == 1 else None)
        paths: list[CollectivePath] = []
        for j in range(dims.tp):        # dp-cp groups: the gradients' reduction (the dp groups when cp == 1)
            path, t = dp_path(node_of_logical[base + j:base + S:dims.tp])
            transports["dp"].add(t)
            if path not in paths:
                paths.append(path)
        cp_hops: list[tuple[Tier, int, bool]] = []
        if dims.cp > 1:
            seen_rings: set = set()
            for j in range(0, S, tc):
                for i in range(dims.tp):
                    ring = tuple(node_of_logical[base + j + i:base + j + tc:dims.tp])
                    if ring in seen_rings:
                        continue
                    seen_rings.add(ring)
                    hop = _ring_hop(net, ring)
                    transports.setdefault("cp", set()).add(net.transport(frozenset(ring)))
                    if hop not in cp_hops:
                        cp_hops.append(hop)
        hops: list[tuple[Tier, int, bool]] = []
        if s + 1 < dims.pp:
            seen: set = set()
            for i in range(S):
                a, b, t = node_of_logical[base + i], node_of_logical[base + S + i], pp_transport[i]
                if (a, b, t) in seen:
                    continue
                seen.add((a, b, t))
                share = 1 if a == b else nodes[a].num_accelerators
                hop = (net.hop(a, b, t), share, t == "host-staged")
                if hop not in hops:
                    hops.append(hop)
        stages.append(StageInfo(accs, capacity, tp_tier, tuple(paths), tuple(hops), tuple(cp_hops)))
    wrap: list[tuple[Tier, int, bool]] = []      # the interleaved schedule's hop from the last stage to the first
    if dims.pp > 1:
        last_base, seen_wrap = (dims.pp - 1) * S, set()
        for i in range(S):
            a, b, t = node_of_logical[last_base + i], node_of_logical[i], pp_transport[i]
            if (a, b, t) not in seen_wrap:
                seen_wrap.add((a, b, t))
                hop = (net.hop(a, b, t), 1 if a == b else nodes[a].num_accelerators, t == "host-staged")
                if hop not in wrap:
                    wrap.append(hop)
    emb_paths: list[CollectivePath] = []
    if dims.pp > 1:
        last = (dims.pp - 1) * S
        for pair in sorted(set(zip(node_of_logical[:S], node_of_logical[last:last + S]))):
            path, t = dp_path(list(pair))
            transports["embedding"].add(t)
            if path not in emb_paths:
                emb_paths.append(path)
    out = Analysis(placement, stages, tuple(emb_paths), transports, tuple(node_of_logical),
                   node_runs=_node_runs(node_of_logical), wrap_hops=tuple(wrap),
                   replica_classes=replica_classes(cluster, node_of_logical, dims))
    return analyze_experts(cluster, out, dims, net)


def replica_classes(cluster: Cluster, node_of_logical: Sequence[int], dims: ParallelDims) -> tuple[ReplicaClass, ...]:
    """Replicas grouped by the device types of their stages (a replica's stage is its tp*cp ranks: TP stays on
    one node and CP on one node or whole nodes of one domain, so its first and last rank tell its devices).
    () when all replicas look alike. O(pp * dp)."""
    if dims.dp == 1:
        return ()
    nodes = cluster.nodes
    accs = {n.accelerator.name: n.accelerator for n in nodes}
    if len(accs) == 1:
        return ()
    names = [n.accelerator.name for n in nodes]
    S, tc = dims.stage_size, dims.tp * dims.cp
    columns = []
    for s in range(dims.pp):
        firsts = node_of_logical[s * S:(s + 1) * S:tc]
        lasts = node_of_logical[s * S + tc - 1:(s + 1) * S:tc]
        columns.append([names[a] if a == b or names[a] == names[b] else tuple(sorted({names[a], names[b]}))
                        for a, b in zip(firsts, lasts)])
    keys: dict[tuple, list[int]] = {}
    for d, key in enumerate(zip(*columns)):
        keys.setdefault(key, []).append(d)
    if len(keys) == 1:
        return ()
    return tuple(ReplicaClass(tuple(ds), tuple(tuple(accs[x] for x in ((k,) if isinstance(k, str) else k))
                                               for k in key)) for key, ds in keys.items())


def analyze_experts(cluster: Cluster, analysis: Analysis, dims: ParallelDims,
                    network: Optional[Network] = None) -> Analysis:
    """The same analysis for the expert sizes of ``dims`` (same tp, cp, pp, dp and placement; any ep, etp):
    each stage's expert-ep all-to-all shapes and expert-dp paths, and :attr:`Analysis.expert_span`, the first
    expert group that leaves one domain (cluster fabric + device type). The dense part is reused, so the
    planner analyzes a placement once and tries every (ep, etp) on it; a stage is looked up by the run
    lengths and kinds of the nodes it covers (O(nodes)), so stages of the same shape -- across stages,
    placements and degrees of one search -- are worked out once (O(stage size)) per ``network``."""
    base_dims = analysis.placement.dims
    if (dims.tp, dims.cp, dims.pp, dims.dp) != (base_dims.tp, base_dims.cp, base_dims.pp, base_dims.dp):
        raise ValueError(f"analyze_experts: {dims} differs from the analyzed {base_dims} in tp, cp, pp or dp")
    placement = analysis.placement if dims == base_dims else replace(analysis.placement, dims=dims)
    transports = {k: v for k, v in analysis.transports.items() if not k.startswith("expert-")}
    if (dims.ep, dims.etp) == (1, dims.tp):      # the expert groups are the dense ones
        stages = [replace(st, expert=None) if st.expert is not None else st for st in analysis.stages]
        return replace(analysis, placement=placement, stages=stages, transports=transports, expert_span=None)
    net = network if network is not None else Network(cluster)
    cache = net.__dict__.setdefault("_expert_stages", {})
    S = dims.stage_size
    node_of_logical = analysis.node_of_logical
    shapes = analysis.__dict__.get("_stage_shapes")      # the same for every (ep, etp) on this placement
    if shapes is None or shapes[0] is not net:
        shapes = analysis.__dict__["_stage_shapes"] = (net, _stage_shapes(net, analysis, S))
    span = None
    transports["expert-ep"], transports["expert-dp"] = set(), set()
    stages = []
    for s, st in enumerate(analysis.stages):
        base = s * S
        key = (shapes[1][s], dims.etp, dims.ep, S)
        got = cache.get(key)
        if got is None:
            got = cache[key] = _expert_stage(net, node_of_logical[base:base + S], dims)
        info, doms, t_ep, t_dp = got
        if doms and span is None:
            span = (f"an expert-ep group of stage {s} (ep={dims.ep}, etp={dims.etp}) spans "
                    f"{' and '.join(f'{c}/{a}' for c, a in doms)}")
        transports["expert-ep"] |= t_ep
        transports["expert-dp"] |= t_dp
        stages.append(replace(st, expert=info))
    return replace(analysis, placement=placement, stages=stages, transports=transports, expert_span=span)


def _stage_shapes(net: Network, analysis: Analysis, S: int) -> list[tuple]:
    """Per stage, the run lengths and node kinds of its logical ranks (what its expert groups' costs depend on)."""
    classes = _node_classes(net)
    node_of_logical = analysis.node_of_logical
    runs = analysis.node_runs or _node_runs(node_of_logical)
    run_starts = [r[0] for r in runs]
    out = []
    for s in range(len(analysis.stages)):
        base = s * S
        i = bisect_right(run_starts, base) - 1
        shape = []
        ids: dict[int, int] = {}
        while i < len(runs) and runs[i][0] < base + S:
            stop = runs[i + 1][0] if i + 1 < len(runs) else len(node_of_logical)
            node = runs[i][1]
            shape.append((min(stop, base + S) - max(runs[i][0], base), classes[node], ids.setdefault(node, len(ids))))
            i += 1
        out.append(tuple(shape))
    return out


def _node_runs(node_of_logical: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """(first logical rank, node) of each run of consecutive logical ranks on one node."""
    out, prev = [], None
    for i, n in enumerate(node_of_logical):
        if n != prev:
            out.append((i, n))
            prev = n
    return tuple(out)


def _node_classes(net: Network) -> list[tuple]:
    """Per node, what the expert groups' costs depend on: cluster, device, size, NICs."""
    classes = net.__dict__.get("_node_classes")
    if classes is None:
        classes = net.__dict__["_node_classes"] = [
            (n.cluster, n.accelerator.name, n.num_accelerators, n.vendor,
             tuple(sorted((nic.type, nic.gbps) for nic in n.nics))) for n in net.cluster.nodes]
    return classes


def _expert_stage(net: Network, stage_nodes: Sequence[int], dims: ParallelDims):
    """One stage's expert groups: (ExpertInfo, the domains of the first expert group spanning more than one
    or None, expert-ep transports, expert-dp transports). ``stage_nodes``: node of each of its logical ranks."""
    nodes = net.cluster.nodes
    classes = _node_classes(net)
    S, etp, ep = len(stage_nodes), dims.etp, dims.ep
    block = etp * ep
    a2as: list[AllToAll] = []
    seen: set = set()
    doms_spanned = None
    t_ep: set[str] = set()
    for start in range(0, S, block):
        # The etp members at one ep index share a node (etp divides tp, and TP stays in a node), so the
        # ep group at etp index 0 touches every node of its expert-tp-ep block.
        members = stage_nodes[start:start + block:etp]
        ids: dict[int, int] = {}      # groups of the same shape (node kinds, runs, which runs share a node)
        shape = tuple((classes[n], ids.setdefault(n, len(ids)), len(list(g))) for n, g in groupby(members))
        if shape in seen:
            continue
        seen.add(shape)
        if ep > 1:
            a2a, t = _alltoall(net, members)
            t_ep.add(t)
        else:
            a2a = AllToAll(())
        if a2a not in a2as:
            a2as.append(a2a)
        if doms_spanned is None:
            doms = list(dict.fromkeys(nodes[n].domain for n in members))
            if len(doms) > 1:
                doms_spanned = doms
    dps: list[CollectivePath] = []
    t_dp: set[str] = set()
    if dims.expert_dp > 1:
        done: set = set()
        for j in range(block):
            members = stage_nodes[j:S:block]
            key = (frozenset(members), Counter(members).most_common(1)[0][1])
            if key in done:
                continue
            done.add(key)
            path, t = _collective_path(net, members)
            t_dp.add(t)
            if path not in dps:
                dps.append(path)
    return ExpertInfo(tuple(a2as), tuple(dps)), doms_spanned, t_ep, t_dp


# ---- per-stage times and memory -------------------------------------------------------------------


@dataclass
class StageModel:
    """Linear pieces of one stage for a micro-batch size: times per micro-batch and bytes per rank."""
    layer_fwd_s: float
    layer_bwd_s: float
    fixed_fwd_s: float
    fixed_bwd_s: float
    send_s: float                   # one activation (or gradient) send to the next stage
    params_per_layer: float         # per rank
    fixed_params: float             # embedding / output layer on this rank
    act_bytes_per_layer: float      # one micro-batch's saved activations of one layer
    fixed_mem_bytes: float          # first/last stage extras for the in-flight micro-batches
    in_flight: int
    capacity_gib: float
    paths: tuple[CollectivePath, ...]
    # Expert layers (MoE models): routed-expert weights per rank and layer (the MoE share of an average
    # layer), reduced over expert-dp (its own paths; None: the dense paths) and sharded by the distributed
    # optimizer over expert_dp ranks.
    expert_params_per_layer: float = 0.0
    expert_paths: Optional[tuple[CollectivePath, ...]] = None
    expert_dp: int = 1
    cp: int = 1                     # the dense gradients are reduced (and sharded) over dp x cp
    alltoall_per_layer_s: float = 0.0   # token dispatch + combine, forward + backward, of an average layer
    cp_ring_per_layer_s: float = 0.0    # ring attention's exposed exchanges, forward + backward, per layer
    # Format-2 profiles: each decoder layer's (fwd, bwd) minus the mean layer above (per-layer overrides; empty:
    # all layers alike), the optimizer's measured seconds per parameter (None: analytic), and the gradient send
    # back from stage s+1 (None: the same as send_s; differs when a link is measured per direction).
    layer_deltas: tuple[tuple[float, float], ...] = ()
    optimizer_s_per_param: Optional[float] = None
    send_back_s: Optional[float] = None

    @property
    def back_s(self) -> float:
        return self.send_s if self.send_back_s is None else self.send_back_s

    def own_layers(self, first: int, n: int) -> tuple[float, float]:
        """(forward, backward) of the ``n`` decoder layers from index ``first`` for one micro-batch."""
        f, b = n * self.layer_fwd_s, n * self.layer_bwd_s
        if self.layer_deltas and n:
            f += sum(d[0] for d in self.layer_deltas[first:first + n])
            b += sum(d[1] for d in self.layer_deltas[first:first + n])
        return f, b


def _compute_s(acc: Accelerator, kind: str, model: ModelSpec, mb: int, tp: int, cp: int, tp_tier: Tier,
               profile: Optional[Profile], apart: bool = False) -> tuple[float, float]:
    """(forward, backward); ``apart``: the analytic (forward compute, TP communication per direction)."""
    if profile is not None and not apart:
        measured = measured_compute_s(profile, acc.name, kind, mb, tp, model.moe_fraction, lambda b, t: Analytic(
            *_compute_s(acc, kind, model, b, t, cp, tp_tier, profile, apart=True)))
        if measured is not None:
            return measured
    if kind == "layer":
        flops = model.mean_layer_flops_fwd(mb) / (tp * cp)
    elif kind == "output":
        flops = model.logits_flops_fwd(mb) / (tp * cp)
    elif kind == "mtp":
        flops = model.mtp_flops_fwd(mb) / (tp * cp)
    else:   # embedding lookup: memory-bound and small; counted as a few FLOPs per element
        flops = 2.0 * mb * model.seq_length * model.hidden_size / (tp * cp)
    fwd = flops / acc.sustained_flops
    bwd = 2 * fwd
    if kind == "layer" and tp > 1:
        act = mb * model.seq_length * model.hidden_size * model.dtype_bytes / cp
        ar = 2 * (tp - 1) * tp_tier.step_s(act / tp, 1, profile)   # one all-reduce equivalent
        # attention and MLP one each; an MoE layer's MLP moves its tokens by all-to-all instead (_moe_comm_s)
        per_layer = 2 - model.moe_fraction
        if apart:
            return fwd, per_layer * ar
        fwd += per_layer * ar
        bwd += per_layer * ar
    return (fwd, 0.0) if apart else (fwd, bwd)


def _layer_deltas(model: ModelSpec, info: StageInfo, mb: int, tp: int, cp: int, mean: tuple[float, float],
                  profile: Optional[Profile]) -> tuple[tuple[float, float], tuple[tuple[float, float], ...]]:
    """With per-layer-index overrides in the profile: the stage's mean decoder layer (for the partition, whose
    costs cannot depend on which layers a stage holds) and each layer's difference from it (for the prediction
    of a split). The stage's slowest device type by its total decides. Without overrides: ``mean``, ()."""
    if profile is None or profile.legacy:
        return mean, ()
    L = model.num_layers
    worst = None
    for acc in info.accelerators:
        roof = _compute_s(acc, "layer", model, mb, tp, cp, info.tp_tier, profile, apart=True)[0] / mb
        over = {i: t for i, t in profile.layer_overrides(acc.name, mb, tp, (roof, 2 * roof)).items() if i < L}
        if not over:
            continue
        own = _compute_s(acc, "layer", model, mb, tp, cp, info.tp_tier, profile)
        times = [(over[i].forward_s, over[i].backward_s) if i in over else own for i in range(L)]
        total = sum(f + b for f, b in times)
        if worst is None or total > worst[0]:
            worst = (total, times)
    # another device type is slower without them (a relative 1e-9 of slack: a measured profile's overrides sum to
    # its mean curve times the layers up to rounding, and must not be dropped for a last bit)
    if worst is None or worst[0] < L * (mean[0] + mean[1]) * (1 - 1e-9):
        return mean, ()
    times = worst[1]
    mf, mb_ = sum(f for f, _ in times) / L, sum(b for _, b in times) / L
    return (mf, mb_), tuple((f - mf, b - mb_) for f, b in times)


def _moe_comm_s(model: ModelSpec, mb: int, dims: ParallelDims, info: StageInfo,
                profile: Optional[Profile]) -> tuple[float, float]:
    """One MoE layer's expert communication per micro-batch: (all-to-all, forward + backward; expert-TP,
    forward + backward).

    Each rank routes its ``mb * seq / (tp*cp)`` tokens (sequence parallel) to ``top_k`` experts: token
    dispatch and combine are each an all-to-all of ``tokens * top_k * hidden * dtype`` bytes over the
    expert-ep group, forward and again backward. With etp > 1 the dispatched tokens are also all-gathered
    (dispatch) and reduce-scattered (combine) in the expert-TP group, inside the node."""
    tokens = mb * model.seq_length / (dims.tp * dims.cp)
    nbytes = tokens * model.moe_router_topk * model.hidden_size * model.dtype_bytes
    a2a = 0.0
    if dims.ep > 1 and info.expert is not None:
        a2a = max((x.time_s(nbytes, profile) for x in info.expert.alltoalls), default=0.0)
    etp = 2 * (dims.etp - 1) * info.tp_tier.step_s(nbytes, 1, profile) if dims.etp > 1 else 0.0
    return 4 * a2a, 4 * etp


def _cp_ring_s(model: ModelSpec, mb: int, dims: ParallelDims, info: StageInfo, acc: Accelerator,
               profile: Optional[Profile]) -> tuple[float, float]:
    """Ring attention's exposed exchanges of one layer per micro-batch, (forward, backward).

    Forward: cp - 1 steps, each passing this rank's K and V chunk (``2 * mb * seq/cp * kv_dim/tp * dtype``
    bytes) to the next CP rank while the attention of the chunk in hand runs (1/cp of the layer's attention
    scores and values); only what the transfer takes beyond that compute is exposed. Backward: cp - 1 steps
    passing K, V and their gradients (twice the bytes) against twice the compute."""
    if dims.cp <= 1 or not info.cp_hops:
        return 0.0, 0.0
    kv_dim = model.hidden_size * model.kv_heads // model.num_attention_heads
    kv = 2 * mb * model.seq_length / dims.cp * kv_dim / dims.tp * model.dtype_bytes
    chunk = model.attention_core_flops_fwd(mb) / (dims.tp * dims.cp) / dims.cp / acc.sustained_flops

    def step(nbytes: float) -> float:
        worst = 0.0
        for tier, share, staged in info.cp_hops:
            t = tier.step_s(nbytes, share, profile)
            if staged:
                t += 2 * nbytes * 8 / (HOST_COPY_GBPS * 1e9)
            worst = max(worst, t)
        return worst

    fwd = (dims.cp - 1) * max(0.0, step(kv) - chunk)
    bwd = (dims.cp - 1) * max(0.0, step(2 * kv) - 2 * chunk)
    return fwd, bwd


def _activation_bytes_per_layer(model: ModelSpec, mb: int, tp: int, cp: int) -> float:
    """Saved activations of one (average) layer and micro-batch (Korthikanti et al. 2022, flash attention,
    SP). An MoE layer's MLP part holds each token top_k times at the expert width, plus the shared experts,
    plus the permuted tokens before and after the experts (2 x top_k x hidden x 2 bytes per token)."""
    h = model.hidden_size
    swiglu = 1.5 if model.activation == "swiglu" else 1.0
    dense = 15 + 19 * model.ffn * swiglu / (4 * h)
    per_token = dense
    if model.is_moe:
        width = model.moe_router_topk * model.moe_ffn + (model.moe_shared_expert_intermediate_size or 0)
        moe = 15 + 19 * width * swiglu / (4 * h) + 4 * model.moe_router_topk
        f = model.moe_fraction
        per_token = (1 - f) * dense + f * moe
    return mb * model.seq_length * h * per_token / (tp * cp)


def _stage_models(model: ModelSpec, analysis: Analysis, mb: int, num_micro_batches: int,
                  profile: Optional[Profile] = None) -> list[StageModel]:
    dims = analysis.placement.dims
    tp, cp, pp = dims.tp, dims.cp, dims.pp
    act_msg = mb * model.seq_length * model.hidden_size * model.dtype_bytes / (tp * cp)
    emb_params = model.embedding_params / tp
    f_moe = model.moe_fraction if model.is_moe else 0.0
    dense_params_per_layer = ((1 - f_moe) * model.params_per_layer + f_moe * model.moe_layer_params) / tp
    expert_params_per_layer = f_moe * model.expert_params_per_moe_layer / (dims.ep * dims.etp)
    out = []
    for s, info in enumerate(analysis.stages):
        layer = max((_compute_s(a, "layer", model, mb, tp, cp, info.tp_tier, profile) for a in info.accelerators),
                    key=lambda fb: fb[0] + fb[1])
        layer, deltas = _layer_deltas(model, info, mb, tp, cp, layer, profile)
        a2a = etp_comm = 0.0
        if f_moe:
            a2a, etp_comm = _moe_comm_s(model, mb, dims, info, profile)
        slowest = min(info.accelerators, key=lambda a: a.sustained_flops)
        ring = _cp_ring_s(model, mb, dims, info, slowest, profile)
        # forward and backward take half of each MoE exchange (dispatch + combine each way)
        layer = (layer[0] + f_moe * (a2a + etp_comm) / 2 + ring[0], layer[1] + f_moe * (a2a + etp_comm) / 2 + ring[1])
        ff = fb_ = 0.0
        fixed_params = 0.0
        fixed_mem = 0.0
        in_flight = min(pp - s, num_micro_batches)
        if s == 0:
            e = max((_compute_s(a, "embedding", model, mb, tp, cp, info.tp_tier, profile)
                     for a in info.accelerators), key=lambda fb: fb[0] + fb[1])
            ff, fb_ = ff + e[0], fb_ + e[1]
            fixed_params += emb_params
            fixed_mem += in_flight * act_msg
        if s == pp - 1:
            o = max((_compute_s(a, "output", model, mb, tp, cp, info.tp_tier, profile)
                     for a in info.accelerators), key=lambda fb: fb[0] + fb[1])
            ff, fb_ = ff + o[0], fb_ + o[1]
            if pp > 1 or not model.tie_embeddings:
                fixed_params += emb_params
            if model.mtp_layers:          # MTP modules run after the decoder on the last stage
                t = max((_compute_s(a, "mtp", model, mb, tp, cp, info.tp_tier, profile)
                         for a in info.accelerators), key=lambda fb: fb[0] + fb[1])
                ff, fb_ = ff + t[0], fb_ + t[1]
                fixed_params += model.mtp_params / tp
                fixed_mem += model.mtp_layers * _activation_bytes_per_layer(model, mb, tp, cp)
                fixed_mem += model.mtp_layers * mb * model.seq_length * model.vocab_size * LOGITS_BYTES / (tp * cp)
            fixed_mem += mb * model.seq_length * model.vocab_size * LOGITS_BYTES / (tp * cp)
        send = 0.0
        for tier, share, staged in info.hop_next:
            t = tier.step_s(act_msg, share, profile)
            if staged:
                t += 2 * act_msg * 8 / (HOST_COPY_GBPS * 1e9)
            send = max(send, t)
        back = None
        if profile is not None and profile.directional and info.hop_next:      # gradients go the other way
            back = _hops_s([(tier.flipped(), share, staged) for tier, share, staged in info.hop_next], act_msg, profile)
        expert = info.expert
        out.append(StageModel(layer[0], layer[1], ff, fb_, send, dense_params_per_layer, fixed_params,
                              _activation_bytes_per_layer(model, mb, tp, cp), fixed_mem, in_flight,
                              info.capacity_gib, info.dp_paths, expert_params_per_layer,
                              expert.dp_paths if expert is not None else None, dims.expert_dp, cp,
                              f_moe * a2a, ring[0] + ring[1], layer_deltas=deltas,
                              optimizer_s_per_param=_optimizer_per_param(info, tp, profile), send_back_s=back))
    return out


def _memory_bytes(st: StageModel, n_layers: int, dp: int, distributed_optimizer: bool) -> float:
    """Bytes per rank; ``dp`` is the dense data-parallel size (the distributed optimizer shards the dense
    state over dp x cp and the experts' over expert-dp)."""
    params = st.fixed_params + n_layers * st.params_per_layer
    opt = OPTIMIZER_STATE_BYTES / (dp * st.cp) if distributed_optimizer else OPTIMIZER_STATE_BYTES
    states = params * (WEIGHT_BYTES + GRAD_BYTES + opt)
    if st.expert_params_per_layer:
        expert_opt = OPTIMIZER_STATE_BYTES / st.expert_dp if distributed_optimizer else OPTIMIZER_STATE_BYTES
        states += n_layers * st.expert_params_per_layer * (WEIGHT_BYTES + GRAD_BYTES + expert_opt)
    acts = st.in_flight * n_layers * st.act_bytes_per_layer + st.fixed_mem_bytes
    return states + acts + FRAMEWORK_OVERHEAD_GIB * GIB


def _optimizer_per_param(info: StageInfo, tp: int, profile: Optional[Profile]) -> Optional[float]:
    """The stage's measured optimizer seconds per parameter (its slowest device type; one not measured counts
    as the analytic step), or None when no device type of the stage is measured."""
    if profile is None:
        return None
    measured = [profile.optimizer_s_per_param(a.name, tp) for a in info.accelerators]
    if all(m is None for m in measured):
        return None
    return max(OPTIMIZER_BYTES_MOVED / HBM_BYTES_PER_S if m is None else m for m in measured)


def _optimizer_s(st: StageModel, n_layers: int, dp: int, distributed_optimizer: bool) -> float:
    """The Adam step of one rank: memory-bound over the parameters it updates (or the profile's time per
    parameter)."""
    params = st.fixed_params + n_layers * st.params_per_layer
    experts = n_layers * st.expert_params_per_layer
    if distributed_optimizer:
        params /= dp * st.cp
        experts /= st.expert_dp
    if st.optimizer_s_per_param is not None:
        return (params + experts) * st.optimizer_s_per_param
    return (params + experts) * OPTIMIZER_BYTES_MOVED / HBM_BYTES_PER_S


def _max_layers_fitting(st: StageModel, num_layers: int, dp: int, distributed_optimizer: bool) -> int:
    """Most layers the stage's memory holds (-1: not even its fixed part fits)."""
    cap = st.capacity_gib * GIB
    base = _memory_bytes(st, 0, dp, distributed_optimizer)
    if base > cap:
        return -1
    per = _memory_bytes(st, 1, dp, distributed_optimizer) - base
    n = num_layers if per <= 0 else min(num_layers, int((cap - base) // per))
    while n > 0 and _memory_bytes(st, n, dp, distributed_optimizer) > cap:   # guard rounding
        n -= 1
    return n


def _dp_reduce_s(st: StageModel, n_layers: int, dp: int, distributed_optimizer: bool,
                profile: Optional[Profile]) -> float:
    """Gradient reduction of the stage (plus the parameter all-gather of the distributed optimizer): the dense
    parameters over dp x cp, the routed experts' over expert-dp (its own groups), one after the other."""

    def reduce(paths, params: float) -> float:
        worst = 0.0
        for path in paths:
            if distributed_optimizer:
                t = path.allreduce_s(params * GRAD_BYTES, profile, 0.5) + path.allreduce_s(params * WEIGHT_BYTES,
                                                                                          profile, 0.5)
            else:
                t = path.allreduce_s(params * GRAD_BYTES, profile)
            worst = max(worst, t)
        return worst

    total = 0.0
    if dp * st.cp > 1:
        total += reduce(st.paths, st.fixed_params + n_layers * st.params_per_layer)
    if st.expert_params_per_layer and st.expert_dp > 1 and n_layers:
        total += reduce(st.paths if st.expert_paths is None else st.expert_paths,
                        n_layers * st.expert_params_per_layer)
    return total


def _stage_costs(sts: list[StageModel], num_layers: int, num_micro_batches: int, dp: int, overlap: bool,
                 distributed_optimizer: bool, profile: Optional[Profile]) -> list[list[float]]:
    """Cost tables for the exact partition: one stage's busy time in an iteration with n layers."""
    m = num_micro_batches
    tables = []
    for s, st in enumerate(sts):
        recv_side = sts[s - 1].back_s if s > 0 else 0.0      # this stage sends gradients back over it
        row = []
        if profile is None:     # the analytic reduction is affine in the layer count: two points suffice
            red0 = _dp_reduce_s(st, 0, dp, distributed_optimizer, None)
            red_step = _dp_reduce_s(st, 1, dp, distributed_optimizer, None) - red0
        for n in range(num_layers + 1):
            fwd = st.fixed_fwd_s + n * st.layer_fwd_s
            bwd = st.fixed_bwd_s + n * st.layer_bwd_s
            if profile is None:
                red = red0 + n * red_step
            else:
                red = _dp_reduce_s(st, n, dp, distributed_optimizer, profile)
            exposed = max(0.0, red - bwd) if overlap else red
            row.append(m * (fwd + bwd + st.send_s + recv_side) + exposed)
        tables.append(row)
    return tables


def _stage_cost_parts(sts: list[StageModel], num_layers: int, dp: int, overlap: bool, distributed_optimizer: bool,
                      profile: Optional[Profile]) -> tuple[list[list[float]], list[list[float]]]:
    """:func:`_stage_costs` in two parts, (per micro-batch, exposed reduction), so that a table for any micro-batch
    count m is ``m * per + exposed`` (replica groups with their own counts)."""
    per_rows, exposed_rows = [], []
    for s, st in enumerate(sts):
        recv_side = sts[s - 1].send_s if s > 0 else 0.0
        if profile is None:
            red0 = _dp_reduce_s(st, 0, dp, distributed_optimizer, None)
            red_step = _dp_reduce_s(st, 1, dp, distributed_optimizer, None) - red0
        per, exposed = [], []
        for n in range(num_layers + 1):
            fwd = st.fixed_fwd_s + n * st.layer_fwd_s
            bwd = st.fixed_bwd_s + n * st.layer_bwd_s
            red = red0 + n * red_step if profile is None else _dp_reduce_s(st, n, dp, distributed_optimizer, profile)
            per.append(fwd + bwd + st.send_s + recv_side)
            exposed.append(max(0.0, red - bwd) if overlap else red)
        per_rows.append(per)
        exposed_rows.append(exposed)
    return per_rows, exposed_rows


# ---- 1F1B simulation ------------------------------------------------------------------------------


def one_f_one_b_order(pp: int, stage: int, m: int) -> list[tuple[str, int]]:
    """Megatron's non-interleaved schedule for one stage: warm-up forwards, 1F1B pairs, cool-down."""
    warmup = min(pp - stage - 1, m)
    ops = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [("F", warmup + i), ("B", i)]
    ops += [("B", i) for i in range(m - warmup, m)]
    return ops


def simulate_1f1b(fwd: Sequence[float], bwd: Sequence[float], send: Sequence[float], m: int,
                  send_back: Optional[Sequence[float]] = None, record: Optional[list] = None) -> list[float]:
    """Finish time of every stage's last backward.

    ``send[s]`` is the time to move one activation (forward) or gradient (backward) between stages s and
    s+1; the sender is busy for it (Megatron's p2p calls block) and the receiver may start when it ends.
    ``send_back[s]``: the gradient's time from s+1 to s where it differs (a link measured per direction).
    ``record``: gets every span as ``(stage, "forward" | "backward" | "send", start, end, micro_batch)`` (the
    timeline draws them).
    """
    pp = len(fwd)
    back = send if send_back is None else send_back
    orders = [one_f_one_b_order(pp, s, m) for s in range(pp)]
    end_f = [[-1.0] * m for _ in range(pp)]
    end_b = [[-1.0] * m for _ in range(pp)]
    arrive_f = [[-1.0] * m for _ in range(pp)]     # activation of micro-batch i arrives at stage s
    arrive_b = [[-1.0] * m for _ in range(pp)]     # gradient of micro-batch i arrives at stage s
    free = [0.0] * pp
    ptr = [0] * pp
    pending = list(range(pp))
    while pending:
        s = pending.pop()
        while ptr[s] < len(orders[s]):
            kind, i = orders[s][ptr[s]]
            if kind == "F":
                ready = 0.0 if s == 0 else arrive_f[s][i]
                if ready < 0:
                    break
                start = max(free[s], ready)
                end = start + fwd[s]
                end_f[s][i] = end
                free[s] = end
                if record is not None:
                    record.append((s, "forward", start, end, i))
                if s + 1 < pp:
                    if record is not None:
                        record.append((s, "send", end, end + send[s], i))
                    free[s] += send[s]
                    arrive_f[s + 1][i] = free[s]
                    pending.append(s + 1)
            else:
                ready = end_f[s][i] if s == pp - 1 else arrive_b[s][i]
                if ready < 0:
                    break
                start = max(free[s], ready)
                end = start + bwd[s]
                end_b[s][i] = end
                free[s] = end
                if record is not None:
                    record.append((s, "backward", start, end, i))
                if s > 0:
                    if record is not None:
                        record.append((s, "send", end, end + back[s - 1], i))
                    free[s] += back[s - 1]
                    arrive_b[s - 1][i] = free[s]
                    pending.append(s - 1)
            ptr[s] += 1
    if any(ptr[s] < len(orders[s]) for s in range(pp)):
        raise RuntimeError("1F1B simulation deadlocked (a bug)")
    return [max(end_b[s][m - 1], free[s]) for s in range(pp)]


def _hops_s(hops: Sequence[tuple[Tier, int, bool]], nbytes: float, profile: Optional[Profile]) -> float:
    """One message over the slowest of ``hops`` (as a stage's send to the next: ``_stage_models``)."""
    worst = 0.0
    for tier, share, staged in hops:
        t = tier.step_s(nbytes, share, profile)
        if staged:
            t += 2 * nbytes * 8 / (HOST_COPY_GBPS * 1e9)
        worst = max(worst, t)
    return worst


def wrap_send_s(model: ModelSpec, analysis: Analysis, mb: int, profile: Optional[Profile] = None) -> float:
    """One activation (or gradient) from the last stage to the first: the interleaved schedule's extra hop."""
    dims = analysis.placement.dims
    act_msg = mb * model.seq_length * model.hidden_size * model.dtype_bytes / (dims.tp * dims.cp)
    return _hops_s(analysis.wrap_hops, act_msg, profile)


def _virtual_times(sts: list[StageModel], virtual_layers: Sequence[Sequence[int]]) -> tuple[list, list]:
    """Forward and backward of one micro-batch of each virtual stage (chunk): its layers, plus the first stage's
    fixed part (embedding) on its first chunk and the last stage's (output layer, loss, MTP) on its last."""
    pp = len(sts)
    fwd, bwd = [], []
    first, at = {}, 0                      # chunk c of rank r is virtual stage c * pp + r (Megatron's order)
    for c in range(len(virtual_layers[0])):
        for r in range(pp):
            first[r, c] = at
            at += virtual_layers[r][c]
    for r, (st, row) in enumerate(zip(sts, virtual_layers)):
        if st.layer_deltas:
            own = [st.own_layers(first[r, c], n) for c, n in enumerate(row)]
            f, b = [x for x, _ in own], [y for _, y in own]
        else:
            f = [n * st.layer_fwd_s for n in row]
            b = [n * st.layer_bwd_s for n in row]
        c = 0 if r == 0 else len(row) - 1 if r == pp - 1 else None
        if c is not None:
            f[c] += st.fixed_fwd_s
            b[c] += st.fixed_bwd_s
        fwd.append(f)
        bwd.append(b)
    return fwd, bwd


def _interleaved_pipeline(sts: list[StageModel], virtual_layers: Sequence[Sequence[int]], m: int,
                          overlap_p2p_comm: bool, wrap_send: float, dp: int, overlap_grad_reduce: bool,
                          distributed_optimizer: bool, profile: Optional[Profile]) -> tuple[list[float], list[float]]:
    """Each stage's finish of the interleaved schedule and the end of its gradient reduction: with overlap, each
    chunk's share (by parameters) starts at its last backward's start and the shares run one after another."""
    from .schedule import simulate_interleaved
    fwd, bwd = _virtual_times(sts, virtual_layers)
    run = simulate_interleaved(fwd, bwd, [max(st.send_s, st.back_s) for st in sts], wrap_send, m,
                               overlap_p2p_comm=overlap_p2p_comm)
    ends = []
    pp = len(sts)
    for r, (st, row) in enumerate(zip(sts, virtual_layers)):
        n = sum(row)
        red = _dp_reduce_s(st, n, dp, distributed_optimizer, profile)
        if not overlap_grad_reduce or red <= 0:
            ends.append(run.finish[r] + red)
            continue
        params = [k * st.params_per_layer for k in row]
        params[0 if r == 0 else -1] += st.fixed_params if r in (0, pp - 1) else 0.0
        total = sum(params) or 1.0
        done = 0.0
        for c in sorted(range(len(row)), key=lambda c: run.last_backward_start[r][c]):
            done = max(done, run.last_backward_start[r][c]) + red * params[c] / total
        ends.append(max(run.finish[r], done))
    return run.finish, ends


def _interleaved_stage_costs(sts: list[StageModel], num_layers: int, m: int, vpp: int, overlap_p2p_comm: bool,
                             wrap_send: float, dp: int, overlap: bool, distributed_optimizer: bool,
                             profile: Optional[Profile]) -> list[list[float]]:
    """The exact partition's cost tables for the interleaved schedule (a lower bound of each stage's part of the
    iteration): compute, and its sends -- blocking, or with overlap_p2p_comm only where its busiest outgoing link
    is slower than its compute -- plus the reduction the last chunk's backward cannot hide."""
    pp = len(sts)
    tables = []
    for r, st in enumerate(sts):
        nxt = st.send_s if r < pp - 1 else wrap_send          # activations out, vpp per micro-batch (one less on
        prv = sts[r - 1].back_s if r > 0 else wrap_send       # the last rank); gradients back, likewise (first)
        n_next, n_prev = vpp - (r == pp - 1), vpp - (r == 0)
        if pp == 2:                                            # one link each way carries both
            links = [n_next * nxt + n_prev * prv]
        else:
            links = [n_next * nxt, n_prev * prv]
        row = []
        for n in range(num_layers + 1):
            compute = st.fixed_fwd_s + st.fixed_bwd_s + n * (st.layer_fwd_s + st.layer_bwd_s)
            red = _dp_reduce_s(st, n, dp, distributed_optimizer, profile)
            exposed = max(0.0, (red - st.fixed_bwd_s - n * st.layer_bwd_s) / vpp) if overlap else red
            if overlap_p2p_comm:
                busy = m * max([compute] + links)
            else:
                busy = m * (compute + n_next * nxt + n_prev * prv)
            row.append(busy + exposed)
        tables.append(row)
    return tables


# ---- prediction -----------------------------------------------------------------------------------


def evaluate(model: ModelSpec, analysis: Analysis, layers_per_stage: Sequence[int], micro_batch_size: int, *,
             overlap_grad_reduce: bool = True, distributed_optimizer: bool = False,
             profile: Optional[Profile] = None, description: str = "", vpp: int = 1,
             overlap_p2p_comm: Optional[bool] = None) -> Prediction:
    """Predict one layer split of an analyzed placement."""
    return SplitCosts(model, analysis, micro_batch_size, overlap_grad_reduce=overlap_grad_reduce,
                      distributed_optimizer=distributed_optimizer, profile=profile, vpp=vpp,
                      overlap_p2p_comm=overlap_p2p_comm).predict(layers_per_stage, description)


def stage_times(sts: Sequence[StageModel], layers_per_stage: Sequence[int]) -> tuple[list[float], list[float]]:
    """Each stage's forward and backward per micro-batch for a split (per-layer overrides: its own layers)."""
    fwd = [st.fixed_fwd_s + n * st.layer_fwd_s for st, n in zip(sts, layers_per_stage)]
    bwd = [st.fixed_bwd_s + n * st.layer_bwd_s for st, n in zip(sts, layers_per_stage)]
    if any(st.layer_deltas for st in sts):                 # per-layer overrides: each stage's own layers
        firsts = [sum(layers_per_stage[:s]) for s in range(len(sts))]
        own = [st.own_layers(i, n) for st, i, n in zip(sts, firsts, layers_per_stage)]
        fwd = [st.fixed_fwd_s + o[0] for st, o in zip(sts, own)]
        bwd = [st.fixed_bwd_s + o[1] for st, o in zip(sts, own)]
    return fwd, bwd


def _evaluate(model: ModelSpec, analysis: Analysis, sts: list[StageModel], m: int, layers_per_stage: Sequence[int],
              overlap_grad_reduce: bool, distributed_optimizer: bool, profile: Optional[Profile],
              description: str, virtual_layers: Optional[Sequence[Sequence[int]]] = None,
              overlap_p2p_comm: bool = False, wrap_send: float = 0.0) -> Prediction:
    """``virtual_layers`` (each stage's layers per virtual stage, vpp > 1): the interleaved schedule."""
    dims = analysis.placement.dims
    fwd, bwd = stage_times(sts, layers_per_stage)
    send = [st.send_s for st in sts]
    interleaved_ends = None
    if virtual_layers is not None and len(virtual_layers[0]) > 1:
        finish, interleaved_ends = _interleaved_pipeline(sts, virtual_layers, m, overlap_p2p_comm, wrap_send, dims.dp,
                                                         overlap_grad_reduce, distributed_optimizer, profile)
    else:
        finish = simulate_1f1b(fwd, bwd, send, m, [st.back_s for st in sts])
    pipeline = max(finish)
    ends = []
    opt = 0.0
    for s, (st, n) in enumerate(zip(sts, layers_per_stage)):
        red = _dp_reduce_s(st, n, dims.dp, distributed_optimizer, profile)
        exposed = max(0.0, red - bwd[s]) if overlap_grad_reduce else red
        ends.append(finish[s] + exposed if interleaved_ends is None else interleaved_ends[s])
        opt = max(opt, _optimizer_s(st, n, dims.dp, distributed_optimizer))
    emb = 0.0
    if len(model.embedding_stages(dims.pp)) > 1 and analysis.embedding_paths:   # tied, or MTP on the last stage
        emb_bytes = model.embedding_params / dims.tp * GRAD_BYTES
        emb = max(p.allreduce_s(emb_bytes, profile) for p in analysis.embedding_paths)
    iteration = max(ends) + emb + opt + _iteration_overhead_s(analysis, profile)
    tokens = model.global_batch_size * model.seq_length
    flops = 3.0 * model.global_batch_size * (model.decoder_flops_fwd(1) + model.logits_flops_fwd(1)
                                             + model.mtp_flops_fwd(1))
    busiest = max(m * (f + b) for f, b in zip(fwd, bwd))
    memory = [_memory_bytes(st, n, dims.dp, distributed_optimizer) / GIB for st, n in zip(sts, layers_per_stage)]
    capacity = [st.capacity_gib for st in sts]
    pred = Prediction(
        iteration_s=iteration, tokens_per_s=tokens / iteration,
        tflops_per_device=flops / iteration / dims.world_size / 1e12,
        pipeline_s=pipeline, dp_exposed_s=max(ends) - pipeline + emb, optimizer_s=opt,
        bubble_fraction=max(0.0, 1.0 - busiest / pipeline) if pipeline > 0 else 0.0,
        stage_compute_s=[f + b for f, b in zip(fwd, bwd)], memory_gib_per_stage=memory,
        capacity_gib_per_stage=capacity, description=description,
        alltoall_s=max(m * n * st.alltoall_per_layer_s for st, n in zip(sts, layers_per_stage)))
    problem = memory_problem(pred)
    if problem:
        pred.description = (pred.description + "; " if pred.description else "") + problem
    return pred


def _iteration_overhead_s(analysis: Analysis, profile: Optional[Profile]) -> float:
    """The profile's fixed cost per iteration: the slowest device type's (0 without one)."""
    if profile is None or not profile.overhead:
        return 0.0
    return max((profile.iteration_overhead_s(a.name) or 0.0 for st in analysis.stages for a in st.accelerators),
               default=0.0)


def profile_notes(profile: Optional[Profile], model: ModelSpec, devices, micro_batch_size: int, tp: int) -> list[str]:
    """Lines saying which measured compute curves of ``devices`` (names) a prediction at this micro-batch size
    and TP extrapolates (format-2 profiles; the description and the plan's warnings carry them)."""
    if profile is None:
        return []
    kinds = ("layer", "embedding", "output") + (("moe_layer",) if model.is_moe else ())
    return profile.extrapolation_notes(devices, micro_batch_size, tp, kinds)


class SplitCosts:
    """The layer split's side of the predictor, for one analyzed placement, micro-batch size and optimizer
    setting: what the exact partition needs (:meth:`tables`, :meth:`max_layers`), how far a split misses
    memory (:meth:`overflow_gib`), and the prediction of a split (:meth:`predict`).

    ``vpp > 1``: Megatron's interleaved schedule with ``vpp`` virtual stages per rank (each stage's layers split
    by :func:`het_plugin.layer_split.virtual_split`), ``overlap_p2p_comm`` (None: on, Megatron-LM's default
    there); the in-flight activations are the interleaved schedule's (warm-up + 1 chunks on each rank)."""

    def __init__(self, model: ModelSpec, analysis: Analysis, micro_batch_size: int, *,
                 overlap_grad_reduce: bool = True, distributed_optimizer: bool = False,
                 profile: Optional[Profile] = None, vpp: int = 1, overlap_p2p_comm: Optional[bool] = None):
        dims = analysis.placement.dims
        self.model, self.analysis, self.micro_batch_size = model, analysis, micro_batch_size
        self.overlap_grad_reduce, self.distributed_optimizer, self.profile = (overlap_grad_reduce,
                                                                              distributed_optimizer, profile)
        self.dp = dims.dp
        self.num_micro_batches = model.global_batch_size // (dims.dp * micro_batch_size)
        #: per stage: its times per micro-batch and bytes per rank, linear in its layer count
        self.stages: list[StageModel] = _stage_models(model, analysis, micro_batch_size, self.num_micro_batches,
                                                      profile)
        self.notes = profile_notes(profile, model, {a.name for st in analysis.stages for a in st.accelerators},
                                   micro_batch_size, dims.tp)
        self.vpp = vpp
        self.overlap_p2p_comm = (vpp > 1) if overlap_p2p_comm is None else bool(overlap_p2p_comm) and vpp > 1
        self.wrap_send_s = 0.0
        if vpp > 1:
            import dataclasses

            from .schedule import check_micro_batches, warmup_count
            m, pp = self.num_micro_batches, dims.pp
            if pp < 2:
                raise ValueError(f"an interleaved pipeline (vpp={vpp}) needs pp >= 2")
            check_micro_batches(pp, m)
            self.wrap_send_s = wrap_send_s(model, analysis, micro_batch_size, profile)
            # warm-up + 1 chunks of about n / vpp layers each hold activations (Megatron's 1 + (pp-1)/(pp vpp))
            self.stages = [dataclasses.replace(st, in_flight=min(warmup_count(pp, s, m, vpp) + 1, m * vpp) / vpp)
                           for s, st in enumerate(self.stages)]
        #: data-parallel replicas that run alike, with their stages' models: one group (every replica, the
        #: stages' slowest devices) unless replicas run on different devices (not with interleaving)
        self.replica_groups: list[tuple[tuple[int, ...], list[StageModel]]] = [(tuple(range(dims.dp)), self.stages)]
        if vpp == 1 and analysis.replica_classes:
            # the same for both optimizer settings: kept on the analysis per micro-batch size
            cache = analysis.__dict__.setdefault("_class_stage_models", {})
            key = (micro_batch_size, self.num_micro_batches, id(profile))
            if key not in cache:
                cache[key] = [(c.replicas, _stage_models(model, _class_analysis(analysis, c), micro_batch_size,
                                                         self.num_micro_batches, profile))
                              for c in analysis.replica_classes]
            self.replica_groups = list(cache[key])
        self.counts: list[int] = []          # micro-batches per replica; [] = the even split
        self._group_rows: Optional[list] = None

    @property
    def per_replica(self) -> bool:
        """Replicas differ (devices or counts): each is predicted on its own."""
        return len(self.replica_groups) > 1 or bool(self.counts)

    def set_counts(self, counts: Sequence[int]) -> None:
        """Micro-batches per replica ([] or all equal: the even split); the first stages hold up to pp of the
        largest count in flight (1F1B), so the memory follows the largest."""
        counts = list(counts)
        if counts and (len(counts) != self.dp or sum(counts) != self.dp * self.num_micro_batches or min(counts) < 1):
            raise ValueError(f"replica counts {counts} must be {self.dp} counts >= 1 adding up to "
                             f"{self.dp * self.num_micro_batches}")
        if counts and self.vpp > 1 and len(set(counts)) > 1:
            raise ValueError("uneven replica counts are not modelled with an interleaved pipeline (vpp > 1)")
        self.counts = counts if counts and len(set(counts)) > 1 else []
        top = max(counts) if self.counts else self.num_micro_batches
        if self.vpp == 1:
            pp = len(self.stages)
            self.stages = [replace(st, in_flight=min(pp - s, top)) for s, st in enumerate(self.stages)]
            if len(self.replica_groups) == 1:
                self.replica_groups = [(self.replica_groups[0][0], self.stages)]

    def group_counts(self) -> list[int]:
        """The largest micro-batch count of each replica group (what its slowest replica runs)."""
        counts = self.counts
        if not counts:
            return [self.num_micro_batches] * len(self.replica_groups)
        return [max(counts[d] for d in reps) for reps, _ in self.replica_groups]

    def balance(self, layers_per_stage: Sequence[int]) -> list[int]:
        """Micro-batches per replica for this split, by each replica group's speed (:func:`share_micro_batches`
        over each group's 1F1B fill and steady-state step); [] where the groups run alike."""
        if len(self.replica_groups) < 2 or self.vpp > 1:
            return []
        sizes, fills, steps = [], [], []
        for reps, sts in self.replica_groups:
            f = [st.fixed_fwd_s + n * st.layer_fwd_s for st, n in zip(sts, layers_per_stage)]
            b = [st.fixed_bwd_s + n * st.layer_bwd_s for st, n in zip(sts, layers_per_stage)]
            send = [st.send_s for st in sts]
            per = [f[s] + b[s] + send[s] * (s + 1 < len(sts)) + (send[s - 1] if s else 0.0) for s in range(len(sts))]
            step = max(per)
            sizes.append(len(reps))
            steps.append(step)
            fills.append(sum(f) + sum(b) + 2 * sum(send[:-1]) - step)
        totals = share_micro_batches(sizes, fills, steps, self.dp * self.num_micro_batches)
        counts = [0] * self.dp
        for (reps, _), q in zip(self.replica_groups, totals):
            base, extra = divmod(q, len(reps))
            for i, d in enumerate(reps):
                counts[d] = base + (1 if i < extra else 0)
        return counts if len(set(counts)) > 1 else []

    def max_layers(self) -> list[int]:
        """Per stage, the most layers its memory holds (-1: not even its fixed part fits)."""
        return [_max_layers_fitting(st, self.model.num_layers, self.dp, self.distributed_optimizer)
                for st in self.stages]

    def tables(self) -> list[list[float]]:
        """Per stage, its busy time in one iteration with 0..num_layers layers (the exact partition's costs)."""
        if self.vpp > 1:
            return _interleaved_stage_costs(self.stages, self.model.num_layers, self.num_micro_batches, self.vpp,
                                            self.overlap_p2p_comm, self.wrap_send_s, self.dp, self.overlap_grad_reduce,
                                            self.distributed_optimizer, self.profile)
        if not self.counts:     # the even split: each stage at its slowest devices (>= any replica group's)
            return _stage_costs(self.stages, self.model.num_layers, self.num_micro_batches, self.dp,
                                self.overlap_grad_reduce, self.distributed_optimizer, self.profile)
        if self._group_rows is None:       # a group's table is m * (per micro-batch) + (exposed reduction)
            self._group_rows = []
            for _, sts in self.replica_groups:
                self._group_rows.append(_stage_cost_parts(sts, self.model.num_layers, self.dp,
                                                          self.overlap_grad_reduce, self.distributed_optimizer,
                                                          self.profile))
        rows: Optional[list[list[float]]] = None       # each stage's cost: its slowest replica group's
        for (per, fixed), m in zip(self._group_rows, self.group_counts()):
            t = [[m * a + e for a, e in zip(ra, re)] for ra, re in zip(per, fixed)]
            rows = t if rows is None else [[max(a, b) for a, b in zip(r, q)] for r, q in zip(rows, t)]
        return rows

    @property
    def layers_differ(self) -> bool:
        """The profile measures some decoder layers on their own (per-layer overrides)."""
        return any(st.layer_deltas for st in self.stages)

    def refine(self, layers_per_stage: Sequence[int], max_layers: Sequence[int], min_layers: int = 1) -> list[int]:
        """With per-layer overrides the partition's tables hold each stage's mean layer; move one layer at a time
        across a stage boundary while the predicted iteration gets shorter (memory caps and ``min_layers``
        kept). Without overrides: the split unchanged."""
        best = list(layers_per_stage)
        if not self.layers_differ:
            return best
        best_s = self.predict(best).iteration_s
        for _ in range(self.model.num_layers * len(best)):         # each pass improves, or stops
            moves = []
            for b in range(len(best) - 1):
                for step in (1, -1):
                    cand = list(best)
                    cand[b] -= step
                    cand[b + 1] += step
                    if min(cand) >= min_layers and all(n <= c for n, c in zip(cand, max_layers)):
                        moves.append((self.predict(cand).iteration_s, cand))
            if not moves or min(moves)[0] >= best_s:
                break
            best_s, best = min(moves)
        return best

    def overflow_gib(self, layers_per_stage: Sequence[int]) -> float:
        """GiB per device by which the fullest stage of this split exceeds its devices' memory (<= 0: fits)."""
        return max(_memory_bytes(st, n, self.dp, self.distributed_optimizer) / GIB - st.capacity_gib
                   for st, n in zip(self.stages, layers_per_stage))

    def predict(self, layers_per_stage: Sequence[int], description: str = "") -> Prediction:
        """The prediction of one split (``fits == False`` and the reason in its description if it does not fit)."""
        if self.per_replica and self.vpp == 1:
            return _extrapolated(_evaluate_replicas(self, layers_per_stage, description), self.notes)
        virtual = None
        if self.vpp > 1:
            from .layer_split import virtual_split
            virtual = virtual_split(layers_per_stage, self.vpp)
        if self.notes:
            description = "; ".join(([description] if description else []) + self.notes)
        return _extrapolated(_evaluate(self.model, self.analysis, self.stages, self.num_micro_batches,
                                       layers_per_stage, self.overlap_grad_reduce, self.distributed_optimizer,
                                       self.profile, description, virtual, self.overlap_p2p_comm, self.wrap_send_s),
                             self.notes)


def _extrapolated(pred: Prediction, notes: Sequence[str]) -> Prediction:
    """The prediction with the profile notes of its compute outside the measured points (issue 23)."""
    pred.extrapolated = list(notes)
    return pred


def _class_analysis(analysis: Analysis, cls: ReplicaClass) -> Analysis:
    """The analysis as one replica class sees it: each stage on that class's devices only."""
    return replace(analysis, stages=[replace(st, accelerators=accs) for st, accs in zip(analysis.stages,
                                                                                       cls.accelerators)])


def share_micro_batches(sizes: Sequence[int], fills: Sequence[float], steps: Sequence[float], total: int) -> list[int]:
    """Micro-batches per replica group (``sizes[g]`` replicas; inside a group counts differ by at most one),
    adding up to ``total``, each replica at least one, minimising the slowest group's ``fills[g] + steps[g] *
    count`` (a replica's 1F1B pipeline with ``count`` micro-batches: the fill and drain, then one step of its
    slowest stage per micro-batch). The continuous optimum (every group finishing together), rounded down, then
    the remainder placed where it finishes earliest; exact for this affine model."""
    groups = range(len(sizes))
    if total < sum(sizes):
        raise ValueError(f"{total} micro-batches cannot give each of {sum(sizes)} replicas one")
    finish = sum(z / st for z, st in zip(sizes, steps))
    t = (total + sum(z * f / st for z, f, st in zip(sizes, fills, steps))) / finish
    q = [z * max(1, int((t - f) / st)) for z, f, st in zip(sizes, fills, steps)]

    def top(g: int) -> int:          # the largest count inside group g
        return -(-q[g] // sizes[g])

    while sum(q) > total:            # rounding up to one each overshot: lower the group finishing last
        g = max((g for g in groups if q[g] > sizes[g]), key=lambda g: (fills[g] + steps[g] * top(g), -g))
        q[g] -= min(q[g] - sizes[g] * (top(g) - 1), sum(q) - total)
    while sum(q) < total:
        short = total - sum(q)
        free = [g for g in groups if q[g] < sizes[g] * top(g)]     # slots below a group's largest count
        if free:
            g = min(free, key=lambda g: (steps[g], g))
            q[g] += min(short, sizes[g] * top(g) - q[g])
            continue
        g = min(groups, key=lambda g: (fills[g] + steps[g] * (top(g) + 1), g))
        q[g] += min(short, sizes[g])
    return q


def _evaluate_replicas(sc: "SplitCosts", layers_per_stage: Sequence[int], description: str) -> Prediction:
    """Each replica group's 1F1B on its own devices with its own micro-batch counts; every stage's gradient
    reduction starts when its last replica gets there (overlapped with that replica's last backward)."""
    model, analysis, dims = sc.model, sc.analysis, sc.analysis.placement.dims
    pp, dp = dims.pp, dims.dp
    counts = sc.counts or [sc.num_micro_batches] * dp
    replica_s = [0.0] * dp
    pipeline, busiest = 0.0, 0.0
    ends = [0.0] * pp
    stage_compute = [0.0] * pp
    alltoall = 0.0
    reds = [_dp_reduce_s(st, n, dp, sc.distributed_optimizer, sc.profile) for st, n in zip(sc.stages, layers_per_stage)]
    for (reps, sts), m in zip(sc.replica_groups, sc.group_counts()):
        fwd = [st.fixed_fwd_s + n * st.layer_fwd_s for st, n in zip(sts, layers_per_stage)]
        bwd = [st.fixed_bwd_s + n * st.layer_bwd_s for st, n in zip(sts, layers_per_stage)]
        send = [st.send_s for st in sts]
        finish = simulate_1f1b(fwd, bwd, send, m)
        # A replica of the group with fewer micro-batches (one less: a group's counts differ by at most one when
        # balanced) finishes a steady-state step of the slowest stage earlier per micro-batch.
        step = max(f + b + send[s] * (s + 1 < pp) + (send[s - 1] if s else 0.0)
                   for s, (f, b) in enumerate(zip(fwd, bwd)))
        for d in reps:
            replica_s[d] = max(finish) - (m - counts[d]) * step
        pipeline = max(pipeline, max(finish))
        busiest = max(busiest, max(m * (f + b) for f, b in zip(fwd, bwd)))
        alltoall = max(alltoall, max(m * n * st.alltoall_per_layer_s for st, n in zip(sts, layers_per_stage)))
        for s in range(pp):
            exposed = max(0.0, reds[s] - bwd[s]) if sc.overlap_grad_reduce else reds[s]
            ends[s] = max(ends[s], finish[s] + exposed)
            stage_compute[s] = max(stage_compute[s], fwd[s] + bwd[s])
    opt = max(_optimizer_s(st, n, dp, sc.distributed_optimizer) for st, n in zip(sc.stages, layers_per_stage))
    emb = 0.0
    if len(model.embedding_stages(pp)) > 1 and analysis.embedding_paths:
        emb_bytes = model.embedding_params / dims.tp * GRAD_BYTES
        emb = max(p.allreduce_s(emb_bytes, sc.profile) for p in analysis.embedding_paths)
    iteration = max(ends) + emb + opt + _iteration_overhead_s(analysis, sc.profile)
    tokens = model.global_batch_size * model.seq_length
    flops = 3.0 * model.global_batch_size * (model.decoder_flops_fwd(1) + model.logits_flops_fwd(1)
                                             + model.mtp_flops_fwd(1))
    memory = [_memory_bytes(st, n, dp, sc.distributed_optimizer) / GIB for st, n in zip(sc.stages, layers_per_stage)]
    pred = Prediction(
        iteration_s=iteration, tokens_per_s=tokens / iteration,
        tflops_per_device=flops / iteration / dims.world_size / 1e12,
        pipeline_s=pipeline, dp_exposed_s=max(ends) - pipeline + emb, optimizer_s=opt,
        bubble_fraction=max(0.0, 1.0 - busiest / pipeline) if pipeline > 0 else 0.0,
        stage_compute_s=stage_compute, memory_gib_per_stage=memory,
        capacity_gib_per_stage=[st.capacity_gib for st in sc.stages], description=description,
        alltoall_s=alltoall, replica_pipeline_s=replica_s)
    problem = memory_problem(pred)
    if problem:
        pred.description = (pred.description + "; " if pred.description else "") + problem
    return pred


def params_memory_gib(model: ModelSpec, dims: ParallelDims, distributed_optimizer: bool) -> float:
    """Weights, gradients and optimizer state per device if the model split perfectly over tp*pp (the routed
    experts over etp*ep*pp): a lower bound of any stage's memory with these degrees."""
    opt = OPTIMIZER_STATE_BYTES / (dims.dp * dims.cp) if distributed_optimizer else OPTIMIZER_STATE_BYTES
    expert_opt = OPTIMIZER_STATE_BYTES / dims.expert_dp if distributed_optimizer else OPTIMIZER_STATE_BYTES
    dense = (model.total_params - model.expert_params) * (WEIGHT_BYTES + GRAD_BYTES + opt) / (dims.tp * dims.pp)
    experts = model.expert_params * (WEIGHT_BYTES + GRAD_BYTES + expert_opt) / (dims.etp * dims.ep * dims.pp)
    return (dense + experts) / GIB


def memory_problem(pred: Prediction) -> Optional[str]:
    """Why a prediction's plan does not fit (None when it does)."""
    over = [(s, m, c) for s, (m, c) in enumerate(zip(pred.memory_gib_per_stage, pred.capacity_gib_per_stage)) if m > c]
    if not over:
        return None
    s, m, c = max(over, key=lambda x: x[1] - x[2])
    return (f"does not fit: stage {s} needs {m:.1f} GiB per device, its devices have {c:.1f} GiB"
            + (f" ({len(over)} stages over)" if len(over) > 1 else ""))


def predict(cluster: Cluster, model: ModelSpec, placement: Placement, layers_per_stage: Sequence[int],
            micro_batch_size: int, *, transport_fn: TransportFn = placement_transport,
            overlap_grad_reduce: bool = True, distributed_optimizer: bool = False,
            profile: Optional[Profile] = None, description: str = "", vpp: int = 1,
            overlap_p2p_comm: Optional[bool] = None) -> Prediction:
    """Predict one plan. A plan whose memory does not fit gets ``fits == False`` and the reason in its
    description (the planner rejects it). ``vpp > 1``: the interleaved schedule (:class:`SplitCosts`)."""
    dims = placement.dims
    if len(layers_per_stage) != dims.pp or sum(layers_per_stage) != model.num_layers:
        raise ValueError(f"layers_per_stage {list(layers_per_stage)} must have {dims.pp} entries summing to "
                         f"{model.num_layers}")
    if model.global_batch_size % (dims.dp * micro_batch_size):
        raise ValueError(f"global batch {model.global_batch_size} is not a multiple of dp*micro_batch "
                         f"{dims.dp}*{micro_batch_size}")
    analysis = analyze(cluster, placement, transport_fn)
    return evaluate(model, analysis, layers_per_stage, micro_batch_size, overlap_grad_reduce=overlap_grad_reduce,
                    distributed_optimizer=distributed_optimizer, profile=profile, description=description,
                    vpp=vpp, overlap_p2p_comm=overlap_p2p_comm)
