"""The Megatron-Core drop-in ``initialize_model_parallel`` and the group building both Megatron-LM paths
end in.

Runs *after* ``torch.distributed.init_process_group`` (the plan check uses the default store), and
*before* Megatron-Core builds any of its groups. Every rank resolves the plan
(:func:`het_plugin.core.launch.resolve_plan`), the ranks compare plan hashes through the store (a rank
that failed publishes its error, so all stop together), and only then are the groups created, through
:func:`het_plugin.megatron.groups.planned_groups` and the one group policy.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional, Union

from ..core.inputs.cluster import Cluster
from ..core.errors import ConfigError
from ..core.inputs.model import ModelSpec
from ..core.plan import Plan
from ..views.report import startup_summary
from ..discovery import discover_cluster
from ..core.launch import Resolved, check_launch_settings, resolve_launch
from ..core.request import LaunchRequest, Timeout
from ..runtime.all_nodes import use_all_nodes as all_nodes_asked
from ..runtime.plan_once import node_sharing
from ..runtime.applied import AppliedPlan
from ..runtime.startup import Planning, Replan, bounded, startup
from ..core.ranks.dims import DEFAULT_ORDER
from ..runtime.patches import PATCHES
from ..runtime.recorder import DEFAULT_EVERY, ProfileSettings
from ..core.replan_command import cluster_file, model_name
from . import applied_state, late_groups, recorder_hooks as timing, replicas
from .applied_state import current_plan  # noqa: F401   the documented path: het_plugin.megatron.mcore.current_plan
from .dist_opt import check_groups_kwarg, groups_kwargs
from .groups import planned_groups
from .version import check_megatron_version

log = logging.getLogger("het_plugin.megatron")

PathLike = Union[str, Path]

# What Megatron calls the degrees (error messages name the user's own argument).
MEGATRON_NAMES = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
                  "cp": "context_parallel_size", "dp": "data_parallel_size", "ep": "expert_model_parallel_size",
                  "etp": "expert_tensor_parallel_size", "order": "order",
                  "vpp": "virtual_pipeline_model_parallel_size", "overlap_p2p_comm": "overlap_p2p_comm"}


def forget_plan() -> None:
    """Take back what het_plugin applied in this process: the measured-profile timing (its recorder writes a last
    profile), the uneven-replica wrappers (Megatron's own schedules and sampler again) and :func:`current_plan`.
    For a process that trains several configurations in turn, the next perhaps without het_plugin. Megatron's
    groups stay Megatron's to destroy (``parallel_state.destroy_model_parallel``)."""
    timing.uninstall()                # in any order: runtime.patches keeps the other label's wrappers
    late_groups.uninstall()
    replicas.uninstall()
    applied_state.write(None)


def resolve_megatron_plan(source: Union[Plan, Cluster, PathLike, None] = None, *,
                 model: Union[ModelSpec, PathLike, None] = None, world_size: int, rank: Optional[int] = None,
                 local_world_size: Optional[int] = None, tp: Optional[int] = None, pp: Optional[int] = None,
                 cp: Optional[int] = None, micro_batch_size: Optional[int] = None, ep: int = 1,
                 etp: Optional[int] = None, order: str = DEFAULT_ORDER, vpp: Optional[int] = None,
                 overlap_p2p_comm: Optional[bool] = None) -> Plan:
    """:func:`het_plugin.core.launch.resolve_plan` with Megatron's names for the degrees (None: the planner
    chooses; a plan file must agree with what is given). ``ep``, ``etp`` and ``order`` are Megatron's
    expert sizes and rank order, ``vpp`` its virtual pipeline size (None: not interleaved, or a plan file's),
    taken as given."""
    return resolve_megatron_launch(source, model=model, world_size=world_size, rank=rank,
                                   local_world_size=local_world_size, tp=tp, pp=pp, cp=cp,
                                   micro_batch_size=micro_batch_size, ep=ep, etp=etp, order=order, vpp=vpp,
                                   overlap_p2p_comm=overlap_p2p_comm).plan


def resolve_megatron_launch(source: Union[Plan, Cluster, PathLike, None] = None, *,
                            model: Union[ModelSpec, PathLike, None] = None, world_size: int, rank: Optional[int] = None,
                            local_world_size: Optional[int] = None, tp: Optional[int] = None,
                            pp: Optional[int] = None, cp: Optional[int] = None, micro_batch_size: Optional[int] = None,
                            ep: int = 1, etp: Optional[int] = None, order: str = DEFAULT_ORDER,
                            vpp: Optional[int] = None, overlap_p2p_comm: Optional[bool] = None,
                            profile: Any = None) -> Resolved:
    """:func:`resolve_megatron_plan` with the cluster the plan was made from (the pre-flight reads its NICs);
    ``profile``: a measured profile to plan with (re-planning on restart). The keyword form of
    :func:`launch_request` + :func:`plan_megatron`."""
    request = launch_request(world_size, rank=rank, local_world_size=local_world_size, tp=tp, pp=pp, cp=cp,
                             micro_batch_size=micro_batch_size, ep=ep, etp=etp, order=order, vpp=vpp,
                             overlap_p2p_comm=overlap_p2p_comm)
    return plan_megatron(source, request, model=model, profile=profile)


def launch_request(world_size: int, *, rank: Optional[int] = None, local_world_size: Optional[int] = None,
                   timeout: Timeout = Timeout(), use_all_nodes: bool = True, **degrees: Any) -> LaunchRequest:
    """A Megatron launch's request: ``degrees`` are tp, pp, cp, ep, etp, order, vpp, overlap_p2p_comm and
    micro_batch_size as Megatron gives them (None: the planner chooses; ep None: 1, Megatron's default), named in
    messages as Megatron names them. ``use_all_nodes``: plan with every node (False: over subsets of the node
    groups, refusing a launch of nodes the best plan leaves out)."""
    degrees["ep"] = degrees.get("ep", 1) or 1
    return LaunchRequest.of(world_size, rank=rank, local_world_size=local_world_size, names=MEGATRON_NAMES,
                            source="Megatron arguments", timeout=timeout, use_all_nodes=use_all_nodes, **degrees)


def plan_megatron(source: Union[Plan, Cluster, PathLike, None], request: LaunchRequest, *,
                  model: Union[ModelSpec, PathLike, None] = None, profile: Any = None) -> Resolved:
    """The plan of a Megatron launch (:func:`het_plugin.core.launch.resolve_launch`): the cluster discovered when
    ``source`` names none, the search shared by a node's ranks (runtime.plan_once)."""
    return resolve_launch(source, request, model=model, discover=discover_cluster, profile=profile,
                          share_plan=node_sharing())


# ---- applying a plan to Megatron-Core ---------------------------------------------------------------

def original_initialize_model_parallel():
    """parallel_state.initialize_model_parallel with any het_plugin wrapper peeled off."""
    from megatron.core import parallel_state
    return PATCHES.original(parallel_state, "initialize_model_parallel")


def plan_degrees(megatron_kwargs: dict) -> dict[str, Any]:
    """The expert sizes and rank order in Megatron's initialize_model_parallel arguments (the planner
    takes them as given)."""
    return {"ep": megatron_kwargs.get("expert_model_parallel_size") or 1,
            "etp": megatron_kwargs.get("expert_tensor_parallel_size") or None,
            "order": megatron_kwargs.get("order") or DEFAULT_ORDER,
            "vpp": megatron_kwargs.get("virtual_pipeline_model_parallel_size")}


def check_kwargs_fit(plan: Plan, megatron_kwargs: dict) -> None:
    """Megatron's own arguments must describe the plan's groups; refuse what the plan cannot express."""
    wanted = plan_degrees(megatron_kwargs)
    # Megatron's expert_tensor_parallel_size None means tp, which build_groups sets to the plan's.
    check_launch_settings(plan, {"ep": wanted["ep"], "etp": wanted["etp"] or plan.tp, "order": wanted["order"],
                                 "vpp": wanted["vpp"]}, None, MEGATRON_NAMES, droppable=False)
    if plan.is_identity:
        return            # the framework's own numbering: whatever else Megatron builds is its own
    for key in ("gtp_remat_size", "expert_gtp_remat_size"):
        if (megatron_kwargs.get(key) or 1) != 1:
            raise ConfigError(f"{key}={megatron_kwargs[key]}: the GTP weight-rematerialisation axis re-orders "
                              "Megatron's ranks, and het_plugin's placement does not model it", field=key,
                              fix=f"use {key}=1 on a heterogeneous cluster")


def build_groups(plan: Plan, megatron_kwargs: dict, *, plan_out: Optional[PathLike] = None,
                 timeout_s: Optional[float] = None, cluster: Optional[Cluster] = None,
                 profile: Optional[ProfileSettings] = None, applied: Optional[AppliedPlan] = None,
                 megatron_groups: bool = True) -> AppliedPlan:
    """Create every Megatron-Core group on the (agreed) plan's placement; rank 0 logs the summary once.
    First, under NCCL, the network pre-flight (``cluster``: the Cluster the plan came from, for the nodes'
    NICs; runtime.preflight). A rank that fails or disappears meanwhile stops every rank within ``timeout_s``
    (None: ``HET_PLUGIN_TIMEOUT`` or 300 s) with a GroupCreationTimeout naming it (runtime.guard).
    ``profile``: time each stage's forward and backward while training and write the measured profile
    (:mod:`het_plugin.megatron.recorder_hooks`). ``applied``: what the start-up sequence began
    (:func:`het_plugin.runtime.startup.startup`; None: begun here, for a plan agreed elsewhere)."""
    import torch.distributed as dist

    check_megatron_version()
    check_kwargs_fit(plan, megatron_kwargs)
    check_groups_kwarg(plan, megatron_kwargs)     # an optimizer instance that would span clusters: refused here
    kwargs = dict(megatron_kwargs)
    kwargs.update(tensor_model_parallel_size=plan.tp, pipeline_model_parallel_size=plan.pp,
                  context_parallel_size=plan.cp)
    if plan.vpp > 1 and kwargs.get("virtual_pipeline_model_parallel_size") is None:
        kwargs["virtual_pipeline_model_parallel_size"] = plan.vpp    # the model gets plan.vpp chunks per rank
    for key in RANK_CALLBACKS:
        if kwargs.get(key) is not None:
            kwargs[key] = through_plan(plan, kwargs[key])
    if applied is None:
        applied = AppliedPlan.begin(plan, dist.get_rank(), cluster=cluster, timeout_s=timeout_s)
    if applied.rank == 0:
        print(startup_summary(plan, "Megatron"), flush=True)
        if plan_out:
            plan.save(plan_out)
            print(f"het_plugin: plan written to {plan_out}", flush=True)
    late_groups.uninstall()   # a plan applied before in this process: its run-long patches would map twice
    if megatron_groups:
        with planned_groups(applied, timeout_s=timeout_s):
            original_initialize_model_parallel()(**kwargs)
    late_groups.install(applied)  # groups Megatron makes later (all-gather, HyperCommGrid) follow the plan
    timing.uninstall()            # a plan applied before in this process: its timing ends here
    replicas.install(plan)        # uneven replicas: per-rank counts, weights and samples; even: Megatron's own
    if profile is not None:
        timing.install(plan, applied.rank, profile, cluster=cluster)
    note = embedding_note(plan, applied.records)
    if note and applied.rank == 0:
        log.warning("het_plugin: %s", note)
    applied_state.write(applied)
    return applied


# Megatron-Core's callbacks that pick members out of each pipeline group (a script passes its own:
# Megatron-LM's pretrain_gpt drops the last stage for untied embeddings and adds the MTP stage).
RANK_CALLBACKS = ("get_embedding_ranks", "get_position_embedding_ranks")


def through_plan(plan: Plan, callback):
    """Wrap a ``get_*_ranks(pp_ranks, ...)`` callback: it sees the *logical* pipeline ranks, exactly what it
    would see on a homogeneous cluster, and its answer is mapped through the plan's permutation. A callback
    written for Megatron's numbering (``min(pp_ranks)`` is the first stage, say) stays right after placement."""
    if plan.is_identity or getattr(callback, "__het_plugin_plan__", None) is plan:
        return callback
    logical_of, physical_of = plan.logical_of_physical, plan.rank_of_logical

    def mapped(pp_ranks, *args, **kwargs):
        chosen = callback([logical_of[r] for r in pp_ranks], *args, **kwargs)
        return [physical_of[r] for r in chosen]

    mapped.__het_plugin_plan__ = plan
    mapped.__wrapped__ = callback
    return mapped


def embedding_note(plan: Plan, records) -> Optional[str]:
    """Say so when the script's embedding groups are not the plan's (the groups follow the script; the
    prediction assumed the plan's, from the model's tie_embeddings and mtp_layers)."""
    made = sorted(sorted(r.ranks) for r in records if r.desc == "EMBEDDING_GROUP")
    want = sorted(sorted(g.ranks) for g in plan.groups.get("embedding", []))
    if not made or made == want:
        return None
    stages = sorted({plan.stage_of(r) for g in made for r in g})
    model = plan.model
    return (f"the script's embedding groups (get_embedding_ranks) hold pipeline stages {stages}, the plan "
            f"assumed {plan.embedding_stages} (tie_embeddings={model.get('tie_embeddings', True)}, "
            f"mtp_layers={model.get('mtp_layers', 0)}); the groups follow the script, the predicted embedding "
            "all-reduce does not. Describe the model as the script builds it (--untie-embeddings-and-output-weights, "
            "--mtp-num-layers, or the model file) for a matching prediction")


def initialize_model_parallel(tensor_model_parallel_size: Optional[int] = None,
                              pipeline_model_parallel_size: Optional[int] = None, *,
                              cluster: Union[Cluster, PathLike, None] = None,
                              plan: Union[Plan, PathLike, None] = None,
                              model: Union[ModelSpec, PathLike, None] = None,
                              micro_batch_size: Optional[int] = None,
                              plan_out: Optional[PathLike] = None,
                              timeout_s: Optional[float] = None,
                              profile_out: Optional[PathLike] = None,
                              profile_every: Optional[int] = None,
                              replan_on_restart: bool = False,
                              checkpoint: Any = None,
                              use_all_nodes: Optional[bool] = None,
                              **megatron_kwargs: Any) -> Plan:
    """Drop-in for ``megatron.core.parallel_state.initialize_model_parallel`` on a heterogeneous cluster.

    Call after ``torch.distributed.init_process_group``. Give ``plan`` (a Plan or a plan file), or
    ``cluster`` (a Cluster or cluster file) plus ``model`` (ModelSpec, model file or preset); with
    neither, the cluster is discovered. Degrees passed are respected, the rest the planner chooses.
    Other keyword arguments go to Megatron-Core unchanged; a ``num_distributed_optimizer_instances`` whose instances
    would span clusters is refused, and where none is given Megatron's one instance stands (rank 0 names the plan's
    count: pass it here and to the DDP config, :mod:`het_plugin.megatron.dist_opt`). Returns the plan: build the model with
    ``plan.tp``/``plan.pp`` and :func:`apply_plan_to_config` (layer split), and DDP with
    :func:`ddp_config_for_plan`; :func:`current_plan` holds what was applied (groups created).
    ``timeout_s`` bounds every wait of het_plugin in this call (the plan check, group creation; default
    ``HET_PLUGIN_TIMEOUT`` or 300 s): a rank that fails or disappears stops every rank within it, naming
    the rank and the phase (PlanMismatchError before the groups, GroupCreationTimeout while they are built).
    ``profile_out``: rank 0 writes the measured profile there (each stage's forward and backward per micro-batch
    and the iteration time) every ``profile_every`` iterations (default 100) and at exit, for
    ``het-plugin plan --profile`` (docs/planner.md, "Plans that learn from the run").
    ``replan_on_restart`` (with ``profile_out``): the next start re-plans from the profile this run writes
    (:mod:`het_plugin.runtime.restart_replan`); ``checkpoint``: the
    :class:`~het_plugin.core.checkpoint_fit.CheckpointShape` of the checkpoint it resumes (or a callable returning it): a re-plan it would not load under is not taken.
    ``use_all_nodes``: with a cluster (file or discovered), True plans with every node; False/None (unless
    ``HET_PLUGIN_USE_ALL_NODES=1``) plans over subsets of its node groups and stops every rank, naming the nodes,
    when the best plan leaves some out (launch the kept ones with its plan file, or ask for every node).
    """
    import torch.distributed as dist
    check_megatron_version()
    if not dist.is_initialized():
        raise RuntimeError("call torch.distributed.init_process_group before "
                           "het_plugin.megatron.initialize_model_parallel")
    if plan is not None and cluster is not None:
        raise ConfigError("pass either plan= or cluster=, not both", fix="a plan already names its cluster")
    rank, world = dist.get_rank(), dist.get_world_size()
    lws = os.environ.get("LOCAL_WORLD_SIZE")
    cp = megatron_kwargs.pop("context_parallel_size", None)
    settings = profile_settings(profile_out, profile_every, cluster if cluster is not None else plan, model=model)
    replan = None
    if replan_on_restart:
        if settings is None:
            raise ConfigError("replan_on_restart needs profile_out: the next start re-plans from the measured "
                              "profile this run writes there", field="replan_on_restart", fix="add profile_out=FILE")
        settings.replan_on_restart = True
        replan = Replan(settings.path, checkpoint=checkpoint)
    request = launch_request(world, rank=rank, local_world_size=int(lws) if lws else None, timeout=Timeout(timeout_s),
                             use_all_nodes=all_nodes_asked(use_all_nodes), tp=tensor_model_parallel_size, pp=pipeline_model_parallel_size, cp=cp,
                             micro_batch_size=micro_batch_size, **plan_degrees(megatron_kwargs))
    source = plan if plan is not None else cluster

    def check(resolved: Resolved) -> None:
        check_kwargs_fit(resolved.plan, megatron_kwargs)
        groups_kwargs(resolved.plan, megatron_kwargs)    # the caller's instance count, refused before the groups

    started = startup(request, Planning(lambda profile: plan_megatron(source, request, model=model, profile=profile),
                                        replan=replan, check=check))
    with bounded(request):
        # num_distributed_optimizer_instances: the caller's (checked); the plan's count named on rank 0 where none
        megatron_kwargs, note = groups_kwargs(started.plan, megatron_kwargs)
        if note and rank == 0:
            print(note, flush=True)
        build_groups(started.plan, megatron_kwargs, plan_out=plan_out, timeout_s=timeout_s, cluster=started.cluster,
                     profile=settings, applied=started.applied)
    return started.plan


def profile_settings(profile_out: Optional[PathLike], every: Optional[int], cluster: Any = None,
                     field: str = "profile_out", every_field: str = "profile_every",
                     model: Any = None) -> Optional[ProfileSettings]:
    """The measured-profile settings (None without a path); checked before any group exists. ``cluster`` and
    ``model``: the run's cluster file and model file or preset, named in the re-plan command of the imbalance
    warning (others are written beside the profile); ``field``/``every_field``: the names errors give the two
    settings."""
    if profile_out is None:
        if every is not None:
            raise ConfigError(f"a profile interval ({every}) was given without a file to write the profile to",
                              field=every_field,
                              fix=f"add {field} FILE, or drop the interval")
        return None
    try:
        return ProfileSettings(str(profile_out), every=DEFAULT_EVERY if every is None else every,
                               cluster=cluster_file(cluster), model=model_name(model))
    except ConfigError as exc:
        name = every_field if exc.field == "profile_every" else field
        raise ConfigError(exc.problem, source=exc.source, field=name, fix=exc.fix) from None
