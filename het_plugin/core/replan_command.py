"""The command that re-plans a run from its measured profile, complete as the run had it (issue 21, item 5).

The imbalance warning used to print ``het-plugin plan CLUSTER --profile FILE``: run as printed it planned the
default model with free degrees. Here the command names the cluster, the model, every degree the run fixed and
its micro-batch size, so that the re-plan answers the run's own question. A run whose model is no file (Megatron-LM
builds it from its arguments, a wrapped DeepSpeed config holds its fields) gets the plan's model written beside
the profile (:func:`inputs_beside`); a run on a discovered cluster gets the discovered cluster written there too.
Pure: builds strings and paths; the recorder (:mod:`het_plugin.runtime.recorder`) writes the files.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .plan import Plan, looks_like_plan

CLUSTER_PLACEHOLDER = "CLUSTER"


@dataclass(frozen=True)
class ReplanInputs:
    """Where the re-plan's cluster and model come from (files or a preset name; None: not known)."""
    cluster: Optional[str] = None
    model: Optional[str] = None


def inputs_beside(profile_path: str) -> ReplanInputs:
    """The files rank 0 writes beside the profile when the run has no file to name: ``RUN.model.yaml`` (the
    plan's model) and ``RUN.cluster.yaml`` (a discovered cluster)."""
    p = Path(profile_path)
    stem = p.with_suffix("")
    return ReplanInputs(cluster=f"{stem}.cluster.yaml", model=f"{stem}.model.yaml")


def degree_options(plan: Plan) -> list[str]:
    """The plan's degrees and micro-batch size as ``het-plugin plan`` options (the defaults left out: cp, ep,
    vpp 1; etp = tp)."""
    opts = ["--tp", str(plan.tp), "--pp", str(plan.pp), "--dp", str(plan.dp)]
    if plan.cp != 1:
        opts += ["--cp", str(plan.cp)]
    if plan.ep != 1:
        opts += ["--ep", str(plan.ep)]
        if (plan.etp or plan.tp) != plan.tp:
            opts += ["--etp", str(plan.etp)]
    if plan.vpp != 1:
        opts += ["--vpp", str(plan.vpp)]
        if not plan.overlap_p2p_comm:
            opts.append("--no-overlap-p2p-comm")
    if plan.order != "tp-cp-ep-dp-pp":
        opts += ["--order", plan.order]
    opts += ["--micro-batch-size", str(plan.micro_batch_size)]
    return opts


def replan_command(plan: Plan, profile_path: str, inputs: ReplanInputs, output: Optional[str] = None) -> str:
    """``het-plugin plan CLUSTER --model MODEL <the run's degrees> --profile PROFILE [-o OUTPUT]``, quoted for a
    shell. The degrees are the run's: a re-plan at other degrees changes the checkpoint's parallel layout
    (docs/planner.md, "Re-planning a running job"); drop them to let the planner choose."""
    words = ["het-plugin", "plan", inputs.cluster or CLUSTER_PLACEHOLDER]
    if inputs.model:
        words += ["--model", inputs.model]
    words += degree_options(plan) + ["--profile", str(profile_path)]
    if output:
        words += ["-o", output]
    return " ".join(w if w == CLUSTER_PLACEHOLDER else shlex.quote(w) for w in words)


def new_plan_path(profile_path: str) -> str:
    """Where the printed command writes the new plan: ``RUN.plan.json`` beside the profile."""
    return f"{Path(profile_path).with_suffix('')}.plan.json"


def cluster_file(source) -> Optional[str]:
    """A launch's cluster source as a file the command can name: a cluster file's path; None for discovery, a
    plan file (it holds no cluster) or an object in memory."""
    if not isinstance(source, (str, Path)) or str(source) in ("discover", "auto"):
        return None
    path = Path(source)
    if not path.is_file() or looks_like_plan(path):
        return None
    return str(source)


def model_name(model) -> Optional[str]:
    """A launch's model as the command can name it: a model file or preset name (None: an object in memory)."""
    if isinstance(model, (str, Path)):
        return str(model)
    return None
