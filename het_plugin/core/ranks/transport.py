"""The transport rule: which network a communicator over some nodes should use. Pure, one place.

The planner (over a :class:`~het_plugin.core.inputs.cluster.Cluster`), the Plan (over its node table and link
kinds, at run time) and the cross-vendor shim (for its vendor subgroups) all ask this one function, so
a group's transport cannot depend on who asks.

Transports: 'local' (one node: NVLink/xGMI/shared memory); 'ib' / 'roce' (every node pair of the group
joined by one RDMA fabric kind: inside one cluster, or across clusters whose link is that same RDMA
kind); 'socket' (some pair crosses Ethernet, or IB meets RoCE -- NCCL cannot join both in one
communicator); 'host-staged' (members on more than one accelerator vendor: NCCL and RCCL cannot share a
communicator, so it goes through het_plugin's shim); 'multinet' (one vendor's group across fabrics, when the NCCL
build joins networks in one communicator -- ``NCCL_ALLNET_ENABLE=1`` with fabric IDs, see
het_plugin.core.nccl_version.NcclBuild: RDMA inside each fabric, TCP between them, rings ordered by fabric;
only asked for with ``multinet=True`` and only where a fabric holds two or more of the group's nodes: with one
node per side every hop that leaves a node crosses anyway, and sockets alone carry it as well).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterable, Literal, Optional

TransportName = Literal["local", "ib", "roce", "socket", "host-staged", "multinet"]


class Transport:
    """The transports by name. Plans, profiles and messages hold the plain strings; code names them here."""
    LOCAL: TransportName = "local"
    IB: TransportName = "ib"
    ROCE: TransportName = "roce"
    SOCKET: TransportName = "socket"
    HOST_STAGED: TransportName = "host-staged"
    MULTINET: TransportName = "multinet"


TRANSPORTS: tuple[TransportName, ...] = (Transport.LOCAL, Transport.IB, Transport.ROCE, Transport.SOCKET,
                                         Transport.HOST_STAGED, Transport.MULTINET)
RDMA: tuple[TransportName, ...] = (Transport.IB, Transport.ROCE)
# Transports whose traffic rides the Ethernet NICs: NCCL's Socket network, or the shim's host hop.
OVER_SOCKETS: frozenset[TransportName] = frozenset({Transport.SOCKET, Transport.HOST_STAGED})


@dataclass(frozen=True)
class Member:
    """What the rule reads about one node of a group."""
    node: str
    cluster: str
    vendor: str


# link_kind(a, b): the link kind between clusters a and b; link_kind(a, a) is cluster a's fabric kind.
LinkKind = Callable[[str, str], str]


# Vendors whose collective library has multi-network communicators in some build (NVIDIA/nccl's cross-dc
# branch); RCCL has none (docs/gpu-assumptions.md).
MULTINET_VENDORS = frozenset({"nvidia"})


def transport_rule(members: Iterable[Member], link_kind: LinkKind, multinet: bool = False) -> TransportName:
    """The transport of a communicator whose members sit on ``members`` (see the module docstring);
    ``multinet``: the NCCL build joins networks in one communicator."""
    by_node = {m.node: m for m in members}
    if len(by_node) <= 1:
        return Transport.LOCAL
    if len({m.vendor for m in by_node.values()}) > 1:
        return Transport.HOST_STAGED
    clusters = sorted({m.cluster for m in by_node.values()})
    kinds = {link_kind(c, c) for c in clusters}
    kinds.update(link_kind(a, b) for a, b in itertools.combinations(clusters, 2))
    if len(kinds) == 1 and next(iter(kinds)) in RDMA:
        return next(iter(kinds))
    if multinet and spans_with_depth(by_node.values()) and next(iter(by_node.values())).vendor in MULTINET_VENDORS:
        return Transport.MULTINET
    return Transport.SOCKET


def spans_with_depth(members: Iterable[Member]) -> bool:
    """More than one cluster, and some cluster holds two or more of the nodes (its hops can stay on RDMA)."""
    per_cluster: dict[str, int] = {}
    for m in members:
        per_cluster[m.cluster] = per_cluster.get(m.cluster, 0) + 1
    return len(per_cluster) > 1 and max(per_cluster.values()) > 1


def pair_key(a: str, b: str) -> str:
    """How a Plan names the link between two clusters: the names sorted, joined by '|'."""
    return "|".join(sorted((a, b)))


# ---- what each transport is called by the communication libraries -----------------------------------
# (pure data: the runtime's group policy and the pre-flight's rules both read these)

ENV_GLOO_IFNAMES = "HET_PLUGIN_GLOO_IFNAMES"   # transport=ifname,... : gloo's interface per transport

# Groups whose transport is 'host-staged' (spanning vendors) are created with this backend, which
# ``import het_plugin.comm`` registers (imported only when such a group exists).
SHIM_BACKEND = "het_shim"

# Only 'Socket' is forced (groups that cross fabrics): an RDMA group keeps NCCL's own choice -- its default order
# is an external network plugin, then IB, then Socket (NVIDIA/nccl v2.30.7-1 src/plugin/net.cc ncclNetInit) --
# because the RDMA network is not called 'IB' everywhere (RCCL on AMD AINIC: 'IB-CAST' / 'ROCM-IB'; AWS libfabric,
# HPC-X register their own). A cluster file may name its fabric's network (fabric.nccl_net): forced then.
SOCKET_NET = "Socket"            # NCCL's built-in socket network (src/transport/net_socket.cc)
RDMA_TRANSPORTS = RDMA
SOCKET_TRANSPORTS = tuple(sorted(OVER_SOCKETS))


def nccl_net_name(transport: str, rdma_net: Optional[str] = None) -> Optional[str]:
    """The net_name forced on an NCCL communicator of ``transport``: 'Socket' for groups crossing fabrics;
    ``rdma_net`` (the cluster file's ``fabric.nccl_net``) for RDMA groups, None there when undeclared (NCCL's
    default order picks the site's plugin, then IB); None for 'local' (NVLink/shared memory: no NIC) and for
    'multinet' (NCCL_ALLNET_ENABLE=1 loads every network and picks per peer: forcing one would undo it)."""
    if transport in OVER_SOCKETS:
        return SOCKET_NET
    if transport in RDMA:
        return rdma_net
    return None

