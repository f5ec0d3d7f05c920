"""Reading NICs from sysfs, the way the kernel lays it out, under a configurable root.

RDMA ports: ``<root>/class/infiniband/<dev>/ports/<n>/{link_layer,rate,state}``. Ethernet NICs:
``<root>/class/net/<if>/{type,operstate,speed}``. The root is an argument (or ``HET_PLUGIN_SYSFS_ROOT``)
so tests read fabricated trees written in the same format. Everything seen but not used is reported
with the reason, so a surprising result can be explained from the output alone.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

ENV_SYSFS_ROOT = "HET_PLUGIN_SYSFS_ROOT"

ARPHRD_ETHER = "1"
ARPHRD_INFINIBAND = "32"
ARPHRD_LOOPBACK = "772"
# /sys/class/net/<if>/speed is in Mb/s; drivers without a speed report -1 (or its unsigned twin).
_UNKNOWN_SPEEDS = {-1, 0, 0xFFFFFFFF, 0xFFFF}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec\b")


@dataclass(frozen=True)
class RdmaPort:
    """One ACTIVE RDMA port; ``type`` is ib (link_layer InfiniBand) or roce (link_layer Ethernet)."""
    device: str
    port: int
    type: str
    gbps: float
    rate: str                    # the kernel's text, e.g. "200 Gb/sec (4X HDR)"
    netdevs: tuple[str, ...] = ()  # RoCE: the Ethernet interface under it; IB: its IPoIB interface


@dataclass(frozen=True)
class EthernetNic:
    """A physical (or bonded) Ethernet interface that is up; ``gbps`` None when the driver won't say."""
    name: str
    gbps: Optional[float]
    operstate: str


def resolve_root(sysfs_root: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(sysfs_root or env.get(ENV_SYSFS_ROOT) or "/sys")


def read_attr(path: Path) -> Optional[str]:
    """A sysfs attribute's text, or None when absent or unreadable (sysfs answers EINVAL for some)."""
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def natural_key(name: str):
    """mlx5_2 before mlx5_10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def parse_rate(text: Optional[str]) -> Optional[float]:
    """'200 Gb/sec (4X HDR)' -> 200.0; anything else -> None."""
    if not text:
        return None
    m = _RATE.match(text)
    if not m:
        return None
    value = float(m.group(1))
    return value if value > 0 else None


def port_state(text: Optional[str]) -> Optional[str]:
    """'4: ACTIVE' -> 'ACTIVE'."""
    if text is None:
        return None
    return text.split(":", 1)[-1].strip().upper()


def _port_netdevs(port_dir: Path, dev_dir: Path) -> tuple[str, ...]:
    names: list[str] = []
    ndevs = port_dir / "gid_attrs" / "ndevs"
    if ndevs.is_dir():
        for entry in sorted(ndevs.iterdir(), key=lambda p: natural_key(p.name)):
            value = read_attr(entry)
            if value and value not in names:
                names.append(value)
    if not names and (dev_dir / "device" / "net").is_dir():
        names = sorted((p.name for p in (dev_dir / "device" / "net").iterdir()), key=natural_key)
    return tuple(names)


def scan_rdma(root: Path) -> tuple[list[RdmaPort], list[str]]:
    """ACTIVE RDMA ports under ``root``, and a line for every port left out (with why)."""
    ports: list[RdmaPort] = []
    ignored: list[str] = []
    base = root / "class" / "infiniband"
    if not base.is_dir():
        return ports, ignored
    for dev_dir in sorted(base.iterdir(), key=lambda p: natural_key(p.name)):
        ports_dir = dev_dir / "ports"
        if not ports_dir.is_dir():
            ignored.append(f"{dev_dir.name}: no ports directory")
            continue
        for port_dir in sorted(ports_dir.iterdir(), key=lambda p: natural_key(p.name)):
            where = f"{dev_dir.name} port {port_dir.name}"
            if not port_dir.name.isdigit():
                continue
            state_text = read_attr(port_dir / "state")
            state = port_state(state_text)
            if state != "ACTIVE":
                ignored.append(f"{where}: state {state_text!r}, not ACTIVE" if state_text is not None
                               else f"{where}: state unreadable")
                continue
            layer = read_attr(port_dir / "link_layer")
            kind = {"infiniband": "ib", "ethernet": "roce"}.get((layer or "").lower())
            if kind is None:
                ignored.append(f"{where}: link_layer {layer!r}, neither InfiniBand nor Ethernet")
                continue
            rate_text = read_attr(port_dir / "rate")
            gbps = parse_rate(rate_text)
            if gbps is None:
                ignored.append(f"{where}: rate {rate_text!r} is not '<number> Gb/sec ...'")
                continue
            ports.append(RdmaPort(dev_dir.name, int(port_dir.name), kind, gbps, rate_text or "",
                                  _port_netdevs(port_dir, dev_dir)))
    return ports, ignored


def _speed_gbps(text: Optional[str]) -> Optional[float]:
    try:
        mbps = int(text) if text is not None else None
    except ValueError:
        return None
    if mbps is None or mbps in _UNKNOWN_SPEEDS or mbps < 0:
        return None
    return mbps / 1000.0


def _is_bond(if_dir: Path) -> bool:
    return (if_dir / "bonding").is_dir()


def scan_ethernet(root: Path, rdma_netdevs: frozenset[str] = frozenset()) -> tuple[list[EthernetNic], list[str], list[str]]:
    """Up physical Ethernet interfaces, the ones left out (with why), and notes.

    Loopback and virtual interfaces (no ``device`` link: bridges, veth, ifb, tun...) are left out;
    bonds count as one NIC and their members are left out. Interfaces that carry an active RoCE port
    are listed with that port instead.
    """
    nics: list[EthernetNic] = []
    ignored: list[str] = []
    notes: list[str] = []
    base = root / "class" / "net"
    if not base.is_dir():
        return nics, ignored, [f"no {base} directory: no network interfaces seen"]
    for if_dir in sorted(base.iterdir(), key=lambda p: natural_key(p.name)):
        name = if_dir.name
        kind = read_attr(if_dir / "type")
        if kind == ARPHRD_LOOPBACK:
            ignored.append(f"{name}: loopback")
            continue
        if not (if_dir / "device").exists() and not _is_bond(if_dir):
            ignored.append(f"{name}: virtual interface (no device link)")
            continue
        if kind == ARPHRD_INFINIBAND:
            ignored.append(f"{name}: IPoIB interface (type 32), counted with its InfiniBand port")
            continue
        if kind != ARPHRD_ETHER:
            ignored.append(f"{name}: type {kind!r}, not Ethernet (1)")
            continue
        master = if_dir / "master"
        if master.exists() and _is_bond(master.resolve()):
            ignored.append(f"{name}: member of bond {master.resolve().name} (counted there)")
            continue
        operstate = read_attr(if_dir / "operstate") or "unreadable"
        if not (operstate == "up" or (operstate == "unknown" and read_attr(if_dir / "carrier") == "1")):
            ignored.append(f"{name}: operstate {operstate!r}, not up")
            continue
        if name in rdma_netdevs:
            notes.append(f"{name}: carries an active RoCE port (listed with that port)")
            continue
        gbps = _speed_gbps(read_attr(if_dir / "speed"))
        if gbps is None:
            notes.append(f"{name}: speed unknown (the driver reports none, as virtio NICs do)")
        nics.append(EthernetNic(name, gbps, operstate))
    return nics, ignored, notes


def roce_v2_gid_index(root: Path, device: str, port: int) -> Optional[int]:
    """The lowest GID index of a RoCE port whose type is "RoCE v2" and whose GID is an IPv4-mapped address
    (``::ffff:a.b.c.d``, what NCCL picks by default); None when there is none or sysfs does not say.

    Reads ``<root>/class/infiniband/<dev>/ports/<n>/gid_attrs/types/<i>`` and ``.../gids/<i>``.
    """
    port_dir = Path(root) / "class" / "infiniband" / device / "ports" / str(port)
    types = port_dir / "gid_attrs" / "types"
    if not types.is_dir():
        return None
    for entry in sorted(types.iterdir(), key=lambda p: natural_key(p.name)):
        if not entry.name.isdigit() or (read_attr(entry) or "").lower() != "roce v2":
            continue
        gid = (read_attr(port_dir / "gids" / entry.name) or "").lower()
        if gid.startswith("0000:0000:0000:0000:0000:ffff:"):
            return int(entry.name)
    return None
