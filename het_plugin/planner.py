"""Planner: choose degrees, placement, micro-batch size and layer split for a cluster and a model.

(First cut: fixed degrees, uniform layers, no search. The cost-model search replaces ``make_plan``'s body;
``assemble_plan`` and ``make_plan``'s signature are the contract the adapters use.)
"""
from __future__ import annotations

from typing import Optional, Sequence

from .cluster import Cluster
from .errors import ConfigError
from .model import ModelSpec
from .placement import Placement, check_dims, place, stage_domains, transport
from .plan import GroupPlan, NodePlan, Plan, Prediction
from .topology import GROUP_KINDS, ParallelDims


def uniform_layers(num_layers: int, pp: int) -> list[int]:
    base, extra = divmod(num_layers, pp)
    return [base + (1 if i < extra else 0) for i in range(pp)]


def assemble_plan(cluster: Cluster, model: ModelSpec, placement: Placement, layers_per_stage: Sequence[int],
                  micro_batch_size: int, *, prediction: Optional[Prediction] = None,
                  baseline: Optional[Prediction] = None, overlap_grad_reduce: bool = True,
                  distributed_optimizer: bool = False, alternatives: Sequence[dict] = (),
                  extra_warnings: Sequence[str] = ()) -> Plan:
    """Turn a placement and a split into a Plan: every group kind with its transport, node table, warnings."""
    dims = placement.dims
    if sum(layers_per_stage) != model.num_layers or len(layers_per_stage) != dims.pp:
        raise ValueError(f"layers_per_stage {list(layers_per_stage)} must have {dims.pp} entries summing to "
                         f"{model.num_layers}")
    groups: dict[str, list[GroupPlan]] = {}
    for kind in GROUP_KINDS + ("embedding",):
        groups[kind] = [GroupPlan(g, transport(cluster, g)) for g in placement.physical_groups(kind)]
    nodes = [NodePlan(n.name, n.cluster, n.fabric.type, n.accelerator.name, n.vendor,
                      cluster.node_first_rank[n.index], n.num_accelerators) for n in cluster.nodes]
    warnings = list(extra_warnings)
    for s, doms in enumerate(stage_domains(cluster, placement)):
        if len(doms) > 1:
            names = ", ".join(f"{c}/{a}" for c, a in doms)
            warnings.append(f"stage {s} spans {names}: its data-parallel groups cross a slow boundary "
                            f"(transport {groups['dp'][0].transport if dims.pp == 1 else 'see dp groups'})")
    per_mb = dims.dp * micro_batch_size
    if model.global_batch_size % per_mb:
        raise ConfigError(f"global_batch_size {model.global_batch_size} is not a multiple of dp*micro_batch "
                          f"= {dims.dp}*{micro_batch_size}", field="global_batch_size",
                          fix=f"use a multiple of {per_mb}")
    return Plan(
        cluster_name=cluster.name, cluster_digest=cluster.digest, model=model.model_dump(),
        world_size=dims.world_size, tp=dims.tp, cp=dims.cp, pp=dims.pp, dp=dims.dp, ep=dims.ep,
        micro_batch_size=micro_batch_size, num_micro_batches=model.global_batch_size // per_mb,
        rank_of_logical=list(placement.rank_of_logical), layers_per_stage=list(layers_per_stage),
        groups=groups, nodes=nodes, overlap_grad_reduce=overlap_grad_reduce,
        distributed_optimizer=distributed_optimizer, homogeneous=cluster.is_homogeneous,
        prediction=prediction, baseline=baseline, alternatives=list(alternatives), warnings=warnings)


def make_plan(cluster: Cluster, model: ModelSpec, *, tp: Optional[int] = None, pp: Optional[int] = None,
              dp: Optional[int] = None, cp: int = 1, micro_batch_size: Optional[int] = None,
              progress: bool = False) -> Plan:
    """Best plan for ``cluster`` and ``model``; degrees given here (or in the model) are respected."""
    tp = tp or 1
    if pp is None and dp is None:
        pp = 1
    if pp is None:
        pp = cluster.world_size // (tp * cp * dp)
    if dp is None:
        dp = cluster.world_size // (tp * cp * pp)
    dims = ParallelDims(tp=tp, cp=cp, pp=pp, dp=dp)
    check_dims(cluster, dims, model.num_layers)
    mb = micro_batch_size or model.micro_batch_size or 1
    placement = place(cluster, dims)
    return assemble_plan(cluster, model, placement, uniform_layers(model.num_layers, pp), mb)
