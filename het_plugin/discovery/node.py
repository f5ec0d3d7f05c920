"""One node's view: its RDMA ports, Ethernet NICs and accelerator, and the fabric they imply."""
from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional

from . import accelerator as accel
from .accelerator import AcceleratorInfo
from .sysfs import EthernetNic, RdmaPort, resolve_root, scan_ethernet, scan_rdma

ENV_NODE_NAME = "HET_PLUGIN_NODE_NAME"
ENV_FABRIC_NAME = "HET_PLUGIN_FABRIC_NAME"
RDMA_PREFERENCE = ("ib", "roce")   # on a tie in bandwidth, InfiniBand wins


@dataclass(frozen=True)
class NodeView:
    """What one node has. Ranks on the same node produce equal views (nothing here is per-rank)."""
    name: str
    rdma: tuple[RdmaPort, ...] = ()
    ethernet: tuple[EthernetNic, ...] = ()
    accelerator: Optional[AcceleratorInfo] = None
    accelerator_count: Optional[int] = None
    fabric_name: Optional[str] = None       # HET_PLUGIN_FABRIC_NAME: which physical fabric this node is on
    ignored: tuple[str, ...] = ()           # seen but not used, each with the reason
    notes: tuple[str, ...] = ()
    sysfs_root: str = "/sys"

    def hardware(self) -> tuple:
        """What must agree between ranks of one node: not the notes, since virtual interfaces come and go."""
        return (self.rdma, self.ethernet, self.accelerator, self.accelerator_count, self.fabric_name)

    @property
    def rdma_bandwidth(self) -> dict[str, float]:
        """Aggregate Gbit/s of the active ports, per RDMA type (NCCL spreads over all HCAs)."""
        out: dict[str, float] = {}
        for p in self.rdma:
            out[p.type] = out.get(p.type, 0.0) + p.gbps
        return out

    @property
    def fabric_type(self) -> str:
        """ib or roce when the node has an active RDMA port (the faster type), else ethernet."""
        bw = self.rdma_bandwidth
        if not bw:
            return "ethernet"
        return max(RDMA_PREFERENCE, key=lambda t: (bw.get(t, -1.0), -RDMA_PREFERENCE.index(t)))

    @property
    def fabric_gbps(self) -> Optional[float]:
        """What the node injects into its fabric; for Ethernet the fastest NIC (None: unknown)."""
        if self.fabric_type != "ethernet":
            return self.rdma_bandwidth[self.fabric_type]
        return self.ethernet_gbps

    @property
    def ethernet_gbps(self) -> Optional[float]:
        """Fastest known speed of the plain Ethernet NICs (None when no NIC reports a speed)."""
        known = [n.gbps for n in self.ethernet if n.gbps is not None]
        return max(known) if known else None

    @property
    def rdma_netdevs(self) -> frozenset[str]:
        return frozenset(d for p in self.rdma for d in p.netdevs)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "NodeView":
        acc = data.get("accelerator")
        return cls(
            name=data["name"],
            rdma=tuple(RdmaPort(**{**p, "netdevs": tuple(p.get("netdevs", ()))}) for p in data.get("rdma", ())),
            ethernet=tuple(EthernetNic(**n) for n in data.get("ethernet", ())),
            accelerator=AcceleratorInfo(**acc) if acc else None,
            accelerator_count=data.get("accelerator_count"),
            fabric_name=data.get("fabric_name"),
            ignored=tuple(data.get("ignored", ())),
            notes=tuple(data.get("notes", ())),
            sysfs_root=data.get("sysfs_root", "/sys"),
        )

    def render(self) -> str:
        """The text ``het-plugin discover`` prints."""
        lines = [f"node: {self.name}   (sysfs root: {self.sysfs_root})"]
        gbps = self.fabric_gbps
        fabric = f"{self.fabric_type} {_g(gbps)}" if gbps is not None else f"{self.fabric_type} (speed unknown)"
        if self.fabric_name:
            fabric += f"  [fabric name {self.fabric_name!r} from {ENV_FABRIC_NAME}]"
        lines.append(f"fabric: {fabric}")
        lines.append("rdma ports:" if self.rdma else "rdma ports: none active")
        for p in self.rdma:
            nd = f", netdevs {', '.join(p.netdevs)}" if p.netdevs else ""
            lines.append(f"  {p.device} port {p.port}: {p.type} {_g(p.gbps)} ({p.rate}){nd}")
        lines.append("ethernet:" if self.ethernet else "ethernet: none up")
        for n in self.ethernet:
            lines.append(f"  {n.name}: {_g(n.gbps) if n.gbps is not None else 'speed unknown'}, {n.operstate}")
        a = self.accelerator
        count = f"x{self.accelerator_count}" if self.accelerator_count is not None else "count unknown"
        if a is None:
            lines.append(f"accelerator: none detected  (on a node with devices torch cannot see: "
                         f"{accel.OVERRIDE_FIX})")
        else:
            what = a.name if a.in_catalog else f"{a.name} (not in the catalog)"
            via = f"from {accel.ENV_ACCELERATOR}" if a.source == "env" else f"torch: {a.device_name!r}"
            lines.append(f"accelerator: {what}, vendor {a.vendor}, {count}  ({via})")
        for title, items in (("ignored", self.ignored), ("notes", self.notes)):
            if items:
                lines.append(f"{title}:")
                lines.extend(f"  {item}" for item in items)
        return "\n".join(lines)


def _g(gbps: Optional[float]) -> str:
    return "?" if gbps is None else f"{gbps:g} Gbit/s"


def node_name(name: Optional[str] = None, env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    return name or env.get(ENV_NODE_NAME) or socket.gethostname()


def discover_node(sysfs_root: str | os.PathLike | None = None, *, name: Optional[str] = None,
                  env: Mapping[str, str] | None = None, torch_module=None, device_index: int = 0) -> NodeView:
    """Read this node's NICs (sysfs) and accelerator (torch, or the environment's override).

    ``sysfs_root`` defaults to ``HET_PLUGIN_SYSFS_ROOT`` or /sys; ``name`` to ``HET_PLUGIN_NODE_NAME`` or
    the hostname. A bad override raises ConfigError; a machine without accelerators is not an error.
    """
    env = os.environ if env is None else env
    root = resolve_root(sysfs_root, env)
    ports, ignored = scan_rdma(root)
    netdevs = frozenset(d for p in ports for d in p.netdevs)
    nics, eth_ignored, notes = scan_ethernet(root, netdevs)
    info, count, acc_notes = accel.detect(env, torch_module, device_index)
    fabric_name = env.get(ENV_FABRIC_NAME, "").strip() or None
    return NodeView(node_name(name, env), tuple(ports), tuple(nics), info, count, fabric_name,
                    tuple(ignored + eth_ignored), tuple(notes + acc_notes), str(root))
