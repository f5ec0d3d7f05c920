"""Which nodes a plan uses: the best plan over subsets of the cluster's node groups, and what a run costs.

The planner (:func:`planner.make_plan`) places every rank it is given. On a cluster where some devices only slow
the job down (old GPUs behind a slow link) that plan is slower than leaving them out, so :func:`plan_nodes` also
plans sub-clusters formed by leaving out whole *node groups* (the nodes of one device type and node size in one
cluster) and returns the best plan over the subsets it tried; the plan is then for the kept nodes
(``Plan.nodes``, ``world_size``) and ``Plan.left_out`` says which nodes it leaves out, why, and the best plan
with every node. A subset is searched only where its compute floor (every device busy, no bubble, no
communication: a lower bound of any prediction without a measured profile) beats the best plan found so far, so
a group too slow to shorten the iteration is dropped without a search. A subset (of one device type too) whose
floor beats it is first screened with the best plan as a cut-off (:func:`planner.could_beat`) and planned only
where it may win.

Objective ``time`` (the default): the shortest predicted iteration. ``cost``: the cheapest iteration at the
cluster file's ``price_per_device_hour`` (devices included: leaving nodes out is what saves), optionally only
plans with at least ``min_tokens_per_s``. Within one subset the fastest plan is also the cheapest (same devices,
same price per second), so each subset's best plan is all either objective needs.

A plan that leaves nodes out runs on its kept nodes only: the launch starts those (``launch_lines``,
``deepspeed_hostfile``); :func:`check_launch_nodes` (node names, world size) and :func:`check_launch_hosts` (every
rank's host, gathered at the plan agreement) refuse a launch that includes left-out nodes or runs elsewhere.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

from .errors import ConfigError
from .inputs.cluster import Cluster
from .inputs.model import ModelSpec
from .plan import Plan
from .planner import could_beat, make_plan
from .ranks.dims import format_ranks

OBJECTIVES = ("time", "cost")
#: Up to this many node groups every subset is a candidate; past it, subsets leaving out at most
#: :data:`MAX_LEFT_OUT_PAST_LIMIT` groups (2^k subsets would not fit the planner-time goals).
MAX_GROUPS_EXHAUSTIVE = 6
MAX_LEFT_OUT_PAST_LIMIT = 2


@dataclass(frozen=True)
class NodeGroup:
    """Nodes of one cluster, device type and node size, in launch order: the unit the search leaves out."""
    cluster: str
    accelerator: str
    per_node: int
    nodes: tuple[str, ...]
    sustained_flops: float               # all its devices together
    price_per_device_hour: Optional[float]

    @property
    def label(self) -> str:
        return f"{self.cluster}/{self.accelerator}"

    @property
    def devices(self) -> int:
        return self.per_node * len(self.nodes)


def node_groups(cluster: Cluster) -> list[NodeGroup]:
    """The cluster's node groups, in the order their first node launches."""
    members: dict[tuple, list] = {}
    for n in cluster.nodes:
        members.setdefault((n.cluster, n.accelerator.name, n.num_accelerators, n.price_per_device_hour), []).append(n)
    return [NodeGroup(c, a, per, tuple(n.name for n in ns), sum(n.accelerator.sustained_flops * per for n in ns),
                      price) for (c, a, per, price), ns in members.items()]


def sub_cluster(cluster: Cluster, keep: Sequence[str]) -> Cluster:
    """The cluster of the kept nodes (names), in the launch order of the whole one, with the links between the
    clusters that keep a node: what a cluster file listing only those nodes (by hostname) describes."""
    wanted = set(keep)
    unknown = sorted(wanted - {n.name for n in cluster.nodes})
    if unknown:
        raise ConfigError(f"nodes {unknown} are not in the cluster", source=cluster.source, field="nodes",
                          fix=f"name nodes of {cluster.name}: {', '.join(n.name for n in cluster.nodes[:4])} ...")
    if not wanted:
        raise ConfigError("a sub-cluster needs at least one node", source=cluster.source, field="nodes",
                          fix="keep at least one node")
    nodes = [replace(n, index=i) for i, n in enumerate(n for n in cluster.nodes if n.name in wanted)]
    names = {n.cluster for n in nodes}
    links = {k: v for k, v in cluster.links.items() if k <= names}
    return Cluster(cluster.name, nodes, links, cluster.source)


def kept_cluster(cluster: Cluster, plan: Plan) -> Cluster:
    """The cluster ``plan`` was made for: ``cluster`` itself, or its sub-cluster of the plan's nodes when the plan
    leaves nodes out (what the cost model and the pictures need to re-predict it)."""
    if not plan.left_out or cluster.digest == plan.cluster_digest:
        return cluster
    return sub_cluster(cluster, [n.name for n in plan.nodes])


def compute_floor_s(model: ModelSpec, sustained_flops: float) -> float:
    """No prediction of the analytic cost model goes below this: the forward and backward FLOPs of the global
    batch (decoder layers, output layer, MTP: what the stages compute) over every device's sustained rate, as if
    every device were busy all the time (no bubble, no communication, no optimizer step)."""
    per_sample = model.decoder_flops_fwd(1) + model.logits_flops_fwd(1) + model.mtp_flops_fwd(1)
    return 3.0 * model.global_batch_size * per_sample / sustained_flops


def price_per_hour(groups: Sequence[NodeGroup]) -> Optional[float]:
    """What the groups' devices cost per hour; None unless every group has a price."""
    if not groups or any(g.price_per_device_hour is None for g in groups):
        return None
    return sum(g.price_per_device_hour * g.devices for g in groups)


@dataclass
class Tried:
    """One subset of the search: the groups it keeps, its compute floor, and its best plan or why none."""
    groups: tuple[int, ...]
    floor_s: float
    plan: Optional[Plan] = None
    error: Optional[ConfigError] = None
    searched: bool = False
    screened: bool = False               # searched only as far as showing it cannot beat the best (no plan kept)

    @property
    def iteration_s(self) -> float:
        return self.plan.prediction.iteration_s if self.plan is not None and self.plan.prediction else math.inf


@dataclass
class SubsetSearch:
    """What :func:`search_subsets` found: the chosen plan, the whole cluster's, and every subset considered."""
    plan: Plan
    full: Tried
    tried: list[Tried] = field(default_factory=list)

    @property
    def searched(self) -> int:
        return sum(t.searched for t in self.tried)

    @property
    def pruned(self) -> int:
        return sum(not t.searched for t in self.tried)


def _candidate_subsets(k: int) -> list[tuple[int, ...]]:
    """Proper non-empty subsets of k groups (group indices, ascending); past MAX_GROUPS_EXHAUSTIVE groups only
    those leaving out at most MAX_LEFT_OUT_PAST_LIMIT."""
    least = 1 if k <= MAX_GROUPS_EXHAUSTIVE else max(1, k - MAX_LEFT_OUT_PAST_LIMIT)
    return [s for size in range(k - 1, least - 1, -1) for s in itertools.combinations(range(k), size)]


def check_objective(objective: str, min_tokens_per_s: Optional[float], groups: Sequence[NodeGroup],
                    source: str) -> None:
    """The objective is known, a throughput floor comes with the cost objective, and every group is priced."""
    if objective not in OBJECTIVES:
        raise ConfigError(f"objective {objective!r} is not one of {', '.join(OBJECTIVES)}", field="objective",
                          fix="use time (the shortest iteration) or cost (the cheapest iteration)")
    if min_tokens_per_s is not None:
        if objective != "cost":
            raise ConfigError("a minimum throughput is a constraint of the cost objective; the time objective already "
                              "takes the fastest plan", field="min_throughput", fix="add --objective cost, or drop it")
        if not (isinstance(min_tokens_per_s, (int, float)) and math.isfinite(min_tokens_per_s)
                and min_tokens_per_s > 0):
            raise ConfigError(f"minimum throughput {min_tokens_per_s!r} is not a positive number of tokens/s",
                              field="min_throughput", fix="give tokens per second, e.g. 100000")
    if objective == "cost":
        missing = [g.label for g in groups if g.price_per_device_hour is None]
        if missing:
            raise ConfigError(f"the cost objective needs a price for every node group; {', '.join(missing)} "
                              f"{'has' if len(missing) == 1 else 'have'} none", source=source,
                              field="clusters[*].nodes[*].price_per_device_hour",
                              fix="add price_per_device_hour to those node groups of the cluster file, or plan "
                                  "with --objective time")


def search_subsets(cluster: Cluster, model: ModelSpec, *, use_all_nodes: bool = False, objective: str = "time",
                   min_tokens_per_s: Optional[float] = None, plan_fn: Optional[Callable[..., Plan]] = None,
                   **options: Any) -> SubsetSearch:
    """The search behind :func:`plan_nodes`; ``options`` go to ``make_plan`` for every subset (``plan_fn``: a
    stand-in for it)."""
    plan_fn = plan_fn or make_plan
    groups = node_groups(cluster)
    check_objective(objective, min_tokens_per_s, groups, cluster.source)
    cost = objective == "cost"
    measured = options.get("profile") is not None      # measured layer times: the compute floor is no bound
    everything = tuple(range(len(groups)))

    def floor(keep: tuple[int, ...]) -> float:
        return 0.0 if measured else compute_floor_s(model, sum(groups[i].sustained_flops for i in keep))

    def rate(keep: tuple[int, ...]) -> float:
        return (price_per_hour([groups[i] for i in keep]) or 0.0) / 3600.0

    def meets(t: Tried) -> bool:
        return t.plan is not None and (min_tokens_per_s is None
                                       or t.plan.prediction.tokens_per_s >= min_tokens_per_s)

    def score(t: Tried) -> float:
        return (t.iteration_s * rate(t.groups) if cost else t.iteration_s) if meets(t) else math.inf

    def run(t: Tried, sub: Cluster) -> None:
        t.searched, t.screened = True, False
        try:
            t.plan = plan_fn(sub, model, **options)
        except ConfigError as exc:
            t.error = exc

    def sub_of(t: Tried) -> Cluster:
        return sub_cluster(cluster, [n for i in t.groups for n in groups[i].nodes])

    # The time objective: a subset must predict below the best so far, so it is first screened with that cut-off
    # (planner.could_beat: no plan assembled, candidates that cannot beat it pruned) and planned only if it may.
    screen = not cost and min_tokens_per_s is None and plan_fn is make_plan

    full = Tried(everything, floor(everything))
    run(full, cluster)
    best = full
    tried: list[Tried] = []
    if not use_all_nodes and len(groups) > 1:
        subsets = [Tried(s, floor(s)) for s in _candidate_subsets(len(groups))]
        tokens = model.global_batch_size * model.seq_length
        bound = (lambda t: t.floor_s * rate(t.groups)) if cost else (lambda t: t.floor_s)
        subsets.sort(key=lambda t: (bound(t), -len(t.groups), t.groups))
        for t in subsets:
            tried.append(t)
            if bound(t) >= score(best):
                continue                            # cannot beat the best: not searched
            if min_tokens_per_s is not None and t.floor_s > 0 and tokens / t.floor_s < min_tokens_per_s:
                continue                            # cannot reach the throughput floor
            sub = sub_of(t)
            near = (best.plan.tp, best.plan.pp) if best.plan is not None else None
            if screen and not _may_beat(sub, model, score(best), near, options):
                t.searched = t.screened = True      # searched: it cannot beat the best
                continue
            run(t, sub)
            if score(t) < score(best):
                best = t
    if best.plan is None or not meets(best):
        if full.error is not None and all(t.plan is None for t in tried):
            raise full.error
        reached = max((t.plan.prediction.tokens_per_s for t in [full] + tried if t.plan is not None), default=0.0)
        raise ConfigError(f"no plan reaches the minimum throughput of {min_tokens_per_s:,.0f} tokens/s; the fastest "
                          f"predicts {reached:,.0f}", source=cluster.source, field="min_throughput",
                          fix=f"ask for at most {reached:,.0f} tokens/s, or add devices")
    plan = best.plan
    price = price_per_hour([groups[i] for i in best.groups])
    if best is not full:
        kept = set(best.groups)
        for t in tried:     # the report gives each left-out group's plan with it added back: plan those screened
            if t.screened and len(t.groups) == len(kept) + 1 and kept <= set(t.groups):
                run(t, sub_of(t))
        plan.left_out = _left_out(cluster, model, groups, best, full, tried, objective, min_tokens_per_s)
    plan.price_per_hour = price
    return SubsetSearch(plan, full, tried)


def _may_beat(sub: Cluster, model: ModelSpec, cutoff: float, near, options: dict) -> bool:
    """planner.could_beat, where a ConfigError means "plan it" (make_plan then records the error as before)."""
    try:
        return could_beat(sub, model, cutoff, near=near, **options)
    except ConfigError:
        return True


def plan_nodes(cluster: Cluster, model: ModelSpec, *, use_all_nodes: bool = False, objective: str = "time",
               min_tokens_per_s: Optional[float] = None, **options: Any) -> Plan:
    """The best plan over the subsets of ``cluster``'s node groups (see the module docstring); ``options`` are
    ``make_plan``'s. ``use_all_nodes``: plan with every node (what the frameworks launch by default), the
    plan ``make_plan`` gives. A plan that uses every node is exactly ``make_plan``'s (same hash) unless the
    cluster file has prices (then ``price_per_hour`` is set)."""
    return search_subsets(cluster, model, use_all_nodes=use_all_nodes, objective=objective,
                          min_tokens_per_s=min_tokens_per_s, **options).plan


def _summary(plan: Plan) -> dict[str, Any]:
    p = plan.prediction
    return {"tp": plan.tp, "pp": plan.pp, "dp": plan.dp, "micro_batch_size": plan.micro_batch_size,
            "layers_per_stage": list(plan.layers_per_stage), "world_size": plan.world_size,
            "iteration_s": round(p.iteration_s, 6), "tokens_per_s": round(p.tokens_per_s, 1),
            "description": p.description}


def _left_out(cluster: Cluster, model: ModelSpec, groups: list[NodeGroup], best: Tried, full: Tried,
              tried: list[Tried], objective: str, min_tokens_per_s: Optional[float]) -> dict[str, Any]:
    """What ``Plan.left_out`` records: the nodes, each left-out group with the best plan found that adds it back
    (or the compute floor that ruled it out), the best plan with every node, and how the search went."""
    kept = set(best.groups)
    by_groups = {t.groups: t for t in tried}
    out_groups = []
    for i, g in enumerate(groups):
        if i in kept:
            continue
        back = by_groups.get(tuple(sorted(kept | {i})), full if kept | {i} == set(range(len(groups))) else None)
        entry: dict[str, Any] = {"group": g.label, "nodes": list(g.nodes), "devices": g.devices}
        if back is not None and back.plan is not None:
            entry["with_it_s"] = round(back.iteration_s, 6)
        elif back is not None and back.searched:
            entry["with_it"] = f"no plan: {back.error.problem if back.error else 'none found'}"
        elif back is not None:
            entry["floor_with_it_s"] = round(back.floor_s, 6)
        out_groups.append(entry)
    out: dict[str, Any] = {
        "nodes": [n.name for n in cluster.nodes if n.name not in {x for i in kept for x in groups[i].nodes}],
        "groups": out_groups, "cluster_digest": cluster.digest, "world_size": cluster.world_size,
        "objective": objective, "searched": 1 + sum(t.searched for t in tried),
        "pruned": sum(not t.searched for t in tried)}
    if min_tokens_per_s is not None:
        out["min_tokens_per_s"] = min_tokens_per_s
    if full.plan is not None:
        out["all_nodes"] = _summary(full.plan)
        price = price_per_hour(groups)
        if price is not None:
            out["all_nodes"]["price_per_hour"] = price
    else:
        out["all_nodes_error"] = full.error.problem if full.error else "no plan"
    return out


# ---- launching a plan that leaves nodes out ----------------------------------------------------------------


def deepspeed_hostfile(plan: Plan) -> str:
    """The plan's nodes as a DeepSpeed hostfile (``hostname slots=N``), in launch order."""
    return "".join(f"{n.name} slots={n.num_ranks}\n" for n in plan.nodes)


def launch_lines(plan: Plan, limit: int = 16) -> list[str]:
    """How to launch the plan's nodes: the node list, DeepSpeed's hostfile or --include/--exclude (DeepSpeed 0.19's
    launcher, ``deepspeed/launcher/runner.py``: ``host slots=N`` lines, nodes numbered in the file's order, the
    filters ``host@host`` over that file), torchrun's --nnodes (past ``limit`` nodes the lists are cut short:
    ``het-plugin plan --hostfile-out/--nodes-out`` write them whole)."""
    names = [n.name for n in plan.nodes]
    left = list(plan.left_out.get("nodes", [])) if plan.left_out else []
    per = sorted({n.num_ranks for n in plan.nodes})

    def cut(items: list[str], sep: str) -> str:
        return sep.join(items) if len(items) <= limit else f"{sep.join(items[:limit])}{sep}... ({len(items)} in all)"

    lines = [f"nodes ({len(names)}, in launch order = node_rank): {cut(names, ' ')}"]
    if left:
        lines.append(f"left out ({len(left)}), do not launch them: {cut(left, ' ')}")
    # DeepSpeed's launcher numbers nodes in its hostfile's order; --include/--exclude only filter that file
    lines.append(f"deepspeed: --hostfile FILE with these nodes in this order (--hostfile-out), or on a hostfile of "
                 f"every node in this order --include {cut(names, '@')}"
                 + (f" or --exclude {cut(left, '@')}" if left else ""))
    nproc = str(per[0]) if len(per) == 1 else "<the node's ranks>"
    lines.append(f"torchrun: --nnodes {len(names)} --nproc-per-node {nproc}, --node-rank i on the i-th node above "
                 f"(WORLD_SIZE {plan.world_size}); give the run the plan file (Megatron-LM: --heterogeneous-nic PLAN)")
    return lines


def node_list(plan: Plan) -> str:
    """The plan's nodes, one hostname a line in node_rank order (a torchrun/Slurm node list)."""
    return "".join(f"{n.name}\n" for n in plan.nodes)


def _launch_fix(plan: Plan) -> str:
    """How to launch ``plan`` instead: its nodes, DeepSpeed's filter, torchrun; or a plan with every node."""
    planned = [n.name for n in plan.nodes]
    shown = " ".join(planned) if len(planned) <= 16 else f"{' '.join(planned[:16])} ... ({len(planned)} in all)"
    return (f"launch only the plan's {len(planned)} nodes, in this order ({shown}): deepspeed --hostfile with "
            f"them (`het-plugin plan PLAN --hostfile-out HOSTS`), or --include {'@'.join(planned[:16])}"
            f"{'@...' if len(planned) > 16 else ''} on a hostfile listing them in this order, or torchrun "
            f"--nnodes {len(planned)} with --node-rank i on the i-th; or re-plan with every node "
            "(`het-plugin plan --use-all-nodes`, use_all_nodes=True)")


def same_host(a: str, b: str) -> bool:
    """A launch's hostname names a node of the file: equal, or equal up to the domain where one side has none
    (``main-0`` is ``main-0.cluster.local``; IP addresses only equal)."""
    return _HostIndex([b]).match(a) is not None


def _is_address(name: str) -> bool:
    return ":" in name or all(part.isdigit() for part in name.split("."))


class _HostIndex:
    """The file's node names, looked up by a launch's hostname as :func:`same_host` compares them, in O(1)."""

    def __init__(self, names: Sequence[str]):
        self.exact = {n: n for n in names}
        self.by_short: dict[str, str] = {}
        for n in names:
            if "." in n and not _is_address(n):
                self.by_short.setdefault(n.split(".", 1)[0], n)

    def match(self, host: str) -> Optional[str]:
        if host in self.exact:
            return host
        if _is_address(host):
            return None
        if "." in host:
            short = host.split(".", 1)[0]
            return short if short in self.exact else None
        return self.by_short.get(host)


def check_launch_nodes(plan: Plan, launch_nodes: Optional[Sequence[str]] = None,
                       world_size: Optional[int] = None) -> None:
    """Refuse a launch that includes nodes ``plan`` leaves out: by hostname (``launch_nodes``, in node_rank order:
    a left-out node, or the kept nodes in another order; names the file does not know are no evidence), and by
    ``world_size`` (any other than the plan's; the whole cluster's names the left-out nodes). Such ranks would
    get no place in any group. The error names the left-out nodes and the launch to use. Pure: the adapters'
    start-up checks every rank's hostname with :func:`check_launch_hosts` at the plan agreement."""
    if not plan.left_out:
        return
    left = plan.left_out["nodes"]
    planned = [n.name for n in plan.nodes]
    fix = _launch_fix(plan)
    if launch_nodes is not None:
        left_index, kept_index = _HostIndex(left), _HostIndex(planned)
        extra = [n for n in launch_nodes if left_index.match(n) is not None]
        if extra:
            raise ConfigError(f"the launch includes {len(extra)} node(s) the plan leaves out: {' '.join(extra)} "
                              f"(the plan is for {plan.world_size} ranks on {len(planned)} nodes)",
                              field="nodes", fix=fix)
        # names the file does not know (it gave no hostnames: its nodes are <cluster>-<i>) tell nothing
        known = [kept_index.match(n) for n in launch_nodes]
        if known and None not in known and known != planned:
            raise ConfigError(f"the launch's nodes ({' '.join(launch_nodes)}) are not the plan's nodes in its launch "
                              f"order ({' '.join(planned)})", field="nodes", fix=fix)
    if world_size is not None and world_size != plan.world_size:
        whole = plan.left_out.get("world_size")
        what = ("every node of the cluster file, including the left-out " + " ".join(left)
                if world_size == whole else f"{world_size} ranks")
        raise ConfigError(f"the launch started {what}, but the plan is for {plan.world_size} ranks on "
                          f"{len(planned)} nodes", field="world_size", fix=fix)


def check_launch_hosts(plan: Plan, hosts: Sequence[Optional[str]]) -> None:
    """Refuse a launch of the plan's world size on other nodes than its own: ``hosts[r]`` is the hostname rank r
    runs on (None: not known), ranks numbered node-major as torchrun and DeepSpeed's launcher number them. Refused:
    a rank on a node the plan leaves out; a rank on a kept node other than the one the plan puts it on (another
    node order, or other ranks per node); and, where the launch's hostnames are the file's (some rank's host is
    a node of the file), a kept node no rank runs on (another node took its place). Hostnames the file does not
    know at all are no evidence (a file without hostnames names its nodes <cluster>-<i>). The error names the
    nodes, their ranks and the launch to use. Pure: rank 0 runs it at the plan agreement, over the hostnames every
    rank sent with its plan hash (:mod:`het_plugin.runtime.launch_hosts`)."""
    if not plan.left_out:
        return
    left = list(plan.left_out["nodes"])
    planned = [n.name for n in sorted(plan.nodes, key=lambda n: n.first_rank)]
    fix = _launch_fix(plan)
    size = f"the plan is for {plan.world_size} ranks on {len(planned)} nodes"
    if len(hosts) != plan.world_size:
        check_launch_nodes(plan, world_size=len(hosts))
    on_left: dict[str, list[int]] = {}
    moved: list[tuple[int, str, str]] = []
    unknown: dict[str, list[int]] = {}
    seen: set[str] = set()
    left_index, kept_index = _HostIndex(left), _HostIndex(planned)
    for rank, host in enumerate(hosts):          # linear in the ranks: rank 0 runs it for every launch
        if not host:
            continue
        left_match, kept_match = left_index.match(host), kept_index.match(host)
        if left_match is not None:
            on_left.setdefault(left_match, []).append(rank)
        elif kept_match is None:
            unknown.setdefault(host, []).append(rank)
        else:
            seen.add(kept_match)
            expected = plan.node_of(rank).name
            if kept_match != expected:
                moved.append((rank, host, expected))
    if on_left:
        where = ", ".join(f"{n} (ranks {format_ranks(rs)})" for n, rs in on_left.items())
        raise ConfigError(f"the launch includes {len(on_left)} node(s) the plan leaves out: {where}; {size}",
                          field="nodes", fix=fix)
    if moved:
        rank, host, expected = moved[0]
        order = f"{' '.join(planned[:16])}{' ...' if len(planned) > 16 else ''}"
        raise ConfigError(f"the launch's nodes are not the plan's in its launch order: rank {rank} runs on {host}, "
                          f"where the plan puts {expected} ({len(moved)} rank(s) misplaced; node_rank must be the "
                          f"node's position in the plan: {order})", field="nodes", fix=fix)
    missing = [n for n in planned if n not in seen]
    if seen and unknown and missing:
        where = ", ".join(f"{h} (ranks {format_ranks(rs)})" for h, rs in list(unknown.items())[:8])
        raise ConfigError(f"the launch leaves out {len(missing)} of the plan's nodes ({' '.join(missing[:16])}"
                          f"{' ...' if len(missing) > 16 else ''}) and runs on node(s) the plan does not know "
                          f"instead: {where}; {size}", field="nodes", fix=fix)
