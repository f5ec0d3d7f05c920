"""Plan resolution, cross-rank agreement and the Megatron-Core drop-in ``initialize_model_parallel``.

Runs *after* ``torch.distributed.init_process_group`` (the plan check uses the default store), and
*before* Megatron-Core builds any of its groups. Every rank computes (or loads) the plan, the ranks
compare plan hashes through the store (a rank that failed publishes its error, so all stop together),
and only then are the groups created, through :func:`het_plugin.megatron.groups.planned_groups`.
"""
from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from ..agreement import agree_on_plan
from ..cluster import Cluster, load_cluster
from ..errors import ConfigError
from ..model import ModelSpec, load_model, preset_model
from ..placement import check_dims, check_world_size
from ..plan import Plan, looks_like_plan
from ..topology import ParallelDims

log = logging.getLogger("het_plugin.megatron")

PathLike = Union[str, Path]


@dataclass
class AppliedPlan:
    """What the adapter did on this rank (for logging, tests and the user's model code)."""
    plan: Plan
    rank: int
    groups: list[dict] = field(default_factory=list)      # one record per group created
    nccl_config_path: Optional[str] = None


_current: Optional[AppliedPlan] = None


def current_plan() -> Optional[AppliedPlan]:
    """The plan applied in this process (None before initialisation or without het_plugin)."""
    return _current


# ---- plan resolution (pure: no torch.distributed) -------------------------------------------------

def _as_model(model: Union[ModelSpec, PathLike, None]) -> Optional[ModelSpec]:
    if model is None or isinstance(model, ModelSpec):
        return model
    text = str(model)
    if Path(text).exists() or text.endswith((".yaml", ".yml", ".json")):
        return load_model(text)
    return preset_model(text)


def placeable_degrees(cluster: Cluster, num_layers: int, cp: int = 1) -> list[tuple[int, int]]:
    """(tp, pp) pairs whose groups this cluster can hold (what a ConfigError suggests instead)."""
    out = []
    world = cluster.world_size
    per_node = math.gcd(*[n.num_accelerators for n in cluster.nodes])   # TP and CP stay inside a node
    for tp in (t for t in range(1, per_node + 1) if per_node % t == 0):
        for pp in range(1, min(world, num_layers) + 1):
            if world % (tp * cp * pp):
                continue
            try:
                check_dims(cluster, ParallelDims(tp=tp, cp=cp, pp=pp, dp=world // (tp * cp * pp)), num_layers)
            except (ConfigError, ValueError):
                continue
            out.append((tp, pp))
    return out


def _check_plan_degrees(plan: Plan, source: str, tp, pp, cp) -> None:
    for name, given, planned in (("tensor_model_parallel_size", tp, plan.tp),
                                 ("pipeline_model_parallel_size", pp, plan.pp),
                                 ("context_parallel_size", cp, plan.cp)):
        if given is not None and given != planned:
            raise ConfigError(f"{name}={given} was passed, but the plan file was made for {planned}",
                              source=source, field=name,
                              fix=f"pass {planned} (or drop it), or re-plan with `het-plugin plan --tp/--pp`")


def _check_plan_model(plan: Plan, source: str, model: Optional[ModelSpec]) -> None:
    """A plan file made for another model would split layers that do not exist."""
    if model is None:
        return
    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        planned, given = plan.model.get(name), getattr(model, name)
        if planned != given:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"the plan was made for {name}={planned}, this run has {given}", source=source,
                              field=f"model.{name}", fix=f"re-plan for this model (`het-plugin plan` with its "
                                                         f"model file), or pass {flag} {planned}")


def resolve_plan(source: Union[Plan, Cluster, PathLike, None] = None, *, model: Union[ModelSpec, PathLike,
                 None] = None, world_size: int, rank: Optional[int] = None,
                 local_world_size: Optional[int] = None, tp: Optional[int] = None, pp: Optional[int] = None,
                 cp: Optional[int] = None, micro_batch_size: Optional[int] = None) -> Plan:
    """The plan this launch runs: loaded (plan file / Plan) or computed (cluster file / Cluster / discovery).

    Degrees given here are respected; if they cannot be placed, the ConfigError lists those that can.
    """
    if isinstance(source, Plan):
        plan, where = source, "<plan>"
    elif isinstance(source, (str, Path)) and looks_like_plan(source):
        plan, where = Plan.load(source), str(source)
    else:
        plan = None
    if plan is not None:
        if plan.world_size != world_size:
            raise ConfigError(f"the plan is for {plan.world_size} ranks, but {world_size} were launched",
                              source=where, field="world_size", fix=f"launch {plan.world_size} ranks, or re-plan")
        _check_plan_degrees(plan, where, tp, pp, cp)
        _check_plan_model(plan, where, _as_model(model))
        return plan

    if isinstance(source, Cluster):
        cluster = source
    elif source is None:
        cluster = _discover()
    else:
        cluster = load_cluster(source)
    check_world_size(cluster, world_size, rank=rank, local_world_size=local_world_size)
    spec = _as_model(model)
    if spec is None:
        raise ConfigError("a cluster needs a model to plan for", field="model",
                          fix="pass model=ModelSpec(...) (or a model file / preset name), or a plan file")
    from ..planner import make_plan
    try:
        return make_plan(cluster, spec, tp=tp, pp=pp, cp=cp or 1, micro_batch_size=micro_batch_size)
    except ConfigError as exc:
        if tp is None and pp is None:
            raise
        ok = placeable_degrees(cluster, spec.num_layers, cp or 1)
        listed = ", ".join(f"tp={a} pp={b}" for a, b in ok[:12]) or "none"
        raise ConfigError(f"the degrees passed (tp={tp}, pp={pp}, cp={cp or 1}) cannot be placed on "
                          f"{cluster.name}: {exc.problem}", source=exc.source, field=exc.field,
                          fix=f"{exc.fix + '; ' if exc.fix else ''}degrees this cluster can hold: {listed}"
                          ) from None


def _discover() -> Cluster:
    try:
        from ..discovery import discover_cluster
    except ImportError:
        raise ConfigError("--heterogeneous-nic without a file needs cluster discovery, which this "
                          "het_plugin does not have", field="--heterogeneous-nic",
                          fix="pass a cluster file: --heterogeneous-nic cluster.yaml") from None
    kwargs = {}
    params = inspect.signature(discover_cluster).parameters
    try:
        import torch.distributed as dist
        if dist.is_initialized():
            from torch.distributed import distributed_c10d
            if "store" in params:
                kwargs["store"] = distributed_c10d._get_default_store()
            if "rank" in params:
                kwargs["rank"] = dist.get_rank()
            if "world_size" in params:
                kwargs["world_size"] = dist.get_world_size()
    except ImportError:
        pass
    return discover_cluster(**kwargs)


# ---- summary --------------------------------------------------------------------------------------

def plan_summary(plan: Plan) -> str:
    """A short, human summary: placement per cluster, layers per stage, transports, prediction."""
    lines = [f"het_plugin: plan {plan.hash} for {plan.cluster_name}: {plan.world_size} ranks, tp={plan.tp} "
             f"cp={plan.cp} pp={plan.pp} dp={plan.dp}, micro-batch {plan.micro_batch_size} x "
             f"{plan.num_micro_batches}" + (" (homogeneous: Megatron's own groups)" if plan.is_identity else "")]
    size = plan.dims.stage_size
    for s, layers in enumerate(plan.layers_per_stage):
        ranks = plan.rank_of_logical[s * size:(s + 1) * size]
        where = sorted({f"{plan.node_of(r).cluster}/{plan.node_of(r).accelerator}" for r in ranks})
        lines.append(f"  stage {s}: {layers} layers on {', '.join(where)} (ranks {_ranks_text(ranks)})")
    kinds = []
    for kind in ("tp", "cp", "dp", "pp", "embedding"):
        ts = sorted({g.transport for g in plan.groups.get(kind, [])})
        if ts:
            kinds.append(f"{kind}={'/'.join(ts)}")
    lines.append("  transports: " + ", ".join(kinds) + f"; overlap_grad_reduce={plan.overlap_grad_reduce}")
    if plan.prediction:
        pred = f"  predicted: {plan.prediction.iteration_s:.4g} s/iteration"
        if plan.baseline and plan.speedup:
            pred += f" (framework default {plan.baseline.iteration_s:.4g} s, x{plan.speedup:.2f})"
        lines.append(pred)
    lines.extend(f"  warning: {w}" for w in plan.warnings)
    return "\n".join(lines)


def _ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


# ---- applying a plan to Megatron-Core ---------------------------------------------------------------

def original_initialize_model_parallel():
    """parallel_state.initialize_model_parallel with any het_plugin wrapper peeled off."""
    from megatron.core import parallel_state
    fn = parallel_state.initialize_model_parallel
    while getattr(fn, "__het_plugin_wrapped__", None) is not None:
        fn = fn.__het_plugin_wrapped__
    return fn


UNSUPPORTED = {
    "order": ("tp-cp-ep-dp-pp", "het_plugin places ranks in Megatron's default order tp-cp-ep-dp-pp",
              "drop --use-tp-pp-dp-mapping / order="),
    "virtual_pipeline_model_parallel_size": (None, "interleaved pipelines are not planned by het_plugin yet",
                                             "drop the virtual pipeline size"),
    "expert_model_parallel_size": (1, "expert parallelism is not planned by het_plugin yet",
                                   "use expert_model_parallel_size=1"),
}


def build_groups(plan: Plan, megatron_kwargs: dict, *, nccl_config_dir: Optional[PathLike] = None,
                 plan_out: Optional[PathLike] = None) -> AppliedPlan:
    """Create every Megatron-Core group on the (agreed) plan's placement; rank 0 logs the summary once."""
    global _current
    import torch.distributed as dist
    from .groups import planned_groups
    from .ncclcfg import write_nccl_config

    rank = dist.get_rank()
    for key, (default, why, fix) in UNSUPPORTED.items():
        if megatron_kwargs.get(key, default) != default:
            raise ConfigError(f"{key}={megatron_kwargs[key]!r}: {why}", field=key, fix=fix)
    kwargs = dict(megatron_kwargs)
    kwargs.update(tensor_model_parallel_size=plan.tp, pipeline_model_parallel_size=plan.pp,
                  context_parallel_size=plan.cp)
    applied = AppliedPlan(plan, rank)
    # A homogeneous cluster keeps Megatron's own setup, NCCL's network choice included.
    if dist.get_backend() == "nccl" and not (plan.homogeneous and plan.is_identity):
        path = write_nccl_config(plan, rank, nccl_config_dir, kwargs.get("nccl_communicator_config_path"))
        kwargs["nccl_communicator_config_path"] = str(path)
        applied.nccl_config_path = str(path)
    if rank == 0:
        text = plan_summary(plan)
        print(text, flush=True)
        if plan_out:
            plan.save(plan_out)
            print(f"het_plugin: plan written to {plan_out}", flush=True)
    if any(g.transport == "host-staged" for gs in plan.groups.values() for g in gs):
        from .groups import shim_backend
        if shim_backend() is not None:      # the shim learns every rank's vendor from the plan
            from ..comm import set_vendor_map_from_plan
            set_vendor_map_from_plan(plan)
    with planned_groups(plan) as created:
        original_initialize_model_parallel()(**kwargs)
    applied.groups = created
    _current = applied
    return applied


def initialize_model_parallel(tensor_model_parallel_size: Optional[int] = None,
                              pipeline_model_parallel_size: Optional[int] = None, *,
                              cluster: Union[Cluster, PathLike, None] = None,
                              plan: Union[Plan, PathLike, None] = None,
                              model: Union[ModelSpec, PathLike, None] = None,
                              micro_batch_size: Optional[int] = None,
                              nccl_config_dir: Optional[PathLike] = None,
                              plan_out: Optional[PathLike] = None,
                              **megatron_kwargs: Any) -> Plan:
    """Drop-in for ``megatron.core.parallel_state.initialize_model_parallel`` on a heterogeneous cluster.

    Call after ``torch.distributed.init_process_group``. Give ``plan`` (a Plan or a plan file), or
    ``cluster`` (a Cluster or cluster file) plus ``model`` (ModelSpec, model file or preset); with
    neither, the cluster is discovered. Degrees passed are respected, the rest the planner chooses.
    Other keyword arguments go to Megatron-Core unchanged. Returns the plan: build the model with
    ``plan.tp``/``plan.pp`` and :func:`apply_plan_to_config` (layer split), and DDP with
    :func:`ddp_config_for_plan`.
    """
    import torch.distributed as dist
    if not dist.is_initialized():
        raise RuntimeError("call torch.distributed.init_process_group before "
                           "het_plugin.megatron.initialize_model_parallel")
    if plan is not None and cluster is not None:
        raise ConfigError("pass either plan= or cluster=, not both", fix="a plan already names its cluster")
    rank, world = dist.get_rank(), dist.get_world_size()
    import os
    lws = os.environ.get("LOCAL_WORLD_SIZE")
    cp = megatron_kwargs.pop("context_parallel_size", None)

    def make() -> Plan:
        return resolve_plan(plan if plan is not None else cluster, model=model, world_size=world, rank=rank,
                            local_world_size=int(lws) if lws else None, tp=tensor_model_parallel_size,
                            pp=pipeline_model_parallel_size, cp=cp,
                            micro_batch_size=micro_batch_size)

    agreed = agree_on_plan(make, rank=rank, world_size=world)
    build_groups(agreed, megatron_kwargs, nccl_config_dir=nccl_config_dir, plan_out=plan_out)
    return agreed
