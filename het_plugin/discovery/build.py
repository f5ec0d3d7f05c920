"""From per-rank node views to a cluster file: one cluster per fabric, links between them.

Nodes whose active RDMA ports have the same type and aggregate speed form one cluster (or, when
``HET_PLUGIN_FABRIC_NAME`` is set, nodes with the same fabric name); Ethernet-only nodes form one
Ethernet cluster. Links between clusters default to the slowest Ethernet speed seen on either side,
overridable by a small YAML file. The result is checked with the cluster file schema, and its launch
order is the launcher's rank order.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import yaml
from pydantic import BaseModel, ConfigDict, PositiveFloat

from ..core.inputs import catalog
from ..core.inputs.cluster import Cluster, FabricType, LinkSpec, cluster_from_dict
from ..core.errors import ConfigError
from ..core.inputs.yamlio import read_data, validate
from .accelerator import OVERRIDE_FIX
from .node import ENV_FABRIC_NAME, ENV_NODE_NAME, NodeView

ENV_LINKS = "HET_PLUGIN_LINKS"
ENV_ETHERNET_GBPS = "HET_PLUGIN_ETHERNET_GBPS"
DEFAULT_UNKNOWN_ETHERNET_GBPS = 10.0
FABRIC_LATENCY_US = {"ib": 2.0, "roce": 5.0, "ethernet": 25.0}
SOURCE = "discovery"


@dataclass(frozen=True)
class RankView:
    """One rank's report: its launch rank, its local rank (None: not known) and its node."""
    rank: int
    local_rank: Optional[int]
    node: NodeView

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "local_rank": self.local_rank, "node": self.node.to_dict()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RankView":
        return cls(data["rank"], data.get("local_rank"), NodeView.from_dict(data["node"]))


class DefaultLink(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    type: FabricType = "ethernet"
    gbps: PositiveFloat
    latency_us: float = 50.0


class LinksFile(BaseModel):
    """``HET_PLUGIN_LINKS``: links between discovered clusters, and a default for the others."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    default: Optional[DefaultLink] = None
    links: list[LinkSpec] = []


LinksArg = Union[None, str, os.PathLike, Mapping[str, Any], LinksFile]


def load_links(links: LinksArg = None, env: Mapping[str, str] | None = None) -> Optional[LinksFile]:
    """The links override: an argument (path, mapping or LinksFile) or the file in HET_PLUGIN_LINKS."""
    env = os.environ if env is None else env
    if links is None:
        path = env.get(ENV_LINKS, "").strip()
        if not path:
            return None
        links = path
    if isinstance(links, LinksFile):
        return links
    if isinstance(links, Mapping):
        return validate(LinksFile, dict(links), "links")
    return validate(LinksFile, read_data(links), str(links))


def unknown_speed(value: Optional[float] = None, env: Mapping[str, str] | None = None) -> float:
    """The Gbit/s assumed for an Ethernet NIC whose driver reports no speed (virtio, some VMs)."""
    env = os.environ if env is None else env
    if value is None:
        text = env.get(ENV_ETHERNET_GBPS, "").strip()
        if not text:
            return DEFAULT_UNKNOWN_ETHERNET_GBPS
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise ConfigError(f"{text!r} is not a positive number", source=ENV_ETHERNET_GBPS,
                              fix="set it to the Ethernet speed in Gbit/s, e.g. 25")
    return float(value)


@dataclass
class _Node:
    view: NodeView
    first_rank: int
    num_ranks: int


def nodes_in_launch_order(views: Sequence[Union[RankView, NodeView]]) -> list[_Node]:
    """Group rank views by node name; check the launch is node-major (each node one block of ranks).

    Plain NodeViews stand for whole nodes in launch order with one rank per accelerator.
    """
    rank_views = _as_rank_views(views)
    ranks = sorted(v.rank for v in rank_views)
    if ranks != list(range(len(ranks))):
        dup = sorted({r for r in ranks if ranks.count(r) > 1})
        missing = sorted(set(range(len(ranks))) - set(ranks))
        raise ConfigError(f"rank views must cover ranks 0..{len(ranks) - 1} once each "
                          f"(repeated {dup}, missing {missing})", source=SOURCE, field="rank",
                          fix="give every rank its own RANK (torchrun does)")
    rank_views = sorted(rank_views, key=lambda v: v.rank)
    by_name: dict[str, list[RankView]] = {}
    for v in rank_views:
        by_name.setdefault(v.node.name, []).append(v)
    nodes: list[_Node] = []
    for name, members in by_name.items():
        first = members[0].rank
        got = [m.rank for m in members]
        if got != list(range(first, first + len(members))):
            raise ConfigError(f"the ranks on node {name!r} are {got}, not one consecutive block: the launch is not "
                              "node-major, which a cluster file cannot describe", source=SOURCE, field="rank",
                              fix="launch with torchrun (or any launcher giving each node a consecutive block of "
                                  f"ranks), or give each node a distinct {ENV_NODE_NAME}")
        for m in members:
            if m.local_rank is not None and m.local_rank != m.rank - first:
                raise ConfigError(f"rank {m.rank} on node {name!r} has local rank {m.local_rank}, but is number "
                                  f"{m.rank - first} of the node's ranks {got}", source=SOURCE, field="local_rank",
                                  fix="number local ranks in rank order inside each node (torchrun does)")
            if m.node.hardware() != members[0].node.hardware():
                raise ConfigError(f"ranks {members[0].rank} and {m.rank} both say they are on node {name!r} but "
                                  "see different hardware", source=SOURCE, field="node",
                                  fix=f"give every node a distinct {ENV_NODE_NAME} (or hostname), and every rank "
                                      "of one node the same environment")
        nodes.append(_Node(members[0].node, first, len(members)))
    return nodes


def _as_rank_views(views: Sequence[Union[RankView, NodeView]]) -> list[RankView]:
    out: list[RankView] = []
    next_rank = 0
    for v in views:
        if isinstance(v, RankView):
            out.append(v)
            continue
        if not v.accelerator_count:
            raise ConfigError(f"node {v.name!r}: accelerator count unknown, so its ranks are unknown",
                              source=SOURCE, field="accelerator_count",
                              fix="set HET_PLUGIN_ACCELERATOR_COUNT, or pass one RankView per rank")
        for local in range(v.accelerator_count):
            out.append(RankView(next_rank, local, v))
            next_rank += 1
    return out


def build_cluster_data(views: Sequence[Union[RankView, NodeView]], *, links: LinksArg = None,
                       unknown_ethernet_gbps: Optional[float] = None, name: str = "discovered",
                       notes: Optional[list[str]] = None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A valid cluster file (as a dict) whose launch order is the views' rank order.

    ``notes`` (a list) receives every assumption made (unknown speeds, placeholder numbers).
    """
    notes = notes if notes is not None else []
    assumed = unknown_speed(unknown_ethernet_gbps, env)
    override = load_links(links, env)
    nodes = nodes_in_launch_order(views)
    _check_accelerators(nodes)
    peak_placeholder = _placeholder_peak(nodes, notes)

    clusters: dict[str, dict[str, Any]] = {}   # cluster name -> {type, gbps, nodes}
    for node in nodes:
        seen = node.view.accelerator_count
        if seen and seen != node.num_ranks:
            notes.append(f"node {node.view.name}: {node.num_ranks} rank(s) on {seen} accelerator(s); the cluster "
                         f"file counts the ranks")
        ftype, gbps = _node_fabric(node.view, assumed, notes)
        cname = node.view.fabric_name or (f"{ftype}-{gbps:g}g" if ftype != "ethernet" else "ethernet")
        c = clusters.setdefault(cname, {"type": ftype, "gbps": [], "nodes": []})
        if c["type"] != ftype:
            other = c["nodes"][0].view.name
            raise ConfigError(f"fabric name {cname!r} covers node {other!r} ({c['type']}) and node "
                              f"{node.view.name!r} ({ftype})", source=ENV_FABRIC_NAME,
                              fix="give nodes on different kinds of fabric different fabric names")
        c["gbps"].append(gbps)
        c["nodes"].append(node)

    out_clusters = []
    for cname, c in clusters.items():
        gbps = min(c["gbps"])
        if len(set(c["gbps"])) > 1:
            notes.append(f"cluster {cname}: nodes inject {sorted(set(c['gbps']))} Gbit/s; using the slowest, {gbps:g}")
        out_clusters.append({"name": cname,
                             "fabric": {"type": c["type"], "gbps": gbps, "latency_us": FABRIC_LATENCY_US[c["type"]]},
                             "nodes": _node_groups(c["nodes"], assumed, peak_placeholder)})

    data: dict[str, Any] = {"name": name, "clusters": out_clusters}
    data["links"] = _links(clusters, override, assumed, notes)
    file_order = [h for c in out_clusters for g in c["nodes"] for h in g["hostnames"]]
    launch_order = [n.view.name for n in nodes]
    if file_order != launch_order:
        data["launch"] = {"node_order": launch_order}
    cluster = cluster_from_dict(data, SOURCE)   # the schema's own checks, and the launch order below
    _check_launch(cluster, nodes)
    return data


def cluster_from_views(views: Sequence[Union[RankView, NodeView]], **kwargs) -> Cluster:
    """The :class:`Cluster` of per-rank or per-node views (keyword arguments: :func:`build_cluster_data`'s)."""
    return cluster_from_dict(build_cluster_data(views, **kwargs), SOURCE)


def _node_fabric(view: NodeView, assumed: float, notes: list[str]) -> tuple[str, float]:
    ftype, gbps = view.fabric_type, view.fabric_gbps
    if len(view.rdma_bandwidth) > 1:
        notes.append(f"node {view.name}: has both InfiniBand and RoCE ports; its fabric is {ftype} (the faster)")
    if gbps is None:
        why = "its Ethernet NICs report no speed" if view.ethernet else "it has no Ethernet NIC up"
        notes.append(f"node {view.name}: {why}; assuming {assumed:g} Gbit/s (set {ENV_ETHERNET_GBPS} to change)")
        gbps = assumed
    return ftype, gbps


def _check_accelerators(nodes: list[_Node]) -> None:
    missing = [n for n in nodes if n.view.accelerator is None]
    if missing:
        where = ", ".join(f"{n.view.name} ({_ranks_text(n)})" for n in missing)
        raise ConfigError(f"no accelerator detected on node(s) {where}", source=SOURCE, field="accelerator",
                          fix=f"on nodes whose devices torch cannot see, {OVERRIDE_FIX}")


def _ranks_text(node: _Node) -> str:
    last = node.first_rank + node.num_ranks - 1
    return f"rank {last}" if node.num_ranks == 1 else f"ranks {node.first_rank}-{last}"


def _placeholder_peak(nodes: list[_Node], notes: list[str]) -> Optional[float]:
    """Parts torch named but the catalog lacks: fine alone (speed is relative), not mixed with others."""
    parts = {n.view.accelerator.name: n.view.accelerator for n in nodes}
    unknown = sorted(p for p, a in parts.items() if a.peak_tflops is None and not a.in_catalog)
    if not unknown:
        return None
    if len(parts) > 1:
        raise ConfigError(f"accelerator(s) {unknown} are not in the catalog, and the cluster mixes them with "
                          f"{sorted(set(parts) - set(unknown))}: their relative speed is unknown", source=SOURCE,
                          field="accelerator", fix=f"on those nodes, {OVERRIDE_FIX}")
    placeholder = catalog.lookup("other-vendor").peak_tflops
    notes.append(f"accelerator {unknown[0]} is not in the catalog; one part only, so a placeholder "
                 f"{placeholder:g} TFLOPS (relative speed is what matters)")
    return placeholder


def _node_groups(nodes: list[_Node], assumed: float, peak_placeholder: Optional[float]) -> list[dict[str, Any]]:
    """Runs of identical nodes (part, ranks, NICs) inside one cluster, with their hostnames."""
    groups: dict[str, dict[str, Any]] = {}
    for node in nodes:
        view = node.view
        group = {"count": 0,
                 "accelerator": view.accelerator.cluster_spec(peak_placeholder),
                 "accelerators_per_node": node.num_ranks,
                 "nics": _nics(view, assumed)}
        key = json.dumps(group, sort_keys=True)
        g = groups.setdefault(key, dict(group, hostnames=[]))
        g["count"] += 1
        g["hostnames"].append(view.name)
    out = []
    for g in groups.values():
        if not g["nics"]:
            del g["nics"]
        out.append(g)
    return out


def _nics(view: NodeView, assumed: float) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    per_device: dict[str, int] = {}
    for p in view.rdma:
        per_device[p.device] = per_device.get(p.device, 0) + 1
    rdma: dict[tuple[str, float], dict[str, Any]] = {}
    for p in view.rdma:
        nic = rdma.setdefault((p.type, p.gbps), {"type": p.type, "gbps": p.gbps, "devices": [], "interfaces": []})
        nic["devices"].append(p.device if per_device[p.device] == 1 else f"{p.device}:{p.port}")
        nic["interfaces"].extend(d for d in p.netdevs if d not in nic["interfaces"])
    eth: dict[float, dict[str, Any]] = {}
    for n in view.ethernet:
        gbps = n.gbps if n.gbps is not None else assumed
        eth.setdefault(gbps, {"type": "ethernet", "gbps": gbps, "interfaces": []})["interfaces"].append(n.name)
    for nic in list(rdma.values()) + list(eth.values()):
        if not nic.get("interfaces"):
            nic.pop("interfaces", None)
        out.append(nic)
    return out


def _side_speed(cluster: dict[str, Any], assumed: float) -> Optional[float]:
    """The Ethernet speed a cluster can push out: the slowest node's fastest Ethernet-capable NIC."""
    if cluster["type"] == "ethernet":
        return min(cluster["gbps"])
    speeds = []
    for node in cluster["nodes"]:
        v = node.view
        candidates = [n.gbps for n in v.ethernet if n.gbps is not None] + [p.gbps for p in v.rdma if p.type == "roce"]
        if candidates:
            speeds.append(max(candidates))
        elif v.ethernet:
            speeds.append(assumed)
    return min(speeds) if speeds else None


def _links(clusters: dict[str, dict[str, Any]], override: Optional[LinksFile], assumed: float,
           notes: list[str]) -> list[dict[str, Any]]:
    names = list(clusters)
    stated: dict[frozenset, LinkSpec] = {}
    if override is not None:
        for i, link in enumerate(override.links):
            for end in link.between:
                if end not in clusters:
                    raise ConfigError(f"links[{i}] names cluster {end!r}, which discovery did not find",
                                      source=ENV_LINKS, field=f"links[{i}].between",
                                      fix=f"use the discovered cluster names {names} (see het-plugin discover "
                                          f"--gather), or name fabrics with {ENV_FABRIC_NAME}")
            stated[frozenset(link.between)] = link
    out = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            link = stated.get(frozenset((a, b)))
            if link is not None:
                out.append({"between": [a, b], "type": link.type, "gbps": link.gbps, "latency_us": link.latency_us})
                continue
            if override is not None and override.default is not None:
                d = override.default
                out.append({"between": [a, b], "type": d.type, "gbps": d.gbps, "latency_us": d.latency_us})
                continue
            sides = [_side_speed(clusters[a], assumed), _side_speed(clusters[b], assumed)]
            if None in sides:
                blind = [n for n, s in zip((a, b), sides) if s is None]
                raise ConfigError(f"no Ethernet NIC seen in cluster(s) {blind}, so the link between {a!r} and "
                                  f"{b!r} is unknown", source=SOURCE, field="links",
                                  fix=f"write a links file (links: [{{between: [{a}, {b}], gbps: 25}}]) and set "
                                      f"{ENV_LINKS} to its path")
            out.append({"between": [a, b], "type": "ethernet", "gbps": min(sides), "latency_us": 50.0})
    return out


def _check_launch(cluster: Cluster, nodes: list[_Node]) -> None:
    """The cluster file must put every rank on the node that reported it."""
    got = [(n.name, n.num_accelerators) for n in cluster.nodes]
    want = [(n.view.name, n.num_ranks) for n in nodes]
    if got != want:   # a bug here, not a user error: say exactly what differs
        raise AssertionError(f"discovered cluster's launch order {got} differs from the ranks' {want}")


def links_setting(links: LinksArg = None, env: Mapping[str, str] | None = None) -> Optional[dict[str, Any]]:
    """The links override as plain data, for comparing ranks' settings."""
    lf = load_links(links, env)
    return None if lf is None else lf.model_dump(mode="json")


def format_yaml(data: dict[str, Any], notes: Sequence[str] = ()) -> str:
    """The cluster file text, with what discovery assumed as comments on top."""
    head = ["# cluster discovered by het-plugin (sysfs NICs + torch accelerators)"]
    head += [f"# note: {n}" for n in notes]
    return "\n".join(head) + "\n" + yaml.safe_dump(data, sort_keys=False, default_flow_style=None)
