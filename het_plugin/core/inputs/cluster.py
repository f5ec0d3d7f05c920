"""Cluster description: the YAML schema (pydantic) and the flat view the planner uses.

A cluster file lists *clusters*; each has one network fabric inside it (``ib``, ``roce`` or
``ethernet``) and one or more groups of identical nodes. Clusters are joined by *links*
(Ethernet unless stated). Ranks map to nodes in launch order: node-major, nodes in file order,
``local_rank`` inside the node (what torchrun does), unless ``launch.node_order`` says otherwise.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Annotated, Literal, Optional, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PositiveInt, field_validator,
                      model_validator)

from . import catalog
from .catalog import Accelerator
from ..errors import ConfigError
from .yamlio import read_data, read_text, validate, with_line

FabricType = Literal["ib", "roce", "ethernet"]
RDMA = ("ib", "roce")

# ---- limits (docs/user-guide.md, "Limits"): past them the planner would take minutes or the numbers mean nothing
MAX_NODES = 16_384                   # nodes in one file (all clusters together)
MAX_ACCELERATORS_PER_NODE = 1_024
MAX_ACCELERATORS = 131_072           # ranks in one file; planning this many takes about half a minute
MAX_CLUSTERS = 256                   # every pair of clusters has a link: 32,640 pairs at most
GBPS_RANGE = (0.001, 1e6)            # Gbit/s: 1 Mbit/s .. 1 Pbit/s
LATENCY_US_MAX = 1e6                 # one second
TFLOPS_RANGE = (0.001, 1e6)
MEMORY_GIB_MAX = 2.0 ** 20
EFFICIENCY_MIN = 0.01
PRICE_MAX = 1e6                      # per device-hour, in whatever currency the file uses


def not_bool(v):
    """YAML reads true/yes/on as a boolean, which pydantic would take as the number 1; .inf and .nan are no
    measurement either."""
    if isinstance(v, bool):
        raise ValueError(f"got {v!r}, a boolean (YAML reads true/false/yes/no/on/off as booleans) | fix: write a "
                         "number")
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"got {v!r}, not a finite number | fix: use a finite number (not .inf or .nan)")
    return v


def at_most(limit: int, unit: str, fix: str):
    def check(v: int) -> int:
        if v > limit:
            raise ValueError(f"{v} {unit} is over the limit of {limit:,} | fix: {fix}")
        return v
    return AfterValidator(check)


def in_range(lo: float, hi: float, unit: str, fix: str):
    def check(v: float) -> float:
        if not lo <= v <= hi:
            u = f" {unit}" if unit else ""
            raise ValueError(f"{v:g}{u} is outside the range het_plugin takes, {lo:g} .. {hi:g}{u} | fix: {fix}")
        return v
    return AfterValidator(check)


Gbps = Annotated[float, BeforeValidator(not_bool), Field(gt=0, allow_inf_nan=False),
                 in_range(*GBPS_RANGE, "Gbit/s", "give the speed in Gbit/s, e.g. 25 for 25GbE, 200 for HDR InfiniBand")]
LatencyUs = Annotated[float, BeforeValidator(not_bool), Field(ge=0, allow_inf_nan=False),
                      in_range(0, LATENCY_US_MAX, "us", "give the one-way latency in microseconds, e.g. 2 (IB) or 50 "
                                                        "(Ethernet between sites)")]
Efficiency = Annotated[float, BeforeValidator(not_bool), Field(gt=0, le=1, allow_inf_nan=False),
                       in_range(EFFICIENCY_MIN, 1, "", "give the sustained fraction of peak, e.g. 0.5")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FabricSpec(_Strict):
    """The network inside one cluster; ``gbps`` is what one node can inject into it.

    Optional, for what NCCL cannot infer (RDMA fabrics only; ``het-plugin check`` prints the settings):
    ``nccl_net``: the name the fabric's NCCL/RCCL network plugin registers ('IB', 'IB-CAST', 'AWS Libfabric',
    ...), forced as the ``netName`` of the cluster's RDMA communicators (unset: NCCL's default order);
    ``ib_tc``: the traffic class its switches expect (``NCCL_IB_TC``); ``rail_only``: a rail-only fabric (NIC i
    of one node reaches only NIC i of the others), so NCCL must not cross rails (``NCCL_CROSS_NIC=0``).
    """
    type: FabricType
    gbps: Gbps
    latency_us: LatencyUs = 5.0
    nccl_net: Optional[Annotated[str, Field(min_length=1, max_length=63, pattern=r"^\S(.*\S)?$")]] = None
    ib_tc: Optional[Annotated[int, BeforeValidator(not_bool), Field(ge=0, le=255)]] = None
    rail_only: bool = False

    @model_validator(mode="after")
    def _rdma_only(self):
        used = [k for k in OPTIONAL_FABRIC_KEYS if getattr(self, k) not in (None, False)]
        if used and self.type not in RDMA:
            raise ValueError(f"{', '.join(used)} describe an RDMA fabric, this one is {self.type!r} | fix: drop "
                             f"{used[0]} (NCCL uses sockets on Ethernet fabrics) or correct the fabric type")
        return self

    def digest_fields(self) -> dict:
        """What the cluster digest hashes: the optional keys only when set (older digests stay)."""
        return self.model_dump(exclude={k for k in OPTIONAL_FABRIC_KEYS if getattr(self, k) in (None, False)})


OPTIONAL_FABRIC_KEYS = ("nccl_net", "ib_tc", "rail_only")


class NicSpec(_Strict):
    type: FabricType
    gbps: Gbps
    devices: list[str] = []      # RDMA device names, e.g. mlx5_0 (what NCCL_IB_HCA takes)
    interfaces: list[str] = []   # netdev names, e.g. eth0 (what NCCL/GLOO_SOCKET_IFNAME take)


class AcceleratorSpec(_Strict):
    """A part not in the catalog (or a catalog part with different numbers)."""
    name: str
    vendor: str
    memory_gib: Annotated[float, BeforeValidator(not_bool), Field(gt=0, allow_inf_nan=False),
                          in_range(0, MEMORY_GIB_MAX, "GiB", "give the device memory in GiB, e.g. 80")]
    peak_tflops: Annotated[float, BeforeValidator(not_bool), Field(gt=0, allow_inf_nan=False),
                           in_range(*TFLOPS_RANGE, "TFLOPS", "give dense BF16 TFLOPS per device, e.g. 989 (H100)")]
    intra_node_gbps: Gbps = 256.0
    efficiency: Efficiency = 0.5


class NodeGroupSpec(_Strict):
    count: Annotated[PositiveInt, BeforeValidator(not_bool),
                     at_most(MAX_NODES, "nodes", f"a file describes at most {MAX_NODES:,} nodes; plan a part of the "
                                                 "cluster, or check the number")]
    accelerator: Union[str, AcceleratorSpec]
    accelerators_per_node: Annotated[PositiveInt, BeforeValidator(not_bool),
                                     at_most(MAX_ACCELERATORS_PER_NODE, "accelerators per node",
                                             "give the devices of one node (one rank each), e.g. 8")]
    intra_node_gbps: Optional[Gbps] = None   # default: the catalog's NVLink/xGMI/PCIe figure
    efficiency: Optional[Efficiency] = None
    nics: list[NicSpec] = []
    hostnames: Optional[list[str]] = None
    # What one device of this group costs per hour (any currency, the same in the whole file); the catalog has no
    # prices. Unset: the report shows no cost and ``--objective cost`` refuses the file.
    price_per_device_hour: Optional[Annotated[float, BeforeValidator(not_bool), Field(allow_inf_nan=False),
                                              in_range(0, PRICE_MAX, "per device-hour",
                                                       "give what one device of this group costs per hour, e.g. "
                                                       "2.5 (one currency for the whole file)")]] = None

    @field_validator("accelerator")
    @classmethod
    def _known(cls, v):
        if isinstance(v, str):
            try:
                catalog.lookup(v)
            except KeyError:
                raise ValueError(f"unknown accelerator {v!r} | fix: use one of {catalog.known_names()}, "
                                 "or describe it: {name, vendor, memory_gib, peak_tflops}") from None
        return v

    @model_validator(mode="after")
    def _hostnames_match(self):
        if self.hostnames is not None and len(self.hostnames) != self.count:
            raise ValueError(f"hostnames lists {len(self.hostnames)} names for count: {self.count} nodes"
                             " | fix: give one hostname per node or drop hostnames")
        return self

    def resolved_accelerator(self) -> Accelerator:
        if isinstance(self.accelerator, str):
            base = catalog.lookup(self.accelerator)
        else:
            a = self.accelerator
            base = Accelerator(a.name, a.vendor.lower(), a.memory_gib, a.peak_tflops, a.intra_node_gbps,
                               a.efficiency)
        changes = {}
        if self.intra_node_gbps is not None:
            changes["intra_node_gbps"] = self.intra_node_gbps
        if self.efficiency is not None:
            changes["efficiency"] = self.efficiency
        if changes:
            base = replace(base, **changes)
        return base


class ClusterSpec(_Strict):
    name: str
    fabric: FabricSpec
    nodes: list[NodeGroupSpec] = Field(min_length=1)


class LinkSpec(_Strict):
    """A link between two clusters; ``gbps`` is per node (what one node can push across)."""
    between: tuple[str, str]
    type: FabricType = "ethernet"
    gbps: Gbps
    latency_us: LatencyUs = 50.0


class LaunchSpec(_Strict):
    order: Literal["node-major"] = "node-major"
    node_order: Optional[list[str]] = None   # node names in launch order (node_rank 0, 1, ...)


class ClusterFile(_Strict):
    name: str = "cluster"
    clusters: list[ClusterSpec] = Field(min_length=1)
    links: list[LinkSpec] = []
    launch: LaunchSpec = LaunchSpec()

    @model_validator(mode="after")
    def _sizes(self):
        """Totals, before anything is built per node (a count of 10^9 nodes used to build 10^9 objects)."""
        if len(self.clusters) > MAX_CLUSTERS:
            raise ValueError(f"{len(self.clusters)} clusters are over the limit of {MAX_CLUSTERS} | field: clusters"
                             " | fix: describe fewer clusters (nodes of one fabric belong in one cluster)")
        nodes = sum(g.count for c in self.clusters for g in c.nodes)
        if nodes > MAX_NODES:
            raise ValueError(f"{nodes:,} nodes in all (the counts added up) are over the limit of {MAX_NODES:,} | "
                             "field: clusters | fix: plan a part of the cluster, or check the counts")
        ranks = sum(g.count * g.accelerators_per_node for c in self.clusters for g in c.nodes)
        if ranks > MAX_ACCELERATORS:
            raise ValueError(f"{ranks:,} accelerators in all (count x accelerators_per_node, added up) are over the "
                             f"limit of {MAX_ACCELERATORS:,} | field: clusters | fix: plan a part of the cluster, or "
                             "check count and accelerators_per_node")
        return self

    @model_validator(mode="after")
    def _references(self):
        names = [c.name for c in self.clusters]
        first: dict[str, int] = {}
        for i, name in enumerate(names):
            if first.setdefault(name, i) != i:
                raise ValueError(f"cluster name {name!r} is used twice (clusters[{first[name]}] and "
                                 f"clusters[{i}]) | field: clusters[{i}].name | fix: give every cluster a unique name")
        seen: dict[frozenset, int] = {}
        for i, link in enumerate(self.links):
            for end in link.between:
                if end not in first:
                    raise ValueError(f"link names unknown cluster {end!r} | field: links[{i}].between"
                                     f" | fix: use one of {names}")
            if link.between[0] == link.between[1]:
                raise ValueError(f"link joins cluster {link.between[0]!r} to itself | field: links[{i}].between"
                                 " | fix: name two different clusters (the fabric inside a cluster is its 'fabric')")
            key = frozenset(link.between)
            if key in seen:
                raise ValueError(f"clusters {list(link.between)} are linked twice (links[{seen[key]}] and links[{i}])"
                                 f" | field: links[{i}] | fix: keep one link per pair of clusters")
            seen[key] = i
        fabric = {c.name: c.fabric for c in self.clusters}
        for i, link in enumerate(self.links):
            a, b = (fabric[e] for e in link.between)
            if link.type in RDMA and a.nccl_net != b.nccl_net:
                raise ValueError(f"clusters {list(link.between)} share an {link.type} link but name different NCCL "
                                 f"networks ({a.nccl_net!r} and {b.nccl_net!r}); one communicator has one network | "
                                 f"field: links[{i}] | fix: give both fabrics the same nccl_net, or make the link "
                                 "ethernet")
        return self


# ----------------------------------------------------------------------------------------------
# The flat view: nodes in launch order, ranks, and the link between any two nodes.


@dataclass(frozen=True)
class Link:
    kind: str            # 'local' (same node), 'ib', 'roce', 'ethernet'
    gbps: float
    latency_us: float


@dataclass(frozen=True)
class Node:
    index: int                 # launch order (node_rank)
    name: str
    cluster: str
    fabric: FabricSpec
    accelerator: Accelerator
    num_accelerators: int
    nics: tuple[NicSpec, ...] = ()
    spec_path: str = ""        # where the file describes it, e.g. 'clusters[1].nodes[0]' (for error messages)
    price_per_device_hour: Optional[float] = None   # the node group's price (None: not given)

    @property
    def vendor(self) -> str:
        return self.accelerator.vendor

    @property
    def domain(self) -> tuple[str, str]:
        """Nodes of one domain share a fabric and a device type: DP and TP groups stay inside one."""
        return (self.cluster, self.accelerator.name)


@dataclass
class Cluster:
    """Nodes in launch order plus the links between clusters; built by :func:`load_cluster`."""
    name: str
    nodes: list[Node]
    links: dict[frozenset, Link]
    source: str = "<memory>"
    spec: Optional[ClusterFile] = field(default=None, repr=False)

    @cached_property
    def rank_node(self) -> list[int]:
        """Node index of every global rank (node-major launch order)."""
        return [n.index for n in self.nodes for _ in range(n.num_accelerators)]

    @cached_property
    def node_first_rank(self) -> list[int]:
        out, r = [], 0
        for n in self.nodes:
            out.append(r)
            r += n.num_accelerators
        return out

    @property
    def world_size(self) -> int:
        return sum(n.num_accelerators for n in self.nodes)

    def node_of(self, rank: int) -> Node:
        return self.nodes[self.rank_node[rank]]

    def local_rank(self, rank: int) -> int:
        return rank - self.node_first_rank[self.rank_node[rank]]

    @cached_property
    def cluster_names(self) -> list[str]:
        seen: list[str] = []
        for n in self.nodes:
            if n.cluster not in seen:
                seen.append(n.cluster)
        return seen

    @cached_property
    def domains(self) -> list[tuple[str, str]]:
        seen: list[tuple[str, str]] = []
        for n in self.nodes:
            if n.domain not in seen:
                seen.append(n.domain)
        return seen

    @cached_property
    def nccl_nets(self) -> dict[str, str]:
        """Cluster -> the NCCL network its RDMA fabric declares (``fabric.nccl_net``), where declared."""
        return {n.cluster: n.fabric.nccl_net for n in self.nodes if n.fabric.nccl_net}

    def cluster_link(self, a: str, b: str) -> Link:
        """Link between two clusters (or the fabric inside one when ``a == b``)."""
        if a == b:
            fab = next(n.fabric for n in self.nodes if n.cluster == a)
            return Link(fab.type, fab.gbps, fab.latency_us)
        return self.links[frozenset((a, b))]

    def link(self, a: Node, b: Node) -> Link:
        if a.index == b.index:
            return Link("local", a.accelerator.intra_node_gbps, 1.0)
        return self.cluster_link(a.cluster, b.cluster)

    @property
    def is_homogeneous(self) -> bool:
        """One fabric kind, one device type and no slower link between clusters."""
        if len(self.domains) > 1 and len({d[1] for d in self.domains}) > 1:
            return False
        fabrics = {(n.fabric.type, n.fabric.gbps) for n in self.nodes}
        if len(fabrics) > 1:
            return False
        if len(self.cluster_names) > 1:
            fab = self.nodes[0].fabric
            for link in self.links.values():
                if link.kind != fab.type or link.gbps < fab.gbps:
                    return False
        return True

    @cached_property
    def digest(self) -> str:
        """Content hash of what the planner reads (not of the file's formatting)."""
        payload = {
            "nodes": [[n.name, n.cluster, n.fabric.digest_fields(), n.accelerator.__dict__, n.num_accelerators]
                      + ([n.price_per_device_hour] if n.price_per_device_hour is not None else [])   # only when set
                      for n in self.nodes],
            "links": sorted([sorted(k), v.__dict__] for k, v in self.links.items()),
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _default_link(spec: ClusterFile, a: ClusterSpec, b: ClusterSpec, source: str) -> Link:
    """Without a stated link, clusters talk over the slower of their Ethernet NICs."""
    speeds = [nic.gbps for c in (a, b) for g in c.nodes for nic in g.nics if nic.type == "ethernet"]
    eth_fabrics = [c.fabric.gbps for c in (a, b) if c.fabric.type == "ethernet"]
    speeds += eth_fabrics
    if not speeds:
        raise ConfigError(f"no link between clusters {a.name!r} and {b.name!r}, and no Ethernet NIC to assume",
                          source=source, field="links",
                          fix=f"add  links: [{{between: [{a.name}, {b.name}], gbps: 25}}]  (Gbit/s per node)")
    return Link("ethernet", min(speeds), 50.0)


def build_cluster(spec: ClusterFile, source: str = "<memory>") -> Cluster:
    nodes: list[Node] = []
    for ci, c in enumerate(spec.clusters):
        k = 0
        for gi, g in enumerate(c.nodes):
            acc = g.resolved_accelerator()
            for i in range(g.count):
                name = g.hostnames[i] if g.hostnames else f"{c.name}-{k}"
                nodes.append(Node(0, name, c.name, c.fabric, acc, g.accelerators_per_node, tuple(g.nics),
                                  f"clusters[{ci}].nodes[{gi}]", g.price_per_device_hour))
                k += 1
    names = [n.name for n in nodes]
    dup = sorted(n for n, k in Counter(names).items() if k > 1)     # linear: 16,384 nodes in milliseconds
    if dup:
        raise ConfigError(f"node names repeat: {dup}", source=source, field="clusters[*].nodes[*].hostnames",
                          fix="give every node a unique hostname (generated names are <cluster>-<i>)")
    if spec.launch.node_order is not None:
        order = spec.launch.node_order
        if sorted(order) != sorted(names):
            missing = sorted(set(names) - set(order))
            extra = sorted(set(order) - set(names))
            repeated = sorted(n for n, k in Counter(order).items() if k > 1)
            problems = [f"{label} {items}" for label, items in
                        (("missing", missing), ("unknown", extra), ("repeated", repeated)) if items]
            raise ConfigError(f"node_order must list every node exactly once ({'; '.join(problems)})",
                              source=source, field="launch.node_order",
                              fix=f"list each of the {len(names)} node names once; names are the hostnames, or "
                                  "<cluster>-<i> when hostnames are not given (e.g. " + ", ".join(names[:3]) + ")")
        by_name = {n.name: n for n in nodes}
        nodes = [by_name[n] for n in order]
    nodes = [replace(n, index=i) for i, n in enumerate(nodes)]

    links: dict[frozenset, Link] = {}
    for ls in spec.links:
        links[frozenset(ls.between)] = Link(ls.type, ls.gbps, ls.latency_us)
    for i, a in enumerate(spec.clusters):
        for b in spec.clusters[i + 1:]:
            key = frozenset((a.name, b.name))
            if key not in links:
                links[key] = _default_link(spec, a, b, source)
    return Cluster(spec.name, nodes, links, source, spec)


def load_cluster(path: str | Path) -> Cluster:
    """Read, validate and flatten a cluster file; every problem is a ConfigError naming the field."""
    text = read_text(path, "cluster file")
    spec = validate(ClusterFile, read_data(path, text), str(path), text)
    try:
        return build_cluster(spec, str(path))
    except ConfigError as exc:
        raise with_line(exc, text) from None


def cluster_from_dict(data: dict, source: str = "<dict>") -> Cluster:
    return build_cluster(validate(ClusterFile, data, source), source)
