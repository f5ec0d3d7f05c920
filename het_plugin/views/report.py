"""Readable text report of a Plan (what ``het-plugin plan`` prints).

Works from the Plan alone (no cluster file needed), so a saved plan can be shown anywhere. Big
clusters stay readable: consecutive nodes that hold the same stages and TP/CP coordinates are shown
as one line. Prediction and baseline are optional (a plan built without the cost model has neither).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from ..core.plan import Plan, Prediction
from ..core.ranks.dims import format_ranks
from ..core.planner import replica_split_text
from ..core.subsets import launch_lines


def spans(values: Iterable[int]) -> str:
    """Compact integer set: [0,1,2,5,7,8] -> '0-2,5,7-8' ('-' when empty)."""
    values = list(values)
    return format_ranks(values) if values else "-"


def all_coords(plan: Plan) -> list[dict[str, int]]:
    """Coordinates of every physical rank (Plan.coord inverts the placement on each call: O(n) each)."""
    dims, inverse = plan.dims, plan.logical_of_physical
    return [dims.coord(inverse[r]) for r in range(plan.world_size)]


def rank_nodes(plan: Plan) -> list:
    """NodePlan of every physical rank."""
    out = [None] * plan.world_size
    for n in plan.nodes:
        out[n.first_rank:n.first_rank + n.num_ranks] = [n] * n.num_ranks
    return out


@dataclass
class NodeRow:
    """One line of the placement table: a run of consecutive nodes holding the same coordinates."""
    cluster: str
    accelerator: str
    names: list[str]
    ranks: list[int]
    stages: tuple[int, ...]
    tp: tuple[int, ...]
    cp: tuple[int, ...]
    dp: set[int]

    @property
    def label(self) -> str:
        if len(self.names) == 1:
            return self.names[0]
        return f"{self.names[0]} .. {self.names[-1]} ({len(self.names)} nodes)"


def node_rows(plan: Plan) -> list[NodeRow]:
    """Per-node coordinates, with runs of consecutive similar nodes merged (compact for big clusters)."""
    rows: list[NodeRow] = []
    coords = all_coords(plan)
    for node in plan.nodes:
        ranks = list(range(node.first_rank, node.first_rank + node.num_ranks))
        cs = [coords[r] for r in ranks]
        key = (node.cluster, node.accelerator, tuple(sorted({c["pp"] for c in cs})),
               tuple(sorted({c["tp"] for c in cs})), tuple(sorted({c["cp"] for c in cs})))
        dp = {c["dp"] for c in cs}
        last = rows[-1] if rows else None
        if last and (last.cluster, last.accelerator, last.stages, last.tp, last.cp) == key \
                and last.ranks[-1] + 1 == ranks[0] and len(ranks) == len(last.ranks) // len(last.names):
            last.names.append(node.name)
            last.ranks.extend(ranks)
            last.dp |= dp
        else:
            rows.append(NodeRow(node.cluster, node.accelerator, [node.name], ranks, *key[2:], dp))
    return rows


def stage_summary(plan: Plan) -> list[dict[str, Any]]:
    """Per stage: its layers, where it runs (cluster/accelerator and rank count), embedding/output."""
    node_of = rank_nodes(plan)
    out = []
    for s in range(plan.pp):
        where: Counter = Counter()
        for r in plan.stage_ranks(s):
            n = node_of[r]
            where[f"{n.cluster}/{n.accelerator}"] += 1
        extra = []
        if s == 0:
            extra.append("embedding")
        if s == plan.pp - 1:
            extra.append("output")
        out.append({"stage": s, "layers": plan.layers_per_stage[s], "where": dict(where), "extra": extra})
    return out


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.3f} s"


def _prediction_lines(p: Prediction, indent: str = "  ", memory: bool = True) -> list[str]:
    lines = [f"{indent}iteration {_fmt_s(p.iteration_s)}, {p.tokens_per_s:,.0f} tokens/s, "
             f"{p.tflops_per_device:.1f} TFLOPS per device"]
    parts = []
    if p.pipeline_s:
        parts.append(f"pipeline {_fmt_s(p.pipeline_s)}")
    if p.bubble_fraction:
        parts.append(f"bubble {p.bubble_fraction:.1%}")
    if p.dp_exposed_s:
        parts.append(f"exposed gradient reduction {_fmt_s(p.dp_exposed_s)}")
    if p.optimizer_s:
        parts.append(f"optimizer {_fmt_s(p.optimizer_s)}")
    alltoall = getattr(p, "alltoall_s", 0.0)
    if alltoall:
        parts.append(f"expert all-to-all {_fmt_s(alltoall)} ({alltoall / p.iteration_s:.1%} of the iteration)")
    if parts:
        lines.append(indent + ", ".join(parts))
    extrapolated = getattr(p, "extrapolated", [])
    if extrapolated:
        lines.append(f"{indent}extrapolated: {len(extrapolated)} compute entr{'y' if len(extrapolated) == 1 else 'ies'}"
                     " outside the measured profile:")
        lines.extend(f"{indent}  {line}" for line in extrapolated)
    if memory and p.memory_gib_per_stage:
        lines.append(f"{indent}memory per rank, by stage (used / capacity):")
        caps = p.capacity_gib_per_stage or [None] * len(p.memory_gib_per_stage)
        for s, (m, c) in enumerate(zip(p.memory_gib_per_stage, caps)):
            if c:
                flag = "" if m <= c else "  DOES NOT FIT"
                lines.append(f"{indent}  stage {s}: {m:6.1f} / {c:.0f} GiB ({m / c:.0%}){flag}")
            else:
                lines.append(f"{indent}  stage {s}: {m:6.1f} GiB")
    return lines


def _alternative_line(alt: dict[str, Any], planned_s: Optional[float]) -> str:
    """One alternative plan from the search: its degrees, split, domain order and predicted time."""
    alt = dict(alt)
    parts = []
    degrees = [f"{k}={alt.pop(k)}" for k in ("tp", "cp", "pp", "dp", "ep", "etp") if k in alt]
    if degrees:
        parts.append(" ".join(degrees))
    if "micro_batch_size" in alt:
        parts.append(f"micro-batch {alt.pop('micro_batch_size')}")
    if "layers_per_stage" in alt:
        parts.append(f"layers {alt.pop('layers_per_stage')}")
    order = alt.pop("domain_order", None)
    if order:
        parts.append("order " + " > ".join(map(str, order)))
    if "distributed_optimizer" in alt:
        parts.append("distributed optimizer" if alt.pop("distributed_optimizer") else "plain optimizer")
    if "shape" in alt:
        parts.append(f"shape: {alt.pop('shape')}")
    if "replica_split" in alt:
        parts.append(f"replica split {alt.pop('replica_split')}")
    it = alt.pop("iteration_s", None)
    alt.pop("tokens_per_s", None)   # follows from the iteration time
    for k in sorted(alt):
        v = alt[k]
        parts.append(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}")
    if isinstance(it, (int, float)):
        rel = f" ({it / planned_s:.3f}x the plan's time)" if planned_s else ""
        parts.append(f"-> {_fmt_s(it)}{rel}")
    return ", ".join(parts)


def boundary_crossings(plan: Plan) -> list[tuple[int, str, str]]:
    """(stage, from, to) for each pipeline hop that changes cluster or vendor, taken from the first
    pipeline (every pipeline crosses at the same stages when stages stay inside one domain)."""
    node_of = rank_nodes(plan)
    first = plan.groups["pp"][0].ranks if plan.groups.get("pp") else []
    out = []
    for s, (a, b) in enumerate(zip(first, first[1:])):
        na, nb = node_of[a], node_of[b]
        if (na.cluster, na.vendor) != (nb.cluster, nb.vendor):
            out.append((s, f"{na.cluster}/{na.vendor}", f"{nb.cluster}/{nb.vendor}"))
    return out


def _link_lines(plan: Plan, cluster) -> list[str]:
    """The links between the plan's clusters, and which communicator kinds cross each one."""
    names = list(dict.fromkeys(n.cluster for n in plan.nodes))
    node_of = rank_nodes(plan)
    lines = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            link = cluster.cluster_link(a, b)
            slow = link.kind == "ethernet" or link.gbps < min(cluster.cluster_link(c, c).gbps for c in (a, b))
            kinds = [k for k, groups in plan.groups.items()
                     if any({node_of[r].cluster for r in g.ranks} >= {a, b} for g in groups)]
            crossing = f"crossed by: {', '.join(kinds)}" if kinds else "not crossed by any communicator"
            lines.append(f"  {a} <-> {b}: {link.kind} {link.gbps:g} Gbit/s, {link.latency_us:g} us"
                         f"{' (slow)' if slow else ''}; {crossing}")
    return lines


@dataclass
class ReplicaRow:
    """Replicas that share a micro-batch count, the devices they run on and (about) their predicted time."""
    replicas: list[int]
    count: int
    devices: str
    pipeline_s: Optional[float]


def replica_rows(plan: Plan) -> list[ReplicaRow]:
    """The data-parallel replicas grouped by count and devices, in dp order of their first replica."""
    node_of = rank_nodes(plan)
    dims, inverse = plan.dims, plan.logical_of_physical
    devices: list[set] = [set() for _ in range(plan.dp)]
    for r in range(plan.world_size):
        n = node_of[r]
        devices[dims.coord(inverse[r])["dp"]].add(f"{n.cluster}/{n.accelerator}")
    counts = plan.replica_counts
    pred = plan.current_prediction
    times = pred.replica_pipeline_s if pred and pred.replica_pipeline_s else None
    rows: dict[tuple, ReplicaRow] = {}
    for d in range(plan.dp):
        key = (counts[d], " + ".join(sorted(devices[d])))
        row = rows.get(key)
        if row is None:
            row = rows[key] = ReplicaRow([], counts[d], key[1], None)
        row.replicas.append(d)
        if times is not None:
            row.pipeline_s = max(row.pipeline_s or 0.0, times[d])
    return list(rows.values())


def replica_lines(plan: Plan) -> list[str]:
    """Each replica's share of the global batch and predicted pipeline time, where replicas differ (uneven
    counts, or devices of different speeds); [] on the even split over alike replicas."""
    pred = plan.current_prediction
    if not plan.uneven_replicas and not (pred and pred.replica_pipeline_s):
        return []
    total = sum(plan.replica_counts)
    lines = []
    for row in replica_rows(plan):
        n = len(row.replicas)
        share = row.count / total
        time = f", pipeline {_fmt_s(row.pipeline_s)}" if row.pipeline_s is not None else ""
        lines.append(f"  replica{'s' if n > 1 else ''} {spans(row.replicas)} on {row.devices}: {row.count} "
                     f"micro-batches{' each' if n > 1 else ''} = {share:.1%} of the batch{' each' if n > 1 else ''}"
                     + (f" ({share * n:.1%} in all)" if n > 1 else "") + time)
    return lines


def shape_lines(plan: Plan) -> list[str]:
    """Why the plan's shape won: the best alternative of each other shape and its predicted time."""
    pred = plan.current_prediction
    if pred is None or not pred.shape:
        return []
    lines = [f"shape: {pred.shape}, replica split {alt_split(plan)}"]
    best: dict[str, dict] = {}
    for alt in plan.alternatives:
        shape = alt.get("shape")
        if shape and shape != pred.shape and shape not in best:
            best[shape] = alt
    same = [a for a in plan.alternatives if a.get("shape") == pred.shape
            and a.get("replica_split") != alt_split(plan)]
    same.sort(key=lambda a: a.get("replica_split") != "even")      # the even split first, where listed
    for shape, alt in best.items():
        lines.append(f"  beat {shape}: its best ({_alt_degrees(alt)}, replica split {alt.get('replica_split')}) "
                     f"predicts {alt['iteration_s'] / pred.iteration_s:.3f}x this plan's time")
    if same:
        alt = same[0]
        lines.append(f"  beat the same shape with replica split {alt.get('replica_split')} ({_alt_degrees(alt)}): "
                     f"{alt['iteration_s'] / pred.iteration_s:.3f}x")
    if not best:
        lines.append("  no plan of another shape was found (none fits, or the degrees allow only this one)")
    return lines


def alt_split(plan: Plan) -> str:
    """The plan's replica split as the alternatives write it."""
    if not plan.uneven_replicas:
        return "even"
    return replica_split_text(plan.replica_counts)


def _alt_degrees(alt: dict) -> str:
    return " ".join(f"{k}{alt[k]}" for k in ("tp", "pp", "dp") if k in alt) + f" mb{alt.get('micro_batch_size')}"


def has_experts(plan: Plan) -> bool:
    """An MoE model, or expert sizes of their own (a dense model file with a framework's ep > 1)."""
    return bool(plan.model.get("num_moe_experts")) or (plan.ep, plan.dims.etp) != (1, plan.tp)


def degrees_text(plan: Plan) -> str:
    out = f"tp={plan.tp} cp={plan.cp} pp={plan.pp} dp={plan.dp}"
    if has_experts(plan):
        out += f" ep={plan.ep} etp={plan.dims.etp} (expert-dp={plan.dims.expert_dp})"
    return out


def _transports(groups) -> str:
    counts = Counter(g.transport for g in groups)
    return "/".join(sorted(counts))


def expert_lines(plan: Plan) -> list[str]:
    """Where expert parallelism lives: what each rank holds, the expert groups' transports, and whether every
    expert-ep group (its token all-to-all) stays inside one domain (cluster fabric + device type)."""
    if not has_experts(plan):
        return []
    dims = plan.dims
    experts = plan.model.get("num_moe_experts") or 0
    lines = []
    if experts:
        topk = plan.model.get("moe_router_topk", 2)
        held = f"{experts // dims.ep} of the {experts}" if experts % dims.ep == 0 else f"{experts}/{dims.ep} of the"
        lines.append(f"  {experts} experts per MoE layer, top-{topk} routing; ep={dims.ep} etp={dims.etp}: each rank "
                     f"holds {held} experts of each MoE layer" + (f", split {dims.etp} ways" if dims.etp > 1 else ""))
    if "expert-ep" not in plan.groups:       # ep 1, etp = tp: the expert layers use the dense groups
        lines.append("  no all-to-all (ep=1); expert gradients reduced with the dense ones "
                     f"(dp-cp={_transports(plan.groups.get('dp-cp', []))})")
        return lines
    kinds = [k for k in ("expert-ep", "expert-tp", "expert-dp")
             if plan.groups.get(k) and len(plan.groups[k][0].ranks) > 1]
    if kinds:
        lines.append("  transports: " + ", ".join(f"{k}={_transports(plan.groups[k])}" for k in kinds))
    if dims.ep == 1:
        lines.append("  no all-to-all (ep=1)")
        return lines
    node_of = rank_nodes(plan)
    spans = [g for g in plan.groups["expert-tp-ep"]
             if len({(node_of[r].cluster, node_of[r].accelerator) for r in g.ranks}) > 1]
    ep_groups = plan.groups["expert-ep"]
    nodes_per_group = max(len({node_of[r].name for r in g.ranks}) for g in ep_groups)
    if spans:
        lines.append(f"  {len(spans)} of {len(plan.groups['expert-tp-ep'])} expert-tp-ep groups span domains: their "
                     "all-to-all crosses a cluster or vendor boundary")
    else:
        lines.append(f"  every expert-ep group ({len(ep_groups)} x {len(ep_groups[0].ranks)} ranks) stays inside one "
                     "domain (cluster fabric + device type), "
                     + ("inside one node" if nodes_per_group == 1 else f"over {nodes_per_group} nodes"))
    return lines


def render_text(plan: Plan, cluster=None) -> str:
    """The report; ``cluster`` (the Cluster the plan was made for) adds the links between clusters."""
    model = plan.model.get("name", "model")
    clusters = list(dict.fromkeys(n.cluster for n in plan.nodes))
    kind = "homogeneous: the frameworks' default groups" if plan.homogeneous else "heterogeneous"
    lines = [f"het_plugin plan {plan.hash}: {model} on {plan.cluster_name} "
             f"({plan.world_size} ranks, {len(plan.nodes)} nodes, {len(clusters)} cluster(s), {kind})",
             f"degrees: {degrees_text(plan)}   micro-batch {plan.micro_batch_size}"
             f" x {plan.num_micro_batches} per iteration"
             f"{' per replica on average (uneven: see the replicas)' if plan.uneven_replicas else ''}"
             f"   overlap grad reduce: "
             f"{'on' if plan.overlap_grad_reduce else 'off'}   distributed optimizer: "
             f"{'on' if plan.distributed_optimizer else 'off'}",
             f"placement: {'identity (logical rank = launch rank)' if plan.is_identity else 'remapped'}",
             ""]

    lines.append("where the ranks live (per cluster and node):")
    rows = node_rows(plan)
    label_w = max(len(r.label) for r in rows)
    ranks_w = max(len(spans(r.ranks)) for r in rows)
    for c in clusters:
        members = [n for n in plan.nodes if n.cluster == c]
        accs = Counter(f"{n.num_ranks} x {n.accelerator} ({n.vendor})" for n in members)
        desc = ", ".join(f"{k} on {v} node(s)" for k, v in accs.items())
        lines.append(f"  cluster {c} [{members[0].fabric}]: {desc}")
        for row in (r for r in rows if r.cluster == c):
            coord = f"stage {spans(row.stages)}  tp {spans(row.tp)}"
            if plan.cp > 1:
                coord += f"  cp {spans(row.cp)}"
            coord += f"  dp {spans(row.dp)}"
            lines.append(f"    {row.label:<{label_w}s}  ranks {spans(row.ranks):<{ranks_w}s}  {coord}")
    lines.append("")

    lines.append("layers per stage:")
    for st in stage_summary(plan):
        where = ", ".join(f"{k} x{v}" for k, v in st["where"].items())
        extra = f" + {' + '.join(st['extra'])}" if st["extra"] else ""
        lines.append(f"  stage {st['stage']:>2d}: {st['layers']:>3d} layers{extra:<22s} on {where}")
    lines.append(f"  total {sum(plan.layers_per_stage)} layers: {plan.layers_per_stage}")
    if plan.vpp > 1:
        lines.append(f"  interleaved: {plan.vpp} virtual stages per rank, layers {plan.layers_per_virtual_stage}; "
                     f"pipeline sends {'overlapped with compute' if plan.overlap_p2p_comm else 'blocking'}")
    crossings = boundary_crossings(plan)
    if crossings:
        hops = "; ".join(f"stage {s} -> {s + 1} ({a} -> {b})" for s, a, b in crossings)
        lines.append(f"  the pipeline crosses a cluster/vendor boundary {len(crossings)} time(s): {hops}")
    if cluster is not None and len(clusters) > 1:
        lines.append("")
        lines.append("links between clusters:")
        lines.extend(_link_lines(plan, cluster))
    lines.append("")
    experts = expert_lines(plan)
    if experts:
        lines.append("expert parallelism (where EP lives):")
        lines.extend(experts)
        lines.append("")

    replicas = replica_lines(plan)
    if replicas:
        lines.append("data-parallel replicas (each its own pipeline; share of the global batch, predicted time):")
        lines.extend(replicas)
        lines.append("")

    lines.append("communicators (kind: count x size, transport):")
    kind_w = max([10] + [len(k) for k in plan.groups])
    for kind_name, groups in plan.groups.items():
        if not groups or (all(len(g.ranks) == 1 for g in groups) and kind_name != "tp"):
            continue   # a degree of 1: no communication
        sizes = Counter(len(g.ranks) for g in groups)
        size = "/".join(str(s) for s in sorted(sizes))
        transports = Counter(g.transport for g in groups)
        tdesc = ", ".join(f"{t} ({n})" if len(transports) > 1 else t for t, n in sorted(transports.items()))
        lines.append(f"  {kind_name:<{kind_w}s} {len(groups):>5d} x {size:<5s} {tdesc}")
    lines.append("")

    lines.append("prediction (this plan):")
    if plan.prediction is None:
        lines.append("  not available (the plan carries no cost-model prediction)")
    elif plan.prediction_stale:
        lines.append(f"  {STALE_NOTE}")
    else:
        lines.extend(_prediction_lines(plan.prediction))
        lines.extend(cost_lines(plan.price_per_hour, plan.prediction, plan.world_size))
    lines.append("baseline (framework-default placement, uniform layers):")
    if plan.baseline is None:
        lines.append("  not available")
    else:
        if plan.baseline.description:
            lines.append(f"  {plan.baseline.description}")
        lines.extend(_prediction_lines(plan.baseline, memory=False))
    speedup = plan.speedup
    if speedup is not None:
        lines.append(f"speed-up over the baseline: {speedup:.2f}x (baseline iteration {_fmt_s(plan.baseline.iteration_s)}"
                     f" / planned {_fmt_s(plan.prediction.iteration_s)})")
    shapes = shape_lines(plan)
    if shapes:
        lines.append("")
        lines.extend(shapes)
    left = left_out_lines(plan)
    if left:
        lines.append("")
        lines.extend(left)
    if plan.alternatives:
        lines.append("")
        lines.append("alternatives considered (next best, then the best of each other shape):")
        for i, alt in enumerate(plan.alternatives, 1):
            lines.append(f"  {i}. {_alternative_line(alt, plan.prediction.iteration_s if plan.prediction else None)}")
    if plan.warnings:
        lines.append("")
        for w in plan.warnings:
            lines.append(f"warning: {w}")
    return "\n".join(lines)


def cost_lines(price_per_hour: Optional[float], p: Prediction, devices: int, indent: str = "  ") -> list[str]:
    """What an iteration and a million tokens cost at the cluster file's prices ([] without prices)."""
    if price_per_hour is None or p.iteration_s <= 0:
        return []
    per_iteration = price_per_hour * p.iteration_s / 3600.0
    per_million = price_per_hour / 3600.0 / p.tokens_per_s * 1e6
    return [f"{indent}cost: {per_iteration:.4g} per iteration, {per_million:.4g} per million tokens ({devices} devices "
            f"at {price_per_hour:.4g} per hour, the cluster file's price_per_device_hour)"]


def _names(names: list[str], limit: int = 8) -> str:
    return " ".join(names) if len(names) <= limit else f"{' '.join(names[:limit - 2])} ... {names[-1]} ({len(names)})"


def left_out_lines(plan: Plan) -> list[str]:
    """The nodes the plan leaves out and why: each left-out group with the best plan that adds it back (or the
    compute floor that ruled it out), the best plan with every node, and how to launch the kept nodes."""
    lo = plan.left_out
    if not lo:
        return []
    total = len(plan.nodes) + len(lo["nodes"])
    cost = lo.get("objective") == "cost"
    p = plan.prediction
    lines = [f"left out: {len(lo['nodes'])} of {total} nodes ({lo['world_size'] - plan.world_size} of "
             f"{lo['world_size']} devices); the plan is predicted {'cheaper' if cost else 'faster'} without them "
             f"({lo['searched']} node subsets planned, {lo['pruned']} ruled out by their compute floor)"]
    for g in lo["groups"]:
        if "with_it_s" in g:
            why = (f"the best plan with them predicts {_fmt_s(g['with_it_s'])}"
                   + (f" ({g['with_it_s'] / p.iteration_s:.2f}x this plan's iteration)" if p else ""))
        elif "floor_with_it_s" in g:
            why = (f"cannot shorten the iteration: with them even the compute alone (every device busy, no "
                   f"communication) needs {_fmt_s(g['floor_with_it_s'])}")
        else:
            why = g.get("with_it", "no plan with them")
        lines.append(f"  {g['group']}: {g['devices']} devices on {_names(g['nodes'])}: {why}")
    every = lo.get("all_nodes")
    if every:
        lines.append(f"  with every node ({every['world_size']} ranks): tp {every['tp']} pp {every['pp']} dp "
                     f"{every['dp']} micro-batch {every['micro_batch_size']}, layers {every['layers_per_stage']}: "
                     f"iteration {_fmt_s(every['iteration_s'])}, {every['tokens_per_s']:,.0f} tokens/s")
        if every.get("price_per_hour") is not None:
            lines.extend(cost_lines(every["price_per_hour"], Prediction(every["iteration_s"], every["tokens_per_s"],
                                                                        0.0), every["world_size"], "    "))
    else:
        lines.append(f"  with every node: no plan ({lo.get('all_nodes_error', 'none found')})")
    if p:
        ratio = f", {every['iteration_s'] / p.iteration_s:.2f}x faster" if every else ""
        lines.append(f"  without them (this plan, {plan.world_size} ranks): iteration {_fmt_s(p.iteration_s)}, "
                     f"{p.tokens_per_s:,.0f} tokens/s{ratio}")
    lines.append("  to use every node anyway (already allocated, say): re-plan with --use-all-nodes")
    lines.append("launch only the kept nodes:")
    lines.extend(f"  {line}" for line in launch_lines(plan))
    return lines


#: what a report shows instead of the numbers of a plan changed after it was predicted (Plan.prediction_stale)
STALE_NOTE = ("stale: the plan was changed after its prediction was computed (edited by hand?), so the saved "
              "numbers are another plan's; re-predict with `het-plugin plan CLUSTER --model MODEL` and the plan's "
              "degrees, or re-plan")


def startup_summary(plan: Plan, framework: str, extra: Iterable[str] = ()) -> str:
    """What an adapter's rank 0 prints before building groups: placement per stage, transports, prediction."""
    same = " (homogeneous: the framework's own groups)" if plan.homogeneous and plan.is_identity else ""
    lines = [f"het_plugin: plan {plan.hash} for {plan.cluster_name} ({framework}): {plan.world_size} ranks, "
             f"{degrees_text(plan)}, micro-batch {plan.micro_batch_size} x "
             f"{plan.num_micro_batches}{same}"]
    for st in stage_summary(plan):
        where = ", ".join(sorted(st["where"]))
        lines.append(f"  stage {st['stage']}: {st['layers']} layers on {where} "
                     f"(ranks {spans(plan.stage_ranks(st['stage']))})")
    kinds = []
    for kind in ("tp", "cp", "dp", "pp", "embedding", "expert-ep", "expert-dp"):
        ts = sorted({g.transport for g in plan.groups.get(kind, [])})
        if ts:
            kinds.append(f"{kind}={'/'.join(ts)}")
    lines.append("  transports: " + ", ".join(kinds) + f"; overlap_grad_reduce={plan.overlap_grad_reduce}")
    if plan.uneven_replicas:
        lines.append(f"  micro-batches per data-parallel replica (by speed): {alt_split(plan)}")
    lines.extend(f"  {line}" for line in extra)
    if plan.prediction_stale:
        lines.append(f"  predicted: {STALE_NOTE}")
    elif plan.prediction:
        pred = f"  predicted: {plan.prediction.iteration_s:.4g} s/iteration"
        if plan.baseline and plan.speedup:
            pred += f" (framework default {plan.baseline.iteration_s:.4g} s, x{plan.speedup:.2f})"
        lines.append(pred)
    lines.extend(f"  warning: {w}" for w in plan.warnings)
    return "\n".join(lines)
