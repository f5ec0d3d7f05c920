"""The transport rule: which network a communicator over some nodes should use. Pure, one place.

The planner (over a :class:`~het_plugin.core.inputs.cluster.Cluster`), the Plan (over its node table and link
kinds, at run time) and the cross-vendor shim (for its vendor subgroups) all ask this one function, so
a group's transport cannot depend on who asks.

Transports: 'local' (one node: NVLink/xGMI/shared memory); 'ib' / 'roce' (every node pair of the group
joined by one RDMA fabric kind: inside one cluster, or across clusters whose link is that same RDMA
kind); 'socket' (some pair crosses Ethernet, or IB meets RoCE -- NCCL cannot join both in one
communicator); 'host-staged' (members on more than one accelerator vendor: NCCL and RCCL cannot share a
communicator, so it goes through het_plugin's shim).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterable, Literal, Optional

TransportName = Literal["local", "ib", "roce", "socket", "host-staged"]


class Transport:
    """The transports by name. Plans, profiles and messages hold the plain strings; code names them here."""
    LOCAL: TransportName = "local"
    IB: TransportName = "ib"
    ROCE: TransportName = "roce"
    SOCKET: TransportName = "socket"
    HOST_STAGED: TransportName = "host-staged"


TRANSPORTS: tuple[TransportName, ...] = (Transport.LOCAL, Transport.IB, Transport.ROCE, Transport.SOCKET,
                                         Transport.HOST_STAGED)
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


def transport_rule(members: Iterable[Member], link_kind: LinkKind) -> TransportName:
    """The transport of a communicator whose members sit on ``members`` (see the module docstring)."""
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
    return Transport.SOCKET


def pair_key(a: str, b: str) -> str:
    """How a Plan names the link between two clusters: the names sorted, joined by '|'."""
    return "|".join(sorted((a, b)))


# ---- what each transport is called by the communication libraries -----------------------------------
# (pure data: the runtime's group policy and the pre-flight's rules both read these)

ENV_GLOO_IFNAMES = "HET_PLUGIN_GLOO_IFNAMES"   # transport=ifname,... : gloo's interface per transport

# Groups whose transport is 'host-staged' (spanning vendors) are created with this backend, which
# ``import het_plugin.comm`` registers (imported only when such a group exists).
SHIM_BACKEND = "het_shim"

NCCL_NET_NAME = {Transport.IB: "IB", Transport.ROCE: "IB", Transport.SOCKET: "Socket", Transport.HOST_STAGED: "Socket"}


def nccl_net_name(transport: str) -> Optional[str]:
    """NCCL's net_name for a transport; None for 'local' (NVLink/shared memory: NCCL needs no NIC)."""
    return NCCL_NET_NAME.get(transport)

