"""Placement analysis: walk every group of a placement once (the expensive part) into per-stage shapes,
data-parallel and expert paths, replica classes; the rest of the predictor reads only this.
"""
from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass, field, replace
from itertools import chain, compress, groupby
from operator import ne
from typing import Optional, Sequence

from ..inputs.catalog import Accelerator
from ..inputs.cluster import Cluster
from ..ranks.placement import Placement, cluster_transport
from ..inputs.profile import Profile
from ..ranks.dims import ParallelDims
from ..ranks.transport import Transport
from .network import CollectivePath, MultinetPath, HOST_COPY_GBPS, LOCAL_LATENCY_US, Level, Network, Tier, TransportFn, _level, _slowest

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
    # Partial distributed optimizer (Analysis.instances > 1, cost.dist_opt): the paths of the instances' blocks and
    # of the inter-instance groups.
    instance_paths: tuple = ()
    cross_instance_paths: tuple = ()


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
    instances: int = 1          # Megatron's distributed-optimizer instances the stages' paths are for (cost.dist_opt)


def _collective_path(net: Network, members_nodes: Sequence[int]) -> tuple[CollectivePath, str]:
    """The hierarchical ring of a group whose members sit on ``members_nodes`` (one entry per member)."""
    per_node: dict[int, int] = dict(Counter(members_nodes))     # (first appearance order, as a loop would)
    # a pure function of the members per node (in order of appearance) on this network: shared by every analysis
    # of a search (the same groups recur across degrees and domain orders)
    key = tuple(per_node.items())
    cached = net.paths.get(key)
    if cached is None:
        cached = net.paths[key] = _uncached_path(net, members_nodes, per_node)
    return cached


def _uncached_path(net: Network, members_nodes: Sequence[int], per_node: dict[int, int]) -> tuple[CollectivePath, str]:
    nodes = net.cluster.nodes
    node_set = frozenset(members_nodes)
    t = net.nodes_transport(node_set)
    if t == Transport.MULTINET:
        return _multinet_path(net, per_node), t
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
    return CollectivePath(tuple(levels), t == Transport.HOST_STAGED), t


def _multinet_path(net: Network, per_node: dict[int, int]) -> MultinetPath:
    """The group's ring on NCCL's multi-network communicator (:class:`MultinetPath`): its fabrics are the clusters
    it touches; the crossings spread over the nodes of the fabric that has fewest of the group's nodes."""
    nodes = net.cluster.nodes
    by_cluster: dict[str, list[int]] = {}
    for n in sorted(per_node):
        by_cluster.setdefault(nodes[n].cluster, []).append(n)
    t = Transport.MULTINET
    inside = [net.hop(n, n, t) for n in per_node if per_node[n] > 1]
    inside += [net.hop(v[0], v[1], t) for v in by_cluster.values() if len(v) > 1]
    reps = [v[0] for v in by_cluster.values()]
    cross = _slowest([net.hop(a, b, t) for i, a in enumerate(reps) for b in reps[i + 1:]])
    k = max(per_node.values())
    share = max(1, max(nodes[n].num_accelerators for n in per_node) // k)
    return MultinetPath(sum(per_node.values()), _slowest(inside) if inside else cross, cross, share,
                        min(len(v) for v in by_cluster.values()), len(by_cluster),
                        max(len(v) for v in by_cluster.values()))


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
        tiers = [net.hop(v[0], v[1], net.nodes_transport(frozenset(v))) for v in sections.values() if len(v) > 1]
        levels.append(Level(_slowest(tiers), n_nodes, share))
    leaders = [v[0] for v in sections.values()]
    tiers = [net.hop(a, b, t) for i, a in enumerate(leaders) for b in leaders[i + 1:]]
    levels.append(Level(_slowest(tiers), len(sections), share))
    return CollectivePath(tuple(levels), t == Transport.HOST_STAGED, 1.0 / (k * n_nodes))


def _ring_hop(net: Network, ring_nodes: Sequence[int]) -> tuple[Tier, int, bool]:
    """Slowest hop of a ring (member i sends to i+1, the last to the first) whose members sit on
    ``ring_nodes``: its tier, how many ranks of the sending node send off it at once, host-staged or not."""
    nodes = net.cluster.nodes
    t = net.nodes_transport(frozenset(ring_nodes))
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
    return worst[0], worst[1], t == Transport.HOST_STAGED


def _alltoall(net: Network, members_nodes: Sequence[int]) -> tuple[AllToAll, str]:
    """The all-to-all of a group whose members sit on ``members_nodes``: for the member that has the most to
    send off its node, the shares of its bytes per leg (own node, its cluster's fabric, other clusters)."""
    nodes = net.cluster.nodes
    size = len(members_nodes)
    t = net.nodes_transport(frozenset(members_nodes))
    per_node: dict[int, int] = dict(Counter(members_nodes))     # (first appearance order, as a loop would)
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
        cand = AllToAll(tuple(legs), t == Transport.HOST_STAGED)
        cost = cand.time_s(1 << 24)
        if worst is None or cost > worst[0]:
            worst = (cost, cand)
    return worst[1], t


def analyze(cluster: Cluster, placement: Placement, transport_fn: TransportFn = cluster_transport,
            network: Optional[Network] = None) -> Analysis:
    """Walk every DP, pipeline and embedding group of a placement once (O(world size))."""
    net = network if network is not None and network.fn is transport_fn else Network(cluster, transport_fn)
    dims = placement.dims
    rank_node = cluster.rank_node
    node_of_logical = list(map(rank_node.__getitem__, placement.rank_of_canonical))
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
            t = columns[col] = net.nodes_transport(col)
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
                    transports.setdefault("cp", set()).add(net.nodes_transport(frozenset(ring)))
                    if hop not in cp_hops:
                        cp_hops.append(hop)
        hops: list[tuple[Tier, int, bool]] = []
        if s + 1 < dims.pp:
            # each distinct (sender node, receiver node, transport) once, in the order of the stage's ranks
            hops = _distinct_hops(net, zip(node_of_logical[base:base + S], node_of_logical[base + S:base + 2 * S],
                                           pp_transport))
        stages.append(StageInfo(accs, capacity, tp_tier, tuple(paths), tuple(hops), tuple(cp_hops)))
    wrap: list[tuple[Tier, int, bool]] = []      # the interleaved schedule's hop from the last stage to the first
    if dims.pp > 1:
        last_base = (dims.pp - 1) * S
        wrap = _distinct_hops(net, zip(node_of_logical[last_base:last_base + S], node_of_logical[:S], pp_transport))
    emb_paths: list[CollectivePath] = []
    if dims.pp > 1:
        last = (dims.pp - 1) * S
        for pair in sorted(set(zip(node_of_logical[:S], node_of_logical[last:last + S]))):
            path, t = dp_path(list(pair))
            transports["embedding"].add(t)
            if path not in emb_paths:
                emb_paths.append(path)
    out = Analysis(placement, stages, tuple(emb_paths), transports, tuple(node_of_logical),
                   wrap_hops=tuple(wrap),      # (node_runs: worked out where the expert groups need them)
                   replica_classes=replica_classes(cluster, node_of_logical, dims))
    return analyze_experts(cluster, out, dims, net)


def _distinct_hops(net: Network, pairs) -> list[tuple[Tier, int, bool]]:
    """(tier, ranks of the sending node sending at once, host-staged) of each distinct hop of ``pairs`` (sending
    node, receiving node, transport), in the order of their first pair: each distinct pair once, then each hop once
    (the network keeps one object per distinct tier, so identity tells them apart; a list's ``not in`` keeps the
    same ones)."""
    nodes = net.cluster.nodes
    out: dict = {}
    for a, b, t in dict.fromkeys(pairs):
        tier, share, staged = net.hop(a, b, t), 1 if a == b else nodes[a].num_accelerators, t == Transport.HOST_STAGED
        out.setdefault((id(tier), share, staged), (tier, share, staged))
    return list(out.values())


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
    # (where a rank's node differs from the one before it; C loops over the O(world size) list)
    return tuple(compress(enumerate(node_of_logical), map(ne, chain((None,), node_of_logical), node_of_logical)))


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
