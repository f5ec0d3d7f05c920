"""Megatron-LM integration shared by the import hook and the patches.

Two calls, at the two moments Megatron-LM gives us:

* :func:`prepare_args` right after ``parse_args`` (before ``validate_args``): with a cluster or plan
  file the plan is computed here (``runtime.startup.resolve_start``, pure: no process group yet) and
  written into ``args`` (degrees, ``pipeline_model_parallel_layout``, ``overlap_grad_reduce``), so Megatron
  validates and builds the model for it. A planning error is kept, not raised: it is published at the
  agreement so *every* rank stops with it (raising here would leave the other ranks waiting in
  init_process_group). The plan or error waits in :mod:`het_plugin.megatron.launch_state`.
* :func:`planned_initialize_model_parallel` in place of ``parallel_state.initialize_model_parallel``
  (called by ``_initialize_distributed`` after ``init_process_group``): the start-up sequence
  (``runtime.startup.startup``: ranks agree on the plan; the bare flag discovers the cluster and plans
  there, with the degrees Megatron already validated), then every group is built on the plan's placement.

megatron.training 0.19+ scripts build the model, DDP and optimizer configs from ``args`` *before*
``pretrain(cfg_container, ...)`` initialises anything. With a file the plan is in ``args`` by then; with
the bare flag it is made later, so ``setup_model_and_optimizer`` is wrapped to bring the container to the
plan (:func:`apply_plan_to_container`) before the model is built.
"""
from __future__ import annotations

import functools
import inspect
import os
import sys
from dataclasses import fields, is_dataclass, replace
from typing import Any, Optional

from ..core.errors import ConfigError, HetPluginError
from ..core.launch import Resolved
from ..core.request import LaunchRequest, Timeout
from ..runtime.all_nodes import use_all_nodes
from ..runtime.patches import PATCHES
from ..runtime.startup import Planning, Replan, bounded, resolve_start, startup
from ..runtime import netselect
from ..runtime.replicas import ReplicaShare
from ..runtime.applied import AppliedPlan
from . import checkpoints, late_groups, launch_state, mcore
from .applied_state import current_plan
from .dist_opt import ARG as INSTANCES, apply_to_ddp_config
from .args import (DISCOVER, PROFILE_OUT_FLAG, REPLAN_FLAG, TIMEOUT_FLAG, apply_plan_to_args, check_compatible,
                   degrees_given, launch_profile_settings, order_of)
from .group_check import install as install_group_check
from .launch_state import LaunchState
from .modelspec import model_from_args
from .pipeline_layout import apply_plan_to_config, layout_for_plan
from .settings import offer, planned_settings, take_plan_settings
from .version import check_megatron_version

PATCH_LABEL = "megatron.lm"    # Megatron-LM's init_process_group, initialize_model_parallel, setup_model_and_optimizer,
#                                load_checkpoint


def __getattr__(name: str) -> Any:
    """``lm.state``: the launch state (:mod:`het_plugin.megatron.launch_state`), read where it was kept before."""
    if name == "state":
        return launch_state.current()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def prepare_args(args: Any, argv: Optional[list[str]] = None) -> Any:
    """Plan from a file and apply it to ``args``; a no-op without ``--heterogeneous-nic``.

    Megatron-LM parses the same command line more than once in one process (megatron.training 0.19:
    ``inprocess_restart.maybe_wrap_for_inprocess_restart`` and ``ft_integration.setup`` each call
    ``parse_args(ignore_unknown_args=True)`` for a look at their own flags): every namespace gets the plan,
    planned once per command line.
    """
    source = getattr(args, "heterogeneous_nic", None)
    if source is None or getattr(args, "_het_plugin_prepared", False):
        return args
    argv = sys.argv[1:] if argv is None else argv
    check_megatron_version()      # the same install on every rank: raising here stops all alike
    check_compatible(args)
    state = launch_state.current()
    if state.args is None or (state.source, state.argv) != (source, tuple(argv)):
        # written first: the profile settings read while planning name this launch's cluster file
        state = launch_state.write(LaunchState(args=args, source=source, argv=tuple(argv),
                                               plan_out=getattr(args, "heterogeneous_plan_out", None)))
        if source != DISCOVER:
            state = _plan_file(state, argv)
    if state.plan is not None:
        state = replace(state, changes=tuple(apply_plan_to_args(args, state.plan)) or state.changes)
    launch_state.write(state)
    args._het_plugin_prepared = True
    install_initialize_wrapper()
    install_world_group_network()
    return args


def _plan_file(state: LaunchState, argv: list[str]) -> LaunchState:
    """Plan a cluster or plan file at parse_args (no process group yet); an error is kept for the agreement, where
    every rank stops with it (raising here would leave the other ranks waiting in init_process_group)."""
    args = state.args
    try:
        world = int(getattr(args, "world_size", None) or os.environ.get("WORLD_SIZE", "1"))
        request = megatron_request(world, rank_of(args), degrees_given(args, argv), args)
        resolved = resolve_start(megatron_planning(args, request, state.source), request.launch.rank)
    except HetPluginError as exc:
        return replace(state, error=exc)
    state = replace(state, plan=resolved.plan, cluster=resolved.cluster)
    try:
        # kept for the agreement like a planning error; the plan still goes into args, so that
        # validate_args passes (its own assertion would pre-empt the message) and every rank reaches it
        check_replica_batch(args, resolved.plan)
    except HetPluginError as exc:
        return replace(state, error=exc)
    return state


def world_needs_own_network(plan: Any) -> bool:
    """The plan's world group spans fabrics (IB and RoCE, or clusters joined by Ethernet) within one vendor:
    under NCCL its communicator must get the socket network (the pre-flight refuses it otherwise)."""
    return plan is not None and plan.rule_transport(range(plan.world_size)) == "socket"


def install_world_group_network() -> None:
    """Megatron-LM creates the world group itself (``_initialize_distributed``), after parse_args: with a plan
    file whose world group spans fabrics, ``init_process_group('nccl', ...)`` gets the world-only network
    (``netselect.world_group_options``, NCCL net_name 'Socket') unless the caller passed ``pg_options`` --
    what docs/user-guide.md tells a script that creates the group itself to do. The bare flag plans after
    the group exists: there the pre-flight names the fix."""
    import torch.distributed as dist
    PATCHES.apply(dist, "init_process_group", _world_network_init, label=PATCH_LABEL)


def _world_network_init(current):
    def init_process_group(*a, **kw):
        backend = kw.get("backend", a[0] if a else None)
        if (world_needs_own_network(launch_state.current().plan) and "nccl" in str(backend or "").lower()
                and kw.get("pg_options") is None and len(a) < 8):     # 8th positional: pg_options
            options = netselect.world_group_options()
            if options is not None:
                kw["pg_options"] = options
                if int(os.environ.get("RANK", "0") or 0) == 0:
                    print("het_plugin: the world group spans fabrics: init_process_group gets NCCL net_name "
                          "'Socket' for it (the plan's groups keep their own networks)", flush=True)
        return current(*a, **kw)

    return functools.update_wrapper(init_process_group, current)


def check_replica_batch(args: Any, plan: Any) -> None:
    """A plan with uneven data-parallel replicas splits exactly its own global batch: a launch asking for another
    global batch or micro-batch size (or a batch-size ramp-up) is refused naming the replica counts, instead of
    the plan's batch silently replacing it."""
    if not plan.uneven_replicas:
        return
    share = ReplicaShare.from_plan(plan, 0)
    if getattr(args, "rampup_batch_size", None):
        raise ConfigError(f"--rampup-batch-size is set, but the plan splits a fixed global batch of "
                          f"{share.global_batch_size} samples over replicas as {plan.replica_counts} micro-batches",
                          source="command line", field="--rampup-batch-size",
                          fix="drop --rampup-batch-size, or use a plan without replica_micro_batches")
    share.check_batch(getattr(args, "global_batch_size", None), getattr(args, "micro_batch_size", None),
                      source="command line", gbs_field="--global-batch-size", mbs_field="--micro-batch-size")


def megatron_args() -> Any:
    """The namespace Megatron-LM trains with: its global args once set, else the first one parsed for this launch."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    args = getattr(global_vars, "_GLOBAL_ARGS", None)
    return args if getattr(args, "_het_plugin_prepared", False) else launch_state.current().args


def rank_of(args: Any) -> int:
    """This rank as Megatron-LM knows it (its args once set, else the launcher's RANK)."""
    return int(getattr(args, "rank", None) or os.environ.get("RANK", "0"))


def megatron_request(world_size: int, rank: int, given: dict, args: Any) -> LaunchRequest:
    """The launch request of a Megatron-LM launch: the degrees ``given`` (:func:`het_plugin.megatron.args.degrees_given`
    at parse_args, Megatron's validated arguments at initialisation) and ``--heterogeneous-timeout``."""
    lws = os.environ.get("LOCAL_WORLD_SIZE")
    timeout = Timeout(getattr(args, "heterogeneous_timeout", None), TIMEOUT_FLAG, "command line")
    every = use_all_nodes(getattr(args, "heterogeneous_use_all_nodes", None) or None)   # the flag, else the env
    return mcore.launch_request(world_size, rank=rank, local_world_size=int(lws) if lws else None, timeout=timeout,
                                use_all_nodes=every, **given)


def megatron_planning(args: Any, request: LaunchRequest, source: Optional[str]) -> Planning:
    """How a Megatron-LM launch plans: for ``source`` (a file, or DISCOVER), the model read from ``args``; with
    ``--heterogeneous-replan-on-restart`` re-planned from the profile the last attempt wrote and the checkpoint in
    ``--load`` (het_plugin.runtime.restart_replan)."""

    def resolve(profile: Any) -> Resolved:
        d = request.degrees
        dp_guess = max(1, request.launch.world_size // ((d.tp or 1) * (d.pp or 1) * (d.cp or 1)))
        model = model_from_args(args, data_parallel_size=dp_guess)
        return mcore.plan_megatron(None if source == DISCOVER else source, request, model=model, profile=profile)

    return Planning(resolve, replan=_replan(args))


def _replan(args: Any) -> Optional[Replan]:
    """``--heterogeneous-replan-on-restart`` as the start-up's Replan (None without it)."""
    if not getattr(args, "heterogeneous_replan_on_restart", False):
        return None
    settings = launch_profile_settings(args)
    if settings is None:
        raise ConfigError(f"{REPLAN_FLAG} needs {PROFILE_OUT_FLAG}: the next start re-plans from the measured profile "
                          "this run writes there", source="command line", field=REPLAN_FLAG,
                          fix=f"add {PROFILE_OUT_FLAG} FILE (on storage every rank sees, e.g. beside the checkpoints)")
    return Replan(settings.path, checkpoint=lambda: checkpoints.checkpoint_shape(args),
                  distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)))


def install_initialize_wrapper() -> None:
    """Route ``parallel_state.initialize_model_parallel`` (what Megatron-LM calls, as ``mpu.``) through het_plugin,
    megatron.training's ``setup_model_and_optimizer`` through :func:`apply_plan_to_container`, and its
    ``load_checkpoint`` through the check of checkpoints.py."""
    from megatron.core import parallel_state
    PATCHES.apply(parallel_state, "initialize_model_parallel", _planned_initialize, label=PATCH_LABEL)
    # megatron.training's package __init__ imports .training: loaded by the time a script parses arguments.
    training = sys.modules.get("megatron.training.training")
    if getattr(training, "setup_model_and_optimizer", None) is not None:
        PATCHES.apply(training, "setup_model_and_optimizer", _planned_setup, label=PATCH_LABEL)
    if getattr(training, "load_checkpoint", None) is not None:
        PATCHES.apply(training, "load_checkpoint", _checked_load, label=PATCH_LABEL)
    install_group_check(training, start=start_explicit_groups)   # skip_model_parallel_init; after the model and
    #                                                                   optimizer: every group against the plan
    if current_plan() is None:           # a script's own groups before pretrain (the MiMo pattern) start the plan
        late_groups.install_start(start_explicit_groups)


def _planned_initialize(current):
    def planned(*a, **kw):
        return planned_initialize_model_parallel(*a, **kw)

    return functools.update_wrapper(planned, current)


def _planned_setup(setup):
    def setup_model_and_optimizer(*a, **kw):
        container = kw.get("cfg_container")
        plan = launch_state.current().plan
        if container is not None and plan is not None:
            changes = apply_plan_to_container(container, plan)
            if changes and int(getattr(megatron_args(), "rank", 0) or 0) == 0:
                print("het_plugin: pretrain's config container set from the plan: " + ", ".join(changes),
                      flush=True)
        return setup(*a, **kw)

    return functools.update_wrapper(setup_model_and_optimizer, setup)


def _checked_load(load):
    """megatron.training's ``load_checkpoint`` (as training.py calls it) checks what the checkpoint holds against
    this run first, on every rank (checkpoints.py): a combination that cannot load stops every rank alike."""
    def load_checkpoint(*a, **kw):
        margs = megatron_args()
        if launch_state.current().plan is not None and margs is not None:
            notes = checkpoints.check_before_load(margs, kw.get("load_arg", "load"))
            if notes and int(getattr(margs, "rank", 0) or 0) == 0:
                print("\n".join(notes), flush=True)
        return load(*a, **kw)

    return functools.update_wrapper(load_checkpoint, load)


def apply_plan_to_container(container: Any, plan: Any, take_settings: Optional[bool] = None) -> list[str]:
    """Give megatron.training's config container (``pretrain(cfg_container, ...)``, 0.19+) the plan's layer split
    where it lacks one, and, with ``take_settings`` (None: ``--heterogeneous-take-plan-settings`` on the command
    line), the gradient-reduction overlap and distributed optimizer the plan assumed; returns what changed.

    The container is built from ``args`` before initialisation. With the bare flag the plan comes after it:
    left alone, the model would get Megatron's even split and the DDP config would disagree with the
    optimizer (which megatron.training builds from ``args``). A split the container already has is kept.
    """
    changes = []
    model = getattr(container, "model", None)
    transformer = getattr(model, "transformer", None)
    layout = layout_for_plan(plan)
    if transformer is not None and layout is not None and transformer.pipeline_model_parallel_layout is None:
        model.transformer = apply_plan_to_config(transformer, plan)
        changes.append(f"model.transformer.pipeline_model_parallel_layout={layout}")
    # the optimizer and overlap are the user's unless asked for (settings.py); a homogeneous plan assumes none
    if take_settings is None:
        take_settings = take_plan_settings(megatron_args())
    wanted = planned_settings(plan) if take_settings else {}
    for name in ("ddp", "optimizer"):
        config = getattr(container, name, None)
        if not is_dataclass(config):
            continue
        names = {f.name for f in fields(config)}
        differ = {k: v for k, v in wanted.items() if k in names and getattr(config, k) != v}
        if differ:
            config = replace(config, **differ)
            setattr(container, name, config)
            changes += [f"{name}.{k}={v}" for k, v in differ.items()]
        if name == "ddp":
            updated = apply_to_ddp_config(config, plan) if INSTANCES in names else config
            if updated is not config:         # the plan's count, where the distributed optimizer is on
                setattr(container, name, updated)
                changes.append(f"ddp.{INSTANCES}={getattr(updated, INSTANCES)}")
    return changes


def planned_initialize_model_parallel(*args, **kwargs):
    """Megatron-LM's call to initialize_model_parallel, on the plan (pass-through without the flag): the start-up
    sequence (:func:`het_plugin.runtime.startup.startup`) on the plan of a file, planned at parse_args, or, with the
    bare flag, discovered and planned here with the degrees Megatron validated; then every group on its placement."""
    original = mcore.original_initialize_model_parallel()
    state = launch_state.current()
    if state.args is None:
        return original(*args, **kwargs)
    names = list(inspect.signature(original).parameters)
    return _start(state, {**dict(zip(names, args)), **kwargs}, megatron_groups=True)


def start_explicit_groups() -> Optional[AppliedPlan]:
    """The start-up for a script that builds its own process groups (Megatron-LM's ``skip_model_parallel_init``,
    the MiMo pattern: ``HyperCommGrid`` or ``parallel_state`` helpers before ``pretrain``): the same start-up
    sequence as :func:`planned_initialize_model_parallel` (the ranks agree on the plan, the pre-flight), with the
    degrees Megatron's arguments hold, then everything but Megatron's own groups: the groups the script makes
    follow the plan (:mod:`het_plugin.megatron.late_groups`) and :func:`~het_plugin.megatron.mcore.current_plan`
    holds it. Once per launch: what was applied already is returned; None without ``--heterogeneous-nic``.
    Every rank calls it (the agreement is collective): at the script's first group, at
    ``initialize_megatron(skip_model_parallel_init=True)`` or in ``planned_collection``."""
    applied = current_plan()
    state = launch_state.current()
    if applied is not None or state.args is None:
        return applied
    import torch.distributed as dist
    if not dist.is_initialized():
        raise ConfigError("a process group is being built before torch.distributed.init_process_group: "
                          "het_plugin cannot agree on the plan without the world group", field="init_process_group",
                          fix="call torch.distributed.init_process_group before building process groups")
    return _start(state, kwargs_of_args(megatron_args()), megatron_groups=False)


def kwargs_of_args(margs: Any) -> dict:
    """The ``initialize_model_parallel`` arguments Megatron-LM's ``_initialize_distributed`` derives from its
    args (megatron.training 0.19.2 initialize.py), for a start-up without that call."""
    kwargs = {"tensor_model_parallel_size": getattr(margs, "tensor_model_parallel_size", 1) or 1,
              "pipeline_model_parallel_size": getattr(margs, "pipeline_model_parallel_size", 1) or 1,
              "virtual_pipeline_model_parallel_size": getattr(margs, "virtual_pipeline_model_parallel_size", None),
              "context_parallel_size": getattr(margs, "context_parallel_size", 1) or 1,
              "expert_model_parallel_size": getattr(margs, "expert_model_parallel_size", 1) or 1,
              "expert_tensor_parallel_size": getattr(margs, "expert_tensor_parallel_size", None),
              "order": order_of(margs)}
    for key, arg in (("num_distributed_optimizer_instances", "num_distributed_optimizer_instances"),
                     ("gtp_remat_size", "gtp_weight_remat_size"),
                     ("expert_gtp_remat_size", "expert_gtp_weight_remat_size")):
        if getattr(margs, arg, None) is not None:
            kwargs[key] = getattr(margs, arg)
    return kwargs


# The degrees a script's own groups are built with, as Megatron-LM's args hold them: they must be the plan's.
DEGREE_FLAGS = (("tensor_model_parallel_size", "tp", "--tensor-model-parallel-size"),
                ("pipeline_model_parallel_size", "pp", "--pipeline-model-parallel-size"),
                ("context_parallel_size", "cp", "--context-parallel-size"))


def check_degrees_kept(plan: Any, kwargs: dict) -> None:
    """A script that builds its own groups reads the degrees from Megatron's args; one that changed them after
    het_plugin planned (MiMo sets ``tensor_model_parallel_size`` from its own ``--llm-tp``) would build groups
    the plan does not describe: refused before any group, naming the flag."""
    for key, attr, flag in DEGREE_FLAGS:
        if int(kwargs.get(key) or 1) != getattr(plan, attr):
            raise ConfigError(f"Megatron's arguments hold {key}={kwargs.get(key)} when the script builds its own "
                              f"process groups, but plan {plan.hash} was made for {attr}={getattr(plan, attr)}: "
                              "the script changed it after het_plugin planned, and its groups would not be the "
                              "plan's", source="Megatron arguments", field=flag,
                              fix=f"give {flag} {kwargs.get(key)} on the command line so the plan is made for it "
                                  "(or leave the planned value)")


def _start(state: LaunchState, kwargs: dict, *, megatron_groups: bool) -> AppliedPlan:
    """The start-up sequence on this launch's plan, then the groups: Megatron's own through the plan
    (``megatron_groups``), or only the run-long placement of the groups a script builds itself."""
    import torch.distributed as dist
    late_groups.uninstall_start()     # from here on a group is made under the plan (or the start-up failed)
    rank, world = dist.get_rank(), dist.get_world_size()
    margs = megatron_args()
    request, planning = _initialize_planning(state, margs, kwargs, rank, world,
                                             explicit=not megatron_groups)
    started = startup(request, planning)
    plan = started.plan
    with bounded(request):
        if state.plan is None:        # discovered: the model is built after this, so args still take the split
            state = launch_state.write(replace(state, plan=plan, cluster=started.cluster,
                                               changes=tuple(apply_plan_to_args(margs, plan))))
        if rank == 0 and state.changes:
            print("het_plugin: Megatron arguments set from the plan: " + ", ".join(state.changes), flush=True)
        note = offer(margs, plan) if rank == 0 else None
        if note:
            print(note, flush=True)
        return mcore.build_groups(plan, kwargs, plan_out=state.plan_out if rank == 0 else None,
                                  timeout_s=request.timeout.seconds, cluster=started.cluster,
                                  profile=launch_profile_settings(margs), applied=started.applied,
                                  megatron_groups=megatron_groups)


def _initialize_planning(state: LaunchState, margs: Any, kwargs: dict, rank: int,
                         world: int, explicit: bool = False) -> tuple[LaunchRequest, Planning]:
    """The request and planning of Megatron-LM's initialisation: the file's plan (or error) from parse_args, or,
    with the bare flag, discovery with Megatron's validated degrees (``kwargs``: its initialize_model_parallel
    arguments). Both check the plan against those arguments before the ranks agree (``explicit``: the script
    builds its groups itself, with the degrees as they are, :func:`check_degrees_kept`)."""

    def check(resolved: Resolved) -> None:
        check_replica_batch(margs, resolved.plan)
        mcore.check_kwargs_fit(resolved.plan, kwargs)
        if explicit:
            check_degrees_kept(resolved.plan, kwargs)

    request = LaunchRequest.of(world, rank=rank, timeout=Timeout(getattr(margs, "heterogeneous_timeout", None),
                                                                  TIMEOUT_FLAG, "command line"))
    if state.error is not None or state.plan is not None:
        return request, Planning(check=check, earlier=state.error or Resolved(state.plan, state.cluster))
    fixed = {"tp": kwargs.get("tensor_model_parallel_size", 1), "pp": kwargs.get("pipeline_model_parallel_size", 1),
             "cp": kwargs.get("context_parallel_size", 1), "micro_batch_size": margs.micro_batch_size,
             **mcore.plan_degrees(kwargs),
             # validated by Megatron already: its interleaved schedule overlaps p2p unless told not to
             "overlap_p2p_comm": None if getattr(margs, "overlap_p2p_comm", True) else False}
    try:
        request = megatron_request(world, rank, fixed, margs)
        return request, replace(megatron_planning(margs, request, DISCOVER), check=check)
    except HetPluginError as exc:        # published at the agreement: every rank stops with it
        return request, Planning(earlier=exc)

