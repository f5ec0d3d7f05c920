"""The environment NCCL's multi-network communicators need, and its checks. Pure: settings in, findings out.

What NCCL reads (NVIDIA/nccl branch ``cross-dc``, commit 18a07eee, version 2.26.2; no release carries it, see
het_plugin.core.nccl_version and docs/gpu-assumptions.md):

* ``NCCL_ALLNET_ENABLE=1`` (src/include/net.h, default 0): every network plugin loaded per communicator; CollNet is
  then not loaded (src/plugin/net.cc ncclNetInit: "NCCL_ALLNET_ENABLE=1, ignore CollNet");
* ``NCCL_IB_HCA`` entries ``device:port:fabricId`` (src/misc/utils.cc parseIfList); the IB plugin reads a fabric ID
  as ``dcId * NCCL_IB_FABRICID_MAXRAIL + railId`` (MAXRAIL default 1<<62, so an ID below 1<<48 is a rail of data
  center 0) and calls two devices disconnected when their rails differ, the same data center (DCL0) or two
  (DCL1) when they match (src/transport/net_ib.cc ncclIbgetNetPath). Without an ID a port gets
  ``NCCL_IB_FABRICID_DEFAULT`` (1<<60) on InfiniBand, ``NCCL_ROCE_FABRICID_DEFAULT`` (1<<61) on RoCE: IB and RoCE
  apart, but two separate IB fabrics (or two RoCE ones) on one rail, so NCCL would try RDMA between them;
* ``NCCL_SCATTER_XDC`` (src/graph/connect.cc, default 1): each channel crosses between data centers on other nodes.

het_plugin gives each cluster's RDMA fabric its own rail (clusters joined by an RDMA link of their own kind share
one): RDMA inside each, NCCL's Socket network between them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

from .nccl_env import Refusal
from .nccl_version import CROSS_DC_BASE, NcclBuild, Version, version_text

ALLNET = "NCCL_ALLNET_ENABLE"
IB_HCA = "NCCL_IB_HCA"
MAXRAIL = "NCCL_IB_FABRICID_MAXRAIL"
SCATTER = "NCCL_SCATTER_XDC"
COLLNET = "NCCL_COLLNET_ENABLE"
ALGO = "NCCL_ALGO"
KEYS = (ALLNET, IB_HCA, MAXRAIL, SCATTER, COLLNET, ALGO)

DEFAULT_MAXRAIL = 1 << 62
DEFAULT_FABRIC_ID = {"ib": 1 << 60, "roce": 1 << 61}
RDMA_KINDS = ("ib", "roce")
KIND_TEXT = {"ib": "InfiniBand", "roce": "RoCE"}


@dataclass(frozen=True)
class Finding:
    """One problem with the environment: ``error`` (NCCL would fail or hang) or ``warning``."""
    level: str
    variable: str
    value: Optional[str]
    problem: str
    fix: str
    nodes: tuple[str, ...] = ()

    def text(self) -> str:
        seen = "unset" if self.value is None else repr(self.value)
        return f"{self.variable} ({seen}): {self.problem}\n  fix: {self.fix}"


# ---- what to set -----------------------------------------------------------------------------------------

def fabric_ids(cluster) -> dict[str, int]:
    """Cluster -> the rail its RDMA fabric gets (0, 1, ...); clusters joined by an RDMA link of their own kind
    are one fabric and share it. Clusters without an RDMA fabric are left out."""
    kind = {n.cluster: n.fabric.type for n in cluster.nodes}
    parent = {c: c for c in cluster.cluster_names if kind.get(c) in RDMA_KINDS}

    def root(c: str) -> str:
        while parent[c] != c:
            c = parent[c]
        return c
    for pair, link in cluster.links.items():
        a, b = sorted(pair)
        if a in parent and b in parent and kind[a] == kind[b] == link.kind:
            parent[root(b)] = root(a)
    ids: dict[str, int] = {}
    out = {}
    for c in cluster.cluster_names:
        if c in parent:
            out[c] = ids.setdefault(root(c), len(ids))
    return out


def _devices(node) -> list[tuple[str, int, str]]:
    """(device, port, kind) of a cluster-file node's RDMA NICs (port 1 where the file names the device only)."""
    out = []
    for nic in node.nics:
        if nic.type in RDMA_KINDS:
            for dev in nic.devices:
                name, _, port = dev.partition(":")
                out.append((name, int(port) if port.isdigit() else 1, nic.type))
    return out


def multinet_settings(cluster) -> dict[str, dict[str, str]]:
    """Node -> the variables NCCL's multi-network communicators need there: ``NCCL_ALLNET_ENABLE=1``, the node's
    RDMA ports with its fabric's ID in ``NCCL_IB_HCA`` (nodes whose file lists them), ``NCCL_SCATTER_XDC=1``."""
    ids = fabric_ids(cluster)
    out: dict[str, dict[str, str]] = {}
    for n in cluster.nodes:
        s = {ALLNET: "1"}
        devices = _devices(n)
        if devices and n.cluster in ids:
            s[IB_HCA] = "=" + ",".join(f"{d}:{p}:{ids[n.cluster]}" for d, p, _ in devices)
        s[SCATTER] = "1"
        out[n.name] = s
    return out


# ---- reading NCCL_IB_HCA ---------------------------------------------------------------------------------

def hca_entries(value: Optional[str]) -> list[tuple[str, Optional[int], Optional[int]]]:
    """``NCCL_IB_HCA`` -> (name, port or None, fabric ID or None) per entry ('=' and '^' prefixes dropped: an
    exclusion list gives no IDs)."""
    if value is None:
        return []
    text = value.strip()
    if text.startswith("^"):
        return []
    text = text.lstrip("=")
    out = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, *rest = item.split(":")
        port = int(rest[0]) if rest and rest[0].strip().isdigit() else None
        fid = int(rest[1]) if len(rest) > 1 and rest[1].strip().isdigit() else None
        out.append((name, port, fid))
    return out


def _rail(fid: int, maxrail: int) -> tuple[int, int]:
    """(data center, rail) as the IB plugin reads a fabric ID (a default ID is its own rail of data center 0)."""
    if fid in DEFAULT_FABRIC_ID.values():
        return 0, fid
    return fid // maxrail, fid % maxrail


# ---- the checks --------------------------------------------------------------------------------------------

def check_build(build: Optional[NcclBuild], loaded: Optional[Version], needed: bool) -> list[Finding]:
    """The NCCL the job loads, where a plan relies on multi-network communicators (``needed``). ``build``: what
    the user declared (``--nccl-version``); ``loaded``: the version torch reports (a cross-dc build reports the
    release it branched from, 2.26.2, so a version can refuse but not confirm)."""
    if not needed:
        return []
    fix = ("load a build of NVIDIA/nccl's cross-dc branch (no release has multi-network communicators yet), or "
           "re-plan for the NCCL you load: `het-plugin plan ... --nccl-version VERSION` puts groups across fabrics "
           "back on sockets")
    if build is not None and not build.multinet:
        return [Finding("error", "NCCL version", build.text, f"the plan puts groups across fabrics on NCCL's "
                        f"multi-network communicator, which NCCL {build.text} does not have", fix)]
    if build is not None:       # declared a build that has them
        return []
    if loaded is None:
        return [Finding("warning", "NCCL version", None, "the NCCL this job loads is unknown here; the plan needs a "
                        "build with multi-network communicators (NCCL_ALLNET_ENABLE)", fix)]
    if tuple(loaded) != CROSS_DC_BASE:
        return [Finding("error", "NCCL version", version_text(loaded), f"the plan needs NCCL's multi-network "
                        f"communicators; NCCL {version_text(loaded)} is a release without them (only the cross-dc "
                        f"branch, version {version_text(CROSS_DC_BASE)}, has them)", fix)]
    return [Finding("warning", "NCCL version", version_text(loaded), "2.26.2 is both a release without "
                    "multi-network communicators and what the cross-dc branch reports", "check that NCCL_DEBUG=INFO "
                    "prints 'NCCL_ALLNET_ENABLE=1, ignore CollNet' (only the cross-dc build does)")]


def check_env(cluster, env_of: Mapping[str, Mapping[str, str]], needed: bool) -> list[Finding]:
    """The environment of each node (``env_of``: node name -> its variables) for multi-network communicators:
    ALLNET on where the plan needs it, collNet/SHARP asked for under ALLNET, ``NCCL_IB_HCA`` without fabric IDs
    where NCCL's defaults join separate fabrics, and fabric IDs that put IB and RoCE ports (or two fabrics) on
    one rail."""
    out: list[Finding] = []
    nodes = [n for n in cluster.nodes if n.name in env_of]
    allnet_nodes = [n.name for n in nodes if (env_of[n.name].get(ALLNET) or "0").strip() not in ("", "0")]
    if needed:
        off = [n.name for n in nodes if n.name not in allnet_nodes]
        if off:
            out.append(Finding("error", ALLNET, env_of[off[0]].get(ALLNET), "the plan puts groups across fabrics on "
                               "NCCL's multi-network communicator, which NCCL builds only with NCCL_ALLNET_ENABLE=1; "
                               "without it such a group has no network that reaches every peer",
                               f"export {ALLNET}=1 on every node (`het-plugin check --format env --multinet`)",
                               tuple(off)))
    if not allnet_nodes and not needed:
        return out
    out += _check_collnet(env_of, allnet_nodes)
    out += _check_fabric_ids(cluster, env_of, allnet_nodes)
    return out


def _check_collnet(env_of, allnet_nodes) -> list[Finding]:
    out = []
    for name in allnet_nodes:
        e = env_of[name]
        algo = (e.get(ALGO) or "").strip()
        if algo and all("collnet" in a.lower() for a in algo.lstrip("^").split(",") if a) and not algo.startswith("^"):
            out.append(Finding("error", ALGO, algo, "only CollNet (SHARP) algorithms are allowed, but under "
                               "NCCL_ALLNET_ENABLE=1 NCCL does not load CollNet, so no algorithm is left",
                               f"unset {ALGO} (or allow Ring/Tree), or run without multi-network communicators",
                               (name,)))
            break
        if (e.get(COLLNET) or "").strip() == "1":
            out.append(Finding("warning", COLLNET, "1", "CollNet/SHARP is asked for (Megatron's "
                               "--sharp-enabled-group sets it too), but NCCL ignores CollNet under "
                               "NCCL_ALLNET_ENABLE=1: the data-parallel all-reduce runs on rings and trees",
                               f"unset {COLLNET} (or drop --sharp-enabled-group), or keep SHARP and do not use "
                               "multi-network communicators", (name,)))
            break
    return out


def _check_fabric_ids(cluster, env_of, allnet_nodes) -> list[Finding]:
    out: list[Finding] = []
    ids = fabric_ids(cluster)
    by_name = {n.name: n for n in cluster.nodes}
    rails: dict[int, list[tuple[str, str, str, int]]] = {}     # rail -> (cluster, kind, node, data center)
    missing: list[str] = []
    for name in allnet_nodes:
        node, e = by_name[name], env_of[name]
        try:
            maxrail = int(e.get(MAXRAIL) or DEFAULT_MAXRAIL)
        except ValueError:
            out.append(Finding("error", MAXRAIL, e.get(MAXRAIL), "is not a number", f"unset {MAXRAIL}", (name,)))
            continue
        given = {d: fid for d, _, fid in hca_entries(e.get(IB_HCA))}
        for dev, _, kind in _devices(node):
            fid = given.get(dev)
            if fid is None:
                if e.get(IB_HCA) is not None:
                    missing.append(name)
                fid = DEFAULT_FABRIC_ID[kind]
            dc, rail = _rail(fid, maxrail)       # connected whenever the rails match (DCL0 or DCL1)
            rails.setdefault(rail, []).append((node.cluster, kind, name, dc))
    seen_pairs = set()
    for rail, users in rails.items():
        fabrics = {ids.get(c, c) for c, _, _, _ in users}
        if len(fabrics) < 2:
            continue
        kinds = sorted({k for _, k, _, _ in users})
        clusters = sorted({c for c, _, _, _ in users})
        dcs = sorted({d for _, _, _, d in users})
        key = tuple(clusters)
        if key in seen_pairs:
            continue
        seen_pairs.add(key)
        names = tuple(dict.fromkeys(n for _, _, n, _ in users))
        shown = env_of[names[0]].get(IB_HCA)
        what = ("InfiniBand and RoCE ports" if len(kinds) > 1 else f"{KIND_TEXT[kinds[0]]} ports of separate fabrics")
        default = rail in DEFAULT_FABRIC_ID.values()
        out.append(Finding("error", IB_HCA, shown,
                           f"{what} of clusters {' and '.join(clusters)} are on one rail (fabric ID "
                           f"{'NCCL default ' if default else ''}{rail}"
                           f"{', data centers ' + ' and '.join(map(str, dcs)) if len(dcs) > 1 else ''}), so "
                           "NCCL would try RDMA between them, which cannot connect",
                           "give each fabric its own fabric ID (rail) in NCCL_IB_HCA, e.g. "
                           + "; ".join(f"{c}: {ids.get(c)}" for c in clusters if c in ids)
                           + " (`het-plugin check --format env --multinet` prints each node's line)", names))
    if missing and not out:
        names = tuple(dict.fromkeys(missing))
        out.append(Finding("warning", IB_HCA, env_of[names[0]].get(IB_HCA), "lists ports without fabric IDs; "
                           "NCCL then keeps InfiniBand and RoCE apart by its defaults, but any fabric added later of "
                           "a kind already present would share their rail",
                           "write each port as device:port:fabricId (`het-plugin check --format env --multinet`)",
                           names))
    return out


def findings_for_plan(plan, cluster, env_of: Mapping[str, Mapping[str, str]], *, loaded: Optional[Version] = None,
                      build: Optional[NcclBuild] = None) -> list[Finding]:
    """Every multi-network finding for a plan (``plan.multinet``: it relies on them) over ``cluster``'s nodes."""
    needed = bool(getattr(plan, "multinet", False))
    return check_build(build, loaded, needed) + check_env(cluster, env_of, needed)


def split(findings: Iterable[Finding]) -> tuple[list[Finding], list[Finding]]:
    """(errors, warnings)."""
    fs = list(findings)
    return [f for f in fs if f.level == "error"], [f for f in fs if f.level != "error"]


def merge(result, settings: Mapping[str, Mapping[str, str]], findings: Iterable[Finding]):
    """Add the multi-network settings to a pre-flight result's nodes (``NCCL_IB_HCA`` with fabric IDs replaces the
    single-fabric one) and its findings to its refusals and warnings; returns ``result``."""
    for name, report in result.nodes.items():
        report.settings.update(settings.get(name, {}))
    for f in findings:
        if f.level == "error":
            seen = "unset" if f.value is None else repr(f.value)
            result.refusals.append(Refusal(f.variable, f"{seen}: {f.problem}", f.fix, f.nodes))
        else:
            result.warnings.append(f"{f.variable}: {f.problem} (fix: {f.fix})")
    return result
