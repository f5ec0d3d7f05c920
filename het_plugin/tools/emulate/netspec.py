"""What the emulated network looks like: namespaces, interfaces, addresses and shaped rates (pure data).

One network namespace per node. Every node has ``eth0`` on one shared Ethernet bridge; nodes of an
RDMA cluster (ib/roce) also have ``fab0`` on their cluster's own bridge, which reaches only that
cluster. Rates are the cluster file's Gbit/s divided by ``scale`` (real bits per emulated bit), so a tiny
model on a CPU keeps a real job's compute:communication proportion (see docs/emulator.md).

Addresses come only from 198.18.0.0/15 (RFC 2544, benchmarking): Ethernet 198.18.<cluster>.<node+1>/16,
fabric 198.19.<cluster>.<node+1>/24, so one u32 filter per destination *cluster* (a /24) shapes traffic
to every node of that cluster.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from ...core.inputs.cluster import RDMA, Cluster, Node
from ...core.errors import ConfigError
from .speed import CpuShare, SpeedInput, cpu_shares

ETH_IF = "eth0"
FAB_IF = "fab0"
NS_PREFIX = "hpemu-"        # namespaces: hpemu-<run id>-n<node>
LINK_PREFIX = "hp"          # root-namespace bridges/veths: hp<run id>...
RUN_ID_RE = re.compile(r"^[0-9a-f]{6}$")
MAX_NODES = 250             # one /24 per cluster
MAX_CLUSTERS = 250


@dataclass(frozen=True)
class ShapedClass:
    """Egress to the destinations in ``dst`` (a CIDR, or None: everything else) and ``also`` (more CIDRs sharing
    the class: another cluster's fabric addresses reached over Ethernet, see ``make_layout``'s multinet) at
    ``kbit`` kbit/s."""
    dst: Optional[str]
    kbit: int
    label: str
    also: tuple[str, ...] = ()

    @property
    def destinations(self) -> tuple[str, ...]:
        return (self.dst, *self.also) if self.dst is not None else ()


@dataclass(frozen=True)
class Interface:
    name: str                    # inside the namespace (eth0 / fab0)
    peer: str                    # the root-namespace end, a port of ``bridge``
    bridge: str
    address: str                 # a.b.c.d
    prefix: int
    kbit: int                    # the NIC's rate (egress ceiling and ingress cap)
    classes: tuple[ShapedClass, ...]   # per-destination egress classes (first match wins, last is default)


@dataclass(frozen=True)
class EmuNode:
    index: int
    name: str
    cluster: str
    fabric: str                  # ib | roce | ethernet
    namespace: str
    num_ranks: int
    first_rank: int
    eth: Interface
    fab: Optional[Interface]
    extra: tuple[Interface, ...] = ()     # extra networks joining every node (benchmark references)
    cpu: Optional[CpuShare] = None        # compute speed (a cpu cgroup named like the namespace); None: unshaped

    @property
    def routes(self) -> tuple[str, ...]:
        """CIDRs routed on-link over eth0: other clusters' fabrics reached over Ethernet (multinet), the
        destinations its Ethernet classes shape besides their own."""
        return tuple(d for c in self.eth.classes for d in c.also)

    @property
    def cgroup(self) -> str:
        """The node's cpu cgroup name (under the controller's mount), when its compute is shaped."""
        return self.namespace

    @property
    def interfaces(self) -> tuple[Interface, ...]:
        return ((self.eth,) if self.fab is None else (self.eth, self.fab)) + self.extra

    def gloo_ifnames(self) -> str:
        """HET_PLUGIN_GLOO_IFNAMES for this node: which interface each plan transport uses."""
        items = []
        if self.fab is not None:
            items += [f"ib={FAB_IF}", f"roce={FAB_IF}"]
        if self.routes:      # multinet: bound to the fabric, a hop to another cluster leaves on Ethernet
            items.append(f"multinet={FAB_IF if self.fab is not None else ETH_IF}")
        items += [f"socket={ETH_IF}", f"host-staged={ETH_IF}", "local=lo"]
        return ",".join(items)


@dataclass(frozen=True)
class Layout:
    run_id: str
    scale: float
    nodes: tuple[EmuNode, ...]
    bridges: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())

    @property
    def world_size(self) -> int:
        return sum(n.num_ranks for n in self.nodes)

    @property
    def namespaces(self) -> list[str]:
        return [n.namespace for n in self.nodes]

    @property
    def master_addr(self) -> str:
        """Rank 0's Ethernet address: the rendezvous store lives in rank 0's namespace, like torchrun."""
        return self.nodes[0].eth.address

    def node_of_rank(self, rank: int) -> EmuNode:
        for n in self.nodes:
            if n.first_rank <= rank < n.first_rank + n.num_ranks:
                return n
        raise IndexError(rank)

    def describe(self) -> str:
        lines = [f"emulated network {self.run_id}: {len(self.nodes)} nodes, {self.world_size} ranks, "
                 f"bandwidth scale 1/{self.scale:g} (real Gbit/s -> emulated Mbit/s x {1000 / self.scale:g})"]
        for n in self.nodes:
            parts = [f"{ETH_IF} {n.eth.address} " + ", ".join(f"{c.label} {c.kbit / 1000:g} Mbit/s"
                                                              for c in n.eth.classes)]
            if n.fab is not None:
                reach = "other clusters' fabrics over eth0" if n.routes else "own cluster only"
                parts.append(f"{FAB_IF} {n.fab.address} {n.fabric} {n.fab.kbit / 1000:g} Mbit/s ({reach})")
            parts += [f"{x.name} {x.address} {x.kbit / 1000:g} Mbit/s (every node)" for x in n.extra]
            if n.cpu is not None:
                parts.append(f"compute speed {n.cpu.speed:.3g} ({n.cpu.cores_per_rank:.3g} core per rank: cpu quota "
                             f"{n.cpu.quota_us}/{n.cpu.period_us} us)")
            lines.append(f"  {n.name} [{n.cluster}] ranks {n.first_rank}..{n.first_rank + n.num_ranks - 1}: "
                         + "; ".join(parts))
        lines += [f"  note: {t}" for t in self.notes]
        return "\n".join(lines)


def kbit_of(gbps: float, scale: float) -> int:
    """Emulated rate for a real ``gbps``; at least 8 kbit/s so tc accepts it."""
    return max(8, int(round(gbps * 1e6 / scale)))


def ethernet_gbps(cluster: Cluster, node: Node) -> float:
    """What the node's Ethernet NIC carries: its Ethernet fabric, its stated Ethernet NIC, or its fastest link."""
    if node.fabric.type == "ethernet":
        return node.fabric.gbps
    nic = [n.gbps for n in node.nics if n.type == "ethernet"]
    if nic:
        return max(nic)
    links = [cluster.cluster_link(node.cluster, c).gbps for c in cluster.cluster_names if c != node.cluster]
    return max(links) if links else node.fabric.gbps


@dataclass(frozen=True)
class ExtraNetwork:
    """A network joining *every* node at ``gbps`` (real units), e.g. an all-RDMA reference for benchmarks."""
    ifname: str
    gbps: float


def make_layout(cluster: Cluster, run_id: str, scale: float, extra: tuple[ExtraNetwork, ...] = (),
                speeds: SpeedInput = None, cpu_per_rank: Optional[float] = None, multinet: bool = False) -> Layout:
    """The emulated network for ``cluster``; ``scale`` = real bits per emulated bit (1000: Gbit/s -> Mbit/s).

    ``multinet``: a node reaches another cluster's fabric addresses over its Ethernet (routed on-link on eth0,
    shaped as that cluster's Ethernet class), as NCCL's multi-network communicator routes a hop by where its peer
    is: a group bound to fab0 then keeps its hops inside a cluster on the fabric and crosses clusters on Ethernet.
    Off: a fabric address of another cluster is unreachable (a misrouted group fails instead of running).

    ``extra`` networks get their own bridge and the addresses 198.19.<250+i>.<node+1>/24. ``speeds``
    (``"catalog"`` or names to relative speeds) shapes each node's compute (see ``speed.cpu_shares``)."""
    if not RUN_ID_RE.match(run_id):
        raise ValueError(f"run id {run_id!r} must be 6 hex digits")
    if not scale > 0:
        raise ConfigError(f"scale must be > 0, got {scale}", field="scale",
                          fix="pass real bits per emulated bit, e.g. --scale 1000 (200 Gbit/s -> 200 Mbit/s)")
    clusters = cluster.cluster_names
    if len(clusters) > MAX_CLUSTERS or len(cluster.nodes) > MAX_NODES:
        raise ConfigError(f"{len(cluster.nodes)} nodes in {len(clusters)} clusters: the emulator handles at most "
                          f"{MAX_NODES} nodes", source=cluster.source, field="clusters",
                          fix="emulate a smaller cluster (one or two ranks per node is enough)")
    eth_bridge = f"{LINK_PREFIX}{run_id}E"
    bridges = [eth_bridge]
    fab_bridge = {}
    for k, c in enumerate(clusters):
        if any(n.fabric.type in RDMA for n in cluster.nodes if n.cluster == c):
            fab_bridge[c] = f"{LINK_PREFIX}{run_id}F{k}"
            bridges.append(fab_bridge[c])
    if len(extra) > 4 or len({x.ifname for x in extra} | {ETH_IF, FAB_IF, "lo"}) != len(extra) + 3:
        raise ConfigError(f"extra networks {[x.ifname for x in extra]}: at most 4, with names other than "
                          f"{ETH_IF}, {FAB_IF}, lo and each other", field="extra", fix="rename or drop some")
    for i, x in enumerate(extra):
        bridges.append(f"{LINK_PREFIX}{run_id}X{i}")
    cpu = cpu_shares(cluster, speeds, cpu_per_rank)
    seen = {c: 0 for c in clusters}
    nodes = []
    notes = ["latency is not emulated (this kernel has no netem): only bandwidth is shaped; "
             "real links' latency_us is ignored"]
    if cpu:
        notes.append("compute speed is a CPU quota per node, a ceiling: the speed ratios hold while the machine "
                     "has the cores to give every node its quota (keep it otherwise idle)")
    for node in cluster.nodes:
        k = clusters.index(node.cluster)
        j = seen[node.cluster]
        seen[node.cluster] += 1
        eth_kbit = kbit_of(ethernet_gbps(cluster, node), scale)
        classes = []
        for k2, other in enumerate(clusters):
            if other == node.cluster:
                continue
            link = cluster.cluster_link(node.cluster, other)
            if link.kind in RDMA:
                notes.append(f"link {node.cluster}-{other} is {link.kind}: emulated on the Ethernet bridge")
            fabric_there = (f"198.19.{k2}.0/24",) if multinet and other in fab_bridge else ()
            classes.append(ShapedClass(f"198.18.{k2}.0/24", min(eth_kbit, kbit_of(link.gbps, scale)),
                                       f"to {other}", fabric_there))
        classes.append(ShapedClass(None, eth_kbit, f"in {node.cluster}"))
        eth = Interface(ETH_IF, f"{LINK_PREFIX}{run_id}e{node.index}", eth_bridge, f"198.18.{k}.{j + 1}", 16,
                        eth_kbit, tuple(classes))
        fab = None
        if node.cluster in fab_bridge and node.fabric.type in RDMA:
            fk = kbit_of(node.fabric.gbps, scale)
            fab = Interface(FAB_IF, f"{LINK_PREFIX}{run_id}f{node.index}", fab_bridge[node.cluster],
                            f"198.19.{k}.{j + 1}", 24, fk, (ShapedClass(None, fk, node.fabric.type),))
        more = []
        for i, x in enumerate(extra):
            xk = kbit_of(x.gbps, scale)
            more.append(Interface(x.ifname, f"{LINK_PREFIX}{run_id}x{i}n{node.index}", f"{LINK_PREFIX}{run_id}X{i}",
                                  f"198.19.{250 + i}.{node.index + 1}", 24, xk, (ShapedClass(None, xk, x.ifname),)))
        nodes.append(EmuNode(node.index, node.name, node.cluster, node.fabric.type, f"{NS_PREFIX}{run_id}-n{node.index}",
                             node.num_accelerators, cluster.node_first_rank[node.index], eth, fab, tuple(more),
                             cpu[node.index] if cpu else None))
    return Layout(run_id, float(scale), tuple(nodes), tuple(bridges), tuple(dict.fromkeys(notes)))
