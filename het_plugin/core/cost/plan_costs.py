"""The predictor's model of a plan that was already made: its placement as the cost model reads it and its
:class:`~het_plugin.core.cost.predict.SplitCosts` on the cluster it was made for. Everyone who re-predicts a plan
file (the timeline, the re-plan on restart, the report's measured section, the fit of a run's fixed costs) goes
through here, so a re-prediction is the planner's own.
"""
from __future__ import annotations

from typing import Optional

from ..errors import ConfigError
from ..inputs.model import ModelSpec
from ..inputs.profile import Profile
from ..plan import Plan
from ..ranks.placement import Placement, cluster_transport, multinet_transport
from .analysis import Analysis, analyze, analyze_experts
from .network import Network
from .predict import SplitCosts
from .dist_opt import with_instances


def placement_of(plan: Plan) -> Placement:
    """The plan's placement as the cost model reads it (default-order numbering)."""
    return Placement.from_rank_of_logical(plan.dims, plan.rank_of_logical)


def plan_analysis(plan: Plan, cluster) -> Analysis:
    """The plan's placement analyzed on ``cluster`` (the expensive part; reusable for any profile)."""
    if cluster.digest != plan.cluster_digest:
        raise ConfigError(f"the plan was made for cluster {plan.cluster_name} (digest {plan.cluster_digest}), the "
                          f"cluster file is {cluster.name} (digest {cluster.digest})", field="cluster",
                          fix="pass the cluster file the plan was made from")
    fn = multinet_transport if plan.multinet else cluster_transport     # the transports the planner used
    analysis = analyze_experts(cluster, analyze(cluster, placement_of(plan), fn), plan.dims)
    if plan.distributed_optimizer_instances > 1:
        analysis = with_instances(cluster, analysis, plan.distributed_optimizer_instances, Network(cluster, fn))
    return analysis


def split_costs(plan: Plan, cluster, profile: Optional[Profile] = None,
                analysis: Optional[Analysis] = None) -> SplitCosts:
    """The predictor's stage models for the plan's placement on ``cluster`` (as the planner predicted it);
    ``analysis``: :func:`plan_analysis`'s, when the caller predicts the plan more than once."""
    analysis = plan_analysis(plan, cluster) if analysis is None else analysis
    sc = SplitCosts(ModelSpec.model_validate(plan.model), analysis, plan.micro_batch_size,
                    overlap_grad_reduce=plan.overlap_grad_reduce, distributed_optimizer=plan.distributed_optimizer,
                    profile=profile, vpp=plan.vpp, overlap_p2p_comm=plan.overlap_p2p_comm)
    if plan.replica_micro_batches:
        sc.set_counts(plan.replica_micro_batches)
    return sc
