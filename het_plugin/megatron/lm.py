"""Megatron-LM integration shared by the import hook and the patches.

Two calls, at the two moments Megatron-LM gives us:

* :func:`prepare_args` right after ``parse_args`` (before ``validate_args``): with a cluster or plan
  file the plan is computed here (pure: no process group yet) and written into ``args`` (degrees,
  ``pipeline_model_parallel_layout``, ``overlap_grad_reduce``), so Megatron validates and builds the
  model for it. A planning error is kept, not raised: it is published at the agreement so *every*
  rank stops with it (raising here would leave the other ranks waiting in init_process_group).
* :func:`planned_initialize_model_parallel` in place of ``parallel_state.initialize_model_parallel``
  (called by ``_initialize_distributed`` after ``init_process_group``): ranks agree on the plan (the
  bare flag discovers the cluster and plans here, with the degrees Megatron already validated), then
  every group is built on the plan's placement.

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
from dataclasses import dataclass, field
from typing import Any, Optional

from ..core.errors import ConfigError, HetPluginError
from ..runtime.patches import PATCHES
from .args import DISCOVER, apply_plan_to_args, check_compatible, degrees_given

PATCH_LABEL = "megatron.lm"    # Megatron-LM's init_process_group, initialize_model_parallel, setup_model_and_optimizer,
#                                load_checkpoint


@dataclass
class LaunchState:
    args: Any = None
    source: Optional[str] = None
    argv: tuple = ()
    plan_out: Optional[str] = None
    plan: Any = None
    cluster: Any = None          # the Cluster the plan came from (its nodes' NICs, for the pre-flight)
    error: Optional[BaseException] = None
    changes: list[str] = field(default_factory=list)


# Megatron-LM calls parse_args and, later, initialize_model_parallel with nothing passed between them
# that het_plugin could use: the plan computed at the first moment waits here for the second.
state = LaunchState()


def prepare_args(args: Any, argv: Optional[list[str]] = None) -> Any:
    """Plan from a file and apply it to ``args``; a no-op without ``--heterogeneous-nic``.

    Megatron-LM parses the same command line more than once in one process (megatron.training 0.19:
    ``inprocess_restart.maybe_wrap_for_inprocess_restart`` and ``ft_integration.setup`` each call
    ``parse_args(ignore_unknown_args=True)`` for a look at their own flags): every namespace gets the plan,
    planned once per command line.
    """
    global state
    source = getattr(args, "heterogeneous_nic", None)
    if source is None or getattr(args, "_het_plugin_prepared", False):
        return args
    argv = sys.argv[1:] if argv is None else argv
    from .version import check_megatron_version
    check_megatron_version()      # the same install on every rank: raising here stops all alike
    check_compatible(args)
    if state.args is None or (state.source, state.argv) != (source, tuple(argv)):
        state = LaunchState(args=args, source=source, argv=tuple(argv),
                            plan_out=getattr(args, "heterogeneous_plan_out", None))
        if source != DISCOVER:
            try:
                resolved = _resolve(args, degrees_given(args, argv), source)
                state.plan, state.cluster = resolved.plan, resolved.cluster
                # kept for the agreement like a planning error; the plan still goes into args, so that
                # validate_args passes (its own assertion would pre-empt the message) and every rank reaches it
                check_replica_batch(args, state.plan)
            except HetPluginError as exc:
                state.error = exc
    if state.plan is not None:
        state.changes = apply_plan_to_args(args, state.plan) or state.changes
    args._het_plugin_prepared = True
    install_initialize_wrapper()
    install_world_group_network()
    return args


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
        if (world_needs_own_network(state.plan) and "nccl" in str(backend or "").lower()
                and kw.get("pg_options") is None and len(a) < 8):     # 8th positional: pg_options
            from ..runtime.netselect import world_group_options
            options = world_group_options()
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
    from ..runtime.replicas import ReplicaShare
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
    return args if getattr(args, "_het_plugin_prepared", False) else state.args


def _resolve(args: Any, given: dict, source: Optional[str], rank: Optional[int] = None,
             world_size: Optional[int] = None):
    """:func:`_plan_for`; with ``--heterogeneous-replan-on-restart`` the plan re-planning on restart chooses from
    the profile the last attempt wrote and the checkpoint in ``--load`` (het_plugin.runtime.restart_replan), its
    reasoning printed on rank 0."""
    from .args import PROFILE_OUT_FLAG, REPLAN_FLAG
    if not getattr(args, "heterogeneous_replan_on_restart", False):
        return _plan_for(args, given, source, rank, world_size)
    settings = launch_profile_settings(args)
    if settings is None:
        raise ConfigError(f"{REPLAN_FLAG} needs {PROFILE_OUT_FLAG}: the next start re-plans from the measured profile "
                          "this run writes there", source="command line", field=REPLAN_FLAG,
                          fix=f"add {PROFILE_OUT_FLAG} FILE (on storage every rank sees, e.g. beside the checkpoints)")
    from ..runtime.restart_replan import resolve_on_restart
    from .checkpoints import checkpoint_shape
    chosen, decision = resolve_on_restart(
        lambda profile: _plan_for(args, given, source, rank, world_size, profile=profile), settings.path,
        checkpoint=lambda: checkpoint_shape(args),
        distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)))
    if (rank if rank is not None else int(os.environ.get("RANK", "0") or 0)) == 0:
        print("\n".join(f"het_plugin: {line}" for line in decision.lines), flush=True)
    return chosen


def _plan_for(args: Any, given: dict, source: Optional[str], rank: Optional[int] = None,
              world_size: Optional[int] = None, profile: Any = None):
    """The plan (and its cluster) for these Megatron arguments (het_plugin.core.launch.Resolved); ``profile``: a
    measured profile to plan with."""
    from .mcore import resolve_megatron_launch
    from .modelspec import model_from_args
    world = world_size or int(getattr(args, "world_size", None) or os.environ.get("WORLD_SIZE", "1"))
    rank = rank if rank is not None else int(getattr(args, "rank", None) or os.environ.get("RANK", "0"))
    dp_guess = max(1, world // ((given["tp"] or 1) * (given["pp"] or 1) * (given["cp"] or 1)))
    model = model_from_args(args, data_parallel_size=dp_guess)
    lws = os.environ.get("LOCAL_WORLD_SIZE")
    return resolve_megatron_launch(None if source == DISCOVER else source, model=model, world_size=world, rank=rank,
                        local_world_size=int(lws) if lws else None, tp=given["tp"], pp=given["pp"],
                        cp=given["cp"], micro_batch_size=given["micro_batch_size"], ep=given.get("ep", 1),
                        etp=given.get("etp"), order=given.get("order") or "tp-cp-ep-dp-pp", vpp=given.get("vpp"),
                        overlap_p2p_comm=given.get("overlap_p2p_comm"), profile=profile)


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
    from .group_check import install as install_group_check
    install_group_check(training)          # after the model and optimizer: every group against the plan


def _planned_initialize(current):
    def planned(*a, **kw):
        return planned_initialize_model_parallel(*a, **kw)

    return functools.update_wrapper(planned, current)


def _planned_setup(setup):
    def setup_model_and_optimizer(*a, **kw):
        container = kw.get("cfg_container")
        if container is not None and state.plan is not None:
            changes = apply_plan_to_container(container, state.plan)
            if changes and int(getattr(megatron_args(), "rank", 0) or 0) == 0:
                print("het_plugin: pretrain's config container set from the plan: " + ", ".join(changes),
                      flush=True)
        return setup(*a, **kw)

    return functools.update_wrapper(setup_model_and_optimizer, setup)


def _checked_load(load):
    """megatron.training's ``load_checkpoint`` (as training.py calls it) checks what the checkpoint holds against
    this run first, on every rank (checkpoints.py): a combination that cannot load stops every rank alike."""
    def load_checkpoint(*a, **kw):
        from .checkpoints import check_before_load
        margs = megatron_args()
        if state.plan is not None and margs is not None:
            notes = check_before_load(margs, kw.get("load_arg", "load"))
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
    from dataclasses import fields, is_dataclass, replace

    from .pipeline_layout import apply_plan_to_config, layout_for_plan
    changes = []
    model = getattr(container, "model", None)
    transformer = getattr(model, "transformer", None)
    layout = layout_for_plan(plan)
    if transformer is not None and layout is not None and transformer.pipeline_model_parallel_layout is None:
        model.transformer = apply_plan_to_config(transformer, plan)
        changes.append(f"model.transformer.pipeline_model_parallel_layout={layout}")
    from .settings import planned_settings, take_plan_settings
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
            setattr(container, name, replace(config, **differ))
            changes += [f"{name}.{k}={v}" for k, v in differ.items()]
    return changes


def planned_initialize_model_parallel(*args, **kwargs):
    """Megatron-LM's call to initialize_model_parallel, on the plan (pass-through without the flag)."""
    import torch.distributed as dist
    from ..runtime.agreement import agree_on_plan
    from .mcore import build_groups, original_initialize_model_parallel

    original = original_initialize_model_parallel()
    if state.args is None:
        return original(*args, **kwargs)
    names = list(inspect.signature(original).parameters)
    kwargs = {**dict(zip(names, args)), **kwargs}
    rank, world = dist.get_rank(), dist.get_world_size()

    margs = megatron_args()

    def make():
        if state.error is not None:
            raise state.error
        if state.plan is not None:
            return state.plan
        from .mcore import plan_degrees
        fixed = {"tp": kwargs.get("tensor_model_parallel_size", 1), "pp": kwargs.get("pipeline_model_parallel_size", 1),
                 "cp": kwargs.get("context_parallel_size", 1), "micro_batch_size": margs.micro_batch_size,
                 **plan_degrees(kwargs),
                 # validated by Megatron already: its interleaved schedule overlaps p2p unless told not to
                 "overlap_p2p_comm": None if getattr(margs, "overlap_p2p_comm", True) else False}
        resolved = _resolve(margs, fixed, DISCOVER, rank=rank, world_size=world)
        state.cluster = resolved.cluster
        check_replica_batch(margs, resolved.plan)
        return resolved.plan

    from ..runtime.exchange import configured_timeout
    from .args import TIMEOUT_FLAG
    timeout_s = getattr(margs, "heterogeneous_timeout", None)
    with configured_timeout(timeout_s, TIMEOUT_FLAG, "command line"):
        plan = agree_on_plan(make, rank=rank, world_size=world, timeout_s=timeout_s)
        if state.plan is None:        # discovered: the model is built after this, so args still take the split
            state.plan = plan
            state.changes = apply_plan_to_args(margs, plan)
        if rank == 0 and state.changes:
            print("het_plugin: Megatron arguments set from the plan: " + ", ".join(state.changes), flush=True)
        from .settings import offer
        note = offer(margs, plan) if rank == 0 else None
        if note:
            print(note, flush=True)
        return build_groups(plan, kwargs, plan_out=state.plan_out if rank == 0 else None, timeout_s=timeout_s,
                            cluster=state.cluster, profile=launch_profile_settings(margs))


def launch_profile_settings(args: Any):
    """``--heterogeneous-profile-out`` / ``--heterogeneous-profile-interval`` as ProfileSettings (None without)."""
    from .args import PROFILE_INTERVAL_FLAG, PROFILE_OUT_FLAG
    from .mcore import profile_settings
    path = getattr(args, "heterogeneous_profile_out", None)
    every = getattr(args, "heterogeneous_profile_interval", None)
    try:
        settings = profile_settings(path, every, state.source, field=PROFILE_OUT_FLAG, every_field=PROFILE_INTERVAL_FLAG)
    except ConfigError as exc:
        raise ConfigError(exc.problem, source="command line", field=exc.field, fix=exc.fix) from None
    if settings is not None and getattr(args, "heterogeneous_replan_on_restart", False):
        settings.replan_on_restart = True       # write the plan run beside the profile: the next start's old plan
    return settings
