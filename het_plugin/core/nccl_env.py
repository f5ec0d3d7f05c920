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
from .ranks.transport import ENV_GLOO_IFNAMES, nccl_net_name

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
    """A communicator het_plugin will create: a label for messages, its nodes, its transport."""
    label: str
    nodes: tuple[str, ...]
    transport: str

    @property
    def net_name(self) -> Optional[str]:
        return nccl_net_name(self.transport) if len(self.nodes) > 1 else None


def groups_from_plan(plan) -> list[GroupUse]:
    """Every group of the plan (one entry per distinct node set and transport) and the world group."""
    seen: dict[tuple, GroupUse] = {}
    for kind, groups in plan.groups.items():
        for g in groups:
            nodes = tuple(dict.fromkeys(plan.node_of(r).name for r in g.ranks))
            key = (nodes, g.transport)
            if key not in seen:
                seen[key] = GroupUse(f"{kind} group of ranks {_ranks(g.ranks)}", nodes, g.transport)
    world = list(range(plan.world_size))
    nodes = tuple(dict.fromkeys(plan.node_of(r).name for r in world))
    seen.setdefault((nodes, plan.rule_transport(world)), GroupUse("world group", nodes, plan.rule_transport(world)))
    return list(seen.values())


def groups_from_cluster(cluster) -> list[GroupUse]:
    """Without a plan, every group the planner can make: per domain, per cluster, per pair of clusters, world."""
    from .ranks.transport import Member, transport_rule

    def rule(nodes) -> str:
        return transport_rule((Member(n.name, n.cluster, n.vendor) for n in nodes),
                              lambda a, b: cluster.cluster_link(a, b).kind)
    out: dict[tuple, GroupUse] = {}

    def add(label, nodes):
        names = tuple(n.name for n in nodes)
        if len(names) > 1:
            out.setdefault((names, rule(nodes)), GroupUse(label, names, rule(nodes)))
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
    from .ranks.dims import format_ranks
    return format_ranks(list(ranks))


# ---- NCCL's name filters ---------------------------------------------------------------------------

@dataclass(frozen=True)
class NameFilter:
    """``NCCL_IB_HCA`` / ``NCCL_SOCKET_IFNAME``: ``[^][=]name[:port],...``."""
    text: str
    exclude: bool
    exact: bool
    tokens: tuple[tuple[str, Optional[int]], ...]

    @classmethod
    def parse(cls, text: str, ports: bool = True) -> "NameFilter":
        rest = text.strip()
        exclude = rest.startswith("^")
        rest = rest[1:] if exclude else rest
        exact = rest.startswith("=")
        rest = rest[1:] if exact else rest
        tokens = []
        for item in filter(None, (t.strip() for t in rest.split(","))):
            name, port = item, None
            if ports:
                name, _, tail = item.partition(":")
                first = tail.split(":", 1)[0]
                port = int(first) if first.isdigit() else None
            tokens.append((name, port))
        return cls(text, exclude, exact, tuple(tokens))

    def token_matches(self, token: tuple[str, Optional[int]], name: str, port: Optional[int] = None) -> bool:
        tname, tport = token
        hit = name == tname if self.exact else name.startswith(tname)
        return hit and (tport is None or port is None or tport == port)

    def selects(self, name: str, port: Optional[int] = None) -> bool:
        hit = any(self.token_matches(t, name, port) for t in self.tokens)
        return not hit if self.exclude else hit


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


def preflight(groups: Iterable[GroupUse], nics: Mapping[str, NodeNics], env: Mapping[str, str], *,
              node_env: Optional[Mapping[str, Mapping[str, str]]] = None,
              clusters: Optional[Mapping[str, str]] = None) -> Preflight:
    """Check ``env`` (and per-node ``node_env`` overrides) against the groups and every node's NICs.

    ``nics``: node name -> NodeNics (nodes missing here are listed as unchecked). ``clusters``: node name ->
    cluster name, for the per-cluster settings. Returns the derived settings and every refusal.
    """
    groups = [g for g in groups if len(g.nodes) > 1]
    node_env = node_env or {}
    clusters = clusters or {}
    envs = {}
    order: list[str] = list(dict.fromkeys([n for g in groups for n in g.nodes] + list(nics)))
    for n in order:
        envs[n] = {**env, **node_env.get(n, {})}
    result = Preflight({})
    refuse = result.refusals.append

    transports: dict[str, list[str]] = {n: [] for n in order}
    for g in groups:
        for n in g.nodes:
            if g.transport not in transports[n]:
                transports[n].append(g.transport)
    result.unchecked = [n for n in order if n not in nics]

    _check_nccl_net(groups, order, envs, refuse)

    # Per node: which HCAs each RDMA transport will use, which interface a socket uses.
    selected: dict[str, list[Hca]] = {}            # node -> HCAs NCCL's IB plugin will open (RDMA nodes)
    socket_ifs: dict[str, list[str]] = {}          # node -> interfaces NCCL_SOCKET_IFNAME selects (when set)
    for n in order:
        if n not in nics:
            continue
        node, e = nics[n], envs[n]
        rdma = [t for t in transports[n] if t in RDMA_KINDS]
        if rdma:
            selected[n] = _check_hcas(node, rdma, e, refuse)
        if any(t in ("socket", "host-staged") for t in transports[n]):
            socket_ifs[n] = _check_socket_ifname(node, e, refuse)

    _check_counts(groups, nics, selected, socket_ifs, envs, refuse, result.warnings)
    _check_gid_index(groups, nics, selected, envs, refuse)

    for n in order:
        if n not in nics:
            continue
        node = nics[n]
        uses = _uses(node, transports[n], selected.get(n), envs[n])
        result.nodes[n] = NodeReport(n, clusters.get(n), node.source, [t for t in transports[n] if t != "local"],
                                     uses, _settings(node, transports[n], nics, groups))
    if result.unchecked:
        result.warnings.append(f"no NIC information for node(s) {', '.join(result.unchecked[:8])}"
                               f"{' ...' if len(result.unchecked) > 8 else ''}: their names were not checked "
                               "(list their nics in the cluster file, or run under torchrun with --gather)")
    return result


def _check_nccl_net(groups, order, envs, refuse) -> None:
    needed: dict[str, list[GroupUse]] = {}
    for g in groups:
        if g.net_name:
            needed.setdefault(g.net_name, []).append(g)
    by_value: dict[str, list[str]] = {}
    for n in order:
        value = _set(envs[n], "NCCL_NET")
        if value is not None:
            by_value.setdefault(value, []).append(n)
    for value, nodes in by_value.items():
        other = {name: gs for name, gs in needed.items() if name.lower() != value.strip().lower()}
        if not other:
            continue
        name, gs = next(iter(other.items()))
        refuse(Refusal("NCCL_NET", f"NCCL_NET={value} overrides the network of every NCCL communicator, but "
                                   f"{gs[0].label} ({gs[0].transport}, nodes {_names(gs[0].nodes)}) needs {name!r}"
                                   f"{f' (and {len(gs) - 1} more group(s))' if len(gs) > 1 else ''}",
                       "unset NCCL_NET: het_plugin gives each communicator its own network (netName)", tuple(nodes)))


def _check_hcas(node: NodeNics, rdma: list[str], env, refuse) -> list[Hca]:
    """The HCAs NCCL will open on ``node`` (NCCL_IB_HCA or every port), checked against its RDMA groups."""
    text = _set(env, "NCCL_IB_HCA")
    if len(rdma) > 1:
        refuse(Refusal("NCCL_IB_HCA", f"node {node.name} is in both InfiniBand and RoCE groups, but NCCL reads one "
                                      "NCCL_IB_HCA per process, so one communicator would join IB and RoCE HCAs",
                       "put the node in one fabric (its cluster's); check the cluster file's fabric types and links",
                       (node.name,)))
        return list(node.hcas)
    kind = rdma[0]
    if text is None:
        chosen = list(node.hcas)
    else:
        flt = NameFilter.parse(text)
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
                                      f"communicator: its {kind} groups cannot mix IB and RoCE",
                       f"on {node.name}: export NCCL_IB_HCA={_hca_value(node.of_kind(kind))}", (node.name,)))
    elif not right:
        refuse(Refusal("NCCL_IB_HCA", f"{where} selects no HCA on node {node.name} (it has "
                                      f"{', '.join(h.label for h in node.hcas)}), so NCCL would fall back to sockets "
                                      f"there while its {kind} groups' other members use RDMA",
                       f"on {node.name}: export NCCL_IB_HCA={_hca_value(node.of_kind(kind))}", (node.name,)))
    return right


def _check_socket_ifname(node: NodeNics, env, refuse) -> list[str]:
    text = _set(env, "NCCL_SOCKET_IFNAME")
    if text is None:
        return []
    flt = NameFilter.parse(text, ports=False)
    chosen = [i for i in node.interfaces if flt.selects(i)]
    if not chosen:
        want = node.ethernet[0] if node.ethernet else None
        refuse(Refusal("NCCL_SOCKET_IFNAME",
                       f"NCCL_SOCKET_IFNAME={text} matches no interface of node {node.name} (it has "
                       f"{', '.join(node.interfaces) or 'none'}): interface names differ between the nodes of its "
                       "socket groups",
                       (f"on {node.name}: export NCCL_SOCKET_IFNAME=={want} (one value per node: "
                        "`het-plugin check --format env` prints each)") if want else
                       f"give node {node.name} an Ethernet interface that reaches the other clusters", (node.name,)))
    return chosen


def _check_counts(groups, nics, selected, socket_ifs, envs, refuse, warnings) -> None:
    """Members of one communicator must see the same number of NICs, and NCCL must not be told to accept less."""
    reported: set = set()
    for g in groups:
        if g.transport in RDMA_KINDS:
            counts = {n: len(selected[n]) for n in g.nodes if n in selected and selected[n]}
            what = "HCAs"
        elif g.transport in ("socket", "host-staged"):
            counts = {n: len(socket_ifs[n]) for n in g.nodes if socket_ifs.get(n)}
            what = "interfaces matching NCCL_SOCKET_IFNAME"
        else:
            continue
        if len(set(counts.values())) <= 1:
            continue
        key = (g.transport, tuple(sorted(counts.items())))
        if key in reported:
            continue
        reported.add(key)
        spread = ", ".join(f"{n}: {c}" for n, c in list(counts.items())[:6])
        values = {envs[n].get("NCCL_IGNORE_NET_MISMATCH", "").strip() for n in counts}
        accepts = [v for v in values if v != "0"]
        fewest = min(counts.values())
        if accepts:
            setting = ("unset (NCCL's default, 1, accepts mismatched NIC counts)" if "" in accepts
                       else f"{accepts[0]} (accepts mismatched NIC counts)")
            refuse(Refusal("NCCL_IGNORE_NET_MISMATCH",
                           f"NCCL_IGNORE_NET_MISMATCH is {setting}, and {g.label} "
                           f"({g.transport}) spans nodes with different numbers of {what} ({spread}): NCCL would "
                           "build channels on NICs that have no peer and hang",
                           f"give every node of the group the same number ({fewest}) of {what} "
                           f"(NCCL_IB_HCA/NCCL_SOCKET_IFNAME per node), and export NCCL_IGNORE_NET_MISMATCH=0 so a "
                           "mismatch stops NCCL at init instead of hanging", tuple(counts)))
        else:
            refuse(Refusal("NCCL_IB_HCA" if g.transport in RDMA_KINDS else "NCCL_SOCKET_IFNAME",
                           f"{g.label} ({g.transport}) spans nodes with different numbers of {what} ({spread}); "
                           "with NCCL_IGNORE_NET_MISMATCH=0 NCCL stops at its init",
                           f"select {fewest} {what} on every node of the group", tuple(counts)))


def _check_gid_index(groups, nics, selected, envs, refuse) -> None:
    done: set[str] = set()
    for g in groups:
        if g.transport != "roce":
            continue
        for n in g.nodes:
            text = _set(envs.get(n, {}), "NCCL_IB_GID_INDEX")
            if n in done or text is None or n not in nics:
                continue
            done.add(n)
            try:
                index = int(text)
            except ValueError:
                refuse(Refusal("NCCL_IB_GID_INDEX", f"NCCL_IB_GID_INDEX={text} is not a number", "unset it (NCCL "
                               "picks a RoCE v2 GID) or set the index show_gids prints", (n,)))
                continue
            known = [h for h in selected.get(n, []) if h.gid_index is not None]
            bad = [h for h in known if h.gid_index != index]
            if index >= 0 and bad:
                refuse(Refusal("NCCL_IB_GID_INDEX",
                               f"NCCL_IB_GID_INDEX={index}, but on node {n} the RoCE v2 IPv4 GID of "
                               f"{', '.join(f'{h.label} is {h.gid_index}' for h in bad)}",
                               f"on {n}: export NCCL_IB_GID_INDEX={bad[0].gid_index}, or unset it (NCCL 2.21+ picks "
                               "a RoCE v2 GID itself)", (n,)))


def _uses(node: NodeNics, transports, hcas, env) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for t in transports:
        if t in RDMA_KINDS:
            hs = hcas if hcas is not None else node.of_kind(t)
            out[t] = [h.label + (f" (GID {h.gid_index})" if h.kind == "roce" and h.gid_index is not None else "")
                      for h in hs]
        elif t in ("socket", "host-staged"):
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


def _settings(node: NodeNics, transports, nics, groups) -> dict[str, str]:
    """The environment this node should run with (exports)."""
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
        elif t in ("socket", "host-staged"):
            ifname = sock
        else:
            continue
        if ifname:
            gloo[t] = ifname
    if gloo:
        s[ENV_GLOO_IFNAMES] = ",".join(f"{k}={v}" for k, v in gloo.items())
    if any(t != "local" for t in transports):
        s["NCCL_IGNORE_NET_MISMATCH"] = "0"
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
                 node_env: Optional[Mapping[str, Mapping[str, str]]] = None) -> Preflight:
    """The checks over a Plan or a Cluster (``source``), discovery views (override the file's NICs per node),
    and the environment. ``cluster``: the Cluster whose ``nics`` describe the nodes when ``source`` is a Plan."""
    from .plan import Plan
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
    return preflight(groups, nics, env, node_env=node_env, clusters=node_cluster)


def render_env(result: Preflight, *, per: str = "node", node: Optional[str] = None) -> str:
    """``export`` lines: per node (``# node NAME``), per cluster (shared lines, then each node's own), or one node."""
    def exports(settings: Mapping[str, str]) -> list[str]:
        return [f"export {k}={_quote(v)}" for k, v in settings.items()]
    lines: list[str] = []
    if node is not None:
        return "\n".join(exports(result.nodes[node].settings)) + "\n"
    if per == "cluster":
        for c, info in result.cluster_settings().items():
            lines.append(f"# cluster {c}: {_names(info['nodes'])}")
            lines += exports(info["common"])
            for n, own in info["per_node"].items():
                lines.append(f"#   node {n} only:")
                lines += ["#   " + x for x in exports(own)]
    else:
        for n, r in result.nodes.items():
            lines.append(f"# node {n}" + (f" (cluster {r.cluster})" if r.cluster else ""))
            lines += exports(r.settings)
    return "\n".join(lines) + "\n"


def _quote(value: str) -> str:
    import shlex
    return shlex.quote(value)


def render_text(result: Preflight) -> str:
    lines = []
    for n, r in result.nodes.items():
        head = f"node {n}" + (f" (cluster {r.cluster}, NICs from {r.source})" if r.cluster else f" ({r.source})")
        lines.append(head)
        for t, used in r.uses.items():
            lines.append(f"  {t:<11} uses {', '.join(used) or 'nothing'}")
        for k, v in r.settings.items():
            lines.append(f"  export {k}={_quote(v)}")
    for w in result.warnings:
        lines.append(f"warning: {w}")
    if result.ok:
        lines.append("pre-flight: ok")
    else:
        lines.append(f"pre-flight: {len(result.refusals)} problem(s) would make NCCL hang or fail; refused")
    return "\n".join(lines) + "\n"


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
    if world_net_name != NET_NAME_UNREADABLE or world.transport == "host-staged":
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
    if world.transport == "host-staged":
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
