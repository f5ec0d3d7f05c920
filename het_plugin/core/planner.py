"""Planner: choose degrees, placement, micro-batch size and layer split for a cluster and a model.

``make_plan`` searches TP (divisors of the accelerators per node that divide the heads), PP, DP and the
micro-batch size; for each it tries the domain orders of :func:`placement.domain_orders`, splits the layers
exactly (:mod:`het_plugin.core.layer_split`) and predicts the iteration (:mod:`het_plugin.core.cost`). The plan also
carries the *baseline*: what the frameworks do by themselves (identity placement, uniform layers, one
process-wide network setting) with the degrees that are best for that baseline. On a homogeneous cluster
the plan *is* that default. ``assemble_plan`` and ``make_plan``'s signature are the adapters' contract.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

from . import cost
from .inputs.cluster import Cluster
from .inputs.compute_curve import extrapolation_advice
from .errors import ConfigError
from .inputs.model import ModelSpec
from .layer_split import bottleneck, exact_partition, virtual_split
from .cost.dist_opt import instance_options, instance_span, with_instances
from .ranks.transport import OVER_SOCKETS, Transport

SPANNING = OVER_SOCKETS | {Transport.MULTINET}      # transports of groups that leave one fabric
from .ranks.placement import (
    Placement,
    baseline_transport,
    default_placement,
    domain_orders,
    local_group_fits,
    place,
    place_replicas,
    stage_domains,
    cluster_transport,
    multinet_transport,
    stock_transport,
)
from .nccl_version import NcclBuild
from .inputs.profile import Profile
from .plan import GroupPlan, LinkPlan, NodePlan, Plan, Prediction, check_replica_split, replica_split_conflict
from .ranks.dims import DEFAULT_ORDER, EXPERT_KINDS, GROUP_KINDS, Degrees, ParallelDims
from .request import LaunchRequest, Schedule


#: ``progress(done, total, best_iteration_s)``: called after each degree combination of a search (``done`` of
#: ``total``; ``best_iteration_s`` None until a candidate fits). A plan may run more than one search.
Progress = Callable[[int, int, Optional[float]], None]


def uniform_layers(num_layers: int, pp: int) -> list[int]:
    base, extra = divmod(num_layers, pp)
    return [base + (1 if i < extra else 0) for i in range(pp)]


def assemble_plan(cluster: Cluster, model: ModelSpec, placement: Placement, layers_per_stage: Sequence[int],
                  micro_batch_size: int, *, prediction: Optional[Prediction] = None,
                  baseline: Optional[Prediction] = None, overlap_grad_reduce: bool = True,
                  distributed_optimizer: bool = False, alternatives: Sequence[dict] = (),
                  extra_warnings: Sequence[str] = (), vpp: int = 1, overlap_p2p_comm: bool = False,
                  replica_micro_batches: Sequence[int] = (), transport_fn=cluster_transport,
                  baseline_previous: Optional[Prediction] = None, distributed_optimizer_instances: int = 1) -> Plan:
    """Turn a placement and a split into a Plan: every group kind with its transport, node table, warnings.
    ``vpp > 1``: an interleaved pipeline, each stage's layers split by :func:`layer_split.virtual_split`.
    ``replica_micro_batches``: micro-batches per data-parallel replica (() or all equal: the even split, stored
    as [] so the plan is the frameworks' own)."""
    dims = placement.dims
    if sum(layers_per_stage) != model.num_layers or len(layers_per_stage) != dims.pp:
        raise ValueError(f"layers_per_stage {list(layers_per_stage)} must have {dims.pp} entries summing to "
                         f"{model.num_layers}")
    groups: dict[str, list[GroupPlan]] = {}
    net = cost.Network(cluster, transport_fn)      # cached nodes_transport(): one call per group shape
    rank_node = cluster.rank_node
    embedding_stages = model.embedding_stages(dims.pp)
    experts = EXPERT_KINDS if (dims.ep, dims.etp) != (1, dims.tp) else ()     # else the same as the dense ones
    for kind in GROUP_KINDS + ("embedding",) + experts:
        groups[kind] = [GroupPlan(g, net.nodes_transport([rank_node[r] for r in g]))
                        for g in placement.physical_groups(kind, embedding_stages)]
    nodes = [NodePlan(n.name, n.cluster, n.fabric.type, n.accelerator.name, n.vendor,
                      cluster.node_first_rank[n.index], n.num_accelerators) for n in cluster.nodes]
    links = [LinkPlan(sorted(pair), link.kind) for pair, link in sorted(cluster.links.items(), key=lambda kv: sorted(kv[0]))]
    warnings = list(extra_warnings)
    spanning = [(s, doms) for s, doms in enumerate(stage_domains(cluster, placement)) if len(doms) > 1]
    if placement.dealing == "replica" and spanning:
        names = ", ".join(f"{c}/{a}" for c, a in spanning[0][1])
        warnings.append(f"data parallel across domains: every stage's data-parallel groups span {names} "
                        f"(transport {', '.join(sorted({g.transport for g in groups['dp']}))}; the gradient "
                        "reduction runs inside each fabric, then between them)")
        spanning = []
    instances = distributed_optimizer_instances
    spans_instance = None
    if instances > 1:
        nodes_of = [rank_node[r] for r in placement.rank_of_canonical]
        spans_instance = instance_span(cluster, nodes_of, instances, dims)
        if spans_instance:
            warnings.append(f"{spans_instance} (an instance per fabric keeps them inside; where the degrees do not "
                            "allow it, fewer instances or a pipeline across the fabrics)")
    for s, doms in spanning:
        names = ", ".join(f"{c}/{a}" for c, a in doms)
        shards = (f"; with {instances} distributed-optimizer instances, one per fabric, only each rank's shard "
                  "crosses it" if instances > 1 and not spans_instance else "")
        warnings.append(f"stage {s} spans {names}: its data-parallel groups cross a slow boundary "
                        f"(transport {groups['dp'][0].transport if dims.pp == 1 else 'see dp groups'}){shards}")
    per_mb = dims.dp * micro_batch_size
    if model.global_batch_size % per_mb:
        raise ConfigError(f"global_batch_size {model.global_batch_size} is not a multiple of dp*micro_batch "
                          f"= {dims.dp}*{micro_batch_size}", field="global_batch_size",
                          fix=f"use a multiple of {per_mb}")
    num_micro_batches = model.global_batch_size // per_mb
    counts = [int(n) for n in replica_micro_batches]
    check_replica_split(counts, dims.dp, num_micro_batches, "<planner>", vpp=vpp, dims=dims)
    if len(set(counts)) == 1:
        counts = []
    return Plan(
        cluster_name=cluster.name, cluster_digest=cluster.digest, model=model.model_dump(),
        world_size=dims.world_size, tp=dims.tp, cp=dims.cp, pp=dims.pp, dp=dims.dp, ep=dims.ep, etp=dims.etp,
        order=dims.order, micro_batch_size=micro_batch_size, num_micro_batches=model.global_batch_size // per_mb,
        rank_of_logical=list(placement.rank_of_logical), layers_per_stage=list(layers_per_stage),
        groups=groups, embedding_stages=list(embedding_stages), nodes=nodes, links=links,
        overlap_grad_reduce=overlap_grad_reduce, vpp=vpp, overlap_p2p_comm=overlap_p2p_comm and vpp > 1,
        layers_per_virtual_stage=virtual_split(layers_per_stage, vpp) if vpp > 1 else [],
        distributed_optimizer=distributed_optimizer, homogeneous=cluster.is_homogeneous,
        distributed_optimizer_instances=distributed_optimizer_instances,
        replica_micro_batches=counts, nccl_nets=dict(cluster.nccl_nets), prediction=prediction, baseline=baseline,
        baseline_previous=baseline_previous, alternatives=list(alternatives),
        warnings=warnings).stamp_prediction()


MICRO_BATCH_CHOICES = (1, 2, 4, 8)
NUM_ALTERNATIVES = 5
#: An uneven replica split is planned only when it predicts at least this much less time than the even split of
#: the same shape (the frameworks' own split stays where the gain is within the model's noise).
UNEVEN_MIN_GAIN = 0.01
#: ``make_plan(replica_split=...)``: the planner chooses, the frameworks' even split only, or uneven only.
REPLICA_SPLITS = ("auto", "even", "uneven")

# The shapes of a heterogeneous plan (Candidate.shape), named in the report and the alternatives.
SHAPE_PIPELINE = "pipeline across domains"
SHAPE_DATA = "data parallel across domains"
SHAPE_MIXED = "pipeline across domains, data parallel across domains inside a stage"
SHAPE_ONE = "one domain"


@dataclass
class Candidate:
    """One evaluated plan of the search."""
    prediction: Prediction
    placement: Placement
    layers: list[int]
    micro_batch_size: int
    order_index: int
    distributed_optimizer: bool = False
    replica_counts: list[int] = field(default_factory=list)     # [] = the even split
    replica_groups: int = 1              # groups of replicas that run on different devices
    spans: bool = False                  # some stage (its DP groups) spans domains
    instances: int = 1                   # Megatron's distributed-optimizer instances (cost.dist_opt)

    @property
    def key(self) -> tuple:
        d = self.placement.dims
        return (self.prediction.iteration_s, d.tp, d.pp, self.micro_batch_size, self.order_index, d.ep, -d.etp,
                bool(self.replica_counts), self.placement.dealing != "stage", self.instances)

    @property
    def shape(self) -> str:
        """How the plan spreads over domains of different devices (see the SHAPE_* names)."""
        d = self.placement.dims
        if self.placement.dealing == "replica" or (d.pp == 1 and self.spans):
            return SHAPE_DATA
        if self.spans:
            return SHAPE_MIXED
        return SHAPE_PIPELINE if d.pp > 1 else SHAPE_ONE

    def split_text(self) -> str:
        """The replica split in words: 'even', or '9 micro-batches on 4 replicas, 5 on 28'."""
        if not self.replica_counts:
            return "even"
        return replica_split_text(self.replica_counts)

    def summary(self, experts: bool = False, shapes: bool = False) -> dict:
        """The candidate in a few keys; ``experts`` (an MoE model) adds ep and etp even when they are 1 and tp;
        ``shapes`` (a heterogeneous cluster) its shape and replica split."""
        d = self.placement.dims
        p = self.prediction
        out = {"tp": d.tp, "cp": d.cp, "pp": d.pp, "dp": d.dp}
        if experts or _has_experts(d):
            out.update(ep=d.ep, etp=d.etp)
        out.update({"micro_batch_size": self.micro_batch_size,
                    "domain_order": [f"{c}/{a}" for c, a in self.placement.domain_order],
                    "layers_per_stage": list(self.layers), "iteration_s": round(p.iteration_s, 6),
                    "tokens_per_s": round(p.tokens_per_s, 1), "distributed_optimizer": self.distributed_optimizer})
        if self.instances > 1:
            out["distributed_optimizer_instances"] = self.instances
        if shapes:
            out.update(shape=self.shape, replica_split=self.split_text())
            if self.placement.together > 1:      # how the replicas were dealt, where two dealings compete
                out["replicas_per_node"] = self.placement.together
        return out


def replica_split_text(counts: Sequence[int]) -> str:
    """'9 micro-batches on 4 replicas, 5 on 28' (largest count first)."""
    parts = sorted(Counter(counts).items(), reverse=True)
    return ", ".join(f"{c}{' micro-batches' if i == 0 else ''} on {n} replica{'s' if n > 1 else ''}"
                     for i, (c, n) in enumerate(parts))


def _has_experts(dims: ParallelDims) -> bool:
    """Expert groups of their own (else the expert layers use the dense groups, or there are none)."""
    return (dims.ep, dims.etp) != (1, dims.tp)


@dataclass
class _Search:
    """Top candidates kept during a search, plus what was rejected and why (for the error messages)."""
    keep: int
    best: list[Candidate] = field(default_factory=list)
    closest_overflow: Optional[tuple[float, str]] = None     # (GiB over, description) of the nearest miss
    expert_spans: list[str] = field(default_factory=list)     # placements refused: an expert group spans domains
    by_shape: dict[str, Candidate] = field(default_factory=dict)   # the best candidate of each shape
    #: A screening search (:func:`could_beat`): only whether some candidate predicts below this matters, so every
    #: candidate whose lower bound reaches it is pruned, and ``hit`` stops the search at the first one below.
    cutoff: Optional[float] = None
    hit: bool = False
    #: Some candidate was pruned whose layers fit the stages' memory caps (so it fits: the caps and the
    #: prediction compare the same bytes, scaled by a power of two): the search has a plan, pruned or not.
    fits_pruned: bool = False

    def bound(self) -> float:
        return self.best[-1].prediction.iteration_s if len(self.best) >= self.keep else math.inf

    def below(self, cand: Candidate) -> None:
        """A screening search notes a candidate predicted below its cut-off (offered or not)."""
        if self.cutoff is not None and cand.prediction.iteration_s < self.cutoff:
            self.hit = True

    def offer(self, cand: Candidate) -> None:
        self.below(cand)
        self.best.append(cand)
        self.best.sort(key=lambda c: c.key)
        del self.best[self.keep:]
        known = self.by_shape.get(cand.shape)
        if known is None or cand.key < known.key:
            self.by_shape[cand.shape] = cand

    def bound_for(self, shape: str) -> float:
        """Prune a candidate whose lower bound reaches this: worse than the kept ones and than its shape's best
        (so the report can still say how the best of every shape did). A screening search: its cut-off."""
        if self.cutoff is not None:
            return self.cutoff
        known = self.by_shape.get(shape)
        return max(self.bound(), known.prediction.iteration_s if known is not None else math.inf)

    def miss(self, overflow_gib: float, what: str) -> None:
        if self.closest_overflow is None or overflow_gib < self.closest_overflow[0]:
            self.closest_overflow = (overflow_gib, what)


@dataclass(frozen=True)
class SearchInputs:
    """What every search of one plan reads, built once (:func:`_search_inputs`) and passed whole instead of a dozen
    arguments; a variant (the stock baseline's transports, the even split) is a :func:`dataclasses.replace`."""
    cluster: Cluster
    model: ModelSpec
    options: Sequence[ParallelDims]          # the degree combinations to search, in order
    fixed_mb: Optional[int]                  # the micro-batch size, where given
    fixed_pp: bool                           # pp was given (the default search then takes a non-uniform split)
    profile: Optional[Profile]
    sched: Schedule = Schedule(1, None)      # (vpp, overlap_p2p_comm) of the pipeline schedule
    replica_split: "str | list[int]" = "auto"
    overlap: bool = True                     # overlap_grad_reduce
    transport_fn: Callable = cluster_transport    # the groups' transports (the plan's; the baselines' their own)
    instances: bool = True                   # Megatron's distributed-optimizer instances may be used
    multinet: bool = False                   # the NCCL build joins networks in one communicator


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _degree_options(cluster: Cluster, model: ModelSpec, asked: dict, fixed_mb: Optional[int]) -> list[ParallelDims]:
    """Every (tp, pp, dp) the frameworks accept for this cluster and model; fixed ones are checked (``asked``:
    make_plan's keyword form, :data:`_KEYWORDS`, with dp as the replica split fixes it). Checked here, not by
    :class:`Degrees` first, so that the error names the values that fit this cluster.

    The planner itself only proposes TP inside a node; a homogeneous cluster takes any fixed tp and cp
    the frameworks take (its plan is their own numbering), a heterogeneous one what the placement keeps
    on one fabric (:func:`het_plugin.core.ranks.placement.local_group_fits`)."""
    tp, pp, dp, cp, ep, etp, order = (asked[k] for k in ("tp", "pp", "dp", "cp", "ep", "etp", "order"))
    per_node = math.gcd(*[n.num_accelerators for n in cluster.nodes])
    src = cluster.source
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise ConfigError(f"cp={cp!r} is not a positive integer", field="cp", fix="give a positive integer")
    heads, kv = model.num_attention_heads, model.kv_heads
    fits = (lambda t: True) if cluster.is_homogeneous else (lambda t: local_group_fits(per_node, t, cp))
    tps = [t for t in _divisors(per_node) if fits(t) and heads % t == 0 and kv % t == 0]
    if isinstance(tp, int) and tp >= 1:          # placeability first: it names the values that fit
        if not cluster.is_homogeneous and not local_group_fits(per_node, tp, cp):
            raise ConfigError(f"tp={tp}, cp={cp}: on a heterogeneous cluster TP stays inside a node ({per_node} "
                              "accelerators) and tp*cp inside a node or on whole nodes", source=src, field="tp",
                              fix=f"use tp in {tps}" if tps else "use cp with tp*cp dividing or a multiple of "
                                                                 f"{per_node}")
        if heads % tp or kv % tp:
            raise ConfigError(f"tp={tp} does not divide num_attention_heads={heads} and num_query_groups="
                              f"{kv}", field="tp", fix=f"use tp in {tps}")
    elif not tps:
        raise ConfigError(f"cp={cp}: no tp keeps tp*cp inside a node ({per_node} accelerators) or on whole nodes",
                          source=src, field="cp", fix=f"use cp dividing or a multiple of {per_node}")
    if isinstance(pp, int) and pp > model.num_layers:
        raise ConfigError(f"a pipeline of {pp} stages cannot hold {model.num_layers} layers", field="pp",
                          fix=f"use pp <= {model.num_layers} (num_layers)")
    request = Degrees(cluster.world_size, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp, order=order, source=src,
                      num_experts=model.num_moe_experts or None)
    request.check_expert_rules(tps, model.num_layers)
    out = [d for d in request.candidates(tps, model.num_layers)
           if model.global_batch_size % (d.dp * (fixed_mb or 1)) == 0]
    if not out:
        fixed = ", ".join(f"{k}={v}" for k, v in (("tp", tp), ("pp", pp), ("dp", dp), ("cp", cp),
                                                   ("micro_batch_size", fixed_mb)) if v is not None)
        raise ConfigError(f"no degree combination is valid for {cluster.world_size} accelerators ({fixed}): tp "
                          f"must divide {per_node} (accelerators per node) and the heads, pp <= {model.num_layers} "
                          f"layers, and dp*micro_batch must divide global_batch_size={model.global_batch_size}",
                          source=src, field="degrees",
                          fix="drop a fixed degree, or change global_batch_size to a multiple of the data-"
                              "parallel size")
    return out


def placeable_degrees(cluster: Cluster, model: ModelSpec, cp: int = 1) -> list[tuple[int, int]]:
    """(tp, pp) pairs the planner accepts for this cluster and model (what an error suggests instead)."""
    try:
        options = _degree_options(cluster, model, {**_KEYWORDS, "cp": cp}, None)
    except ConfigError:
        return []
    return sorted({(d.tp, d.pp) for d in options})


def _micro_batches(model: ModelSpec, dims: ParallelDims, fixed_mb: Optional[int], vpp: int = 1,
                   replica_split: "str | list[int]" = "auto") -> list[int]:
    """Micro-batch sizes to try; with vpp > 1 only those whose micro-batch count pp divides (Megatron's
    interleaved schedule, its default microbatch_group_size_per_vp_stage = pp); with given replica counts only
    a size whose micro-batches they add up to."""
    choices = [fixed_mb] if fixed_mb else list(MICRO_BATCH_CHOICES)
    return [mb for mb in choices if model.global_batch_size % (dims.dp * mb) == 0
            and (vpp == 1 or (model.global_batch_size // (dims.dp * mb)) % dims.pp == 0)
            and (isinstance(replica_split, str) or (len(replica_split) == dims.dp
                                                    and sum(replica_split) * mb == model.global_batch_size))]


def _spans_domains(analysis: cost.Analysis) -> bool:
    """Some stage's data-parallel groups span domains: two device types in a stage, or a DP group that leaves a
    fabric or a vendor (sockets, the shim)."""
    return (any(len(st.accelerators) > 1 for st in analysis.stages)
            or bool(analysis.transports.get("dp", set()) & SPANNING))


def _evaluate_split(inputs: SearchInputs, search: _Search, analysis: cost.Analysis, dims: ParallelDims, mb: int,
                    layers: Optional[list[int]], order_index: int, dist_opt: bool) -> None:
    """Partition (when ``layers`` is None) and predict one candidate into ``search``; offer it or record why not.
    ``inputs.replica_split``: "even", "auto" (also the speed-proportional split of :meth:`cost.SplitCosts.balance`
    where replicas run on different devices, re-partitioned for it, offered when it gains
    :data:`UNEVEN_MIN_GAIN`), "uneven" (only that), or the counts."""
    model, sched, replica_split, label = inputs.model, inputs.sched, inputs.replica_split, _label(dims)
    split = cost.SplitCosts(model, analysis, mb, overlap_grad_reduce=inputs.overlap, distributed_optimizer=dist_opt,
                            profile=inputs.profile, vpp=sched[0], overlap_p2p_comm=sched[1])
    explicit = not isinstance(replica_split, str)
    if explicit:
        split.set_counts(replica_split)
    groups = len(split.replica_groups)
    spans = _spans_domains(analysis)
    fixed = layers

    def partition() -> tuple[Optional[list[int]], Optional[list[list[float]]]]:
        """The split for the current counts, and the cost tables (None when layers are given)."""
        caps = split.max_layers()
        if fixed is not None:
            return (fixed if all(n <= c for n, c in zip(fixed, caps)) else None), None
        tables = split.tables()
        lay = exact_partition(model.num_layers, tables, caps, min_layers=sched[0])
        if lay is not None:         # per-layer overrides in the profile: single-layer moves from the mean split
            lay = split.refine(lay, caps, min_layers=sched[0])
        return lay, tables

    def attempt(lay: list[int], tables, counts: list[int], prune: bool) -> Optional[Candidate]:
        cand = Candidate(None, analysis.placement, list(lay), mb, order_index, dist_opt, counts, groups, spans,
                         analysis.instances)
        # (with per-layer overrides the tables' bottleneck is not a lower bound: no pruning; given layers, the
        # default search's, bounded at those counts only)
        if prune and not split.layers_differ:
            cut = search.bound_for(cand.shape)
            if cut < math.inf and (bottleneck(tables, lay) if tables is not None else split.bottleneck(lay)) >= cut:
                search.fits_pruned = True       # (``lay`` is within the caps: partition() made or checked it)
                return None
        pred = split.predict(lay)
        if not pred.fits:
            search.miss(max(m_ - c for m_, c in zip(pred.memory_gib_per_stage, pred.capacity_gib_per_stage)),
                        f"{label} mb={mb}")
            return None
        cand.prediction = pred
        return cand

    try_uneven = not explicit and replica_split != "even" and groups > 1 and sched[0] == 1
    tries = (replica_split != "uneven", try_uneven)        # (the even split, an uneven one)
    if fixed is None and not explicit and sched[0] == 1 and _cannot_win(search, split, analysis,
                                                                        (mb, order_index, dist_opt), tries):
        return
    even_layers, tables = partition()
    if even_layers is None:
        search.miss(split.overflow_gib(fixed or uniform_layers(model.num_layers, dims.pp)), f"{label} mb={mb}")
        return
    even = None
    even_bound = bottleneck(tables, even_layers) if tables is not None else 0.0
    if replica_split != "uneven":
        even = attempt(even_layers, tables, list(split.counts), prune=True)
        if even is not None:
            search.offer(even)
    if not try_uneven:
        return
    counts = split.balance(even_layers)         # speed-proportional for the even split's layers ...
    if not counts:
        return
    split.set_counts(counts)
    lay, tables = partition()                   # ... the layers again for those counts, and the counts again
    if lay is None:
        return
    if lay != even_layers:
        counts = split.balance(lay)
        if not counts:
            return
        split.set_counts(counts)
        if any(n > c for n, c in zip(lay, split.max_layers())):
            return
        tables = split.tables() if tables is not None else None
    if (tables is not None and not split.layers_differ and bottleneck(tables, lay) >= search.bound_for(
            Candidate(None, analysis.placement, lay, mb, order_index, dist_opt, counts, groups, spans).shape)):
        return                                  # pruned as attempt() would, before the O(world) check below
    if replica_split_conflict(dims, counts) is not None:
        return                                  # an expert group would join replicas of different counts: a hang
    uneven = attempt(lay, tables, counts, prune=True)
    if uneven is None:
        return
    search.below(uneven)        # (a screen counts it even where the gain rule below would not offer it)
    # Against the even split's prediction, or (pruned: worse than the kept plans) its lower bound.
    even_s = even.prediction.iteration_s if even is not None else even_bound
    if replica_split == "uneven" or uneven.prediction.iteration_s < even_s * (1 - UNEVEN_MIN_GAIN):
        search.offer(uneven)


def _cannot_win(search: _Search, split: cost.SplitCosts, analysis: cost.Analysis, which: tuple,
                tries: tuple[bool, bool]) -> bool:
    """Neither the even split's partition nor any uneven replica split's (``tries``: which of them the search
    tries) can get below
    what the search would prune them at (``which``: micro-batch size, domain order index, distributed optimizer),
    shown by :meth:`cost.SplitCosts.partition_floor` before any cost table is built (both candidates have the
    same shape, so the same cut)."""
    mb, order_index, dist_opt = which
    shape = Candidate(None, analysis.placement, [], mb, order_index, dist_opt, [], len(split.replica_groups),
                      _spans_domains(analysis), analysis.instances).shape
    cut = search.bound_for(shape)
    if cut == math.inf:
        return False
    floor = split.partition_floor() if tries[0] else math.inf
    if tries[1]:
        floor = min(floor, split.partition_floor(uneven=True))
    return floor >= cut


def _search_planned(inputs: SearchInputs, progress: Optional[Progress] = None,
                    cutoff: Optional[float] = None) -> _Search:
    """Het-aware search (groups on ``inputs.transport_fn``: :func:`placement.multinet_transport` where the NCCL build
    joins networks): every domain order, the exact partition, with and without the distributed
    optimizer, for each degree combination. Where devices differ in speed (:func:`_replica_dealing`: on one
    fabric and vendor, or across vendors), also each pipeline inside one domain and data parallelism across
    domains (:func:`placement.place_replicas`, the file's domain order: the order only renumbers the replicas;
    replicas dealt one at a time and as many together as a node holds stages of), with speed-proportional
    replica shares (see :func:`_evaluate_split`); Megatron's distributed-optimizer instances where
    ``inputs.instances``. ``cutoff``: a screen (see :attr:`_Search.cutoff`)."""
    cluster, model, options, transport_fn = inputs.cluster, inputs.model, inputs.options, inputs.transport_fn
    found = _Search(keep=NUM_ALTERNATIVES + 1, cutoff=cutoff)
    orders = list(domain_orders(cluster))
    # Whole pipelines per domain where the DP groups that dealing makes stay on one fabric and vendor, or cross
    # vendors through the shim (reduced inside each vendor's fabric first); across clusters of one vendor DP spans
    # them only when nothing else fits the degrees (pp = 1), on sockets as before.
    speeds = _replica_dealing(cluster)
    least_memory = min(n.accelerator.memory_gib for n in cluster.nodes)
    per_node = math.gcd(*[n.num_accelerators for n in cluster.nodes])
    net = cost.Network(cluster, transport_fn)
    most_memory = max(n.accelerator.memory_gib for n in cluster.nodes)
    dense_key = lambda d: (d.tp, d.cp, d.pp, d.dp, d.order)      # noqa: E731 -- what the placement depends on
    analyses: dict[tuple, list] = {}       # one analysis per dense degrees and domain order, every (ep, etp) on it
    for i, dims in enumerate(options):
        dist_opts = [d for d in (False, True) if not (d and dims.dp * dims.cp * dims.expert_dp == 1)]
        dist_opts = [d for d in dist_opts if cost.params_memory_gib(model, dims, d) <= most_memory]
        if not dist_opts:
            found.miss(cost.params_memory_gib(model, dims, True) - most_memory, _label(dims))
            continue
        key = dense_key(dims)
        if key not in analyses:
            analyses.clear()                # options come grouped by dense degrees: keep one group's analyses
            seen: set = set()
            placed = []
            for k, order in enumerate(orders):
                placement = place(cluster, dims, order)
                if placement.rank_of_canonical in seen:
                    continue
                seen.add(placement.rank_of_canonical)
                placed.append((k, cost.analyze(cluster, placement, transport_fn, net)))
            # each domain holds whole pipelines, so the smallest devices must hold a pipeline's stages
            if speeds and dims.pp > 1 and dims.dp > 1 and cost.params_memory_gib(model, dims, True) <= least_memory:
                for j, together in enumerate(_replicas_together(dims, per_node)):
                    if not _whole_pipelines(cluster, dims, together):
                        continue
                    placement = place_replicas(cluster, dims, orders[0], together)
                    if placement.rank_of_canonical not in seen:
                        seen.add(placement.rank_of_canonical)
                        placed.append((len(orders) + j, cost.analyze(cluster, placement, transport_fn, net)))
            analyses[key] = placed
        for k, dense in analyses[key]:
            analysis = cost.analyze_experts(cluster, dense, dims, net)
            if analysis.expert_span is not None:
                # Token all-to-all across a slow boundary or between vendors: never planned (the cost of
                # the all-to-all decides only among placements that keep every expert group in one domain).
                found.expert_spans.append(f"{_label(dims)}, order {' > '.join(f'{c}/{a}' for c, a in dense.placement.domain_order)}: "
                                          f"{analysis.expert_span}")
                continue
            variants = _instance_variants(cluster, model, dims, analysis, net) if inputs.instances else [analysis]
            for mb in _micro_batches(model, dims, inputs.fixed_mb, inputs.sched[0], inputs.replica_split):
                for dist_opt in dist_opts:
                    for an in (variants if dist_opt else variants[:1]):
                        _evaluate_split(inputs, found, an, dims, mb, None, k, dist_opt)
                        if found.hit:
                            return found
        if progress is not None:
            progress(i + 1, len(options), found.best[0].prediction.iteration_s if found.best else None)
    return found


def _replica_dealing(cluster: Cluster) -> bool:
    """Whole pipelines per domain are worth trying: the devices differ in type, and every data-parallel group the
    dealing makes across domains either stays on one fabric of one vendor, or crosses vendors -- the shim then
    reduces it inside each vendor's fabric first and stripes only the rest between them (charged so). Not where
    two clusters of one vendor meet: such a group is one NCCL communicator on sockets, a flat ring over Ethernet."""
    if len({n.accelerator.name for n in cluster.nodes}) < 2:
        return False
    vendors: dict[str, set] = {}
    for n in cluster.nodes:
        vendors.setdefault(n.cluster, set()).add(n.vendor)
    seen: set = set()
    for vs in vendors.values():
        if vs & seen:
            return False
        seen |= vs
    return True


def _replicas_together(dims: ParallelDims, per_node: int) -> list[int]:
    """How many replicas :func:`placement.place_replicas` deals together: 1 (a node holds consecutive stages of one
    replica: its pipeline sends stay inside the node), and as many as a node holds stages of (``per_node /
    (tp*cp)``: each DP group has that many members per node and reduces inside it first). The cost model picks."""
    tc = dims.tp * dims.cp
    out = [1]
    if tc < per_node and per_node % tc == 0 and dims.dp % (per_node // tc) == 0:
        out.append(per_node // tc)
    return out


def _whole_pipelines(cluster: Cluster, dims: ParallelDims, together: int = 1) -> bool:
    """Every domain holds whole pipelines (``together`` x pp*tp*cp ranks): the premise of data parallelism across
    domains."""
    size = together * dims.pp * dims.tp * dims.cp
    per_domain: dict = {}
    for n in cluster.nodes:
        per_domain[n.domain] = per_domain.get(n.domain, 0) + n.num_accelerators
    return all(k % size == 0 for k in per_domain.values())


#: plan_candidates' keywords: make_plan's degrees, micro-batch size and replica split (not the schedule or the NCCL
#: build: the candidates are the 1F1B het-aware search's on per-group transports)
CANDIDATE_KEYWORDS = ("tp", "pp", "dp", "cp", "micro_batch_size", "ep", "etp", "order", "replica_split")


def plan_candidates(cluster: Cluster, model: ModelSpec, *, profile: Optional[Profile] = None,
                    **degrees) -> list[Candidate]:
    """The best few plans of the het-aware search, best first, on any cluster (homogeneous ones too:
    benchmarks use it for the best a sub-cluster could do on its own). ``degrees``: :data:`CANDIDATE_KEYWORDS`,
    as make_plan's keyword form takes them."""
    unknown = sorted(set(degrees) - set(CANDIDATE_KEYWORDS))
    if unknown:
        raise TypeError(f"plan_candidates() got an unexpected keyword argument {unknown[0]!r}")
    asked = {**_KEYWORDS, **degrees}
    fixed_mb = asked["micro_batch_size"] or model.micro_batch_size
    replica_split, dp, fixed_mb = _replica_request(cluster, model, asked["replica_split"], asked["dp"], fixed_mb, 1)
    options = _degree_options(cluster, model, {**asked, "dp": dp}, fixed_mb)
    return _search_planned(SearchInputs(cluster, model, options, fixed_mb, asked["pp"] is not None, profile,
                                        replica_split=replica_split)).best


#: make_plan's options :func:`could_beat` understands; with any other it answers "maybe" (the caller plans).
SCREEN_OPTIONS = frozenset({"tp", "pp", "dp", "cp", "micro_batch_size", "progress", "profile", "ep", "etp", "order",
                            "vpp", "overlap_p2p_comm", "replica_split", "nccl", "optimizer_instances"})


def could_beat(cluster: Cluster, model: ModelSpec, cutoff: float, *, near: Optional[tuple[int, int]] = None,
               **options) -> bool:
    """Whether ``make_plan(cluster, model, **options)`` may predict an iteration below ``cutoff`` s; False only
    where it certainly does not (or raises). Cheaper than planning: the het-aware search prunes every candidate
    whose lower bound reaches the cut-off and stops at the first one below it, and no plan is assembled. The
    subset search (:mod:`subsets`) asks it before planning a subset that must beat the best plan so far.

    Exact, not a heuristic: make_plan's plan is its search's best or, where the frameworks' default predicts
    faster, that default re-predicted on the plan's transports; every search candidate below the cut-off has its
    lower bound below it and is evaluated here, and the default's best (searched in full, as make_plan does) is
    re-predicted here too. A homogeneous cluster's plan is the default search's: that search is screened
    (:func:`_default_could_beat`). ``near``:
    (tp, pp) of the best plan so far, whose neighbours are searched first (the answer does not depend on the
    order; a subset that may win usually shows it there)."""
    if not options.keys() <= SCREEN_OPTIONS or not math.isfinite(cutoff):
        return True
    try:
        inputs = _search_inputs(cluster, model, {**_KEYWORDS, **options}, options.get("profile"))
    except ConfigError:
        return False                                # make_plan raises the same
    if cluster.is_homogeneous:
        return _default_could_beat(inputs, cutoff)
    if near is not None:        # (a stable sort on tp and pp keeps each dense degree combination's options together)
        inputs = replace(inputs, options=sorted(inputs.options,
                                                key=lambda d: (abs(d.tp - near[0]) + abs(d.pp - near[1]))))
    found = _search_planned(inputs, cutoff=cutoff)
    if found.hit:
        return True
    # no search candidate below the cut-off: make_plan's plan is below it only as the frameworks' default
    stock, _ = _best_default(replace(inputs, transport_fn=stock_transport(inputs.multinet)))
    if stock is None:
        return False
    if stock.prediction.iteration_s < cutoff:
        return True
    return _own_prediction(inputs, stock).iteration_s < cutoff


def _default_could_beat(inputs: SearchInputs, cutoff: float) -> bool:
    """:func:`could_beat` on a homogeneous cluster, whose plan is the default search's best with Megatron's own
    optimizer or, where nothing fits without it, with the distributed optimizer: each search with the cut-off in
    that order. A search with a fitting candidate and none below the cut-off (a pruned one's lower bound reaches
    it) ends it: make_plan's plan is that search's best or an earlier one's, both at or above the cut-off. Where
    neither finds a fitting candidate, make_plan decides (True)."""
    for dist_opt in (False, True):
        found = _search_default(replace(inputs, transport_fn=cluster_transport, instances=False), dist_opt,
                                cutoff=cutoff)
        if found.hit:
            return True
        if found.best or found.fits_pruned:
            return False
    return True


def _search_default(inputs: SearchInputs, dist_opt: bool, progress: Optional[Progress] = None,
                    cutoff: Optional[float] = None) -> _Search:
    """The frameworks' default: identity placement, uniform layers (pp must divide the layers, as
    Megatron-Core requires without a layout, unless the user fixed such a pp), ``inputs.transport_fn``;
    ``inputs.instances`` (with ``dist_opt``): also Megatron's partial distributed optimizer where data parallelism
    spans fabrics (today's stock stack). ``cutoff``: a screen (see :attr:`_Search.cutoff`)."""
    cluster, model, options, transport_fn = inputs.cluster, inputs.model, inputs.options, inputs.transport_fn
    fixed_pp, sched = inputs.fixed_pp, inputs.sched
    found = _Search(keep=NUM_ALTERNATIVES + 1, cutoff=cutoff)
    net = cost.Network(cluster, transport_fn)
    dense: Optional[cost.Analysis] = None
    for i, dims in enumerate(options):
        uneven = model.num_layers % (dims.pp * sched[0]) != 0     # Megatron's own split: even virtual stages too
        if uneven and not fixed_pp:
            continue
        states = cost.params_memory_gib(model, dims, dist_opt)
        most_memory = max(n.accelerator.memory_gib for n in cluster.nodes)
        if states > most_memory:
            found.miss(states - most_memory, _label(dims))
            continue
        d0 = dense.placement.dims if dense is not None else None
        if d0 is None or (d0.tp, d0.cp, d0.pp, d0.dp, d0.order) != (dims.tp, dims.cp, dims.pp, dims.dp, dims.order):
            dense = cost.analyze(cluster, default_placement(cluster, dims), transport_fn, net)
        analysis = cost.analyze_experts(cluster, dense, dims, net)
        variants = (_instance_variants(cluster, model, dims, analysis, net) if dist_opt and inputs.instances
                    else [analysis])
        for mb in _micro_batches(model, dims, inputs.fixed_mb, sched[0], inputs.replica_split):
            layers = None if uneven else uniform_layers(model.num_layers, dims.pp)
            for an in variants:
                _evaluate_split(inputs, found, an, dims, mb, layers, 0, dist_opt)
                if found.hit:
                    return found
        if progress is not None:
            progress(i + 1, len(options), found.best[0].prediction.iteration_s if found.best else None)
    return found


def _instance_variants(cluster: Cluster, model: ModelSpec, dims: ParallelDims, analysis: cost.Analysis,
                       net: cost.Network) -> list[cost.Analysis]:
    """The analysis, and where data parallelism leaves a fabric (a DP group on sockets, the multi-network
    communicator or the shim) the same with Megatron's distributed-optimizer instances (cost.dist_opt): the
    planner's choice among them. Dense models only (the expert state's instances are not modelled)."""
    if model.is_moe or dims.ep > 1 or not (analysis.transports.get("dp", set()) & SPANNING):
        return [analysis]
    fabrics = len(cluster.cluster_names)
    return [analysis] + [with_instances(cluster, analysis, i, net) for i in instance_options(dims.dp * dims.cp, fabrics)]


def _label(dims: ParallelDims) -> str:
    return (f"tp={dims.tp} pp={dims.pp} dp={dims.dp}" + (f" cp={dims.cp}" if dims.cp > 1 else "")
            + (f" ep={dims.ep} etp={dims.etp}" if _has_experts(dims) else ""))


def _describe(cand: Candidate, what: str, shape: bool = False) -> str:
    d = cand.placement.dims
    order = " > ".join(f"{c}/{a}" for c, a in cand.placement.domain_order)
    experts = f" ep={d.ep} etp={d.etp}" if _has_experts(d) else ""
    return (f"{what}: tp={d.tp} pp={d.pp} dp={d.dp} cp={d.cp}{experts} micro-batch {cand.micro_batch_size}, "
            f"domain order {order}, layers {cand.layers}"
            + (", distributed optimizer" if cand.distributed_optimizer else "")
            + (f" in {cand.instances} instances" if cand.instances > 1 else "")
            + (f"; shape: {cand.shape}, replica split {cand.split_text()}" if shape else "")
            + (f", stages of {cand.placement.together} replicas per node" if shape and cand.placement.together > 1
               else ""))


def _replica_request(cluster: Cluster, model: ModelSpec, replica_split, dp: Optional[int], fixed_mb: Optional[int],
                     vpp: int) -> tuple["str | list[int]", Optional[int], Optional[int]]:
    """Check ``replica_split`` ("auto", "even", "uneven", or micro-batches per replica); given counts fix dp
    (their number) and the micro-batch size (global batch / their sum). Returns (split, dp, micro-batch size)."""
    fix = "use auto, even, uneven, or one count (>= 1) per data-parallel replica adding up to dp x num_micro_batches"
    if isinstance(replica_split, str):
        if replica_split not in REPLICA_SPLITS:
            raise ConfigError(f"replica_split={replica_split!r} is not one of {', '.join(REPLICA_SPLITS)} or a list of "
                              "counts", field="replica_split", fix=fix)
        devices = sorted({n.accelerator.name for n in cluster.nodes})
        if replica_split == "uneven" and len(devices) == 1:
            raise ConfigError(f"replica_split=uneven cannot be honoured: every accelerator of {cluster.name} is a "
                              f"{devices[0]}, so every replica runs at the same speed (an uneven split only makes "
                              "the others wait for the busiest)", source=cluster.source, field="replica_split",
                              fix="use auto or even, or give the counts yourself")
        if replica_split == "uneven" and vpp > 1:
            raise ConfigError(f"replica_split=uneven cannot be honoured with an interleaved pipeline (vpp={vpp}): "
                              "the planner models uneven replicas for the 1F1B schedule only", field="replica_split",
                              fix="use vpp=1, or replica_split auto/even")
        return replica_split, dp, fixed_mb
    try:
        counts = list(replica_split)
    except TypeError:
        raise ConfigError(f"replica_split={replica_split!r} is neither a mode nor a list of counts",
                          field="replica_split", fix=fix) from None
    if not counts:
        raise ConfigError("replica_split is an empty list of counts", field="replica_split", fix=fix)
    for d, n in enumerate(counts):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"replica {d} gets {n!r} micro-batches (replica_split {counts}); each replica needs at "
                              "least 1", field="replica_split", fix=fix)
    total, size, batch = sum(counts), len(counts), model.global_batch_size
    if dp is not None and dp != size:
        raise ConfigError(f"replica_split gives {size} counts {counts}, but dp={dp}", field="replica_split",
                          fix=f"give {dp} counts, or drop dp")
    if total % size:
        raise ConfigError(f"replica_split {counts} adds up to {total} micro-batches, not a multiple of its {size} "
                          f"replicas (the frameworks run dp x num_micro_batches per iteration)", field="replica_split",
                          fix=f"make the counts add up to a multiple of {size}")
    if fixed_mb is not None and total * fixed_mb != batch:
        raise ConfigError(f"replica_split {counts} adds up to {total} micro-batches of micro_batch_size {fixed_mb} = "
                          f"{total * fixed_mb} samples; global_batch_size is {batch}", field="replica_split",
                          fix=(f"make the counts add up to {batch // fixed_mb}" if batch % fixed_mb == 0 else
                               "use a micro_batch_size that divides global_batch_size"))
    if batch % total:
        raise ConfigError(f"replica_split {counts} adds up to {total} micro-batches, which do not divide "
                          f"global_batch_size {batch} into equal micro-batches", field="replica_split",
                          fix=f"make the counts add up to a divisor of {batch}")
    if vpp > 1 and len(set(counts)) > 1:
        raise ConfigError(f"replica_split {counts} is uneven, which the planner does not model with an interleaved "
                          f"pipeline (vpp={vpp})", field="replica_split", fix="use vpp=1, or equal counts")
    return counts, size, batch // total


def _interleaved_options(model: ModelSpec, options: list[ParallelDims], pp: Optional[int], fixed_mb: Optional[int],
                         vpp: int, overlap_p2p_comm: Optional[bool]) -> tuple[list[ParallelDims], Schedule]:
    """The degree options an interleaved pipeline of ``vpp`` virtual stages per rank can run, and the schedule
    (vpp, overlap_p2p_comm). Megatron needs pp >= 2 (pp > 2 without p2p overlap: Megatron-LM's validate_args),
    at least one layer per virtual stage here, and a micro-batch count that pp divides."""
    if not isinstance(vpp, int) or isinstance(vpp, bool) or vpp < 1:
        raise ConfigError(f"vpp={vpp!r} is not a positive integer", field="vpp",
                          fix="give the virtual pipeline stages per rank (1: not interleaved)")
    if vpp == 1:
        return options, Schedule(1, False)
    overlap = True if overlap_p2p_comm is None else bool(overlap_p2p_comm)
    least = 2 if overlap else 3
    if pp is not None and pp < least:
        raise ConfigError(f"an interleaved pipeline (vpp={vpp}) needs pp >= {least}"
                          + ("" if overlap else " without p2p overlap (Megatron-LM's rule)") + f", got pp={pp}",
                          field="vpp", fix=f"use vpp=1, or pp >= {least}"
                                           + ("" if overlap else ", or overlap p2p communication"))
    keep = [d for d in options if d.pp >= least and d.pp * vpp <= model.num_layers]
    if not keep:
        raise ConfigError(f"no pipeline size fits {vpp} virtual stages per rank: pp >= {least} and pp * vpp <= "
                          f"{model.num_layers} layers (one layer per virtual stage at least)", field="vpp",
                          fix=f"use a smaller vpp (at most {model.num_layers // least}), or vpp=1")
    if not any(_micro_batches(model, d, fixed_mb, vpp) for d in keep):
        raise ConfigError(f"the interleaved schedule needs micro-batches per pipeline (global_batch_size / (dp * "
                          f"micro_batch_size)) to be a multiple of pp; none of pp {sorted({d.pp for d in keep})} "
                          f"gets that from global_batch_size={model.global_batch_size}", field="global_batch_size",
                          fix="use a global batch size that gives a multiple of pp micro-batches, or vpp=1")
    return keep, Schedule(vpp, overlap)


# make_plan's keyword form: the request's fields under the names the planner always took (tests, docs, the CLI)
_KEYWORDS = {"tp": None, "pp": None, "dp": None, "cp": 1, "micro_batch_size": None, "ep": 1, "etp": None,
             "order": DEFAULT_ORDER, "vpp": 1, "overlap_p2p_comm": None, "replica_split": "auto", "nccl": None,
             "optimizer_instances": True}


def make_plan(cluster: Cluster, model: ModelSpec, request: Optional[LaunchRequest] = None, *,
              progress: Optional[Progress] = None, profile: Optional[Profile] = None, **keywords) -> Plan:
    """Best plan for ``cluster`` and ``model``; degrees given in ``request`` (a
    :class:`~het_plugin.core.request.LaunchRequest`) or in the model are respected. The keyword form
    (``tp=``, ``pp=``, ``dp=``, ``cp=``, ``micro_batch_size=``, ``ep=``, ``etp=``, ``order=``, ``vpp=``,
    ``overlap_p2p_comm=``, ``replica_split=``, ``nccl=``, ``optimizer_instances=``) is kept for one release; its degrees are checked by the search
    itself, which names the values that fit first.

    ``ep``/``etp`` (expert parallel sizes) and ``order`` (Megatron's rank order) are the framework's, taken
    as given: on a homogeneous cluster the plan is the framework's own numbering in that order. ``ep=1``
    (the default) is no expert parallelism, what a launch without ``--expert-model-parallel-size`` runs;
    ``ep=None`` lets the planner choose it among the divisors of the model's ``num_moe_experts``, with
    ``etp`` in {1, tp} unless ``etp`` is given. A heterogeneous plan keeps every expert group (its token
    all-to-all) inside one domain: one cluster fabric and one device type.

    ``profile`` (measured layer times and link bandwidths) overrides the analytic estimates. ``progress``
    (see :data:`Progress`) hears how far the search is; the planner itself prints nothing. Raises a
    ConfigError naming the field when no plan is possible (degrees, memory).

    ``vpp`` (virtual pipeline stages per rank, Megatron's interleaved schedule) is taken as given: each stage's
    layers go over its ``vpp`` virtual stages (:func:`layer_split.virtual_split`), the cost model simulates the
    interleaved 1F1B, and ``overlap_p2p_comm`` (None: on, Megatron-LM's default with interleaving) says whether
    it hides the pipeline's sends behind compute.

    ``replica_split``: how the global batch goes over the data-parallel replicas. "auto" (the default): where
    replicas run on devices of different speeds (data parallelism across domains, or a stage over two device
    types), each replica's micro-batch count follows its speed when that predicts at least
    :data:`UNEVEN_MIN_GAIN` less time, else the frameworks' even split (always on a homogeneous cluster).
    "even": the even split only. "uneven": only plans with uneven counts (a ConfigError if none exists). A list:
    those counts (dp = their number, micro-batch size = global batch / their sum).

    ``nccl``: the NCCL the run loads (None: the newest release, :data:`nccl_version.CURRENT_RELEASE`). Where it
    joins networks in one communicator (:attr:`NcclBuild.multinet`) a one-vendor group across fabrics gets the
    'multinet' transport, and the baseline is today's stock stack on it (:func:`placement.stock_transport`), the
    sockets-everywhere baseline kept as ``Plan.baseline_previous``. The plan is never predicted slower than the
    baseline: where the frameworks' default is best, it is the plan. ``optimizer_instances``: the planner (and the
    baseline) may use Megatron's partial distributed optimizer; False for DeepSpeed, whose pipeline engine has no
    such mode (ZeRO-1 shards over the whole data-parallel group; docs/deepspeed.md).
    """
    if request is not None and keywords:
        raise TypeError(f"make_plan: pass the request or its keywords, not both ({', '.join(keywords)})")
    unknown = sorted(set(keywords) - set(_KEYWORDS))
    if unknown:
        raise TypeError(f"make_plan() got an unexpected keyword argument {unknown[0]!r}")
    asked = {**_KEYWORDS, **(request.planner_options() if request is not None else keywords)}
    return _make_plan(cluster, model, asked, progress, profile)


def _search_inputs(cluster: Cluster, model: ModelSpec, asked: dict, profile: Optional[Profile]) -> SearchInputs:
    """The searches' inputs for the request's fields (``asked``: :meth:`LaunchRequest.planner_options` over
    :data:`_KEYWORDS`): the checked replica split, degree options and schedule; the plan's transports."""
    multinet = (asked["nccl"] or NcclBuild()).multinet
    fixed_mb = asked["micro_batch_size"] or model.micro_batch_size
    if fixed_mb is not None and model.global_batch_size % fixed_mb:
        raise ConfigError(f"global_batch_size {model.global_batch_size} is not a multiple of micro_batch_size "
                          f"{fixed_mb}", field="micro_batch_size", fix="use a divisor of global_batch_size")
    pp = asked["pp"]
    replica_split, dp, fixed_mb = _replica_request(cluster, model, asked["replica_split"], asked["dp"], fixed_mb,
                                                   asked["vpp"])
    options = _degree_options(cluster, model, {**asked, "dp": dp}, fixed_mb)
    options, sched = _interleaved_options(model, options, pp, fixed_mb, asked["vpp"], asked["overlap_p2p_comm"])
    return SearchInputs(cluster, model, options, fixed_mb, pp is not None, profile, sched, replica_split,
                        overlap=True, transport_fn=multinet_transport if multinet else cluster_transport,
                        instances=asked["optimizer_instances"], multinet=multinet)


def _make_plan(cluster: Cluster, model: ModelSpec, asked: dict, progress: Optional[Progress],
               profile: Optional[Profile]) -> Plan:
    """:func:`make_plan` on the request's fields (``asked``: :meth:`LaunchRequest.planner_options`)."""
    inputs = _search_inputs(cluster, model, asked, profile)
    options, sched, replica_split, overlap = inputs.options, inputs.sched, inputs.replica_split, inputs.overlap
    multinet, plan_fn = inputs.multinet, inputs.transport_fn
    if cluster.is_homogeneous:
        for dist_opt in (False, True):      # Megatron's default first; the distributed optimizer if needed
            planned = _search_default(replace(inputs, transport_fn=cluster_transport, instances=False), dist_opt,
                                      progress)
            if planned.best:
                break
        if not planned.best and planned.closest_overflow is None:
            # No degree option has a pp that divides num_layers (Megatron's uniform default needs one):
            # the exact split over identical stages, which the layout knob expresses, is the next best.
            planned = _search_planned(replace(inputs, transport_fn=cluster_transport, instances=True), progress)
    else:
        planned = _search_planned(inputs, progress)
    if not planned.best and replica_split == "uneven":
        devices = ", ".join(sorted({n.accelerator.name for n in cluster.nodes}))
        raise ConfigError(f"replica_split=uneven cannot be honoured: of {len(options)} degree combinations on "
                          f"{cluster.name} ({devices}), none has replicas on devices of different speeds for which "
                          f"an uneven split fits in memory and predicts a plan", source=cluster.source,
                          field="replica_split", fix="use auto or even, or fix fewer degrees")
    if not planned.best:
        ep = asked["ep"]
        if planned.expert_spans and (planned.closest_overflow is None or (ep or 1) > 1):
            raise _expert_span_error(cluster, planned, ep)
        raise _memory_error(cluster, model, planned)
    base_best = planned.best[0] if cluster.is_homogeneous else None
    previous_best = None
    if not cluster.is_homogeneous:
        # What a user gets today, at its best: either optimizer setting, the best degrees for it.
        base_best, plain_best = _best_default(replace(inputs, transport_fn=stock_transport(multinet)))
        # the line before today's stack (sockets everywhere, one optimizer instance), kept where it differs; on a
        # released NCCL it is the stock search's best without instances (no second search)
        previous_best = plain_best if not multinet else _best_default(
            replace(inputs, transport_fn=baseline_transport, instances=False))[0]
        if previous_best is not None and base_best is not None and \
                previous_best.prediction.iteration_s == base_best.prediction.iteration_s:
            previous_best = None
    best = planned.best[0]
    het = not cluster.is_homogeneous
    stock_wins = het and base_best is not None and base_best.prediction.iteration_s < best.prediction.iteration_s
    if stock_wins:          # never a plan predicted slower than what the frameworks do by themselves
        best = replace(base_best, prediction=_own_prediction(inputs, base_best))
    stock_wins = stock_wins or (het and base_best is not None and _same_run(best, base_best))
    best.prediction.description = _describe(best, STOCK_IS_BEST if stock_wins else "planned" if het else
                                            "framework default (homogeneous cluster: het_plugin changes nothing)",
                                            shape=het and not stock_wins)
    if het and not stock_wins:
        best.prediction.shape = best.shape
    baseline = None
    if base_best is not None:
        b = base_best
        baseline = b.prediction
        if b is not best:      # (the old wording where today's stack changes nothing: those plans keep their hashes)
            baseline.description = _describe(b, STOCK_MULTINET if multinet else
                                             STOCK_RELEASED if previous_best is not None else STOCK_SOCKETS)
    baseline_previous = None
    if previous_best is not None:
        baseline_previous = replace(previous_best.prediction,
                                    description=_describe(previous_best, STOCK_SOCKETS_OLD))
    warnings = []
    if baseline is None:
        warnings.append("no framework-default plan fits in memory (uniform layers); no baseline to compare")
    warnings += cost.profile_notes(profile, model, {n.accelerator.name for n in cluster.nodes},
                                   best.micro_batch_size, best.placement.dims.tp)
    advice = extrapolation_advice(profile, model, {n.accelerator.name for n in cluster.nodes},
                                  best.micro_batch_size, best.placement.dims.tp) if best.prediction.extrapolated else None
    if advice:                                # chosen on guessed numbers: say so, and what to measure
        warnings.append(advice)
    others = list(planned.best[1:])
    if het:     # the best of every other shape too, so the report can say why this shape won
        others += [c for shape, c in sorted(planned.by_shape.items()) if shape != best.shape and c not in others]
    return assemble_plan(cluster, model, best.placement, best.layers, best.micro_batch_size,
                         prediction=best.prediction, baseline=baseline, overlap_grad_reduce=overlap,
                         distributed_optimizer=best.distributed_optimizer,
                         alternatives=[c.summary(model.is_moe, shapes=het) for c in others], extra_warnings=warnings,
                         vpp=sched.vpp, overlap_p2p_comm=bool(sched.overlap_p2p_comm), replica_micro_batches=best.replica_counts,
                         transport_fn=plan_fn, baseline_previous=baseline_previous,
                         distributed_optimizer_instances=best.instances)


# What the baseline lines say (the report prints them).
STOCK_SOCKETS = ("baseline = framework default placement (identity), uniform layers, one process-wide NCCL network "
                 "setting, best degrees for that default")
STOCK_RELEASED = ("baseline = today's stock stack: framework default placement (identity), uniform layers, one "
                  "process-wide NCCL network setting (no NCCL release joins fabrics in one communicator), Megatron's "
                  "distributed-optimizer instances where they help, best degrees for that default")
STOCK_MULTINET = ("baseline = today's stock stack: framework default placement (identity), uniform layers, NCCL's "
                  "multi-network communicators (NCCL_ALLNET_ENABLE=1, fabric IDs), best degrees and optimizer for "
                  "that default")
STOCK_SOCKETS_OLD = ("previous baseline = framework default placement, uniform layers, every communicator on sockets "
                     "once one crosses fabrics, one distributed-optimizer instance, best degrees for that default")
STOCK_IS_BEST = ("stock = framework default placement and uniform layers: no placement or split het_plugin "
                 "searched predicts faster, so the plan keeps the frameworks' own")


def _own_prediction(inputs: SearchInputs, cand: "Candidate") -> Prediction:
    """A stock candidate predicted as the plan it becomes will run (its groups on ``inputs.transport_fn``, which is
    never slower than the stock baseline's: per-group RDMA where the baseline put everything on sockets)."""
    sched = inputs.sched
    return cost.predict(inputs.cluster, inputs.model, cand.placement, cand.layers, cand.micro_batch_size,
                        transport_fn=inputs.transport_fn, overlap_grad_reduce=inputs.overlap,
                        distributed_optimizer=cand.distributed_optimizer, profile=inputs.profile, vpp=sched[0],
                        overlap_p2p_comm=sched[1], instances=cand.instances)


def _same_run(a: "Candidate", b: "Candidate") -> bool:
    """The same placement, layers, micro-batch, optimizer and predicted time (so the same transports too): the plan
    is the frameworks' own run."""
    return (a.prediction.iteration_s == b.prediction.iteration_s
            and a.placement.rank_of_canonical == b.placement.rank_of_canonical and a.placement.dims == b.placement.dims
            and list(a.layers) == list(b.layers) and a.micro_batch_size == b.micro_batch_size
            and (a.distributed_optimizer, a.instances, a.replica_counts) == (b.distributed_optimizer, b.instances,
                                                                             b.replica_counts))


def _best_default(inputs: SearchInputs) -> "tuple[Optional[Candidate], Optional[Candidate]]":
    """The frameworks' default on ``inputs.transport_fn`` at its best, with their even replica split: either
    optimizer setting (``inputs.instances``: also Megatron's distributed-optimizer instances where data
    parallelism leaves a fabric), the best degrees; and the best of those with one optimizer instance (the same
    where none is better)."""
    even = replace(inputs, replica_split="even")
    best = plain = None
    for dist_opt in (False, True):
        found = _search_default(even, dist_opt)
        if found.best and (best is None or found.best[0].key < best.key):
            best = found.best[0]
        one = next((c for c in found.best if c.instances == 1), None)
        if one is not None and (plain is None or one.key < plain.key):
            plain = one
    return best, plain


def _expert_span_error(cluster: Cluster, found: _Search, ep: Optional[int]) -> ConfigError:
    return ConfigError(
        f"every placement of these degrees puts an expert group across domains ({len(found.expert_spans)} "
        f"refused; e.g. {found.expert_spans[0]}): the token all-to-all would cross a slow link or a vendor "
        "boundary", source=cluster.source, field="ep (expert_model_parallel_size)",
        fix=("use a smaller ep (an expert group of etp*ep ranks must fit inside one cluster's nodes of one "
             "device type), or leave ep to the planner (ep=None / no --ep)") if ep is not None else
            "fix tp/pp/dp so that a pipeline stage fits inside one domain, or leave them to the planner")


def _memory_error(cluster: Cluster, model: ModelSpec, found: _Search) -> ConfigError:
    if found.closest_overflow is None:
        return ConfigError(f"no plan of {model.name} could be evaluated for {cluster.world_size} accelerators",
                           source=cluster.source, field="degrees",
                           fix="drop the fixed degrees, or change num_layers / global_batch_size")
    over, what = found.closest_overflow
    mem = sorted({n.accelerator.memory_gib for n in cluster.nodes})
    return ConfigError(
        f"memory cannot hold even the smallest plan of {model.name} ({model.total_params / 1e9:.1f}B parameters, "
        f"seq_length {model.seq_length}): the closest, {what}, is {over:.1f} GiB per device over the "
        f"{', '.join(f'{m:g}' for m in mem)} GiB the devices have (distributed optimizer tried too)",
        source=cluster.source, field="clusters[*].nodes[*].accelerator (memory_gib)",
        fix="add nodes or use accelerators with more memory, or a smaller model / seq_length / global batch")
