"""Prediction: a plan's iteration time, throughput and memory from its stages -- the planner's cost tables
(:class:`SplitCosts`) and the one-call :func:`predict`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from ..inputs.cluster import Cluster
from ..inputs.model import ModelSpec
from ..ranks.placement import Placement, cluster_transport
from ..plan import Prediction
from ..inputs.profile import Profile
from ..ranks.batches import ReplicaBatches
from ..ranks.dims import ParallelDims
from .analysis import Analysis, ReplicaClass, analyze
from .network import GIB, GRAD_BYTES, OPTIMIZER_STATE_BYTES, Network, TransportFn, WEIGHT_BYTES
from .fixed_costs import iteration_overhead_s, with_slots
from .pipeline import _interleaved_pipeline, simulate_1f1b, wrap_send_s
from .stage import (
    StageModel, _dp_reduce_s, _max_layers_fitting, _memory_bytes, _optimizer_s, _stage_cost_parts, _stage_costs,
    _stage_models, exposed_reduction_s, stage_costs_at,
)
from ..layer_split import virtual_split
from .interleaved import check_micro_batches, warmup_count
from .dist_opt import with_instances

# ---- prediction -----------------------------------------------------------------------------------


def evaluate(model: ModelSpec, analysis: Analysis, layers_per_stage: Sequence[int], micro_batch_size: int, *,
             overlap_grad_reduce: bool = True, distributed_optimizer: bool = False,
             profile: Optional[Profile] = None, description: str = "", vpp: int = 1,
             overlap_p2p_comm: Optional[bool] = None) -> Prediction:
    """Predict one layer split of an analyzed placement."""
    return SplitCosts(model, analysis, micro_batch_size, overlap_grad_reduce=overlap_grad_reduce,
                      distributed_optimizer=distributed_optimizer, profile=profile, vpp=vpp,
                      overlap_p2p_comm=overlap_p2p_comm).predict(layers_per_stage, description)


def stage_times(sts: Sequence[StageModel], layers_per_stage: Sequence[int]) -> tuple[list[float], list[float]]:
    """Each stage's forward and backward per micro-batch for a split (per-layer overrides: its own layers)."""
    fwd = [st.fixed_fwd_s + n * st.layer_fwd_s for st, n in zip(sts, layers_per_stage)]
    bwd = [st.fixed_bwd_s + n * st.layer_bwd_s for st, n in zip(sts, layers_per_stage)]
    if any(st.layer_deltas for st in sts):                 # per-layer overrides: each stage's own layers
        firsts = [sum(layers_per_stage[:s]) for s in range(len(sts))]
        own = [st.own_layers(i, n) for st, i, n in zip(sts, firsts, layers_per_stage)]
        fwd = [st.fixed_fwd_s + o[0] for st, o in zip(sts, own)]
        bwd = [st.fixed_bwd_s + o[1] for st, o in zip(sts, own)]
    return fwd, bwd


def steady_step_s(fwd: Sequence[float], bwd: Sequence[float], sts: Sequence[StageModel], chunks: int = 1) -> float:
    """One steady-state 1F1B step of the slowest stage: its forward and backward (with their pipeline slots, one
    per model chunk each way: ``chunks`` = vpp when interleaved), its activation send to the next stage and its
    gradient send back to the previous one (each link's own direction)."""
    pp = len(sts)
    return max(f + b + 2 * chunks * sts[s].slot_s + (sts[s].send_s if s + 1 < pp else 0.0)
               + (sts[s - 1].back_s if s else 0.0) for s, (f, b) in enumerate(zip(fwd, bwd)))


@dataclass
class GroupPipeline:
    """One replica group's pipeline in a prediction: its stages' times per micro-batch, its count of
    micro-batches, when each stage's last backward finishes (and each stage is done, its exposed reduction
    included), and -- when asked for -- every forward, backward and send (the timeline draws those)."""
    replicas: tuple[int, ...]
    micro_batches: int
    fwd: list[float]
    bwd: list[float]
    finish: list[float]
    ends: list[float]
    step_s: float
    spans: Optional[list] = None


def group_pipelines(sc: "SplitCosts", layers_per_stage: Sequence[int], record: bool = False) -> list[GroupPipeline]:
    """Every replica group's pipeline for a split (the even split: one group, every replica at the stages'
    slowest devices). The one place stage times, the schedule and the exposed reduction meet."""
    dims = sc.analysis.placement.dims
    virtual = None
    if sc.vpp > 1:
        virtual = virtual_split(layers_per_stage, sc.vpp)
    reds = stage_reductions(sc, layers_per_stage)
    out = []
    for (reps, sts), m in zip(sc.replica_groups, sc.group_counts()):
        fwd, bwd = stage_times(sts, layers_per_stage)
        spans: Optional[list] = [] if record else None
        if virtual is not None and len(virtual[0]) > 1:
            finish, ends = _interleaved_pipeline(sts, virtual, m, sc.overlap_p2p_comm, sc.wrap_send_s, dims.dp,
                                                 sc.overlap_grad_reduce, sc.distributed_optimizer, sc.profile)
        else:
            finish = simulate_1f1b(*with_slots(fwd, bwd, sts), [st.send_s for st in sts], m, [st.back_s for st in sts],
                                   record=spans)
            ends = [f + exposed_reduction_s(r, b, sc.overlap_grad_reduce) for f, r, b in zip(finish, reds, bwd)]
        chunks = len(virtual[0]) if virtual is not None else 1
        out.append(GroupPipeline(reps, m, fwd, bwd, finish, ends, steady_step_s(fwd, bwd, sts, chunks), spans))
    return out


def stage_reductions(sc: "SplitCosts", layers_per_stage: Sequence[int]) -> list[float]:
    """Each stage's gradient reduction (its slowest replica's paths: the analysis's stages)."""
    return [_dp_reduce_s(st, n, sc.dp, sc.distributed_optimizer, sc.profile)
            for st, n in zip(sc.stages, layers_per_stage)]


def _interleaved_tables(sc: "SplitCosts") -> list[list[float]]:
    """The exact partition's cost tables for the interleaved schedule (a lower bound of each stage's part of the
    iteration): compute, and its sends -- blocking, or with overlap_p2p_comm only where its busiest outgoing link
    is slower than its compute -- plus the reduction the last chunk's backward cannot hide."""
    sts, num_layers, m, vpp = sc.stages, sc.model.num_layers, sc.num_micro_batches, sc.vpp
    overlap_p2p_comm, wrap_send, dp, overlap = sc.overlap_p2p_comm, sc.wrap_send_s, sc.dp, sc.overlap_grad_reduce
    distributed_optimizer, profile = sc.distributed_optimizer, sc.profile
    pp = len(sts)
    tables = []
    for r, st in enumerate(sts):
        nxt = st.send_s if r < pp - 1 else wrap_send          # activations out, vpp per micro-batch (one less on
        prv = sts[r - 1].back_s if r > 0 else wrap_send       # the last rank); gradients back, likewise (first)
        n_next, n_prev = vpp - (r == pp - 1), vpp - (r == 0)
        if pp == 2:                                            # one link each way carries both
            links = [n_next * nxt + n_prev * prv]
        else:
            links = [n_next * nxt, n_prev * prv]
        row = []
        for n in range(num_layers + 1):
            compute = st.fixed_fwd_s + st.fixed_bwd_s + n * (st.layer_fwd_s + st.layer_bwd_s) + 2 * vpp * st.slot_s
            red = _dp_reduce_s(st, n, dp, distributed_optimizer, profile)
            exposed = max(0.0, (red - st.fixed_bwd_s - n * st.layer_bwd_s) / vpp) if overlap else red
            if overlap_p2p_comm:
                busy = m * max([compute] + links)
            else:
                busy = m * (compute + n_next * nxt + n_prev * prv)
            row.append(busy + exposed)
        tables.append(row)
    return tables


def _evaluate(sc: "SplitCosts", layers_per_stage: Sequence[int], description: str) -> Prediction:
    """The prediction of one split: every replica group's pipeline (:func:`group_pipelines`; one group for the
    even split), every stage's gradient reduction starting when its last replica gets there, the tied embedding's
    all-reduce, the optimizer step and the per-iteration overhead."""
    model, analysis, dims = sc.model, sc.analysis, sc.analysis.placement.dims
    pp, dp = dims.pp, dims.dp
    counts = sc.counts or [sc.num_micro_batches] * dp
    replica_s = [0.0] * dp
    pipeline, busiest, alltoall = 0.0, 0.0, 0.0
    ends = [0.0] * pp
    stage_compute = [0.0] * pp
    for g, (_, sts) in zip(group_pipelines(sc, layers_per_stage), sc.replica_groups):
        # A replica of the group with fewer micro-batches (one less: a group's counts differ by at most one when
        # balanced) finishes a steady-state step of the slowest stage earlier per micro-batch.
        for d in g.replicas:
            replica_s[d] = max(g.finish) - (g.micro_batches - counts[d]) * g.step_s
        pipeline = max(pipeline, max(g.finish))
        busiest = max(busiest, max(g.micro_batches * (f + b) for f, b in zip(g.fwd, g.bwd)))
        alltoall = max(alltoall, max(g.micro_batches * n * st.alltoall_per_layer_s
                                     for st, n in zip(sts, layers_per_stage)))
        ends = [max(e, x) for e, x in zip(ends, g.ends)]
        stage_compute = [max(c, f + b) for c, f, b in zip(stage_compute, g.fwd, g.bwd)]
    opt = max(_optimizer_s(st, n, dp, sc.distributed_optimizer) for st, n in zip(sc.stages, layers_per_stage))
    emb = 0.0
    if len(model.embedding_stages(pp)) > 1 and analysis.embedding_paths:   # tied, or MTP on the last stage
        emb_bytes = model.embedding_params / dims.tp * GRAD_BYTES
        emb = max(p.allreduce_s(emb_bytes, sc.profile) for p in analysis.embedding_paths)
    iteration = max(ends) + emb + opt + _iteration_overhead_s(analysis, sc.profile)
    tokens = model.global_batch_size * model.seq_length
    flops = 3.0 * model.global_batch_size * (model.decoder_flops_fwd(1) + model.logits_flops_fwd(1)
                                             + model.mtp_flops_fwd(1))
    memory = [_memory_bytes(st, n, dp, sc.distributed_optimizer) / GIB for st, n in zip(sc.stages, layers_per_stage)]
    pred = Prediction(
        iteration_s=iteration, tokens_per_s=tokens / iteration,
        tflops_per_device=flops / iteration / dims.world_size / 1e12,
        pipeline_s=pipeline, dp_exposed_s=max(ends) - pipeline + emb, optimizer_s=opt,
        bubble_fraction=max(0.0, 1.0 - busiest / pipeline) if pipeline > 0 else 0.0,
        stage_compute_s=stage_compute, memory_gib_per_stage=memory,
        capacity_gib_per_stage=[st.capacity_gib for st in sc.stages], description=description,
        alltoall_s=alltoall, replica_pipeline_s=replica_s if sc.per_replica else [])
    problem = memory_problem(pred)
    if problem:
        pred.description = (pred.description + "; " if pred.description else "") + problem
    return pred


def _iteration_overhead_s(analysis: Analysis, profile: Optional[Profile]) -> float:
    """The fixed cost per iteration: the slowest device type's, measured or defaulted (fixed_costs)."""
    return iteration_overhead_s(profile, [a for st in analysis.stages for a in st.accelerators])


def profile_notes(profile: Optional[Profile], model: ModelSpec, devices, micro_batch_size: int, tp: int) -> list[str]:
    """Lines saying which measured compute curves of ``devices`` (names) a prediction at this micro-batch size
    and TP extrapolates (format-2 profiles; the description and the plan's warnings carry them)."""
    if profile is None:
        return []
    kinds = ("layer", "embedding", "output") + (("moe_layer",) if model.is_moe else ())
    return profile.extrapolation_notes(devices, micro_batch_size, tp, kinds)


class SplitCosts:
    """The layer split's side of the predictor, for one analyzed placement, micro-batch size and optimizer
    setting: what the exact partition needs (:meth:`tables`, :meth:`max_layers`), how far a split misses
    memory (:meth:`overflow_gib`), and the prediction of a split (:meth:`predict`).

    ``vpp > 1``: Megatron's interleaved schedule with ``vpp`` virtual stages per rank (each stage's layers split
    by :func:`het_plugin.core.layer_split.virtual_split`), ``overlap_p2p_comm`` (None: on, Megatron-LM's default
    there); the in-flight activations are the interleaved schedule's (warm-up + 1 chunks on each rank)."""

    def __init__(self, model: ModelSpec, analysis: Analysis, micro_batch_size: int, *,
                 overlap_grad_reduce: bool = True, distributed_optimizer: bool = False,
                 profile: Optional[Profile] = None, vpp: int = 1, overlap_p2p_comm: Optional[bool] = None):
        dims = analysis.placement.dims
        self.model, self.analysis, self.micro_batch_size = model, analysis, micro_batch_size
        self.overlap_grad_reduce, self.distributed_optimizer, self.profile = (overlap_grad_reduce,
                                                                              distributed_optimizer, profile)
        self.dp = dims.dp
        self.num_micro_batches = model.global_batch_size // (dims.dp * micro_batch_size)
        #: per stage: its times per micro-batch and bytes per rank, linear in its layer count
        # the same for both optimizer settings: kept on the analysis per micro-batch size (without a profile, which
        # its owner may still change)
        own = analysis.__dict__.setdefault("_stage_models", {}) if profile is None else {}
        key = (micro_batch_size, self.num_micro_batches, id(model))
        if key not in own:
            own[key] = (_stage_models(model, analysis, micro_batch_size, self.num_micro_batches, profile), model)
        self.stages: list[StageModel] = list(own[key][0])
        self.notes = profile_notes(profile, model, {a.name for st in analysis.stages for a in st.accelerators},
                                   micro_batch_size, dims.tp)
        self.vpp = vpp
        self.overlap_p2p_comm = (vpp > 1) if overlap_p2p_comm is None else bool(overlap_p2p_comm) and vpp > 1
        self.wrap_send_s = 0.0
        if vpp > 1:

            m, pp = self.num_micro_batches, dims.pp
            if pp < 2:
                raise ValueError(f"an interleaved pipeline (vpp={vpp}) needs pp >= 2")
            check_micro_batches(pp, m)
            self.wrap_send_s = wrap_send_s(model, analysis, micro_batch_size, profile)
            # warm-up + 1 chunks of about n / vpp layers each hold activations (Megatron's 1 + (pp-1)/(pp vpp))
            self.stages = [dataclasses.replace(st, in_flight=min(warmup_count(pp, s, m, vpp) + 1, m * vpp) / vpp)
                           for s, st in enumerate(self.stages)]
        #: data-parallel replicas that run alike, with their stages' models: one group (every replica, the
        #: stages' slowest devices) unless replicas run on different devices (not with interleaving)
        self.replica_groups: list[tuple[tuple[int, ...], list[StageModel]]] = [(tuple(range(dims.dp)), self.stages)]
        if vpp == 1 and analysis.replica_classes:
            # the same for both optimizer settings: kept on the analysis per micro-batch size
            cache = analysis.__dict__.setdefault("_class_stage_models", {})
            key = (micro_batch_size, self.num_micro_batches, id(profile))
            if key not in cache:
                cache[key] = [(c.replicas, _stage_models(model, _class_analysis(analysis, c), micro_batch_size,
                                                         self.num_micro_batches, profile))
                              for c in analysis.replica_classes]
            self.replica_groups = list(cache[key])
        self.counts: list[int] = []          # micro-batches per replica; [] = the even split
        self._group_rows: Optional[list] = None

    @property
    def per_replica(self) -> bool:
        """Replicas differ (devices or counts): each is predicted on its own."""
        return len(self.replica_groups) > 1 or bool(self.counts)

    def set_counts(self, counts: Sequence[int]) -> None:
        """Micro-batches per replica ([] or all equal: the even split); the first stages hold up to pp of the
        largest count in flight (1F1B), so the memory follows the largest."""
        counts = list(ReplicaBatches.of(counts, self.dp, self.num_micro_batches, self.micro_batch_size).counts)
        if counts and self.vpp > 1 and len(set(counts)) > 1:
            raise ValueError("uneven replica counts are not modelled with an interleaved pipeline (vpp > 1)")
        self.counts = counts if counts and len(set(counts)) > 1 else []
        top = max(counts) if self.counts else self.num_micro_batches
        if self.vpp == 1:
            pp = len(self.stages)
            self.stages = [replace(st, in_flight=min(pp - s, top)) for s, st in enumerate(self.stages)]
            if len(self.replica_groups) == 1:
                self.replica_groups = [(self.replica_groups[0][0], self.stages)]

    def group_counts(self) -> list[int]:
        """The largest micro-batch count of each replica group (what its slowest replica runs)."""
        counts = self.counts
        if not counts:
            return [self.num_micro_batches] * len(self.replica_groups)
        return [max(counts[d] for d in reps) for reps, _ in self.replica_groups]

    def balance(self, layers_per_stage: Sequence[int]) -> list[int]:
        """Micro-batches per replica for this split, by each replica group's speed (:func:`share_micro_batches`
        over each group's 1F1B fill and steady-state step); [] where the groups run alike."""
        if len(self.replica_groups) < 2 or self.vpp > 1:
            return []
        sizes, fills, steps = [], [], []
        for reps, sts in self.replica_groups:
            f, b = stage_times(sts, layers_per_stage)
            step = steady_step_s(f, b, sts)
            sizes.append(len(reps))
            steps.append(step)
            links = sum(st.send_s for st in sts[:-1]) + sum(st.back_s for st in sts[:-1])   # each link each way
            slots = 2 * sum(st.slot_s for st in sts)                                         # each stage's F and B
            fills.append(sum(f) + sum(b) + slots + links - step)
        totals = share_micro_batches(sizes, fills, steps, self.dp * self.num_micro_batches)
        counts = [0] * self.dp
        for (reps, _), q in zip(self.replica_groups, totals):
            base, extra = divmod(q, len(reps))
            for i, d in enumerate(reps):
                counts[d] = base + (1 if i < extra else 0)
        return counts if len(set(counts)) > 1 else []

    def max_layers(self) -> list[int]:
        """Per stage, the most layers its memory holds (-1: not even its fixed part fits)."""
        return [_max_layers_fitting(st, self.model.num_layers, self.dp, self.distributed_optimizer)
                for st in self.stages]

    def tables(self) -> list[list[float]]:
        """Per stage, its busy time in one iteration with 0..num_layers layers (the exact partition's costs)."""
        if self.vpp > 1:
            return _interleaved_tables(self)
        if not self.counts:     # the even split: each stage at its slowest devices (>= any replica group's)
            return _stage_costs(self.stages, self.model.num_layers, self.num_micro_batches, self.dp,
                                self.overlap_grad_reduce, self.distributed_optimizer, self.profile)
        if self._group_rows is None:       # a group's table is m * (per micro-batch) + (exposed reduction)
            self._group_rows = []
            for _, sts in self.replica_groups:
                self._group_rows.append(_stage_cost_parts(sts, self.model.num_layers, self.dp,
                                                          self.overlap_grad_reduce, self.distributed_optimizer,
                                                          self.profile))
        rows: Optional[list[list[float]]] = None       # each stage's cost: its slowest replica group's
        for (per, fixed), m in zip(self._group_rows, self.group_counts()):
            t = [[m * a + e for a, e in zip(ra, re)] for ra, re in zip(per, fixed)]
            rows = t if rows is None else [[max(a, b) for a, b in zip(r, q)] for r, q in zip(rows, t)]
        return rows

    def partition_floor(self, uneven: bool = False) -> float:
        """A lower bound of the exact partition's bottleneck (1F1B tables), without building the tables: a stage's
        cost with n layers is at least m * (a + n * b) (compute, slots and sends per micro-batch; the exposed
        reduction is >= 0), so the best split's bottleneck v has n_s <= (v / m - a_s) / b_s, summing to the layers
        (:func:`_floor_per_micro_batch`). ``uneven``: for any replica counts (:meth:`balance`'s): group g's
        largest count m_g times its own floor f_g, with sum(|g| m_g) >= dp * m, is at least dp * m / sum(|g| /
        f_g). Slightly lowered (1e-9) for the rounding of the tables' sums. 0.0 where it does not apply
        (interleaved, given counts, per-layer overrides)."""
        if self.vpp > 1 or self.counts or self.layers_differ:
            return 0.0
        num_layers, m = self.model.num_layers, self.num_micro_batches
        if not uneven:
            return m * _floor_per_micro_batch(self.stages, num_layers) * (1.0 - 1e-9)
        inverse = 0.0
        for reps, sts in self.replica_groups:
            f = _floor_per_micro_batch(sts, num_layers)
            if f <= 0.0:
                return 0.0
            inverse += len(reps) / f
        return self.dp * m / inverse * (1.0 - 1e-9)

    def bottleneck(self, layers_per_stage: Sequence[int]) -> float:
        """``layer_split.bottleneck(self.tables(), layers_per_stage)``, the split's lower bound, computed for those
        layer counts only where the tables are the even split's 1F1B ones (the default search's fixed splits)."""
        if self.vpp > 1 or self.counts:
            tables = self.tables()
            return max(tables[s][n] for s, n in enumerate(layers_per_stage))
        return max(stage_costs_at(self.stages, layers_per_stage, self.num_micro_batches, self.dp,
                                  self.overlap_grad_reduce, self.distributed_optimizer, self.profile))

    @property
    def layers_differ(self) -> bool:
        """The profile measures some decoder layers on their own (per-layer overrides)."""
        return any(st.layer_deltas for st in self.stages)

    def refine(self, layers_per_stage: Sequence[int], max_layers: Sequence[int], min_layers: int = 1) -> list[int]:
        """With per-layer overrides the partition's tables hold each stage's mean layer; move one layer at a time
        across a stage boundary while the predicted iteration gets shorter (memory caps and ``min_layers``
        kept). Without overrides: the split unchanged."""
        best = list(layers_per_stage)
        if not self.layers_differ:
            return best
        best_s = self.predict(best).iteration_s
        for _ in range(self.model.num_layers * len(best)):         # each pass improves, or stops
            moves = []
            for b in range(len(best) - 1):
                for step in (1, -1):
                    cand = list(best)
                    cand[b] -= step
                    cand[b + 1] += step
                    if min(cand) >= min_layers and all(n <= c for n, c in zip(cand, max_layers)):
                        moves.append((self.predict(cand).iteration_s, cand))
            if not moves or min(moves)[0] >= best_s:
                break
            best_s, best = min(moves)
        return best

    def overflow_gib(self, layers_per_stage: Sequence[int]) -> float:
        """GiB per device by which the fullest stage of this split exceeds its devices' memory (<= 0: fits)."""
        return max(_memory_bytes(st, n, self.dp, self.distributed_optimizer) / GIB - st.capacity_gib
                   for st, n in zip(self.stages, layers_per_stage))

    def predict(self, layers_per_stage: Sequence[int], description: str = "") -> Prediction:
        """The prediction of one split (``fits == False`` and the reason in its description if it does not fit)."""
        if self.notes:
            description = "; ".join(([description] if description else []) + self.notes)
        pred = _evaluate(self, layers_per_stage, description)
        pred.extrapolated = list(self.notes)          # where its compute lies outside the profile (issue 23)
        return pred


def _floor_per_micro_batch(sts: Sequence[StageModel], num_layers: int, min_layers: int = 1) -> float:
    """The least bottleneck per micro-batch any split of ``num_layers`` (at least ``min_layers`` a stage) can
    have over stages costing a_s + n * b_s each (continuous, so a lower bound); 0.0 where a layer costs
    nothing."""
    fixed = [st.fixed_fwd_s + st.fixed_bwd_s + 2 * st.slot_s + st.send_s + (sts[s - 1].back_s if s else 0.0)
             for s, st in enumerate(sts)]
    per_layer = [st.layer_fwd_s + st.layer_bwd_s for st in sts]
    if min(per_layer) <= 0.0:
        return 0.0
    return max(max(a + min_layers * b for a, b in zip(fixed, per_layer)),
               (num_layers + sum(a / b for a, b in zip(fixed, per_layer))) / sum(1.0 / b for b in per_layer))


def _class_analysis(analysis: Analysis, cls: ReplicaClass) -> Analysis:
    """The analysis as one replica class sees it: each stage on that class's devices only."""
    return replace(analysis, stages=[replace(st, accelerators=accs) for st, accs in zip(analysis.stages,
                                                                                       cls.accelerators)])


def share_micro_batches(sizes: Sequence[int], fills: Sequence[float], steps: Sequence[float], total: int) -> list[int]:
    """Micro-batches per replica group (``sizes[g]`` replicas; inside a group counts differ by at most one),
    adding up to ``total``, each replica at least one, minimising the slowest group's ``fills[g] + steps[g] *
    count`` (a replica's 1F1B pipeline with ``count`` micro-batches: the fill and drain, then one step of its
    slowest stage per micro-batch). The continuous optimum (every group finishing together), rounded down, then
    the remainder placed where it finishes earliest; exact for this affine model."""
    groups = range(len(sizes))
    if total < sum(sizes):
        raise ValueError(f"{total} micro-batches cannot give each of {sum(sizes)} replicas one")
    finish = sum(z / st for z, st in zip(sizes, steps))
    t = (total + sum(z * f / st for z, f, st in zip(sizes, fills, steps))) / finish
    q = [z * max(1, int((t - f) / st)) for z, f, st in zip(sizes, fills, steps)]

    def top(g: int) -> int:          # the largest count inside group g
        return -(-q[g] // sizes[g])

    while sum(q) > total:            # rounding up to one each overshot: lower the group finishing last
        g = max((g for g in groups if q[g] > sizes[g]), key=lambda g: (fills[g] + steps[g] * top(g), -g))
        q[g] -= min(q[g] - sizes[g] * (top(g) - 1), sum(q) - total)
    while sum(q) < total:
        short = total - sum(q)
        free = [g for g in groups if q[g] < sizes[g] * top(g)]     # slots below a group's largest count
        if free:
            g = min(free, key=lambda g: (steps[g], g))
            q[g] += min(short, sizes[g] * top(g) - q[g])
            continue
        g = min(groups, key=lambda g: (fills[g] + steps[g] * (top(g) + 1), g))
        q[g] += min(short, sizes[g])
    return q


def params_memory_gib(model: ModelSpec, dims: ParallelDims, distributed_optimizer: bool) -> float:
    """Weights, gradients and optimizer state per device if the model split perfectly over tp*pp (the routed
    experts over etp*ep*pp): a lower bound of any stage's memory with these degrees."""
    opt = OPTIMIZER_STATE_BYTES / (dims.dp * dims.cp) if distributed_optimizer else OPTIMIZER_STATE_BYTES
    expert_opt = OPTIMIZER_STATE_BYTES / dims.expert_dp if distributed_optimizer else OPTIMIZER_STATE_BYTES
    dense = (model.total_params - model.expert_params) * (WEIGHT_BYTES + GRAD_BYTES + opt) / (dims.tp * dims.pp)
    experts = model.expert_params * (WEIGHT_BYTES + GRAD_BYTES + expert_opt) / (dims.etp * dims.ep * dims.pp)
    return (dense + experts) / GIB


def memory_problem(pred: Prediction) -> Optional[str]:
    """Why a prediction's plan does not fit (None when it does)."""
    over = [(s, m, c) for s, (m, c) in enumerate(zip(pred.memory_gib_per_stage, pred.capacity_gib_per_stage)) if m > c]
    if not over:
        return None
    s, m, c = max(over, key=lambda x: x[1] - x[2])
    return (f"does not fit: stage {s} needs {m:.1f} GiB per device, its devices have {c:.1f} GiB"
            + (f" ({len(over)} stages over)" if len(over) > 1 else ""))


def predict(cluster: Cluster, model: ModelSpec, placement: Placement, layers_per_stage: Sequence[int],
            micro_batch_size: int, *, transport_fn: TransportFn = cluster_transport,
            overlap_grad_reduce: bool = True, distributed_optimizer: bool = False,
            profile: Optional[Profile] = None, description: str = "", vpp: int = 1,
            overlap_p2p_comm: Optional[bool] = None, instances: int = 1) -> Prediction:
    """Predict one plan. A plan whose memory does not fit gets ``fits == False`` and the reason in its
    description (the planner rejects it). ``vpp > 1``: the interleaved schedule (:class:`SplitCosts`).
    ``instances``: Megatron's distributed-optimizer instances (with ``distributed_optimizer``; cost.dist_opt)."""
    dims = placement.dims
    if len(layers_per_stage) != dims.pp or sum(layers_per_stage) != model.num_layers:
        raise ValueError(f"layers_per_stage {list(layers_per_stage)} must have {dims.pp} entries summing to "
                         f"{model.num_layers}")
    if model.global_batch_size % (dims.dp * micro_batch_size):
        raise ValueError(f"global batch {model.global_batch_size} is not a multiple of dp*micro_batch "
                         f"{dims.dp}*{micro_batch_size}")
    analysis = analyze(cluster, placement, transport_fn)
    if instances > 1:
        analysis = with_instances(cluster, analysis, instances, Network(cluster, transport_fn))
    return evaluate(model, analysis, layers_per_stage, micro_batch_size, overlap_grad_reduce=overlap_grad_reduce,
                    distributed_optimizer=distributed_optimizer, profile=profile, description=description,
                    vpp=vpp, overlap_p2p_comm=overlap_p2p_comm)
