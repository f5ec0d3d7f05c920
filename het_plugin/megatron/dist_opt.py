"""Megatron's partial distributed optimizer under a plan: ``--num-distributed-optimizer-instances``.

The plan may shard the optimizer inside instances (``Plan.distributed_optimizer_instances``: one per fabric where
data parallelism spans fabrics, het_plugin.core.cost.dist_opt). Megatron-Core builds the instances itself from its
own argument: every data-parallel (dp x cp) group, in its rank order, cut into that many consecutive blocks
(megatron-core 0.19.2 parallel_state.py, the INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP groups), so applying it is
setting that argument. A user's own value stands where every block stays inside one cluster, and is refused before
any group where one would not (its reduce-scatter and all-gather would cross the slow link).
"""
from __future__ import annotations

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


def apply_instances(args: Any, plan: Plan) -> Optional[str]:
    """Set Megatron's ``args.num_distributed_optimizer_instances`` for ``plan``; returns a line for rank 0 (None:
    nothing to say). The plan's count is applied where the command line left the default (1) and uses the
    distributed optimizer; a user's own count is honoured where no instance spans clusters, refused otherwise."""
    wanted = plan.distributed_optimizer_instances
    given = int(getattr(args, ARG, 1) or 1)
    if given != 1:
        why = spanning_instance(plan, given)
        if why is not None:
            raise ConfigError(f"{FLAG} {given}: {why}; its reduce-scatter and all-gather would cross the link "
                              "between clusters every iteration", field=FLAG,
                              fix=(f"use {FLAG} {wanted} (the plan's: an instance per fabric)" if wanted > 1 else
                                   f"leave {FLAG} out (1), or re-plan: `het-plugin plan` chooses instances where "
                                   "data parallelism spans fabrics"))
        if given != wanted:
            return (f"het_plugin: {FLAG} {given} from the command line is kept (each instance stays in one "
                    f"cluster); plan {plan.hash} predicted with {wanted}")
        return None
    if wanted == 1:
        return None
    if not getattr(args, "use_distributed_optimizer", False):
        return (f"het_plugin: plan {plan.hash} assumed the distributed optimizer in {wanted} instances; this run "
                f"has no --use-distributed-optimizer, so {FLAG} is left at 1")
    setattr(args, ARG, wanted)
    return None
