"""What ``het-plugin profile`` measures, decided before any process group exists (pure: no torch).

Every rank derives the same lists from the cluster, the model and the options, so the ranks step through
the measurements in lockstep without asking each other; a size that cannot fit the device's memory is
refused here, on every rank, before anything is allocated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from ...core.inputs.cluster import Cluster
from ...core.cost.network import FRAMEWORK_OVERHEAD_GIB, GIB, GRAD_BYTES, LOGITS_BYTES
from ...core.cost.stage import _activation_bytes_per_layer
from ...core.errors import ConfigError
from ...core.inputs.model import LIMITS, ModelSpec
from ...core.ranks.placement import cluster_transport

KIB, MIB = 1 << 10, 1 << 20
DEFAULT_MICRO_BATCHES = (1, 2, 4, 8)
QUICK_MICRO_BATCHES = (1, 2)
DEFAULT_MESSAGE_SIZES = (64 * KIB, 1 * MIB, 16 * MIB, 64 * MIB)
QUICK_MESSAGE_SIZES = (64 * KIB, 16 * MIB)
DEFAULT_WINDOW_S = 0.5        # seconds timed per point (after warm-up): long against a CFS period or a clock tick
QUICK_WINDOW_S = 0.1
MAX_MESSAGE_BYTES = 1 << 32
LATENCY_BYTES = 8             # the ping-pong message that measures a link's latency
OPTIMIZER_MAX_PARAMS = 1 << 24   # the optimizer step is elementwise: this many parameters give its rate
LAYER_SOURCES = ("auto", "megatron", "torch")


@dataclass(frozen=True)
class Settings:
    """The options of one profiling run (``make_settings`` checks them)."""
    micro_batch_sizes: tuple[int, ...]
    message_sizes: tuple[int, ...]
    window_s: float
    tp: Optional[tuple[int, ...]] = None       # None: every TP degree that fits a node of the device type
    quick: bool = False
    compute: bool = True
    links: bool = True
    warmup: int = 2
    layers: str = "auto"                       # auto | megatron | torch: whose layers are timed (run.layer_source)


def _sorted_unique(values: Sequence[int], field: str, lo: int, hi: int, unit: str,
                   example: str = "1,2,4") -> tuple[int, ...]:
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi]
    if bad or not values:
        raise ConfigError(f"{bad or 'nothing'} is not a list of whole numbers from {lo:,} to {hi:,} {unit}",
                          field=field, fix=f"give comma-separated numbers, e.g. {field} {example}")
    return tuple(sorted(set(values)))


def make_settings(*, quick: bool = False, micro_batch_sizes: Optional[Sequence[int]] = None,
                  message_sizes: Optional[Sequence[int]] = None, tp: Optional[Sequence[int]] = None,
                  window_s: Optional[float] = None, compute: bool = True, links: bool = True,
                  layers: str = "auto", model_micro_batch: Optional[int] = None) -> Settings:
    """Defaults (``quick``: fewer sizes, shorter windows: a minute-scale run) overridden by what is given. The
    default micro-batch sizes include ``model_micro_batch`` (the model file's own), so a plan for that size
    reads a measured point, not an extrapolation."""
    default = (QUICK_MICRO_BATCHES if quick else DEFAULT_MICRO_BATCHES) + ((model_micro_batch,) if model_micro_batch
                                                                           else ())
    mbs = _sorted_unique(list(micro_batch_sizes or default), "--micro-batch-sizes", 1, LIMITS["micro_batch_size"],
                         "samples")
    sizes = _sorted_unique(list(message_sizes or (QUICK_MESSAGE_SIZES if quick else DEFAULT_MESSAGE_SIZES)),
                           "--message-sizes", 4, MAX_MESSAGE_BYTES, "bytes", example="64K,1M")
    tps = None if tp is None else _sorted_unique(list(tp), "--tp", 1, 1024, "ranks")
    window = (QUICK_WINDOW_S if quick else DEFAULT_WINDOW_S) if window_s is None else window_s
    if not (isinstance(window, (int, float)) and math.isfinite(window) and 0.001 <= window <= 600):
        raise ConfigError(f"{window!r} is not between 0.001 and 600 seconds", field="--window",
                          fix="give the seconds each point is timed for, e.g. 0.5 (--quick: 0.1)")
    if not (compute or links):
        raise ConfigError("nothing to measure: both compute and links are switched off", field="--no-compute",
                          fix="drop --no-compute or --no-links")
    if layers not in LAYER_SOURCES:
        raise ConfigError(f"{layers!r} is not a layer source", field="--layers",
                          fix=f"use one of {list(LAYER_SOURCES)}")
    return Settings(mbs, sizes, float(window), tps, quick, compute, links, layers=layers)


# ---- compute --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceType:
    """One accelerator type of the cluster and the ranks that measure it: the first node of that type."""
    name: str
    memory_gib: float
    ranks_per_node: int              # the fewest of any node of this type: a TP group fits every one
    node_ranks: tuple[int, ...]      # the ranks of the first node of this type (launch order)


def device_types(cluster: Cluster) -> list[DeviceType]:
    """Every accelerator type in launch order of its first node (names compared case-insensitively)."""
    out: dict[str, DeviceType] = {}
    for node in cluster.nodes:
        key = node.accelerator.name.lower()
        first = cluster.node_first_rank[node.index]
        known = out.get(key)
        if known is None:
            out[key] = DeviceType(node.accelerator.name, node.accelerator.memory_gib, node.num_accelerators,
                                  tuple(range(first, first + node.num_accelerators)))
        elif node.num_accelerators < known.ranks_per_node:
            out[key] = DeviceType(known.name, known.memory_gib, node.num_accelerators, known.node_ranks)
    return list(out.values())


def layer_kinds(model: ModelSpec) -> list[str]:
    """The profile kinds this model has: dense and/or MoE decoder layers, the embedding, output + loss."""
    kinds = []
    if model.num_moe_layers < model.num_layers:
        kinds.append("layer")
    if model.is_moe:
        kinds.append("moe_layer")
    return kinds + ["embedding", "output"]


def tp_degrees(model: ModelSpec, device: DeviceType, wanted: Optional[Sequence[int]]) -> list[int]:
    """TP degrees measured on ``device``: every divisor of its node size that splits the heads, the KV heads
    and the FFN (what the planner proposes), or the ``wanted`` ones of those that fit its node."""
    def splits(t: int) -> bool:
        ffn_ok = model.ffn % t == 0 and (not model.is_moe or model.moe_ffn % t == 0)
        return model.num_attention_heads % t == 0 and model.kv_heads % t == 0 and ffn_ok
    fitting = [t for t in range(1, device.ranks_per_node + 1) if device.ranks_per_node % t == 0 and splits(t)]
    if wanted is None:
        return fitting
    return [t for t in wanted if t in fitting]


def check_tp(model: ModelSpec, devices: Sequence[DeviceType], wanted: Optional[Sequence[int]]) -> None:
    """A ``--tp`` value that no device type can run is refused, naming what fits."""
    if wanted is None:
        return
    for t in wanted:
        if not any(t in tp_degrees(model, d, None) for d in devices):
            options = {d.name: tp_degrees(model, d, None) for d in devices}
            raise ConfigError(f"tp={t} fits no device type's node or does not split the model's heads/FFN "
                              f"(what fits: {options})", field="--tp",
                              fix="give TP degrees from those lists, or leave --tp out to measure all of them")


@dataclass(frozen=True)
class ComputeJob:
    """One point: ``kind`` at ``micro_batch_size`` on TP ``tp`` of ``device``, run by ``ranks`` (its TP group)."""
    device: str
    kind: str
    tp: int
    micro_batch_size: int
    ranks: tuple[int, ...]


def compute_jobs(cluster: Cluster, model: ModelSpec, settings: Settings) -> list[list[ComputeJob]]:
    """Rounds of jobs: the jobs of one round run at once, one per device type (each on its own node)."""
    devices = device_types(cluster)
    check_tp(model, devices, settings.tp)
    rounds: list[list[ComputeJob]] = []
    all_tp = sorted({t for d in devices for t in tp_degrees(model, d, settings.tp)})
    for t in all_tp:
        for kind in layer_kinds(model):
            for mb in settings.micro_batch_sizes:
                jobs = [ComputeJob(d.name, kind, t, mb, d.node_ranks[:t]) for d in devices
                        if t in tp_degrees(model, d, settings.tp)]
                if jobs:
                    rounds.append(jobs)
    return rounds


def run_dtype_bytes(model: ModelSpec, on_gpu: bool) -> int:
    """Bytes per element the layers run in: the model's dtype on an accelerator, fp32 on a CPU (where bf16
    matmuls are slow or missing)."""
    return model.dtype_bytes if on_gpu else 4


def memory_need_bytes(model: ModelSpec, kind: str, micro_batch_size: int, tp: int, dtype_bytes: int) -> float:
    """What measuring one ``kind`` needs on one rank: its weights and gradients, one micro-batch's saved
    activations (the cost model's formulas, written for 2-byte elements, plus attention scores as a plain
    attention keeps them), the logits of the output layer, and the framework's slack."""
    mb, s, h = micro_batch_size, model.seq_length, model.hidden_size
    if kind in ("layer", "moe_layer"):
        params = (model.params_per_layer if kind == "layer"
                  else model.moe_layer_params + model.expert_params_per_moe_layer) / tp
        scores = 3 * mb * model.num_attention_heads / tp * s * s * dtype_bytes   # without flash attention
        acts = _activation_bytes_per_layer(model, mb, tp, 1) * dtype_bytes / 2 + scores
    elif kind == "embedding":
        params = model.embedding_params / tp
        acts = 2 * mb * s * h * dtype_bytes
    else:
        params = model.embedding_params / tp + 2 * h
        acts = 2 * mb * s * h * dtype_bytes + mb * s * model.vocab_size * LOGITS_BYTES / tp
    return params * (dtype_bytes + GRAD_BYTES) + acts + FRAMEWORK_OVERHEAD_GIB * GIB


def check_memory(model: ModelSpec, rounds: Sequence[Sequence[ComputeJob]], memory_gib: dict[str, float],
                 dtype_bytes: int) -> None:
    """Refuse (before allocating) any job whose estimate exceeds its device's memory (``memory_gib`` by device
    name), naming the micro-batch size, the TP degree and the fix."""
    for jobs in rounds:
        for job in jobs:
            need = memory_need_bytes(model, job.kind, job.micro_batch_size, job.tp, dtype_bytes) / GIB
            have = memory_gib[job.device]
            if need > have:
                fits = [mb for mb in sorted({j.micro_batch_size for r in rounds for j in r})
                        if memory_need_bytes(model, job.kind, mb, job.tp, dtype_bytes) / GIB <= have]
                raise ConfigError(
                    f"{job.kind} of {model.name} at micro-batch {job.micro_batch_size} with tp={job.tp} needs about "
                    f"{need:.1f} GiB on one {job.device} rank, which has {have:g} GiB", field="--micro-batch-sizes",
                    fix=(f"measure smaller micro-batches (of those asked, {fits} fit at tp={job.tp})" if fits
                         else f"measure smaller micro-batches with --micro-batch-sizes, or a larger TP with --tp"))


# ---- links ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkJob:
    """One link to measure between ``senders`` (on one node) and ``receivers`` (the same count, on another
    node, or on the same node for ``local``). ``key`` is the profile tier the forward direction is written
    as, ``back_key`` the reverse direction's (the same key for a tier kind: the slower direction is kept);
    ``transport`` is what the plan's transport rule gives the group (its gloo interface / NCCL network)."""
    key: str
    back_key: str
    cluster: Optional[str]
    transport: str
    senders: tuple[int, ...]
    receivers: tuple[int, ...]

    @property
    def members(self) -> tuple[int, ...]:
        return self.senders + self.receivers

    @property
    def label(self) -> str:
        return self.key + (f" in {self.cluster}" if self.cluster else "") + (
            f" (and {self.back_key})" if self.back_key != self.key else "")


def link_jobs(cluster: Cluster) -> list[LinkJob]:
    """Per cluster: inside a node (``local``, a node with 2+ ranks), its fabric between two of its nodes (the
    transport the rule picks: ``ib``/``roce``, ``socket`` on an Ethernet fabric), and its Ethernet (``socket``)
    when the fabric is RDMA. Per pair of clusters: the named link both ways (``a->b``, ``b->a``)."""
    jobs: list[LinkJob] = []
    first = cluster.node_first_rank

    def ranks(node) -> tuple[int, ...]:
        return tuple(range(first[node.index], first[node.index] + node.num_accelerators))

    by_cluster = {name: [n for n in cluster.nodes if n.cluster == name] for name in cluster.cluster_names}
    for name, nodes in by_cluster.items():
        multi = next((n for n in nodes if n.num_accelerators >= 2), None)
        if multi is not None:
            own = ranks(multi)
            half = len(own) // 2
            jobs.append(LinkJob("local", "local", name, "local", own[:1], own[half:half + 1]))
        if len(nodes) >= 2:
            a, b = ranks(nodes[0]), ranks(nodes[1])
            k = min(len(a), len(b))
            kind = cluster_transport(cluster, [a[0], b[0]])
            jobs.append(LinkJob(kind, kind, name, kind, a[:k], b[:k]))
            if kind in ("ib", "roce"):
                jobs.append(LinkJob("socket", "socket", name, "socket", a[:k], b[:k]))
    names = cluster.cluster_names
    for i, ca in enumerate(names):
        for cb in names[i + 1:]:
            a, b = by_cluster[ca][0], by_cluster[cb][0]
            ra, rb = ranks(a), ranks(b)
            k = min(len(ra), len(rb))
            jobs.append(LinkJob(f"{ca}->{cb}", f"{cb}->{ca}", None, cluster_transport(cluster, [ra[0], rb[0]]), ra[:k], rb[:k]))
    return jobs


def sender_counts(k: int, quick: bool) -> list[int]:
    """Concurrent senders per node measured on a link between nodes of ``k`` ranks each: 1, 2, 4, ... and k
    (``quick``: 1 and k)."""
    if quick:
        return sorted({1, k})
    out, c = [], 1
    while c < k:
        out.append(c)
        c *= 2
    return out + [k]
