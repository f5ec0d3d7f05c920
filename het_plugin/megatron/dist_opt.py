"""Megatron's partial distributed optimizer under a plan: ``--num-distributed-optimizer-instances``.

The plan may shard the optimizer inside instances (``Plan.distributed_optimizer_instances``: one per fabric where
data parallelism spans fabrics, het_plugin.core.cost.dist_opt). Megatron-Core builds the instances itself from its
own argument: every data-parallel (dp x cp) group, in its rank order, cut into that many consecutive blocks
(megatron-core 0.19.2 parallel_state.py, the INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP groups), so applying it is
setting that argument. A user's own value stands where every block stays inside one cluster, and is refused before
any group where one would not (its reduce-scatter and all-gather would cross the slow link).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from ..core.errors import ConfigError
from ..core.plan import Plan

ARG = "num_distributed_optimizer_instances"
FLAG = "--num-distributed-optimizer-instances"


def spanning_instance(plan: Plan, instances: int) -> Optional[str]:
    """The first optimizer instance that would hold ranks of two clusters under ``instances``, in words; None
    where each stays in one cluster. Raises a ConfigError where ``instances`` does not divide dp*cp."""
    size = plan.dp * plan.cp
    if instances < 1 or size % instances:
        raise ConfigError(f"{FLAG} {instances} does not divide the data-parallel size dp*cp = {size} (Megatron "
                          "cuts each data-parallel group into that many equal instances)", field=FLAG,
                          fix=f"use a divisor of {size}" + (f", e.g. {plan.distributed_optimizer_instances} (the "
                                                             "plan's)" if plan.distributed_optimizer_instances > 1
                                                             else ""))
    groups = plan.groups.get("dp-cp") or plan.groups.get("dp") or []
    for g in groups:
        block = len(g.ranks) // instances
        for i in range(instances):
            members = g.ranks[i * block:(i + 1) * block]
            clusters = sorted({plan.node_of(r).cluster for r in members})
            if len(clusters) > 1:
                return (f"instance {i} of the data-parallel group of ranks {g.ranks[:4]}{' ...' if len(g.ranks) > 4 else ''} "
                        f"would hold ranks of clusters {' and '.join(clusters)}")
    return None


def choose(plan: Plan, given: Optional[int], distributed_optimizer: Optional[bool],
           name: str = FLAG) -> tuple[int, Optional[str]]:
    """The instance count to run with and a line for rank 0 (None: nothing to say). ``given``: the user's own count
    (None: not given, Megatron's default 1); ``distributed_optimizer``: whether the run shards its optimizer (None:
    not known here, the drop-in's groups: the DDP config decides). Megatron uses instances only with the distributed
    optimizer (megatron-core 0.16.1/0.19.2 distributed_data_parallel.py asserts it), so the plan's count is applied
    only where that is on; a user's count is honoured where no instance spans clusters, refused otherwise.
    ``name``: the setting as the user gave it (the flag, or the drop-in's keyword)."""
    wanted = plan.distributed_optimizer_instances
    if given is not None:
        why = spanning_instance(plan, given) if given != 1 else None   # 1: no partial instance, Megatron's own
        if why is not None:
            raise ConfigError(f"{name} {given}: {why}; its reduce-scatter and all-gather would cross the link "
                              "between clusters every iteration", field=name,
                              fix=(f"use {name} {wanted} (the plan's: an instance per fabric)" if wanted > 1 else
                                   f"leave {name} out (1), or re-plan: `het-plugin plan` chooses instances where "
                                   "data parallelism spans fabrics"))
        if given != wanted:
            return given, (f"het_plugin: {name} {given} as given is kept (each instance stays in one "
                           f"cluster); plan {plan.hash} predicted with {wanted}")
        return given, None
    if wanted == 1:
        return 1, None
    if distributed_optimizer is False:
        return 1, (f"het_plugin: plan {plan.hash} assumed the distributed optimizer in {wanted} instances; this run "
                   f"has no --use-distributed-optimizer, so {FLAG} is left at 1")
    return wanted, None


def apply_instances(args: Any, plan: Plan) -> Optional[str]:
    """Set Megatron's ``args.num_distributed_optimizer_instances`` for ``plan``; returns a line for rank 0 (None:
    nothing to say). The plan's count is applied where the command line left the default (1) and uses the
    distributed optimizer; a user's own count is honoured where no instance spans clusters, refused otherwise.
    Calling it again on the same args says the same and changes nothing."""
    given = int(getattr(args, ARG, 1) or 1)
    value, note = choose(plan, None if given == 1 else given, bool(getattr(args, "use_distributed_optimizer", False)))
    if value != given:
        setattr(args, ARG, value)
    return note


def instances_note(args: Any, plan: Plan) -> Optional[str]:
    """What :func:`apply_instances` says for ``args`` (already applied: nothing changes), for rank 0's one line."""
    given = int(getattr(args, ARG, 1) or 1)
    return choose(plan, None if given == 1 else given, bool(getattr(args, "use_distributed_optimizer", False)))[1]


def apply_to_ddp_config(config: Any, plan: Plan) -> Any:
    """A Megatron-Core DistributedDataParallelConfig (a dataclass) with the instance count :func:`choose` gives for
    it (its own ``use_distributed_optimizer`` decides); the same object where nothing changes."""
    given = int(getattr(config, ARG, 1) or 1)
    value, _ = choose(plan, None if given == 1 else given, bool(getattr(config, "use_distributed_optimizer", False)))
    return config if value == given else replace(config, **{ARG: value})


def groups_kwargs(plan: Plan, megatron_kwargs: dict) -> tuple[dict, Optional[str]]:
    """The drop-in's ``initialize_model_parallel`` arguments: the caller's own ``num_distributed_optimizer_instances``
    honoured or refused; where the caller gave none, Megatron's default (1) stands and rank 0 gets a line naming
    what the plan assumed. Not added on the caller's behalf: the groups would be sharded per instance while the
    script's DDP and optimizer (which the drop-in never sees) reduce over one, and the replicas would drift apart."""
    if ARG in megatron_kwargs and megatron_kwargs[ARG] is not None:
        _, note = choose(plan, int(megatron_kwargs[ARG]), None, name=ARG)
        return dict(megatron_kwargs), note
    value, _ = choose(plan, None, None)
    if value == 1:
        return dict(megatron_kwargs), None
    return dict(megatron_kwargs), (
        f"het_plugin: plan {plan.hash} assumed {ARG}={value} (an optimizer instance per fabric); to run it, pass "
        f"{ARG}={value} here and build DDP with ddp_config_for_plan(plan, {ARG}={value}) (the distributed optimizer "
        "on); without, Megatron's one instance runs and the prediction does not hold")


def check_groups_kwarg(plan: Plan, megatron_kwargs: dict) -> None:
    """Refuse, before any group, an ``initialize_model_parallel`` instance count whose instances span clusters."""
    given = megatron_kwargs.get(ARG)
    if given is not None and int(given) != 1:
        choose(plan, int(given), None, name=ARG)
