"""Write fabricated sysfs trees in the kernel's layout, for discovery tests.

The layout mirrors a real machine: devices live under ``devices/pci0000:00/<pci address>/`` (RDMA
devices in ``infiniband/<dev>``, netdevs in ``net/<if>``, each with a ``device`` link back to the PCI
function), ``class/infiniband/<dev>`` and ``class/net/<if>`` are symlinks into ``devices``, virtual
interfaces live under ``devices/virtual/net`` without a ``device`` link, and attribute files hold what
the kernel prints (``4: ACTIVE``, ``200 Gb/sec (4X HDR)``, speed in Mb/s, a trailing newline).
"""
from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

# The kernel prints rate as "%d%s Gb/sec (%dX%s)" from deci-Gb/s (drivers/infiniband/core/sysfs.c).
RATES = {"HDR": "200 Gb/sec (4X HDR)", "NDR": "400 Gb/sec (4X NDR)", "EDR": "100 Gb/sec (4X EDR)",
         "FDR": "56 Gb/sec (4X FDR)", "XDR": "800 Gb/sec (4X XDR)", "SDR1X": "2.5 Gb/sec (1X SDR)",
         "FDR1X": "14 Gb/sec (1X FDR)", "EDR1X": "25 Gb/sec (1X EDR)"}
ACTIVE, DOWN, INIT = "4: ACTIVE", "1: DOWN", "2: INIT"


@dataclass
class Port:
    link_layer: str = "InfiniBand"           # or "Ethernet" (RoCE)
    rate: Optional[str] = RATES["HDR"]       # None: no rate file
    state: Optional[str] = ACTIVE
    phys_state: str = "5: LinkUp"
    netdev: Optional[str] = None             # RoCE: the Ethernet netdev in gid_attrs/ndevs


@dataclass
class Hca:
    name: str
    ports: list[Port] = field(default_factory=lambda: [Port()])
    netdevs: list["NetIf"] = field(default_factory=list)   # netdevs of the same PCI function


@dataclass
class NetIf:
    name: str
    speed: Optional[str] = "25000"   # Mb/s as the kernel prints it; None: no file; "EINVAL": unreadable
    operstate: str = "up"
    type: str = "1"                  # 1 Ethernet, 32 IPoIB, 772 loopback
    carrier: Optional[str] = "1"
    virtual: bool = False            # lives under devices/virtual/net, no device link
    bond: bool = False               # has a bonding/ directory
    master: Optional[str] = None     # name of the interface this one is enslaved to


def _write(path: Path, text: Optional[str]) -> None:
    if text is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    if text == "EINVAL":
        # sysfs answers read() with EINVAL for some attributes; a directory makes read_text() fail alike.
        path.mkdir(exist_ok=True)
        return
    path.write_text(text + "\n")


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent))


def write_tree(root: Path, hcas: Sequence[Hca] = (), netifs: Sequence[NetIf] = ()) -> Path:
    """Write the tree under ``root`` (created); returns ``root``."""
    root = Path(root)
    (root / "class" / "net").mkdir(parents=True, exist_ok=True)
    pci = 0x17
    for hca in hcas:
        pci_dir = root / "devices" / "pci0000:00" / f"0000:{pci:02x}:00.0"
        pci += 1
        dev_dir = pci_dir / "infiniband" / hca.name
        dev_dir.mkdir(parents=True)
        _link(dev_dir / "device", pci_dir)
        _write(dev_dir / "node_type", "1: CA")
        for i, port in enumerate(hca.ports, start=1):
            pdir = dev_dir / "ports" / str(i)
            pdir.mkdir(parents=True)
            _write(pdir / "link_layer", port.link_layer)
            _write(pdir / "rate", port.rate)
            _write(pdir / "state", port.state)
            _write(pdir / "phys_state", port.phys_state)
            (pdir / "gid_attrs" / "ndevs").mkdir(parents=True)
            for gid in range(4):   # a RoCE port shows its netdev on its used GID indices; unused ones,
                used = port.netdev and gid < 2   # and every index of an IB port, answer EINVAL
                _write(pdir / "gid_attrs" / "ndevs" / str(gid), port.netdev if used else "EINVAL")
        _link(root / "class" / "infiniband" / hca.name, dev_dir)
        for nif in hca.netdevs:
            _write_netif(root, nif, pci_dir)
    for nif in netifs:
        _write_netif(root, nif, None)
    return root


def _write_netif(root: Path, nif: NetIf, pci_dir: Optional[Path]) -> None:
    if nif.virtual or pci_dir is None and nif.bond:
        if_dir = root / "devices" / "virtual" / "net" / nif.name
    else:
        if pci_dir is None:
            pci_dir = root / "devices" / "pci0000:00" / f"0000:00:{zlib.crc32(nif.name.encode()) % 200 + 3:02x}.0"
        if_dir = pci_dir / "net" / nif.name
    if_dir.mkdir(parents=True)
    if not (nif.virtual or nif.bond):
        _link(if_dir / "device", if_dir.parent.parent)
    _write(if_dir / "type", nif.type)
    _write(if_dir / "operstate", nif.operstate)
    _write(if_dir / "speed", nif.speed)
    _write(if_dir / "carrier", nif.carrier)
    if nif.bond:
        (if_dir / "bonding").mkdir()
    _link(root / "class" / "net" / nif.name, if_dir)
    if nif.master:
        _link(if_dir / "master", root / "class" / "net" / nif.master)


# ---- whole nodes ----------------------------------------------------------------------------------

def loopback() -> NetIf:
    return NetIf("lo", speed="EINVAL", operstate="unknown", type="772", virtual=True)


def ib_node(root: Path, hcas: int = 4, rate: str = RATES["HDR"], eth_mbps: str = "25000",
            down: Sequence[int] = ()) -> Path:
    """InfiniBand HCAs mlx5_0.. (each with an IPoIB netdev), one 25 GbE eth0, lo; ``down``: HCA indices."""
    cards = [Hca(f"mlx5_{i}", [Port("InfiniBand", rate, DOWN if i in down else ACTIVE,
                                    "3: Disabled" if i in down else "5: LinkUp")],
                 [NetIf(f"ib{i}", speed=rate.split()[0].split(".")[0] + "000", type="32")]) for i in range(hcas)]
    return write_tree(root, cards, [NetIf("eth0", speed=eth_mbps), loopback(), NetIf("docker0", virtual=True)])


def roce_node(root: Path, hcas: int = 4, rate: str = RATES["HDR"], eth_mbps: str = "25000") -> Path:
    """RoCE NICs mlx5_0.. on netdevs ens1f0.., one 25 GbE eth0, lo."""
    cards = []
    for i in range(hcas):
        netdev = f"ens{i // 2 + 1}f{i % 2}"
        mbps = rate.split()[0].split(".")[0] + "000"
        cards.append(Hca(f"mlx5_{i}", [Port("Ethernet", rate, ACTIVE, netdev=netdev)], [NetIf(netdev, speed=mbps)]))
    return write_tree(root, cards, [NetIf("eth0", speed=eth_mbps), loopback()])


def ethernet_node(root: Path, mbps: str = "100000", name: str = "eth0") -> Path:
    return write_tree(root, (), [NetIf(name, speed=mbps), loopback(), NetIf("veth1a2b", virtual=True)])
