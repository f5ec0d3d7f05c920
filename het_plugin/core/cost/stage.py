"""Per-stage costs: compute per layer (analytic or a measured profile), TP/CP/MoE communication, memory,
the optimizer step and the exposed gradient reduction of one stage.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..inputs.catalog import Accelerator
from ..inputs.compute_curve import Analytic, measured_compute_s
from ..inputs.model import ModelSpec
from ..inputs.profile import Profile
from ..ranks.dims import ParallelDims
from .analysis import Analysis, StageInfo
from .fixed_costs import slot_s
from .network import _hops_s, CollectivePath, FRAMEWORK_OVERHEAD_GIB, GIB, GRAD_BYTES, HBM_BYTES_PER_S, LOGITS_BYTES, OPTIMIZER_BYTES_MOVED, OPTIMIZER_STATE_BYTES, Tier, WEIGHT_BYTES

# ---- per-stage times and memory -------------------------------------------------------------------


@dataclass
class StageModel:
    """Linear pieces of one stage for a micro-batch size: times per micro-batch and bytes per rank."""
    layer_fwd_s: float
    layer_bwd_s: float
    fixed_fwd_s: float
    fixed_bwd_s: float
    send_s: float                   # one activation (or gradient) send to the next stage
    params_per_layer: float         # per rank
    fixed_params: float             # embedding / output layer on this rank
    act_bytes_per_layer: float      # one micro-batch's saved activations of one layer
    fixed_mem_bytes: float          # first/last stage extras for the in-flight micro-batches
    in_flight: int
    capacity_gib: float
    paths: tuple[CollectivePath, ...]
    # Expert layers (MoE models): routed-expert weights per rank and layer (the MoE share of an average
    # layer), reduced over expert-dp (its own paths; None: the dense paths) and sharded by the distributed
    # optimizer over expert_dp ranks.
    expert_params_per_layer: float = 0.0
    expert_paths: Optional[tuple[CollectivePath, ...]] = None
    expert_dp: int = 1
    cp: int = 1                     # the dense gradients are reduced (and sharded) over dp x cp
    alltoall_per_layer_s: float = 0.0   # token dispatch + combine, forward + backward, of an average layer
    cp_ring_per_layer_s: float = 0.0    # ring attention's exposed exchanges, forward + backward, per layer
    # Format-2 profiles: each decoder layer's (fwd, bwd) minus the mean layer above (per-layer overrides; empty:
    # all layers alike), the optimizer's measured seconds per parameter (None: analytic), and the gradient send
    # back from stage s+1 (None: the same as send_s; differs when a link is measured per direction).
    layer_deltas: tuple[tuple[float, float], ...] = ()
    optimizer_s_per_param: Optional[float] = None
    send_back_s: Optional[float] = None
    slot_s: float = 0.0             # the schedule's own work per forward or backward (fixed_costs)
    # Megatron's partial distributed optimizer: state sharded over dp*cp/instances ranks, gradients reduce-scattered
    # on instance_paths, the shards all-reduced on cross_paths (cost.dist_opt).
    instances: int = 1
    instance_paths: tuple = ()
    cross_paths: tuple = ()

    @property
    def back_s(self) -> float:
        return self.send_s if self.send_back_s is None else self.send_back_s

    def own_layers(self, first: int, n: int) -> tuple[float, float]:
        """(forward, backward) of the ``n`` decoder layers from index ``first`` for one micro-batch."""
        f, b = n * self.layer_fwd_s, n * self.layer_bwd_s
        if self.layer_deltas and n:
            f += sum(d[0] for d in self.layer_deltas[first:first + n])
            b += sum(d[1] for d in self.layer_deltas[first:first + n])
        return f, b


def _compute_s(acc: Accelerator, kind: str, model: ModelSpec, mb: int, tp: int, cp: int, tp_tier: Tier,
               profile: Optional[Profile], apart: bool = False) -> tuple[float, float]:
    """(forward, backward); ``apart``: the analytic (forward compute, TP communication per direction)."""
    if profile is not None and not apart:
        measured = measured_compute_s(profile, acc.name, kind, mb, tp, model.moe_fraction, lambda b, t: Analytic(
            *_compute_s(acc, kind, model, b, t, cp, tp_tier, profile, apart=True)))
        if measured is not None:
            return measured
    if kind == "layer":
        flops = model.mean_layer_flops_fwd(mb) / (tp * cp)
    elif kind == "output":
        flops = model.logits_flops_fwd(mb) / (tp * cp)
    elif kind == "mtp":
        flops = model.mtp_flops_fwd(mb) / (tp * cp)
    else:   # embedding lookup: memory-bound and small; counted as a few FLOPs per element
        flops = 2.0 * mb * model.seq_length * model.hidden_size / (tp * cp)
    fwd = flops / acc.sustained_flops
    bwd = 2 * fwd
    if kind == "layer" and tp > 1:
        act = mb * model.seq_length * model.hidden_size * model.dtype_bytes / cp
        ar = 2 * (tp - 1) * tp_tier.step_s(act / tp, 1, profile)   # one all-reduce equivalent
        # attention and MLP one each; an MoE layer's MLP moves its tokens by all-to-all instead (_moe_comm_s)
        per_layer = 2 - model.moe_fraction
        if apart:
            return fwd, per_layer * ar
        fwd += per_layer * ar
        bwd += per_layer * ar
    return (fwd, 0.0) if apart else (fwd, bwd)


def _layer_deltas(model: ModelSpec, info: StageInfo, mb: int, tp: int, cp: int, mean: tuple[float, float],
                  profile: Optional[Profile]) -> tuple[tuple[float, float], tuple[tuple[float, float], ...]]:
    """With per-layer-index overrides in the profile: the stage's mean decoder layer (for the partition, whose
    costs cannot depend on which layers a stage holds) and each layer's difference from it (for the prediction
    of a split). The stage's slowest device type by its total decides. Without overrides: ``mean``, ()."""
    if profile is None or profile.legacy:
        return mean, ()
    L = model.num_layers
    worst = None
    for acc in info.accelerators:
        roof = _compute_s(acc, "layer", model, mb, tp, cp, info.tp_tier, profile, apart=True)[0] / mb
        over = {i: t for i, t in profile.layer_overrides(acc.name, mb, tp, (roof, 2 * roof)).items() if i < L}
        if not over:
            continue
        own = _compute_s(acc, "layer", model, mb, tp, cp, info.tp_tier, profile)
        times = [(over[i].forward_s, over[i].backward_s) if i in over else own for i in range(L)]
        total = sum(f + b for f, b in times)
        if worst is None or total > worst[0]:
            worst = (total, times)
    # another device type is slower without them (a relative 1e-9 of slack: a measured profile's overrides sum to
    # its mean curve times the layers up to rounding, and must not be dropped for a last bit)
    if worst is None or worst[0] < L * (mean[0] + mean[1]) * (1 - 1e-9):
        return mean, ()
    times = worst[1]
    mf, mb_ = sum(f for f, _ in times) / L, sum(b for _, b in times) / L
    return (mf, mb_), tuple((f - mf, b - mb_) for f, b in times)


def _moe_comm_s(model: ModelSpec, mb: int, dims: ParallelDims, info: StageInfo,
                profile: Optional[Profile]) -> tuple[float, float]:
    """One MoE layer's expert communication per micro-batch: (all-to-all, forward + backward; expert-TP,
    forward + backward).

    Each rank routes its ``mb * seq / (tp*cp)`` tokens (sequence parallel) to ``top_k`` experts: token
    dispatch and combine are each an all-to-all of ``tokens * top_k * hidden * dtype`` bytes over the
    expert-ep group, forward and again backward. With etp > 1 the dispatched tokens are also all-gathered
    (dispatch) and reduce-scattered (combine) in the expert-TP group, inside the node."""
    tokens = mb * model.seq_length / (dims.tp * dims.cp)
    nbytes = tokens * model.moe_router_topk * model.hidden_size * model.dtype_bytes
    a2a = 0.0
    if dims.ep > 1 and info.expert is not None:
        a2a = max((x.time_s(nbytes, profile) for x in info.expert.alltoalls), default=0.0)
    etp = 2 * (dims.etp - 1) * info.tp_tier.step_s(nbytes, 1, profile) if dims.etp > 1 else 0.0
    return 4 * a2a, 4 * etp


def _cp_ring_s(model: ModelSpec, mb: int, dims: ParallelDims, info: StageInfo, acc: Accelerator,
               profile: Optional[Profile]) -> tuple[float, float]:
    """Ring attention's exposed exchanges of one layer per micro-batch, (forward, backward).

    Forward: cp - 1 steps, each passing this rank's K and V chunk (``2 * mb * seq/cp * kv_dim/tp * dtype``
    bytes) to the next CP rank while the attention of the chunk in hand runs (1/cp of the layer's attention
    scores and values); only what the transfer takes beyond that compute is exposed. Backward: cp - 1 steps
    passing K, V and their gradients (twice the bytes) against twice the compute."""
    if dims.cp <= 1 or not info.cp_hops:
        return 0.0, 0.0
    kv_dim = model.hidden_size * model.kv_heads // model.num_attention_heads
    kv = 2 * mb * model.seq_length / dims.cp * kv_dim / dims.tp * model.dtype_bytes
    chunk = model.attention_core_flops_fwd(mb) / (dims.tp * dims.cp) / dims.cp / acc.sustained_flops

    def step(nbytes: float) -> float:
        return _hops_s(info.cp_hops, nbytes, profile)

    fwd = (dims.cp - 1) * max(0.0, step(kv) - chunk)
    bwd = (dims.cp - 1) * max(0.0, step(2 * kv) - 2 * chunk)
    return fwd, bwd


def _activation_bytes_per_layer(model: ModelSpec, mb: int, tp: int, cp: int) -> float:
    """Saved activations of one (average) layer and micro-batch (Korthikanti et al. 2022, flash attention,
    SP). An MoE layer's MLP part holds each token top_k times at the expert width, plus the shared experts,
    plus the permuted tokens before and after the experts (2 x top_k x hidden x 2 bytes per token)."""
    h = model.hidden_size
    swiglu = 1.5 if model.activation == "swiglu" else 1.0
    dense = 15 + 19 * model.ffn * swiglu / (4 * h)
    per_token = dense
    if model.is_moe:
        width = model.moe_router_topk * model.moe_ffn + (model.moe_shared_expert_intermediate_size or 0)
        moe = 15 + 19 * width * swiglu / (4 * h) + 4 * model.moe_router_topk
        f = model.moe_fraction
        per_token = (1 - f) * dense + f * moe
    return mb * model.seq_length * h * per_token / (tp * cp)


def _stage_models(model: ModelSpec, analysis: Analysis, mb: int, num_micro_batches: int,
                  profile: Optional[Profile] = None) -> list[StageModel]:
    dims = analysis.placement.dims
    tp, cp, pp = dims.tp, dims.cp, dims.pp
    act_msg = mb * model.seq_length * model.hidden_size * model.dtype_bytes / (tp * cp)
    emb_params = model.embedding_params / tp
    f_moe = model.moe_fraction if model.is_moe else 0.0
    dense_params_per_layer = ((1 - f_moe) * model.params_per_layer + f_moe * model.moe_layer_params) / tp
    expert_params_per_layer = f_moe * model.expert_params_per_moe_layer / (dims.ep * dims.etp)
    out = []
    act_bytes = _activation_bytes_per_layer(model, mb, tp, cp)
    done: dict = {}     # (device, kind, TP tier) -> (fwd, bwd): stages repeat them (frozen values: equal = same)

    def slowest_of(kind: str, info: StageInfo) -> tuple[float, float]:
        """The stage's slowest device's (forward, backward) for ``kind`` (the same arithmetic, once per device)."""
        best = None
        for a in info.accelerators:
            key = (a, kind, info.tp_tier)
            fb = done.get(key)
            if fb is None:
                fb = done[key] = _compute_s(a, kind, model, mb, tp, cp, info.tp_tier, profile)
            if best is None or fb[0] + fb[1] > best[0] + best[1]:
                best = fb
        return best

    for s, info in enumerate(analysis.stages):
        layer = slowest_of("layer", info)
        layer, deltas = _layer_deltas(model, info, mb, tp, cp, layer, profile)
        a2a = etp_comm = 0.0
        if f_moe:
            a2a, etp_comm = _moe_comm_s(model, mb, dims, info, profile)
        slowest = min(info.accelerators, key=lambda a: a.sustained_flops)
        ring = _cp_ring_s(model, mb, dims, info, slowest, profile)
        # forward and backward take half of each MoE exchange (dispatch + combine each way)
        layer = (layer[0] + f_moe * (a2a + etp_comm) / 2 + ring[0], layer[1] + f_moe * (a2a + etp_comm) / 2 + ring[1])
        ff = fb_ = 0.0
        fixed_params = 0.0
        fixed_mem = 0.0
        in_flight = min(pp - s, num_micro_batches)
        if s == 0:
            e = slowest_of("embedding", info)
            ff, fb_ = ff + e[0], fb_ + e[1]
            fixed_params += emb_params
            fixed_mem += in_flight * act_msg
        if s == pp - 1:
            o = slowest_of("output", info)
            ff, fb_ = ff + o[0], fb_ + o[1]
            if pp > 1 or not model.tie_embeddings:
                fixed_params += emb_params
            if model.mtp_layers:          # MTP modules run after the decoder on the last stage
                t = slowest_of("mtp", info)
                ff, fb_ = ff + t[0], fb_ + t[1]
                fixed_params += model.mtp_params / tp
                fixed_mem += model.mtp_layers * act_bytes
                fixed_mem += model.mtp_layers * mb * model.seq_length * model.vocab_size * LOGITS_BYTES / (tp * cp)
            fixed_mem += mb * model.seq_length * model.vocab_size * LOGITS_BYTES / (tp * cp)
        send = _hops_s(info.hop_next, act_msg, profile)
        back = None
        if profile is not None and profile.directional and info.hop_next:      # gradients go the other way
            back = _hops_s([(tier.flipped(), share, staged) for tier, share, staged in info.hop_next], act_msg, profile)
        expert = info.expert
        out.append(StageModel(layer[0], layer[1], ff, fb_, send, dense_params_per_layer, fixed_params,
                              act_bytes, fixed_mem, in_flight,
                              info.capacity_gib, info.dp_paths, expert_params_per_layer,
                              expert.dp_paths if expert is not None else None, dims.expert_dp, cp,
                              f_moe * a2a, ring[0] + ring[1], layer_deltas=deltas,
                              optimizer_s_per_param=_optimizer_per_param(info, tp, profile), send_back_s=back,
                              slot_s=slot_s(profile, info.accelerators), instances=analysis.instances,
                              instance_paths=info.instance_paths, cross_paths=info.cross_instance_paths))
    return out


def _memory_bytes(st: StageModel, n_layers: int, dp: int, distributed_optimizer: bool) -> float:
    """Bytes per rank; ``dp`` is the dense data-parallel size (the distributed optimizer shards the dense
    state over dp x cp and the experts' over expert-dp)."""
    params = st.fixed_params + n_layers * st.params_per_layer
    opt = OPTIMIZER_STATE_BYTES * st.instances / (dp * st.cp) if distributed_optimizer else OPTIMIZER_STATE_BYTES
    states = params * (WEIGHT_BYTES + GRAD_BYTES + opt)
    if st.expert_params_per_layer:
        expert_opt = OPTIMIZER_STATE_BYTES / st.expert_dp if distributed_optimizer else OPTIMIZER_STATE_BYTES
        states += n_layers * st.expert_params_per_layer * (WEIGHT_BYTES + GRAD_BYTES + expert_opt)
    acts = st.in_flight * n_layers * st.act_bytes_per_layer + st.fixed_mem_bytes
    return states + acts + FRAMEWORK_OVERHEAD_GIB * GIB


def _optimizer_per_param(info: StageInfo, tp: int, profile: Optional[Profile]) -> Optional[float]:
    """The stage's measured optimizer seconds per parameter (its slowest device type; one not measured counts
    as the analytic step), or None when no device type of the stage is measured."""
    if profile is None:
        return None
    measured = [profile.optimizer_s_per_param(a.name, tp) for a in info.accelerators]
    if all(m is None for m in measured):
        return None
    return max(OPTIMIZER_BYTES_MOVED / HBM_BYTES_PER_S if m is None else m for m in measured)


def _optimizer_s(st: StageModel, n_layers: int, dp: int, distributed_optimizer: bool) -> float:
    """The Adam step of one rank: memory-bound over the parameters it updates (or the profile's time per
    parameter)."""
    params = st.fixed_params + n_layers * st.params_per_layer
    experts = n_layers * st.expert_params_per_layer
    if distributed_optimizer:
        params /= dp * st.cp / st.instances
        experts /= st.expert_dp
    if st.optimizer_s_per_param is not None:
        return (params + experts) * st.optimizer_s_per_param
    return (params + experts) * OPTIMIZER_BYTES_MOVED / HBM_BYTES_PER_S


def _max_layers_fitting(st: StageModel, num_layers: int, dp: int, distributed_optimizer: bool) -> int:
    """Most layers the stage's memory holds (-1: not even its fixed part fits)."""
    cap = st.capacity_gib * GIB
    base = _memory_bytes(st, 0, dp, distributed_optimizer)
    if base > cap:
        return -1
    per = _memory_bytes(st, 1, dp, distributed_optimizer) - base
    n = num_layers if per <= 0 else min(num_layers, int((cap - base) // per))
    while n > 0 and _memory_bytes(st, n, dp, distributed_optimizer) > cap:   # guard rounding
        n -= 1
    return n


def _dp_reduce_s(st: StageModel, n_layers: int, dp: int, distributed_optimizer: bool,
                profile: Optional[Profile]) -> float:
    """Gradient reduction of the stage (plus the parameter all-gather of the distributed optimizer): the dense
    parameters over dp x cp, the routed experts' over expert-dp (its own groups), one after the other."""

    def reduce(paths, params: float) -> float:
        worst = 0.0
        for path in paths:
            if distributed_optimizer:
                t = path.allreduce_s(params * GRAD_BYTES, profile, 0.5) + path.allreduce_s(params * WEIGHT_BYTES,
                                                                                          profile, 0.5)
            else:
                t = path.allreduce_s(params * GRAD_BYTES, profile)
            worst = max(worst, t)
        return worst

    total = 0.0
    if dp * st.cp > 1 and distributed_optimizer and st.instances > 1:
        total += _partial_reduce_s(st, st.fixed_params + n_layers * st.params_per_layer, dp, profile)
    elif dp * st.cp > 1:
        total += reduce(st.paths, st.fixed_params + n_layers * st.params_per_layer)
    if st.expert_params_per_layer and st.expert_dp > 1 and n_layers:
        total += reduce(st.paths if st.expert_paths is None else st.expert_paths,
                        n_layers * st.expert_params_per_layer)
    return total


def _partial_reduce_s(st: StageModel, params: float, dp: int, profile: Optional[Profile]) -> float:
    """Megatron's partial distributed optimizer: gradients reduce-scattered inside an instance, each rank's shard
    all-reduced across the instances, parameters all-gathered inside the instance (the slowest group of each)."""
    shard = params / (dp * st.cp / st.instances)
    inside = max((p.allreduce_s(params * GRAD_BYTES, profile, 0.5) + p.allreduce_s(params * WEIGHT_BYTES, profile, 0.5)
                  for p in st.instance_paths), default=0.0)
    across = max((p.allreduce_s(shard * GRAD_BYTES, profile) for p in st.cross_paths), default=0.0)
    return inside + across


def exposed_reduction_s(reduction_s: float, last_backward_s: float, overlap: bool) -> float:
    """The part of a stage's gradient reduction the iteration waits for: with ``overlap`` (Megatron's bucketed
    overlap) it starts with the last micro-batch's backward and only what outlasts it shows."""
    return max(0.0, reduction_s - last_backward_s) if overlap else reduction_s


def _stage_costs(sts: list[StageModel], num_layers: int, num_micro_batches: int, dp: int, overlap: bool,
                 distributed_optimizer: bool, profile: Optional[Profile]) -> list[list[float]]:
    """Cost tables for the exact partition: one stage's busy time in an iteration with n layers."""
    if profile is not None:
        per_rows, exposed_rows = _stage_cost_parts(sts, num_layers, dp, overlap, distributed_optimizer, profile)
        return [[num_micro_batches * a + e for a, e in zip(per, exposed)]
                for per, exposed in zip(per_rows, exposed_rows)]
    # Analytic: :func:`_stage_cost_parts`'s arithmetic, step for step, in one pass per stage (the planner's hottest
    # loop: a table per stage for every candidate)
    m, ns, out = num_micro_batches, range(num_layers + 1), []
    for s, st in enumerate(sts):
        recv_side = sts[s - 1].back_s if s > 0 else 0.0
        red0 = _dp_reduce_s(st, 0, dp, distributed_optimizer, None)
        red_step = _dp_reduce_s(st, 1, dp, distributed_optimizer, None) - red0
        ff, lf, fb, lb = st.fixed_fwd_s, st.layer_fwd_s, st.fixed_bwd_s, st.layer_bwd_s
        two_slot, send = 2 * st.slot_s, st.send_s
        if overlap:
            out.append([m * (ff + n * lf + (b := fb + n * lb) + two_slot + send + recv_side)
                        + (d if (d := red0 + n * red_step - b) > 0.0 else 0.0) for n in ns])
        else:
            out.append([m * (ff + n * lf + (fb + n * lb) + two_slot + send + recv_side) + (red0 + n * red_step)
                        for n in ns])
    return out


def _stage_cost_parts(sts: list[StageModel], num_layers: int, dp: int, overlap: bool, distributed_optimizer: bool,
                      profile: Optional[Profile]) -> tuple[list[list[float]], list[list[float]]]:
    """The exact partition's cost tables in two parts, (per micro-batch, exposed reduction): a stage's busy time
    with n layers and m micro-batches is ``m * per + exposed`` (every replica group with its own m)."""
    per_rows, exposed_rows = [], []
    for s, st in enumerate(sts):
        recv_side = sts[s - 1].back_s if s > 0 else 0.0      # this stage sends gradients back over it
        if profile is None:     # the analytic reduction is affine in the layer count: two points suffice
            red0 = _dp_reduce_s(st, 0, dp, distributed_optimizer, None)
            red_step = _dp_reduce_s(st, 1, dp, distributed_optimizer, None) - red0
        # (list comprehensions over the layer counts, the same arithmetic as exposed_reduction_s: the planner's
        # hottest loop, one table per stage for every candidate)
        ns = range(num_layers + 1)
        ff, lf, fb, lb = st.fixed_fwd_s, st.layer_fwd_s, st.fixed_bwd_s, st.layer_bwd_s
        bwds = [fb + n * lb for n in ns]
        two_slot, send = 2 * st.slot_s, st.send_s
        per = [ff + n * lf + b + two_slot + send + recv_side for n, b in zip(ns, bwds)]
        reds = ([red0 + n * red_step for n in ns] if profile is None
                else [_dp_reduce_s(st, n, dp, distributed_optimizer, profile) for n in ns])
        exposed = [(d if d > 0.0 else 0.0) for d in (r - b for r, b in zip(reds, bwds))] if overlap else reds
        per_rows.append(per)
        exposed_rows.append(exposed)
    return per_rows, exposed_rows


def stage_costs_at(sts: list[StageModel], layers_per_stage: Sequence[int], num_micro_batches: int, dp: int,
                   overlap: bool, distributed_optimizer: bool, profile: Optional[Profile]) -> list[float]:
    """Each stage's entry of :func:`_stage_costs` at its own layer count only (the same arithmetic): the lower
    bound of a split whose layers are given (the frameworks' uniform split), without whole tables."""
    out = []
    for s, (st, n) in enumerate(zip(sts, layers_per_stage)):
        recv_side = sts[s - 1].back_s if s > 0 else 0.0
        if profile is None:
            red0 = _dp_reduce_s(st, 0, dp, distributed_optimizer, None)
            red = red0 + n * (_dp_reduce_s(st, 1, dp, distributed_optimizer, None) - red0)
        else:
            red = _dp_reduce_s(st, n, dp, distributed_optimizer, profile)
        b = st.fixed_bwd_s + n * st.layer_bwd_s
        per = st.fixed_fwd_s + n * st.layer_fwd_s + b + 2 * st.slot_s + st.send_s + recv_side
        d = red - b
        exposed = (d if d > 0.0 else 0.0) if overlap else red
        out.append(num_micro_batches * per + exposed)
    return out
