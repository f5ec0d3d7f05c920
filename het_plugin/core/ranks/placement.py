"""The group mapper: which physical (launch) rank holds which logical coordinate, and each group's transport.

Idea (Holmes' cross-cluster pipeline parallelism, HETHUB's vendor split): nodes are grouped into
*domains* (same cluster fabric and same device type). Domains are laid out one after another, clusters
kept contiguous, and the logical ranks are dealt out in that order. Because a pipeline stage is a
contiguous block of ``tp*cp*dp`` logical ranks, a stage stays inside one domain whenever the domain's
size is a multiple of it -- so TP and DP traffic stays on one fabric and one vendor and only the
pipeline's point-to-point hops cross the slow boundaries, once per boundary. On a homogeneous cluster
the order is the launch order and the mapping is the identity: the frameworks' own groups.
"""
from __future__ import annotations

import itertools
import math
from pathlib import Path
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

from ..inputs.cluster import RDMA, Cluster
from ..errors import ConfigError
from ..inputs.yamlio import with_line
from .dims import Degrees, ParallelDims
from .transport import Member, transport_rule

Domain = tuple[str, str]   # (cluster name, accelerator name)



@dataclass(frozen=True)
class Placement:
    """Two numberings of the same placement, named for what they are: ``rank_of_canonical`` numbers coordinates
    in the default order (tp fastest ... pp slowest: a stage is a contiguous block -- what the dealing and the cost
    model read); :attr:`rank_of_logical` numbers them in the framework's order ``dims.order`` (what a Plan
    stores under the same name, and what the frameworks' rank generators produce)."""
    dims: ParallelDims
    rank_of_canonical: tuple[int, ...]   # default-order logical rank -> physical launch rank
    domain_order: tuple[Domain, ...]
    # How the logical ranks were dealt: "stage" (a stage's block of tp*cp*dp ranks after another: the pipeline
    # crosses domains, DP stays inside) or "replica" (a replica's whole pipeline after another: each pipeline
    # inside a domain, DP groups across domains; see place_replicas).
    dealing: str = "stage"
    together: int = 1                    # "replica" dealing: replicas dealt together (a node: one stage of each)

    @property
    def rank_of_logical(self) -> tuple[int, ...]:
        """Framework-order logical rank -> physical launch rank (a Plan's ``rank_of_logical``)."""
        if self.dims.is_default_order:
            return self.rank_of_canonical
        return tuple(self.rank_of_canonical[c] for c in self.dims.to_canonical())

    @classmethod
    def from_rank_of_logical(cls, dims: ParallelDims, rank_of_logical: Sequence[int],
                             domain_order: tuple = ()) -> "Placement":
        """The placement a Plan stores (framework-order numbering) as the cost model reads it."""
        if dims.is_default_order:
            return cls(dims, tuple(rank_of_logical), domain_order)
        canonical = [0] * len(rank_of_logical)
        for framework_rank, canonical_rank in enumerate(dims.to_canonical()):
            canonical[canonical_rank] = rank_of_logical[framework_rank]
        return cls(dims, tuple(canonical), domain_order)

    @property
    def is_identity(self) -> bool:
        """The framework's own numbering (logical rank == launch rank in its order)."""
        return all(i == r for i, r in enumerate(self.rank_of_logical))

    def physical_groups(self, kind: str, embedding_stages: Optional[Sequence[int]] = None) -> list[list[int]]:
        return self.dims.placed_groups(kind, self.rank_of_logical, embedding_stages)

    def stage_ranks(self, stage: int) -> list[int]:
        return self.dims.canonical().placed_stage(stage, self.rank_of_canonical)


def check_dims(cluster: Cluster, dims: ParallelDims, num_layers: int | None = None) -> None:
    """Reject degrees that cannot be placed, naming the field and what would work.

    A homogeneous cluster takes whatever the frameworks take (the placement is their own numbering). On a
    heterogeneous one het_plugin keeps each TP group inside a node, and a CP group either inside a node or
    on whole nodes (a ring over one fabric when the domain sizes allow).
    """
    if not cluster.is_homogeneous:
        check_local_groups(cluster, dims.tp, dims.cp)
    Degrees(cluster.world_size, tp=dims.tp, pp=dims.pp, dp=dims.dp, cp=dims.cp, ep=dims.ep, etp=dims.etp,
            order=dims.order, source=cluster.source)
    if num_layers is not None and dims.pp > num_layers:
        raise ConfigError(f"a pipeline of {dims.pp} stages cannot hold {num_layers} layers (every stage needs at "
                          "least one)", field="pp (--pp)", fix=f"use pp <= {num_layers} (the model's num_layers)")


def local_group_fits(per_node: int, tp: int, cp: int) -> bool:
    """TP inside a node; TP*CP inside a node or on whole nodes."""
    return per_node % tp == 0 and (per_node % (tp * cp) == 0 or (tp * cp) % per_node == 0)


def check_local_groups(cluster: Cluster, tp: int, cp: int) -> None:
    common = math.gcd(*(n.num_accelerators for n in cluster.nodes))
    for n in cluster.nodes:
        if local_group_fits(n.num_accelerators, tp, cp):
            continue
        ok = [d for d in range(1, common + 1) if common % d == 0]
        if n.num_accelerators % tp:
            problem, fix = (f"not divisible by tp = {tp}; on a heterogeneous cluster het_plugin keeps each TP group "
                            "inside one node", f"use tp in {ok} (a divisor of every node's accelerators_per_node)")
        else:
            problem, fix = (f"and tp*cp = {tp * cp} neither divides it nor is a multiple of it; a CP group sits "
                            "inside one node or on whole nodes", "use cp with tp*cp dividing or a multiple of "
                                                                 f"{n.num_accelerators}")
        raise _located(cluster, ConfigError(
            f"node {n.name} has accelerators_per_node: {n.num_accelerators}, {problem}", source=cluster.source,
            field=f"{n.spec_path or 'clusters'}.accelerators_per_node", fix=fix))


def check_world_size(cluster: Cluster, launched: int, *, rank: int | None = None,
                     local_world_size: int | None = None) -> None:
    """Check that the ranks actually launched are the ones the cluster file describes.

    Adapters call this with WORLD_SIZE (and RANK, LOCAL_WORLD_SIZE when known) before creating any
    group: a plan for a different number of ranks would build wrong groups or hang.
    """
    if launched != cluster.world_size:
        per_cluster = ", ".join(
            f"{c}: {sum(n.num_accelerators for n in cluster.nodes if n.cluster == c)}" for c in cluster.cluster_names)
        raise ConfigError(
            f"{launched} ranks were launched (WORLD_SIZE), but the cluster file describes {cluster.world_size} "
            f"accelerators ({per_cluster})", source=cluster.source, field="clusters[*].nodes[*].count",
            fix=f"launch {cluster.world_size} ranks (one per accelerator, e.g. torchrun --nnodes "
                f"{len(cluster.nodes)}), or make the node counts describe the nodes you launch")
    if rank is not None and local_world_size is not None:
        if not 0 <= rank < cluster.world_size:
            raise ConfigError(f"rank {rank} is outside the cluster's {cluster.world_size} ranks", source=cluster.source,
                              fix="check RANK and WORLD_SIZE")
        node = cluster.node_of(rank)
        if node.num_accelerators != local_world_size:
            raise _located(cluster, ConfigError(
                f"rank {rank} runs on node {node.name}, which the file gives accelerators_per_node: "
                f"{node.num_accelerators}, but {local_world_size} ranks were launched on its node "
                "(LOCAL_WORLD_SIZE)", source=cluster.source,
                field=f"{node.spec_path or 'clusters'}.accelerators_per_node",
                fix="launch one rank per accelerator (--nproc-per-node) in the file's node order, or fix "
                    "accelerators_per_node / launch.node_order"))


def _located(cluster: Cluster, exc: ConfigError) -> ConfigError:
    """Add the line of the field when the cluster came from a file."""
    path = Path(cluster.source)
    return with_line(exc, path.read_text()) if path.is_file() else exc


def domain_orders(cluster: Cluster, limit: int = 48) -> Iterator[tuple[Domain, ...]]:
    """Domain orders that keep each cluster contiguous; the file order comes first.

    With few domains every such order is produced (the planner's cost model picks); past ``limit`` only
    the file order and its reverse are.
    """
    by_cluster = {c: [d for d in cluster.domains if d[0] == c] for c in cluster.cluster_names}
    count = 1
    for c, ds in by_cluster.items():
        count *= len(ds)
    for k in range(2, len(by_cluster) + 1):
        count *= k
    if count > limit:
        first = tuple(d for c in cluster.cluster_names for d in by_cluster[c])
        yield first
        if len(first) > 1:
            yield tuple(reversed(first))
        return
    for corder in itertools.permutations(cluster.cluster_names):
        for inner in itertools.product(*(itertools.permutations(by_cluster[c]) for c in corder)):
            yield tuple(d for part in inner for d in part)


def place(cluster: Cluster, dims: ParallelDims, domain_order: Sequence[Domain] | None = None) -> Placement:
    """Deal logical ranks to physical ranks domain by domain (see module docstring)."""
    check_dims(cluster, dims)
    order = tuple(domain_order) if domain_order is not None else tuple(cluster.domains)
    if sorted(order) != sorted(cluster.domains):
        raise ValueError(f"domain order {order} must list each of {cluster.domains} once")
    # the dealing depends on the domain order only (not the degrees): worked out once per cluster and order
    dealt = cluster.__dict__.setdefault("_dealt_in_order", {})
    seq = dealt.get(order)
    if seq is None:
        ranks: list[int] = []
        for dom in order:
            for n in cluster.nodes:
                if n.domain == dom:
                    first = cluster.node_first_rank[n.index]
                    ranks.extend(range(first, first + n.num_accelerators))
        seq = dealt[order] = tuple(ranks)
    return Placement(dims, seq, order)


def place_replicas(cluster: Cluster, dims: ParallelDims, domain_order: Sequence[Domain] | None = None,
                   together: int = 1) -> Placement:
    """Deal whole pipelines domain by domain, ``together`` replicas at a time: stage ``s`` of the next
    ``together`` replicas (their ``tp*cp`` ranks each) takes the next ``together*tp*cp`` launch ranks, stage after
    stage. Each pipeline (and its TP and CP groups) stays inside one domain when the domain sizes allow; every
    stage's DP groups span the domains instead (heterogeneous data parallelism: replicas on faster devices take
    more micro-batches). ``together = 1``: a node holds consecutive stages of one replica (pipeline sends inside
    it); ``together`` = a node's ranks / (tp*cp): a node holds one stage of that many replicas, so every DP group
    has that many members on each node and reduces inside it first. With pp == 1 it is :func:`place`'s dealing."""
    if together < 1 or dims.dp % together:
        raise ValueError(f"together={together} must divide dp={dims.dp}")
    stage_dealt = place(cluster, dims, domain_order)
    seq = stage_dealt.rank_of_canonical          # launch ranks in domain order
    S, tc = dims.stage_size, dims.tp * dims.cp
    out = [0] * dims.world_size
    i = 0
    for block in range(0, dims.dp, together):
        for s in range(dims.pp):
            for d in range(block, block + together):
                first = s * S + d * tc
                out[first:first + tc] = seq[i:i + tc]
                i += tc
    return Placement(dims, tuple(out), stage_dealt.domain_order, "replica", together)


def default_placement(cluster: Cluster, dims: ParallelDims) -> Placement:
    """What Megatron-Core and DeepSpeed do by themselves: logical rank == launch rank (in the framework's order)."""
    check_dims(cluster, dims)
    rank_of_canonical = [0] * dims.world_size
    for framework_rank, canonical_rank in enumerate(dims.to_canonical()):
        rank_of_canonical[canonical_rank] = framework_rank
    return Placement(dims, tuple(rank_of_canonical), tuple(cluster.domains))


def stage_domains(cluster: Cluster, placement: Placement) -> list[list[Domain]]:
    """Domains each pipeline stage touches (more than one: its DP groups cross a boundary)."""
    out = []
    for s in range(placement.dims.pp):
        doms: list[Domain] = []
        for r in placement.stage_ranks(s):
            d = cluster.node_of(r).domain
            if d not in doms:
                doms.append(d)
        out.append(doms)
    return out


def cluster_transport(cluster: Cluster, ranks: Sequence[int]) -> str:
    """The transport rule (:func:`het_plugin.core.ranks.transport.transport_rule`) over a Cluster's nodes: what
    a communicator over launch ranks ``ranks`` uses. (A Plan asks the same rule over its node table:
    ``Plan.rule_transport``.)"""
    members = (cluster.nodes[i] for i in {cluster.rank_node[r] for r in ranks})
    return transport_rule((Member(n.name, n.cluster, n.vendor) for n in members),
                          lambda a, b: cluster.cluster_link(a, b).kind)


def multinet_transport(cluster: Cluster, ranks: Sequence[int]) -> str:
    """The transport rule where the NCCL build joins networks in one communicator (NVIDIA/nccl's cross-dc
    branch: see het_plugin.core.nccl_version): a one-vendor group across fabrics is 'multinet' where a fabric
    holds two or more of its nodes."""
    members = (cluster.nodes[i] for i in {cluster.rank_node[r] for r in ranks})
    return transport_rule((Member(n.name, n.cluster, n.vendor) for n in members),
                          lambda a, b: cluster.cluster_link(a, b).kind, multinet=True)


def stock_multinet_transport(cluster: Cluster, ranks: Sequence[int]) -> str:
    """What a plain framework run gets with today's NCCL set up well where the build joins networks
    (``NCCL_ALLNET_ENABLE=1``, each fabric's IDs in ``NCCL_IB_HCA``): every communicator on its own fabric, one
    spanning fabrics on NCCL's multi-network rings; the frameworks have no way past vendors, so those groups are
    charged as het_plugin's shim would run them (the same in both lines)."""
    return multinet_transport(cluster, ranks)


def baseline_transport(cluster: Cluster, ranks: Sequence[int]) -> str:
    """What a plain framework run gets with a released NCCL (none joins IB and RoCE HCAs, or two fabrics over TCP,
    in one communicator: docs/gpu-assumptions.md): with IB and RoCE mixed, or clusters joined by Ethernet, users
    force NCCL onto sockets for every communicator."""
    t = cluster_transport(cluster, ranks)
    if t in RDMA and needs_global_socket(cluster):
        return "socket"
    return t


def stock_transport(multinet: bool):
    """The baseline's transport function: :func:`stock_multinet_transport` where the NCCL build joins networks,
    else :func:`baseline_transport` (sockets everywhere once one group must cross)."""
    return stock_multinet_transport if multinet else baseline_transport


def needs_global_socket(cluster: Cluster) -> bool:
    """True when one process-wide NCCL network setting cannot serve every group: fabrics of two kinds,
    or clusters joined only by Ethernet."""
    kinds = {n.fabric.type for n in cluster.nodes}
    kinds |= {link.kind for link in cluster.links.values()}
    return len(kinds) > 1
