"""Re-plan on restart (issue 21, item 3): one switch, and a run re-plans at its next start from the measured
profile its last attempt wrote.

A run with a measured-profile path and ``replan_on_restart`` writes, beside the profile, the plan it ran
(``RUN.ran-plan.json``, :func:`ran_plan_path`). At its next start (a new launch, or a torchrun elastic restart:
``TORCHELASTIC_RESTART_COUNT`` > 0) every rank, before the plan agreement, calls :func:`decide`:

* no profile yet (the first attempt), or one of another model: the plan as usual;
* else a new plan is made with the profile for the cluster of *this* start (the nodes that came back: a
  discovered or given cluster; a plan file cannot be re-planned) and compared with the last attempt's plan,
  re-predicted with the same profile where it still fits these nodes; the new one is taken when it predicts at
  least ``min_gain`` less time per iteration, or when the last plan no longer fits;
* a plan the checkpoint would not load under (:func:`het_plugin.core.checkpoint_fit.resume_problem` on the
  :class:`~het_plugin.core.checkpoint_fit.CheckpointShape` the adapter read) is not taken: the run continues on the old
  plan and says why; when no runnable plan would load, a ConfigError (before any group) names the fix.

Pure apart from reading the two files; every rank reads the same files (put the profile where the checkpoint is:
on storage every rank sees) and computes the same answer, and the plan agreement checks that it did.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..core.checkpoint_fit import CheckpointShape, resume_problem
from ..core.errors import ConfigError
from ..core.plan import Plan
from ..core.cost.plan_costs import split_costs
from ..core.inputs.profile import load_profile
from ..core.launch import LeftOutRefused, Resolved

#: a re-plan is taken when it predicts at least this fraction less time per iteration than the plan it replaces
DEFAULT_MIN_GAIN = 0.02


def ran_plan_path(profile_path: str) -> str:
    """The plan a run ran, written beside its measured profile (the old plan of the next start)."""
    return f"{Path(profile_path).with_suffix('')}.ran-plan.json"


def restart_count(environ=None) -> int:
    """torchrun's elastic restart count (0: the first attempt, or not under torchrun)."""
    environ = os.environ if environ is None else environ
    try:
        return int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


@dataclass
class RestartDecision:
    """The plan this start runs and what the log says about it."""
    plan: Plan
    replanned: bool = False
    old: Optional[Plan] = None
    new: Optional[Plan] = None
    lines: list[str] = field(default_factory=list)


def _predicted(plan: Plan, cluster, profile) -> Optional[float]:
    """The plan's iteration time predicted with ``profile`` on ``cluster`` (None: it does not fit these nodes)."""
    if not _fits(plan, cluster):
        return None
    try:
        return split_costs(plan, cluster, profile).predict(plan.layers_per_stage).iteration_s
    except (ValueError, ConfigError):
        return None


def _fits(plan: Plan, cluster) -> bool:
    """The plan was made for these nodes: the same cluster, or, for a plan that left nodes out (issue 32, made
    for the sub-cluster of its kept nodes), a start on exactly its kept nodes in its launch order."""
    if plan.world_size != cluster.world_size:
        return False
    if plan.cluster_digest == cluster.digest:
        return True
    return bool(plan.left_out) and [n.name for n in cluster.nodes] == [n.name for n in plan.nodes]


def _describe(plan: Plan) -> str:
    return (f"{plan.hash}: tp={plan.tp} pp={plan.pp} dp={plan.dp} micro-batch {plan.micro_batch_size}, layers "
            f"{list(plan.layers_per_stage)}, {plan.world_size} ranks on {plan.cluster_name}")


def load_last_run(profile_path: str):
    """(the measured profile, the plan that run ran) the last attempt wrote; None for what is not there."""
    profile = load_profile(profile_path) if Path(profile_path).is_file() else None
    plan_path = Path(ran_plan_path(profile_path))
    last = Plan.load(plan_path) if plan_path.is_file() else None
    return profile, last


def decide(current: Plan, cluster, profile, last: Optional[Plan], replan, *,
           checkpoint: Optional[CheckpointShape] = None, min_gain: float = DEFAULT_MIN_GAIN,
           restart: int = 0, distributed_optimizer: Optional[bool] = None) -> RestartDecision:
    """The plan this start runs. ``current``: the plan as this launch resolves it without the profile;
    ``cluster``: the Cluster of this start (None: a plan file, no re-plan); ``profile`` and ``last``: what the
    last attempt wrote (:func:`load_last_run`); ``replan(profile) -> Plan``: the launch's own planning (its
    model and fixed degrees) with a profile; ``checkpoint``: what the checkpoint to resume records."""
    head = f"re-plan on restart{f' (elastic restart {restart})' if restart else ''}"
    if profile is None or profile.measured is None:
        return RestartDecision(current, lines=[f"{head}: no measured profile from a previous attempt; plan as usual"])
    if cluster is None:
        return RestartDecision(current, lines=[f"{head}: the launch names a plan file (no cluster to re-plan for); "
                                               "running it as given"])
    if last is not None and last.model != current.model:
        return RestartDecision(current, lines=[f"{head}: the profile's run trained another model; plan as usual"])
    old = last if last is not None and _predicted(last, cluster, profile) is not None else None
    lines = [f"{head}: old plan {_describe(last)}" if last is not None else
             f"{head}: measured run of plan {profile.measured.plan_hash} (its plan file is gone)"]
    if last is not None and old is None:
        lines.append(f"  the old plan does not fit the nodes of this start ({cluster.world_size} ranks on "
                     f"{cluster.name}): planning for the nodes that came back")
    new = replan(profile)
    new_s = new.prediction.iteration_s if new.prediction else None
    old_s = _predicted(old, cluster, profile) if old is not None else None
    lines.append(f"  new plan {_describe(new)}" + (f", predicted {new_s:.4g} s/iteration" if new_s else ""))
    fallback = old if old is not None else current
    if old is not None and new.hash == old.hash:
        lines.append("  the measured times keep the plan: no change")
        return RestartDecision(old, old=old, new=new, lines=lines)
    problem = resume_problem(checkpoint, new, distributed_optimizer=distributed_optimizer)
    if problem is not None:
        fallback_problem = resume_problem(checkpoint, fallback, distributed_optimizer=distributed_optimizer)
        if fallback_problem is not None:
            raise ConfigError(f"re-plan on restart: {problem.problem}; the plan of the previous attempt does not "
                              f"fit or load either ({fallback_problem.problem})", field=problem.field,
                              fix=problem.fix)
        lines.append(f"  not taken: {problem.problem}. Fix: {problem.fix}. Continuing on plan {fallback.hash}")
        return RestartDecision(fallback, old=old, new=new, lines=lines)
    if old is None:
        lines.append("  taken (the old plan cannot run here)")
        return RestartDecision(new, replanned=True, old=old, new=new, lines=lines)
    gain = (old_s - new_s) / old_s if old_s and new_s is not None else 0.0
    lines.append(f"  old plan with the same profile: predicted {old_s:.4g} s/iteration; predicted gain "
                 f"{gain:+.1%}")
    if gain < min_gain:
        lines.append(f"  not taken: the gain is under {min_gain:.0%}")
        return RestartDecision(old, old=old, new=new, lines=lines)
    lines.append("  taken")
    return RestartDecision(new, replanned=True, old=old, new=new, lines=lines)


def resolve_on_restart(resolve, profile_path: str, *, checkpoint=None, min_gain: float = DEFAULT_MIN_GAIN,
                       distributed_optimizer: Optional[bool] = None, environ=None):
    """For an adapter: ``resolve(profile) -> Resolved`` is its plan resolution (profile None: as usual);
    ``checkpoint``: a CheckpointShape, or a callable returning one (None: nothing to resume). Returns (the
    Resolved this start runs, the RestartDecision). A launch whose analytic plan would leave nodes out
    (:class:`~het_plugin.core.launch.LeftOutRefused`) is planned with the measured profile when there is one:
    that plan, for the nodes that came back, is the one the start runs or refuses with."""
    profile, last = load_last_run(profile_path)
    made: dict[int, Resolved] = {}

    def planned(prof) -> Resolved:          # each profile planned once (the refusal below may plan it first)
        if id(prof) not in made:
            made[id(prof)] = resolve(prof)
        return made[id(prof)]

    try:
        resolved = planned(None)
    except LeftOutRefused:
        # the analytic plan leaves nodes of this start out; the measured times decide which nodes pay (issue 32):
        # plan for the nodes that came back with them, refused the same way if that plan leaves nodes out too
        if profile is None or profile.measured is None:
            raise
        resolved = planned(profile)
    shape = checkpoint() if callable(checkpoint) else checkpoint
    decision = decide(resolved.plan, resolved.cluster, profile, last, lambda prof: planned(prof).plan,
                      checkpoint=shape, min_gain=min_gain, restart=restart_count(environ),
                      distributed_optimizer=distributed_optimizer)
    return Resolved(decision.plan, resolved.cluster), decision
