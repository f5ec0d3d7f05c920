"""Predictor: iteration time, throughput and memory per stage of one plan (HETHUB's performance predictor).

The model, in short (details and constants in docs/planner.md):

* Compute: a transformer layer's forward FLOPs / TP / (peak x efficiency) of the slowest device in the
  stage; backward = 2 x forward. With TP > 1 (sequence parallel) each layer pays 2 all-reduce-equivalents
  of its activations forward and 2 backward over the node's intra-node link. A measured profile
  (:mod:`het_plugin.core.inputs.profile`) replaces these per (device, layer kind, TP) as a curve over the micro-batch size,
  per layer index where it has overrides, and the optimizer step, a per-iteration overhead and link rates
  (per cluster, direction and concurrent senders) too.
* Communication: latency-bandwidth per link tier. A collective over ``n`` members is ``2(n-1)`` ring steps
  of ``bytes/n``; a group spanning tiers reduces hierarchically (inside the node, then over the cluster
  fabric, then across clusters), each step paying its tier's latency and its bandwidth shared by all
  accelerators of the node that talk at once. A group whose transport is ``socket`` uses Ethernet even
  inside an RDMA cluster; ``host-staged`` (cross-vendor shim) reduces inside each vendor's fabric first, then
  over sockets between vendors, and pays a device-host copy of its share each way.
* Replicas: data-parallel replicas on different devices (:class:`ReplicaClass`) are simulated each on its own
  devices with its own micro-batch count (heterogeneous data parallelism; :meth:`SplitCosts.balance`).
* Pipeline: 1F1B with per-stage forward/backward times and per-hop send times, simulated op by op; with
  ``vpp`` virtual stages per rank Megatron's interleaved 1F1B (:mod:`het_plugin.core.cost.interleaved`), its extra hop from
  the last stage back to the first, and ``overlap_p2p_comm`` (sends hidden behind compute).
* Data parallel: gradient reduction per stage (dense parameters over dp x cp, routed experts over expert-dp);
  with ``overlap_grad_reduce`` (Megatron's bucketed overlap) only the last micro-batch's backward can hide
  it. Tied embeddings (or MTP on the last stage) add the first/last-stage all-reduce.
* Mixture of experts: per MoE layer the router and the top-k experts' FFN per token (plus shared experts) as
  compute, token dispatch and combine as all-to-alls over the expert-ep group forward and backward
  (:class:`AllToAll`: own node, cluster fabric, other clusters), expert weights split over ep x etp. A
  model whose layers mix dense and MoE is costed per average layer.
* Context parallel: ring attention's cp - 1 K/V exchanges per layer over the CP group's slowest hop, each
  hidden behind the attention of one chunk as far as it goes.
* Memory per rank: bf16 weights, fp32 gradients, fp32 master + Adam moments (divided by dp x cp, or
  expert-dp, with the distributed optimizer), activations of the in-flight micro-batches, logits on the
  last stage.

The expensive part (walking every group of a placement) is :func:`analyze`; the rest is cheap, so the
planner analyzes a placement once and evaluates it for many micro-batch sizes and layer splits, and
:func:`analyze_experts` re-does only the expert groups for each (ep, etp) on an analyzed placement.

What the planner uses: :class:`Network` and :func:`analyze` (once per placement), :class:`SplitCosts` (per
micro-batch size and optimizer setting: the exact partition's cost tables and memory caps, a split's memory
excess, its prediction) and :func:`params_memory_gib` (a lower bound to skip degrees that cannot fit).
:func:`predict` is the one-call form for everyone else.
"""
from .network import (  # noqa: F401
    DEFAULT_SOCKET_GBPS, FALLBACK_TIERS, FRAMEWORK_OVERHEAD_GIB, GIB, GRAD_BYTES, HBM_BYTES_PER_S,
    HOST_COPY_GBPS, LOCAL_LATENCY_US, LOGITS_BYTES, OPTIMIZER_BYTES_MOVED, OPTIMIZER_STATE_BYTES,
    SECTIONED_TRANSPORTS, SOCKET_LATENCY_US, WEIGHT_BYTES, CollectivePath, MultinetPath, hop_tier, Level, Network,
    socket_tier, Tier, TransportFn,
)
from .analysis import (  # noqa: F401
    AllToAll, Analysis, analyze, analyze_experts, ExpertInfo, replica_classes, ReplicaClass, StageInfo,
)
from .stage import (  # noqa: F401
    exposed_reduction_s, StageModel,
)
from .pipeline import (  # noqa: F401
    one_f_one_b_order, simulate_1f1b, wrap_send_s,
)
from .predict import (  # noqa: F401
    evaluate, group_pipelines, GroupPipeline, memory_problem, params_memory_gib, predict, profile_notes,
    share_micro_batches, SplitCosts, stage_reductions, stage_times, steady_step_s,
)
