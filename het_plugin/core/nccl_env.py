"""Pre-flight for mixed NICs: refuse a launch whose NCCL environment contradicts the plan, before any
communicator exists, and derive the settings that make every node agree.

NCCL hangs instead of failing when the members of one communicator do not agree on the network: nodes
expose different HCAs, IB and RoCE HCAs meet in one communicator, interface names differ between nodes,
``NCCL_NET`` overrides the per-communicator ``netName`` het_plugin sets, or ``NCCL_IGNORE_NET_MISMATCH``
(NCCL's default: accept) lets ranks with different NIC counts proceed. het_plugin knows every node's NICs
and every group's transport, so :func:`preflight` checks them together. Pure: no sysfs, no torch, no store.

Inputs: the groups (:func:`groups_from_plan` / :func:`groups_from_cluster`), each node's NICs
(:class:`NodeNics`, from a discovery :class:`~het_plugin.discovery.NodeView` or a cluster file's ``nics``),
and the environment (one mapping for every node, as a launcher propagates it; ``node_env`` overrides per node).
How NCCL reads its name lists is ported in :mod:`het_plugin.core.nccl_names`; the result's ``export`` lines and
text are rendered by :mod:`het_plugin.views.nccl_env`.

NCCL semantics relied on (NCCL's "Environment Variables" documentation, docs/user-guide.md cites them):
``NCCL_IB_HCA`` and ``NCCL_SOCKET_IFNAME`` are comma-separated lists, prefix matches unless the list
starts with ``=`` (exact names), an exclude list when it starts with ``^`` (``^=`` both), IB entries
``<hca>[:<port>...]`` (no port: every port); ``NCCL_NET`` overrides ``netName`` in *all* communicators
(names "IB", "Socket", case-insensitive); ``NCCL_IB_GID_INDEX`` defaults to -1 (NCCL picks a RoCE v2
GID); ``NCCL_IGNORE_NET_MISMATCH`` defaults to 1 in NCCL's init.cc (mixed NIC counts are accepted), 0 makes
communicator init fail with "Detected mixed local Net device counts across ranks".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

from .errors import ConfigError
from .nccl_names import NameFilter, nccl_auto_interfaces, socket_ifname_value
from .ranks.transport import ENV_GLOO_IFNAMES, Member, OVER_SOCKETS, Transport, nccl_net_name, transport_rule
from .ranks.dims import format_ranks
from .nccl_version import CONNECT_CHECK, GID_AUTO, MERGE_NICS, NET_MISMATCH_VAR, at_least, normalize, version_text
from .plan import Plan

RDMA_KINDS = ("ib", "roce")
KIND_TEXT = {"ib": "InfiniBand", "roce": "RoCE"}
SOURCE = "pre-flight"


# ---- inputs ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Hca:
    """One RDMA port of a node. ``port`` None: unknown (a cluster file naming the device only)."""
    device: str
    port: Optional[int]
    kind: str                              # 'ib' or 'roce'
    netdevs: tuple[str, ...] = ()          # RoCE: its Ethernet interface; IB: its IPoIB interface
    gid_index: Optional[int] = None        # RoCE: the RoCE v2 IPv4 GID index, when known

    @property
    def label(self) -> str:
        """The device, with ``:port`` when it is not port 1 (NCCL_IB_HCA's ``mlx5_0`` means every port)."""
        return self.device if self.port in (None, 1) else f"{self.device}:{self.port}"


@dataclass(frozen=True)
class NodeNics:
    """What the checks read about one node: its RDMA ports and its plain Ethernet interfaces (fastest first)."""
    name: str
    hcas: tuple[Hca, ...] = ()
    ethernet: tuple[str, ...] = ()
    source: str = "discovery"             # 'discovery' or 'cluster file'

    def of_kind(self, kind: str) -> list[Hca]:
        return [h for h in self.hcas if h.kind == kind]

    @property
    def interfaces(self) -> list[str]:
        """Every interface a socket could bind: plain Ethernet, RoCE netdevs, IPoIB."""
        out = list(self.ethernet)
        out += [d for h in self.hcas for d in h.netdevs if d not in out]
        return out

    @classmethod
    def from_view(cls, view, gid_index: Optional[Mapping[tuple[str, int], int]] = None) -> "NodeNics":
        """From a discovery NodeView; ``gid_index`` maps (device, port) to the RoCE v2 GID index read there."""
        gids = gid_index or {}
        hcas = tuple(Hca(p.device, p.port, p.type, tuple(p.netdevs), gids.get((p.device, p.port)))
                     for p in view.rdma)
        eth = sorted(view.ethernet, key=lambda n: -(n.gbps or 0.0))
        return cls(view.name, hcas, tuple(n.name for n in eth), "discovery")

    @classmethod
    def from_cluster_node(cls, node) -> "NodeNics":
        """From a cluster file's node (its ``nics``: devices as ``mlx5_0`` or ``mlx5_0:1``, interfaces)."""
        hcas: list[Hca] = []
        eth: list[tuple[float, str]] = []
        for nic in node.nics:
            if nic.type in RDMA_KINDS:
                ifs = list(nic.interfaces)
                for i, dev in enumerate(nic.devices):
                    name, _, port = dev.partition(":")
                    netdevs = (ifs[i],) if len(ifs) == len(nic.devices) else ()
                    hcas.append(Hca(name, int(port) if port.isdigit() else None, nic.type, netdevs))
            else:
                eth += [(nic.gbps, i) for i in nic.interfaces]
        eth.sort(key=lambda t: -t[0])
        return cls(node.name, tuple(hcas), tuple(i for _, i in eth), "cluster file")


@dataclass(frozen=True)
class GroupUse:
    """A communicator het_plugin will create: a label for messages, its nodes, its transport, and the RDMA
    network its clusters declare (``fabric.nccl_net``; None: NCCL's default)."""
    label: str
    nodes: tuple[str, ...]
    transport: str
    rdma_net: Optional[str] = None

    @property
    def net_name(self) -> Optional[str]:
        """The net_name het_plugin forces on it (het_plugin.runtime.netselect), None where NCCL keeps its own choice."""
        return nccl_net_name(self.transport, self.rdma_net) if len(self.nodes) > 1 else None


def groups_from_plan(plan) -> list[GroupUse]:
    """Every group of the plan (one entry per distinct node set and transport) and the world group."""
    seen: dict[tuple, GroupUse] = {}
    for kind, groups in plan.groups.items():
        for g in groups:
            nodes = tuple(dict.fromkeys(plan.node_of(r).name for r in g.ranks))
            key = (nodes, g.transport)
            if key not in seen:
                seen[key] = GroupUse(f"{kind} group of ranks {_ranks(g.ranks)}", nodes, g.transport,
                                     plan.rdma_net_of(g.ranks))
    world = list(range(plan.world_size))
    nodes = tuple(dict.fromkeys(plan.node_of(r).name for r in world))
    seen.setdefault((nodes, plan.rule_transport(world)), GroupUse("world group", nodes, plan.rule_transport(world),
                                                                   plan.rdma_net_of(world)))
    return list(seen.values())


def groups_from_cluster(cluster) -> list[GroupUse]:
    """Without a plan, every group the planner can make: per domain, per cluster, per pair of clusters, world."""

    def rule(nodes) -> str:
        return transport_rule((Member(n.name, n.cluster, n.vendor) for n in nodes),
                              lambda a, b: cluster.cluster_link(a, b).kind)
    out: dict[tuple, GroupUse] = {}

    def add(label, nodes):
        names = tuple(n.name for n in nodes)
        nets = {n.fabric.nccl_net for n in nodes}
        if len(names) > 1:
            out.setdefault((names, rule(nodes)), GroupUse(label, names, rule(nodes),
                                                          nets.pop() if len(nets) == 1 else None))
    for cname, acc in cluster.domains:
        add(f"groups inside domain {cname}/{acc}", [n for n in cluster.nodes if n.domain == (cname, acc)])
    names = cluster.cluster_names
    for c in names:
        add(f"groups inside cluster {c}", [n for n in cluster.nodes if n.cluster == c])
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            add(f"groups across clusters {a} and {b}", [n for n in cluster.nodes if n.cluster in (a, b)])
    add("world group", list(cluster.nodes))
    return list(out.values())


def _ranks(ranks: Sequence[int]) -> str:
    return format_ranks(list(ranks))


# ---- result ----------------------------------------------------------------------------------------

@dataclass
class Refusal:
    field: str
    problem: str
    fix: str
    nodes: tuple[str, ...] = ()

    def text(self) -> str:
        return f"{self.field}: {self.problem}\n  fix: {self.fix}"

    def to_dict(self) -> dict[str, Any]:
        return {"field": self.field, "problem": self.problem, "fix": self.fix, "nodes": list(self.nodes)}


@dataclass
class NodeReport:
    name: str
    cluster: Optional[str]
    source: str
    transports: list[str]                       # transports of the groups this node is in (not 'local')
    uses: dict[str, list[str]]                  # transport -> HCAs / interfaces it will use
    settings: dict[str, str]                    # derived environment


@dataclass
class Preflight:
    nodes: dict[str, NodeReport]
    refusals: list[Refusal] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)   # nodes whose NICs are unknown

    @property
    def ok(self) -> bool:
        return not self.refusals

    def cluster_settings(self) -> dict[str, dict[str, Any]]:
        """Per cluster: the settings every node of it shares (``common``) and each node's own (``nodes``)."""
        out: dict[str, dict[str, Any]] = {}
        by_cluster: dict[str, list[NodeReport]] = {}
        for r in self.nodes.values():
            by_cluster.setdefault(r.cluster or "(no cluster)", []).append(r)
        for c, reps in by_cluster.items():
            keys = dict.fromkeys(k for r in reps for k in r.settings)
            common = {k: reps[0].settings[k] for k in keys
                      if all(r.settings.get(k) == reps[0].settings.get(k) for r in reps)}
            nodes = {r.name: {k: v for k, v in r.settings.items() if k not in common} for r in reps}
            out[c] = {"nodes": [r.name for r in reps], "common": common,
                      "per_node": {n: s for n, s in nodes.items() if s}}
        return out

    def raise_if_refused(self) -> None:
        """ConfigError naming every refusal (what the adapters raise before any NCCL communicator exists)."""
        if not self.refusals:
            return
        first = self.refusals[0]
        more = "".join(f"\n- {r.text()}" for r in self.refusals[1:])
        raise ConfigError(first.problem + (f"\n{len(self.refusals) - 1} more:{more}" if more else ""),
                          source=SOURCE, field=first.field, fix=first.fix)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "refusals": [r.to_dict() for r in self.refusals], "warnings": list(self.warnings),
                "unchecked": list(self.unchecked),
                "nodes": {n: {"cluster": r.cluster, "source": r.source, "transports": r.transports,
                              "uses": r.uses, "settings": r.settings} for n, r in self.nodes.items()},
                "clusters": self.cluster_settings()}


# ---- the checks ------------------------------------------------------------------------------------

def _set(env: Mapping[str, str], key: str) -> Optional[str]:
    value = env.get(key)
    return value if value is not None and value.strip() != "" else None


@dataclass(frozen=True)
class FabricHints:
    """What a node's cluster file says about its RDMA fabric that NCCL cannot infer (cluster.FabricSpec)."""
    nccl_net: Optional[str] = None
    ib_tc: Optional[int] = None
    rail_only: bool = False


def preflight(groups: Iterable[GroupUse], nics: Mapping[str, NodeNics], env: Mapping[str, str], *,
              node_env: Optional[Mapping[str, Mapping[str, str]]] = None,
              clusters: Optional[Mapping[str, str]] = None,
              nccl_version: Optional[Sequence[int]] = None,
              node_version: Optional[Mapping[str, Optional[Sequence[int]]]] = None,
              fabric: Optional[Mapping[str, FabricHints]] = None) -> Preflight:
    """Check ``env`` (and per-node ``node_env`` overrides) against the groups and every node's NICs.

    ``nics``: node name -> NodeNics (nodes missing here are listed as unchecked). ``clusters``: node name ->
    cluster name, for the per-cluster settings. ``nccl_version``: the NCCL/RCCL version the ranks load
    (het_plugin.core.nccl_version; None: unknown, the rules then say what each version does), ``node_version`` per
    node where they differ. ``fabric``: node -> its fabric's hints (settings to export). Returns the derived
    settings, every refusal and every warning.
    """
    groups = [g for g in groups if len(g.nodes) > 1]
    node_env = node_env or {}
    clusters = clusters or {}
    fabric = fabric or {}
    envs = {}
    order: list[str] = list(dict.fromkeys([n for g in groups for n in g.nodes] + list(nics)))
    for n in order:
        envs[n] = {**env, **node_env.get(n, {})}
    versions = {n: _version((node_version or {}).get(n, nccl_version)) for n in order}
    result = Preflight({})
    refuse = result.refusals.append
    warn = result.warnings.append

    transports: dict[str, list[str]] = {n: [] for n in order}
    for g in groups:
        for n in g.nodes:
            if g.transport not in transports[n]:
                transports[n].append(g.transport)
    result.unchecked = [n for n in order if n not in nics]

    _check_nccl_net(groups, order, envs, refuse)
    _check_split_share(groups, order, envs, refuse)

    # Per node: which HCAs each RDMA transport will use, which interfaces NCCL's sockets use.
    selected: dict[str, list[Hca]] = {}            # node -> HCAs NCCL's IB plugin will open (RDMA nodes)
    socket_ifs: dict[str, list[str]] = {}          # node -> interfaces NCCL_SOCKET_IFNAME selects (when set)
    crossing = {n for g in groups if g.transport in OVER_SOCKETS for n in g.nodes}
    for n in order:
        if n not in nics:
            continue
        node, e = nics[n], envs[n]
        rdma = [t for t in transports[n] if t in RDMA_KINDS]
        if rdma:
            selected[n] = _check_hcas(node, rdma, e, refuse, versions[n])
        if transports[n]:
            chosen = _check_socket_ifname(node, e, refuse, warn, rdma=bool(rdma), crossing=n in crossing)
            if n in crossing:
                socket_ifs[n] = chosen

    _check_counts(groups, selected, socket_ifs, envs, refuse, warn, versions)
    _check_gid_index(groups, nics, selected, envs, refuse, warn, versions)
    _check_mismatch_variable(order, envs, warn, versions)

    for n in order:
        if n not in nics:
            continue
        node = nics[n]
        uses = _uses(node, transports[n], selected.get(n), envs[n])
        result.nodes[n] = NodeReport(n, clusters.get(n), node.source, [t for t in transports[n] if t != "local"],
                                     uses, _settings(node, transports[n], fabric.get(n)))
    if result.unchecked:
        result.warnings.append(f"no NIC information for node(s) {', '.join(result.unchecked[:8])}"
                               f"{' ...' if len(result.unchecked) > 8 else ''}: their names were not checked "
                               "(list their nics in the cluster file, or run under torchrun with --gather)")
    return result


def _version(value) -> Optional[tuple[int, int, int]]:
    return normalize(value)


def _vtext(version) -> str:
    return f"NCCL {version_text(version)}"


def _check_nccl_net(groups, order, envs, refuse) -> None:
    """NCCL_NET overrides every communicator's netName (NVIDIA/nccl v2.30.7-1 src/init.cc: "Comm config netName
    reset to NCCL_NET"): refused when a group needs another network, or (Socket) when an RDMA group would lose
    RDMA."""
    forced: dict[str, list[GroupUse]] = {}
    rdma_default = [g for g in groups if g.transport in RDMA_KINDS and g.net_name is None]
    for g in groups:
        if g.net_name:
            forced.setdefault(g.net_name, []).append(g)
    by_value: dict[str, list[str]] = {}
    for n in order:
        value = _set(envs[n], "NCCL_NET")
        if value is not None:
            by_value.setdefault(value, []).append(n)
    for value, nodes in by_value.items():
        other = {name: gs for name, gs in forced.items() if name.lower() != value.strip().lower()}
        if other:
            name, gs = next(iter(other.items()))
            need = repr(name)
        elif rdma_default and value.strip().lower() == "socket":
            name, gs, need = "", rdma_default, "its RDMA network (NCCL's default choice)"
        else:
            continue
        refuse(Refusal("NCCL_NET", f"NCCL_NET={value} overrides the network of every NCCL communicator, but "
                                   f"{gs[0].label} ({gs[0].transport}, nodes {_names(gs[0].nodes)}) needs {need}"
                                   f"{f' (and {len(gs) - 1} more group(s))' if len(gs) > 1 else ''}",
                       "unset NCCL_NET: het_plugin gives each communicator that needs one its own network (netName); "
                       "to name the fabric's RDMA network, set fabric.nccl_net in the cluster file", tuple(nodes)))


def _check_split_share(groups, order, envs, refuse) -> None:
    """With shared resources a split child must use its parent's network (NVIDIA/nccl v2.30.7-1 src/init.cc:
    "Split shares resources, but parent comm netName ... is different"; src/plugin/net.cc ncclNetInitFromParent:
    "Comm config netName (%s) does not match the parent", compared against the parent's config, NULL when the
    world has none): ncclInvalidUsage at the first group whose network differs from the world's."""
    nets = {g.net_name for g in groups}
    if len(nets) <= 1:
        return
    for n in order:
        value = _set(envs[n], "NCCL_COMM_SPLIT_SHARE_RESOURCES")
        if value is None or value.strip() == "0":
            continue
        shown = ", ".join(sorted(repr(x) if x else "NCCL's default" for x in nets))
        refuse(Refusal("NCCL_COMM_SPLIT_SHARE_RESOURCES",
                       f"NCCL_COMM_SPLIT_SHARE_RESOURCES={value} makes every group split from the world communicator "
                       f"share its network, but the plan's groups use different networks ({shown}): NCCL refuses such "
                       "a split (ncclInvalidUsage, 'Split shares resources, but parent comm netName ... is different')",
                       "unset NCCL_COMM_SPLIT_SHARE_RESOURCES (or set it to 0) on every node, and do not pass "
                       "split_share in the framework's NCCL options", tuple(order)))
        return


def _check_hcas(node: NodeNics, rdma: list[str], env, refuse, version=None) -> list[Hca]:
    """The HCAs NCCL will open on ``node`` (NCCL_IB_HCA or every port), checked against its RDMA groups."""
    text = _set(env, "NCCL_IB_HCA")
    late = at_least(version, CONNECT_CHECK)
    mixing = ({True: f"{_vtext(version)} stops at connect ('Attempted to connect incompatible devices')",
               False: f"{_vtext(version)} (before 2.26) does not check it and may hang"}.get(
                   late, "NCCL >= 2.26 stops at connect ('Attempted to connect incompatible devices'), older "
                         "versions may hang"))
    if len(rdma) > 1:
        refuse(Refusal("NCCL_IB_HCA", f"node {node.name} is in both InfiniBand and RoCE groups, but NCCL reads one "
                                      f"NCCL_IB_HCA per process, so one communicator would join IB and RoCE HCAs "
                                      f"({mixing})",
                       "put the node in one fabric (its cluster's); check the cluster file's fabric types and links",
                       (node.name,)))
        return list(node.hcas)
    kind = rdma[0]
    if text is None:
        chosen = list(node.hcas)
    else:
        flt = NameFilter.parse(env["NCCL_IB_HCA"])
        chosen = [h for h in node.hcas if flt.selects(h.device, h.port)]
        if not flt.exclude:
            missing = [t for t in flt.tokens if not any(flt.token_matches(t, h.device, h.port) for h in node.hcas)]
            if missing:
                have = ", ".join(h.label for h in node.hcas) or "none"
                refuse(Refusal("NCCL_IB_HCA", f"NCCL_IB_HCA={text} names {', '.join(_tok(t) for t in missing)}, which "
                                              f"node {node.name} does not have (its RDMA ports: {have})",
                               f"on {node.name}: export NCCL_IB_HCA={_hca_value(node.of_kind(kind))} "
                               "(`het-plugin check --format env` prints every node's)", (node.name,)))
    wrong = [h for h in chosen if h.kind != kind]
    right = [h for h in chosen if h.kind == kind]
    where = f"NCCL_IB_HCA={text}" if text is not None else "NCCL_IB_HCA unset (every HCA)"
    if not node.of_kind(kind):
        refuse(Refusal("NCCL_IB_HCA", f"node {node.name} takes part in {kind} groups but has no {KIND_TEXT[kind]} "
                                      f"port (it has {', '.join(f'{h.label} ({h.kind})' for h in node.hcas) or 'none'})",
                       "correct the node's cluster (fabric type) in the cluster file, or re-discover it", (node.name,)))
    elif wrong:
        refuse(Refusal("NCCL_IB_HCA", f"{where} on node {node.name} joins {KIND_TEXT[kind]} HCAs "
                                      f"({', '.join(h.label for h in right) or 'none'}) and "
                                      f"{', '.join(f'{h.label} ({KIND_TEXT[h.kind]})' for h in wrong)} in one "
                                      f"communicator: its {kind} groups cannot mix IB and RoCE ({mixing})",
                       f"on {node.name}: export NCCL_IB_HCA={_hca_value(node.of_kind(kind))}", (node.name,)))
    elif not right:
        refuse(Refusal("NCCL_IB_HCA", f"{where} selects no HCA on node {node.name} (it has "
                                      f"{', '.join(h.label for h in node.hcas)}), so NCCL would fall back to sockets "
                                      f"there while its {kind} groups' other members use RDMA",
                       f"on {node.name}: export NCCL_IB_HCA={_hca_value(node.of_kind(kind))}", (node.name,)))
    return right


def _check_socket_ifname(node: NodeNics, env, refuse, warn, *, rdma: bool, crossing: bool) -> list[str]:
    """NCCL_SOCKET_IFNAME picks NCCL's bootstrap interface, the Socket network's and the IB plugin's out-of-band
    one (src/transport/net_ib/init.cc: ncclFindInterfaces, 'NET/IB : No IP interface found.' when none). Set and
    matching nothing: bootstrap fails, and on an RDMA node the IB plugin is disabled. Unset: NCCL takes ``ib*``
    (IPoIB) first, which other clusters cannot reach."""
    raw = env.get("NCCL_SOCKET_IFNAME")
    text = socket_ifname_value(env)
    want = _socket_interface(node)
    if text is None:
        if raw is not None and raw != "":
            warn(f"NCCL_SOCKET_IFNAME={raw!r} on node {node.name} is one character long, so NCCL ignores it and "
                 "picks an interface itself (src/misc/socket.cc reads it only when longer); give the full name")
        auto = nccl_auto_interfaces(node.interfaces)
        ipoib = [i for i in auto if i.startswith("ib")]
        if crossing and ipoib:
            refuse(Refusal("NCCL_SOCKET_IFNAME",
                           f"NCCL_SOCKET_IFNAME is unset on node {node.name}, so NCCL takes the IPoIB interface(s) "
                           f"{', '.join(ipoib)} (its first choice, 'ib*') for its bootstrap and its socket groups, "
                           "which nodes of other clusters cannot reach",
                           (f"on {node.name}: export NCCL_SOCKET_IFNAME=={want} (`het-plugin check --format env` "
                            "prints every node's)") if want and not want.startswith("ib") else
                           f"give node {node.name} an Ethernet interface that reaches the other clusters and name it "
                           "in NCCL_SOCKET_IFNAME", (node.name,)))
        return auto
    flt = NameFilter.parse(text, ports=False)
    chosen = [i for i in node.interfaces if flt.selects(i)]
    if not chosen:
        effect = ("NCCL's bootstrap finds no interface, and NCCL's IB plugin (which needs one for its out-of-band "
                  "connection) is disabled, so its RDMA groups would not use RDMA" if rdma else
                  "NCCL's bootstrap and its socket groups find no interface there")
        refuse(Refusal("NCCL_SOCKET_IFNAME",
                       f"NCCL_SOCKET_IFNAME={text} matches no interface of node {node.name} (it has "
                       f"{', '.join(node.interfaces) or 'none'}): {effect}",
                       (f"on {node.name}: export NCCL_SOCKET_IFNAME=={want} (one value per node: "
                        "`het-plugin check --format env` prints each)") if want else
                       f"give node {node.name} an Ethernet interface that reaches the other clusters", (node.name,)))
    return chosen


def nic_count(hcas: Sequence[Hca], env: Mapping[str, str], version=None) -> int:
    """Network devices NCCL counts for these ports: the ports of one NIC are fused into one device
    (NCCL_IB_MERGE_NICS, default 1, from 2.20: NVIDIA/nccl v2.30.7-1 src/graph/topo.cc ncclTopoMakeVNics with
    NCCL_NET_MERGE_LEVEL's default PATH_PORT); each port counts with NCCL_IB_MERGE_NICS=0 or before 2.20."""
    merge = (_set(env, "NCCL_IB_MERGE_NICS") or "1").strip() != "0" and at_least(version, MERGE_NICS) is not False
    return len({h.device for h in hcas}) if merge else len(hcas)


def _check_counts(groups, selected, socket_ifs, envs, refuse, warn, versions) -> None:
    """Members of one communicator with different NIC counts: NCCL 2.30 accepts it by default (its channels use
    the fewest); warned, since the node's NCCL_IB_HCA is per process (cutting it would slow every group there).
    Refused only where NCCL is known to stop: NCCL_IGNORE_NET_MISMATCH=0 on NCCL >= 2.30."""
    reported: set = set()
    for g in groups:
        if g.transport in RDMA_KINDS:
            counts = {n: nic_count(selected[n], envs[n], versions.get(n)) for n in g.nodes if selected.get(n)}
            what, var = "network devices (NICs, ports of one NIC merged as NCCL merges them)", "NCCL_IB_HCA"
        elif g.transport in OVER_SOCKETS:
            counts = {n: len(socket_ifs[n]) for n in g.nodes if socket_ifs.get(n)}
            what, var = "interfaces NCCL's sockets use", "NCCL_SOCKET_IFNAME"
        else:
            continue
        if len(set(counts.values())) <= 1:
            continue
        key = (g.transport, tuple(sorted(counts.items())))
        if key in reported:
            continue
        reported.add(key)
        spread = ", ".join(f"{n}: {c}" for n, c in list(counts.items())[:6])
        strict = [n for n in counts if (_set(envs[n], "NCCL_IGNORE_NET_MISMATCH") or "").strip() == "0"
                  and at_least(versions.get(n), NET_MISMATCH_VAR) is not False]
        if strict:
            n = strict[0]
            refuse(Refusal("NCCL_IGNORE_NET_MISMATCH",
                           f"NCCL_IGNORE_NET_MISMATCH=0 on node {n}, and {g.label} ({g.transport}) spans nodes with "
                           f"different numbers of {what} ({spread}): NCCL >= 2.30 stops its init with 'Detected "
                           f"mixed local Net device counts across ranks' ({_vtext(versions.get(n))} here)",
                           "unset NCCL_IGNORE_NET_MISMATCH (NCCL 2.30's default, 1, accepts the mismatch), or give "
                           f"every node of the group the same number of {what} ({var} per node)", tuple(strict)))
            continue
        warn(f"{g.label} ({g.transport}) spans nodes with different numbers of {what} ({spread}): NCCL uses as many "
             f"channels as the node with the fewest, so the others' extra NICs sit idle in this group; {var} is read "
             "once per process, so lowering it on the bigger nodes would slow every other group there too -- left as "
             "it is")


def _check_mismatch_variable(order, envs, warn, versions) -> None:
    for n in order:
        value = _set(envs[n], "NCCL_IGNORE_NET_MISMATCH")
        if value is not None and at_least(versions.get(n), NET_MISMATCH_VAR) is False:
            warn(f"NCCL_IGNORE_NET_MISMATCH={value} on node {n} does nothing: {_vtext(versions.get(n))} has no such "
                 "variable (added in NCCL 2.30); unset it")
            return


def _check_gid_index(groups, nics, selected, envs, refuse, warn, versions) -> None:
    """RoCE GID: NCCL >= 2.21 picks a RoCE v2 GID itself (NCCL_IB_GID_INDEX=-1, its default); before 2.21 the
    default is 0, usually a RoCE v1 / link-local GID, and -1 is no index at all."""
    done: set[str] = set()
    unknown: list[str] = []
    for g in groups:
        if g.transport != "roce":
            continue
        for n in g.nodes:
            if n in done or n not in nics:
                continue
            done.add(n)
            version = versions.get(n)
            auto = at_least(version, GID_AUTO)
            text = _set(envs.get(n, {}), "NCCL_IB_GID_INDEX")
            known = [h for h in selected.get(n, []) if h.gid_index is not None]
            v2 = known[0].gid_index if known else None
            set_to = f"export NCCL_IB_GID_INDEX={v2}" if v2 is not None else \
                "export NCCL_IB_GID_INDEX=<the RoCE v2 IPv4 index `show_gids` prints>"
            if text is None:
                if auto is False and v2 != 0:
                    refuse(Refusal("NCCL_IB_GID_INDEX",
                                   f"NCCL_IB_GID_INDEX is unset on node {n}, and {_vtext(version)} (before 2.21) then "
                                   "uses GID index 0, on most RoCE NICs a RoCE v1 / link-local GID: routed RoCE "
                                   "between its nodes fails", f"on {n}: {set_to}, or use NCCL >= 2.21", (n,)))
                elif auto is None and v2 != 0:
                    unknown.append(n)
                continue
            try:
                index = int(text)
            except ValueError:
                refuse(Refusal("NCCL_IB_GID_INDEX", f"NCCL_IB_GID_INDEX={text} on node {n} is not a number",
                               "unset it (NCCL 2.21+ picks a RoCE v2 GID) or set the index show_gids prints", (n,)))
                continue
            if index < 0 and auto is False:
                refuse(Refusal("NCCL_IB_GID_INDEX", f"NCCL_IB_GID_INDEX={index} on node {n}: automatic GID "
                                                    f"selection exists from NCCL 2.21, this is {_vtext(version)}",
                               f"on {n}: {set_to}", (n,)))
                continue
            bad = [h for h in known if h.gid_index != index]
            if index >= 0 and bad:
                refuse(Refusal("NCCL_IB_GID_INDEX",
                               f"NCCL_IB_GID_INDEX={index}, but on node {n} the RoCE v2 IPv4 GID of "
                               f"{', '.join(f'{h.label} is {h.gid_index}' for h in bad)}",
                               f"on {n}: export NCCL_IB_GID_INDEX={bad[0].gid_index}, or unset it (NCCL 2.21+ picks "
                               "a RoCE v2 GID itself)", (n,)))
    if unknown:
        warn(f"NCCL_IB_GID_INDEX is unset on RoCE node(s) {_names(unknown)} and the NCCL version is unknown: NCCL >= "
             "2.21 picks a RoCE v2 GID itself, older versions use index 0 (often RoCE v1, and routed RoCE fails); "
             "with an older NCCL export the index `het-plugin check --format env` prints")


def _uses(node: NodeNics, transports, hcas, env) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for t in transports:
        if t in RDMA_KINDS:
            hs = hcas if hcas is not None else node.of_kind(t)
            out[t] = [h.label + (f" (GID {h.gid_index})" if h.kind == "roce" and h.gid_index is not None else "")
                      for h in hs]
        elif t in OVER_SOCKETS:
            ifname = _socket_interface(node)
            out[t] = [ifname] if ifname else []
    return out


def _socket_interface(node: NodeNics) -> Optional[str]:
    """The interface socket traffic between clusters takes: the fastest plain Ethernet NIC, else a RoCE netdev."""
    if node.ethernet:
        return node.ethernet[0]
    for h in node.hcas:
        if h.kind == "roce" and h.netdevs:
            return h.netdevs[0]
    return None


def _hca_value(hcas: Sequence[Hca]) -> str:
    """An exact NCCL_IB_HCA list of these ports (``dev:port`` wherever a port number is known and not 1)."""
    return "=" + ",".join(h.label for h in hcas)


def _settings(node: NodeNics, transports, hints: Optional[FabricHints] = None) -> dict[str, str]:
    """The environment this node should run with (exports). No NCCL_IGNORE_NET_MISMATCH: NCCL 2.30's default
    accepts mixed NIC counts (a warning here), older versions have no such variable. No NCCL_NET: it would
    override the Socket groups' network too (a declared RDMA network is each RDMA group's netName)."""
    s: dict[str, str] = {}
    rdma = [t for t in transports if t in RDMA_KINDS]
    if len(rdma) == 1 and node.of_kind(rdma[0]):
        hcas = node.of_kind(rdma[0])
        s["NCCL_IB_HCA"] = _hca_value(hcas)
        gids = {h.gid_index for h in hcas}
        if rdma[0] == "roce" and len(gids) == 1 and None not in gids:
            s["NCCL_IB_GID_INDEX"] = str(gids.pop())
    sock = _socket_interface(node)
    if sock:
        s["NCCL_SOCKET_IFNAME"] = "=" + sock
        s["GLOO_SOCKET_IFNAME"] = sock
    gloo: dict[str, str] = {}
    for t in transports:
        if t == "ib":
            ipoib = [d for h in node.of_kind("ib") for d in h.netdevs]
            ifname = ipoib[0] if ipoib else sock
        elif t == "roce":
            netdevs = [d for h in node.of_kind("roce") for d in h.netdevs]
            ifname = netdevs[0] if netdevs else sock
        elif t in OVER_SOCKETS:
            ifname = sock
        else:
            continue
        if ifname:
            gloo[t] = ifname
    if gloo:
        s[ENV_GLOO_IFNAMES] = ",".join(f"{k}={v}" for k, v in gloo.items())
    if rdma and hints is not None:
        if hints.ib_tc is not None:
            s["NCCL_IB_TC"] = str(hints.ib_tc)          # the fabric's traffic class (cluster file fabric.ib_tc)
        if hints.rail_only:
            s["NCCL_CROSS_NIC"] = "0"                   # rail-only: a ring/tree keeps NIC i to NIC i
    return s


def _tok(token: tuple[str, Optional[int]]) -> str:
    return token[0] if token[1] is None else f"{token[0]}:{token[1]}"


def _names(nodes: Sequence[str]) -> str:
    return ", ".join(nodes[:4]) + (f" ... ({len(nodes)} nodes)" if len(nodes) > 4 else "")


# ---- convenience -----------------------------------------------------------------------------------

def nics_from_cluster(cluster) -> dict[str, NodeNics]:
    """NodeNics of every node whose cluster-file entry lists NICs."""
    return {n.name: NodeNics.from_cluster_node(n) for n in cluster.nodes if n.nics}


def check_launch(source, env: Mapping[str, str], *, views: Sequence = (), cluster=None,
                 gid_index: Optional[Mapping[str, Mapping[tuple[str, int], int]]] = None,
                 node_env: Optional[Mapping[str, Mapping[str, str]]] = None,
                 nccl_version: Optional[Sequence[int]] = None,
                 node_version: Optional[Mapping[str, Optional[Sequence[int]]]] = None) -> Preflight:
    """The checks over a Plan or a Cluster (``source``), discovery views (override the file's NICs per node),
    and the environment. ``cluster``: the Cluster whose ``nics`` describe the nodes when ``source`` is a Plan.
    ``nccl_version``: the NCCL/RCCL version the ranks load (None: unknown)."""
    if isinstance(source, Plan):
        groups = groups_from_plan(source)
        node_cluster = {n.name: n.cluster for n in source.nodes}
    else:
        groups = groups_from_cluster(source)
        cluster = cluster or source
        node_cluster = {n.name: n.cluster for n in source.nodes}
    nics = nics_from_cluster(cluster) if cluster is not None else {}
    for v in views:
        nics[v.name] = NodeNics.from_view(v, (gid_index or {}).get(v.name))
    hints = fabric_hints(cluster) if cluster is not None else {}
    return preflight(groups, nics, env, node_env=node_env, clusters=node_cluster, nccl_version=nccl_version,
                     node_version=node_version, fabric=hints)


def fabric_hints(cluster) -> dict[str, FabricHints]:
    """Node -> what its cluster file's fabric declares beyond its type (only nodes whose fabric declares some)."""
    out = {}
    for n in cluster.nodes:
        f = n.fabric
        hints = FabricHints(getattr(f, "nccl_net", None), getattr(f, "ib_tc", None), bool(getattr(f, "rail_only", False)))
        if hints != FabricHints():
            out[n.name] = hints
    return out


# ---- the world group (created by init_process_group before het_plugin runs) ------------------------

WORLD_OPTIONS_FIX = ("create the world group with its own network before the framework does: "
                     "torch.distributed.init_process_group('nccl', pg_options=het_plugin.runtime.netselect.world_group_options()) "
                     "(NCCL net_name 'Socket' for the world communicator only; the plan's groups keep theirs), then "
                     "deepspeed.init_distributed() / Megatron's initialize, which keep an existing world group")


# The world group's net_name could not be read from torch (a build whose NCCL options do not show it): the
# check cannot tell a correctly created world group from a wrong one, so it warns instead of refusing.
NET_NAME_UNREADABLE = "<unreadable>"


def world_warning(world: GroupUse, backend: str, world_net_name: Optional[str],
                  node_nets: Mapping[str, Optional[str]]) -> Optional[str]:
    """The warning given instead of :func:`world_refusal`'s refusal when the world's net_name is unreadable."""
    if world_net_name != NET_NAME_UNREADABLE or world.transport == Transport.HOST_STAGED:
        return None
    refusal = world_refusal(world, backend, None, node_nets)
    if refusal is None:
        return None
    return ("this torch does not show the world group's NCCL options, so het_plugin cannot tell whether it has a "
            f"network of its own; if it was not created with one: {refusal.problem}. Fix: {refusal.fix}")


def world_refusal(world: GroupUse, backend: str, world_net_name: Optional[str],
                  node_nets: Mapping[str, Optional[str]]) -> Optional[Refusal]:
    """The world group under NCCL: one communicator over every node, created before het_plugin could give it a
    network. Spanning vendors it cannot exist (NCCL and RCCL do not form one communicator); spanning fabrics
    (IB and RoCE, or clusters joined by Ethernet) it must be a socket communicator: its own ``net_name``
    ``world_net_name`` (from ``init_process_group``'s ``pg_options``) or ``NCCL_NET=Socket`` on every node
    (``node_nets``: node -> NCCL_NET). None: nothing to refuse."""
    if "nccl" not in backend.lower() or len(world.nodes) <= 1:
        return None
    if world.transport == Transport.HOST_STAGED:
        return Refusal("init_process_group(backend=)",
                       f"the world group (init_process_group's backend {backend!r}) spans accelerator vendors: NCCL "
                       "and RCCL cannot form one communicator, so its first collective would hang",
                       "create it with backend='het_shim' (import het_plugin.comm first; docs/shim.md) or 'gloo' "
                       "before the framework initialises torch.distributed", world.nodes)
    if world.transport != "socket":
        return None
    if (world_net_name or "").lower() == "socket":
        return None
    nets = {(v or "").strip().lower() for v in node_nets.values()}
    if nets == {"socket"} or world_net_name == NET_NAME_UNREADABLE:      # the latter: world_warning
        return None
    given = f"net_name {world_net_name!r}" if world_net_name else "no net_name"
    return Refusal("init_process_group(pg_options=)",
                   f"the world group spans fabrics (IB and RoCE, or clusters joined by Ethernet) and was created with "
                   f"{given}: NCCL would open its communicator on the RDMA HCAs, which cannot reach each other across "
                   "fabrics, and its first collective would hang",
                   WORLD_OPTIONS_FIX, world.nodes)
