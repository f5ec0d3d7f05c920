"""The ``"heterogeneous"`` section of a DeepSpeed config: what :func:`wrap` records and every rank reads.

DeepSpeed has no notion of a pipeline degree in its config (the model's ``num_stages``/topology holds it),
so the section records the degrees the plan was made for, the cluster source, the model used for
planning, and by default the plan itself (so every rank loads the same plan without the cluster file).
No torch.distributed here: ``het-plugin wrap-config`` runs without DeepSpeed installed.
"""
from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Optional, Union

from ..core.errors import ConfigError
from ..core.inputs.model import ModelSpec
from ..core.plan import Plan
from ..core.launch import ModelArg, load_source, model_from_arg
from ..core.planner import make_plan
from ..core.ranks.dims import Degrees
from ..core.inputs.yamlio import validate
from ..core.replan_command import cluster_file
from ..runtime.exchange import check_timeout
from ..runtime.recorder import DEFAULT_EVERY, ProfileSettings

SECTION = "heterogeneous"
SECTION_VERSION = 1
AUTO = "auto"
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# What DeepSpeed calls the degrees (error messages name the user's own knob).
DEEPSPEED_NAMES = {"tp": "tp (the topology's model axis)", "pp": "pp (num_stages)",
                   "dp": "train_batch_size / (micro * accumulation)"}


OPTIONAL_KEYS = ("profile_out", "profile_every", "replan_on_restart", "resume_from", "use_all_nodes")     # written only when set


@dataclass
class HetSection:
    """What a wrapped config carries; enough to load (``plan``) or recompute (cluster + model) the plan."""
    cluster: Optional[str]              # cluster file, plan file, "auto", or None (a Plan given in memory)
    cluster_digest: Optional[str] = None
    model: Optional[dict[str, Any]] = None   # ModelSpec fields; None: derived from the layer list at run time
    tp: Optional[int] = None            # DeepSpeed's 'model' axis
    pp: Optional[int] = None
    dp: Optional[int] = None
    layer_pattern: Optional[str] = None  # regex on layer class names: which layers the plan counts
    plan_hash: Optional[str] = None
    plan: Optional[dict[str, Any]] = None    # the plan itself (wrap's default), so ranks need no cluster file
    timeout_s: Optional[float] = None   # bound on every wait of het_plugin at start-up (None: HET_PLUGIN_TIMEOUT / 300)
    # Measured profile: rank 0 writes each stage's measured forward/backward and the iteration time here every
    # profile_every iterations (default 100) and at exit (None: not timed). Added to version 1: optional keys.
    profile_out: Optional[str] = None
    profile_every: Optional[int] = None
    # Re-plan on restart (runtime.restart_replan): the next start re-plans from the profile this run writes to
    # profile_out, for the nodes of that start; resume_from: the checkpoint folder the script loads (load_dir),
    # so that a re-plan it would not load under is not taken. Optional keys, added to version 1.
    replan_on_restart: Optional[bool] = None
    resume_from: Optional[str] = None
    # Plan with every node launched (issue 32; None: HET_PLUGIN_USE_ALL_NODES, else the planner may leave node
    # groups out and a launch including them stops before any group). Optional key, added to version 1.
    use_all_nodes: Optional[bool] = None
    version: int = SECTION_VERSION

    def to_dict(self) -> dict[str, Any]:
        """The section's keys; the profile keys only when set (a section without them reads as before)."""
        return {k: v for k, v in asdict(self).items() if v is not None or k not in OPTIONAL_KEYS}

    @classmethod
    def from_dict(cls, data: Any, source: str = "<config>") -> "HetSection":
        if not isinstance(data, dict):
            raise ConfigError(f"the '{SECTION}' section must be a mapping, got {type(data).__name__}",
                              source=source, field=SECTION, fix="re-create it with `het-plugin wrap-config`")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown keys {unknown}", source=source, field=SECTION,
                              fix=f"allowed keys: {sorted(known)}; re-create it with `het-plugin wrap-config`")
        if data.get("version") != SECTION_VERSION:
            raise ConfigError(f"section version {data.get('version')!r}, this het_plugin reads {SECTION_VERSION}",
                              source=source, field=f"{SECTION}.version", fix="re-wrap the config with this version")
        if data.get("timeout_s") is not None:
            check_timeout(data["timeout_s"], f"{SECTION}.timeout_s", source)
        section = cls(**data)
        section.profile_settings(source)          # a bad profile_out / profile_every / replan_on_restart is refused
        return section

    def profile_settings(self, source: str = "<config>", profile_out: Optional[str] = None):
        """The measured-profile settings (``profile_out`` overrides the section's), or None."""
        path = profile_out if profile_out is not None else self.profile_out
        every = self.profile_every
        if self.use_all_nodes not in (None, True, False):
            raise ConfigError(f"use_all_nodes must be true or false, got {self.use_all_nodes!r}", source=source,
                              field=f"{SECTION}.use_all_nodes", fix="true (plan with every node), or drop the key")
        if self.replan_on_restart not in (None, True, False):
            raise ConfigError(f"replan_on_restart must be true or false, got {self.replan_on_restart!r}",
                              source=source, field=f"{SECTION}.replan_on_restart", fix="true, or drop the key")
        if self.resume_from is not None and not self.replan_on_restart:
            raise ConfigError("resume_from is set without replan_on_restart (it only tells re-planning which "
                              "checkpoint the run resumes)", source=source, field=f"{SECTION}.resume_from",
                              fix="add \"replan_on_restart\": true, or drop resume_from")
        if self.replan_on_restart and self.cluster is None:
            raise ConfigError("replan_on_restart needs the cluster to re-plan for: the section names none (a plan "
                              "given in memory)", source=source, field=f"{SECTION}.replan_on_restart",
                              fix="wrap with the cluster file (or \"auto\")")
        if path is None:
            if every is not None:
                raise ConfigError("profile_every is set without profile_out", source=source,
                                  field=f"{SECTION}.profile_every", fix="add profile_out: FILE, or drop profile_every")
            if self.replan_on_restart:
                raise ConfigError("replan_on_restart needs profile_out: the next start re-plans from the measured "
                                  "profile this run writes there", source=source,
                                  field=f"{SECTION}.replan_on_restart",
                                  fix="add profile_out: FILE (on storage every rank sees, e.g. beside the checkpoints)")
            return None
        if every is not None and (not isinstance(every, int) or isinstance(every, bool)):
            raise ConfigError(f"profile_every must be a whole number of iterations, got {every!r}", source=source,
                              field=f"{SECTION}.profile_every", fix="e.g. 100")
        try:
            return ProfileSettings(str(path), every=DEFAULT_EVERY if every is None else every,
                                   cluster=cluster_file(self.cluster), replan_on_restart=bool(self.replan_on_restart))
        except ConfigError as exc:
            key = "profile_every" if exc.field == "profile_every" else "profile_out"
            raise ConfigError(exc.problem, source=source, field=f"{SECTION}.{key}", fix=exc.fix) from None


# ---- reading DeepSpeed configs --------------------------------------------------------------------

def load_ds_config(config: Union[str, Path, dict]) -> tuple[dict, str]:
    """A deep copy of the config (dict or JSON path) and a name for messages."""
    if isinstance(config, dict):
        return copy.deepcopy(config), "<config dict>"
    path = Path(config)
    if not path.is_file():
        raise ConfigError("DeepSpeed config file not found", source=str(path), fix="pass an existing JSON file")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}", source=str(path),
                          fix="DeepSpeed configs are JSON; correct the syntax there") from None
    if not isinstance(data, dict):
        raise ConfigError("a DeepSpeed config must be a JSON object", source=str(path), fix="wrap it in { }")
    return data, str(path)


def section_of(config: Optional[dict], source: str = "<config>") -> Optional[HetSection]:
    """The parsed section, or None when the config has none (het_plugin is then a pass-through)."""
    if not isinstance(config, dict) or SECTION not in config:
        return None
    return HetSection.from_dict(config[SECTION], source)


def strip_section(config: dict) -> dict:
    """The config DeepSpeed sees: everything but our section."""
    return {k: v for k, v in config.items() if k != SECTION}


@dataclass(frozen=True)
class BatchSettings:
    train_batch_size: Optional[int]
    micro_batch_size: Optional[int]
    grad_accum: Optional[int]

    @classmethod
    def of(cls, config: dict, source: str = "<config>") -> "BatchSettings":
        values = []
        for key in BATCH_KEYS:
            v = config.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"must be a positive integer, got {v!r}", source=source, field=key,
                                  fix="use a positive integer (or remove it)")
            values.append(v)
        return cls(*values)

    @property
    def dp(self) -> Optional[int]:
        """The data-parallel degree the config implies (DeepSpeed: batch = micro * accum * dp)."""
        if None in (self.train_batch_size, self.micro_batch_size, self.grad_accum):
            return None
        return self.train_batch_size // (self.micro_batch_size * self.grad_accum)

    def check_divisible(self, source: str) -> None:
        if self.dp is not None and self.train_batch_size % (self.micro_batch_size * self.grad_accum):
            raise ConfigError(
                f"train_batch_size {self.train_batch_size} is not a multiple of train_micro_batch_size_per_gpu * "
                f"gradient_accumulation_steps = {self.micro_batch_size}*{self.grad_accum}", source=source,
                field="train_batch_size", fix="DeepSpeed needs train_batch_size = micro * accumulation * dp")


# ---- the batch an uneven plan fixes (checked before any group exists) -------------------------------

FIX_CONFIG = ("give the config the plan's batch: train_batch_size = global batch, train_micro_batch_size_per_gpu = "
              "the plan's micro-batch size, gradient_accumulation_steps = the plan's even count (or leave them out); "
              "het_plugin sets each rank's accumulation steps to its replica's count")


def check_batch_settings(plan: Plan, config: dict, source: str = "<config>") -> None:
    """An uneven plan fixes the batch: the config may restate it but not contradict it (even plans: no-op)."""
    if not plan.uneven_replicas:
        return
    batch = BatchSettings.of(config, source)
    counts = plan.replica_counts
    expected = {"train_batch_size": (batch.train_batch_size, plan.global_batch_size),
                "train_micro_batch_size_per_gpu": (batch.micro_batch_size, plan.micro_batch_size),
                "gradient_accumulation_steps": (batch.grad_accum, plan.num_micro_batches)}
    for key, (given, wanted) in expected.items():
        if given is not None and given != wanted:
            raise ConfigError(f"{key} is {given}, but the plan splits a global batch of {plan.global_batch_size} "
                              f"samples ({plan.micro_batch_size} per micro-batch) unevenly over {plan.dp} replicas, "
                              f"micro-batches {counts} (even count {plan.num_micro_batches}); {key} must be {wanted}",
                              source=source, field=key, fix=FIX_CONFIG)
    stage = zero_stage(config)
    if stage >= 2:
        raise ConfigError(f"ZeRO stage {stage} reduces gradients at every micro-batch, so replicas running "
                          f"different numbers of micro-batches {counts} would issue different numbers of collectives",
                          source=source, field="zero_optimization.stage",
                          fix="use ZeRO stage 0 or 1 with an uneven replica split, or a plan with the even split")


def zero_stage(config: dict) -> int:
    zero = config.get("zero_optimization") or {}
    return int(zero.get("stage", 0)) if isinstance(zero, dict) else 0


# ---- resolving wrap()'s inputs --------------------------------------------------------------------

def model_for_config(model: ModelSpec, batch: BatchSettings) -> ModelSpec:
    """The config decides the batch DeepSpeed trains with; the planning model follows it."""
    update = {}
    if batch.train_batch_size is not None:
        update["global_batch_size"] = batch.train_batch_size
    if batch.micro_batch_size is not None:
        update["micro_batch_size"] = batch.micro_batch_size
    if not update:
        return model
    return validate(ModelSpec, {**model.model_dump(), **update}, "<model + DeepSpeed batch settings>")


def check_plan(plan: Plan, *, world_size: Optional[int] = None, pp: Optional[int] = None,
               tp: Optional[int] = None, dp: Optional[int] = None, num_layers: Optional[int] = None,
               source: str = "<config>") -> None:
    """Reject a plan that contradicts what DeepSpeed will run (before any group is created)."""
    if plan.cp != 1 or plan.ep != 1:
        raise ConfigError(f"the plan uses cp={plan.cp}, ep={plan.ep}; DeepSpeed's pipeline topology has no such axes",
                          source=source, field=f"{SECTION}.plan", fix="plan with cp=1")
    if plan.distributed_optimizer_instances > 1:
        # Megatron's partial distributed optimizer; DeepSpeed's pipeline engine shards ZeRO-1 over all of data
        # parallelism (no partial ZeRO), so the plan's prediction of sharded instances would not hold
        raise ConfigError(f"the plan shards the optimizer in {plan.distributed_optimizer_instances} instances "
                          "(Megatron's partial distributed optimizer); DeepSpeed's pipeline engine has no partial "
                          "ZeRO", source=source, field=f"{SECTION}.plan.distributed_optimizer_instances",
                          fix="re-plan for DeepSpeed: `het-plugin wrap-config` plans without instances")
    if world_size is not None and plan.world_size != world_size:
        raise ConfigError(f"the plan is for {plan.world_size} ranks but {world_size} were launched", source=source,
                          field=f"{SECTION}.plan.world_size",
                          fix=f"launch {plan.world_size} ranks, or re-wrap the config for the nodes you launch")
    if pp is not None and plan.pp != pp:
        raise ConfigError(f"the plan has {plan.pp} pipeline stages but the model has {pp}", source=source,
                          field=f"{SECTION}.pp",
                          fix=f"re-wrap with pp={pp} (`het-plugin wrap-config --pp {pp}`), or build the "
                              f"PipelineModule with num_stages={plan.pp}")
    if tp is not None and plan.tp != tp:
        raise ConfigError(f"the plan has tensor (model-axis) degree {plan.tp} but the model's topology has {tp}",
                          source=source, field=f"{SECTION}.tp", fix=f"re-wrap with tp={tp}, or use num_mp={plan.tp}")
    if dp is not None and plan.dp != dp:
        raise ConfigError(f"the plan has data-parallel degree {plan.dp} but the config/topology implies {dp}",
                          source=source, field="train_batch_size",
                          fix=f"make train_batch_size = micro * accumulation * {plan.dp}, or re-wrap the config")
    if num_layers is not None and sum(plan.layers_per_stage) != num_layers:
        raise ConfigError(f"the plan splits {sum(plan.layers_per_stage)} layers {plan.layers_per_stage}, but the "
                          f"model has {num_layers}", source=source, field=f"{SECTION}.model.num_layers",
                          fix=f"re-wrap with a model of {num_layers} layers, or set layer_pattern to the layers "
                              "the plan counts (e.g. your transformer block's class name)")
    if pp is not None and any(n < 1 for n in plan.layers_per_stage):
        raise ConfigError(f"the plan gives a stage no layers {plan.layers_per_stage}; a DeepSpeed pipeline stage "
                          "needs at least one", source=source, field=f"{SECTION}.plan.layers_per_stage",
                          fix="use fewer pipeline stages")


# ---- wrap -----------------------------------------------------------------------------------------

def wrap(config: Union[str, Path, dict], cluster: Union[str, Path, Plan] = AUTO, model: ModelArg = None, *,
         pp: Optional[int] = None, tp: Optional[int] = None, layer_pattern: Optional[str] = None,
         embed_plan: bool = True, timeout_s: Optional[float] = None, profile_out: Optional[str] = None,
         profile_every: Optional[int] = None, replan_on_restart: bool = False,
         resume_from: Optional[str] = None, use_all_nodes: bool = False) -> dict:
    """Return ``config`` with a ``"heterogeneous"`` section (the input is not modified).

    ``cluster``: a cluster file, a plan file, a :class:`Plan`, or ``"auto"`` (every rank discovers the
    cluster at start-up). ``model``: a ModelSpec, dict, model file or preset; None plans from the
    layer list at run time. ``pp``/``tp``: the pipeline and tensor (DeepSpeed 'model' axis) degrees of
    the model you will build; ``dp`` follows from the config's batch settings. ``layer_pattern``: a
    regex on layer class names selecting the layers the plan counts (default: every layer).
    ``embed_plan``: store the plan in the config (default) or only its hash (ranks then recompute it
    from the cluster file and must get the same hash). ``timeout_s``: the bound on every wait of het_plugin
    at start-up (plan check, group creation; stored in the section; None: ``HET_PLUGIN_TIMEOUT`` or 300 s
    on each rank). ``profile_out``: rank 0 writes the run's measured profile there every ``profile_every``
    iterations (default 100) and at exit, for ``het-plugin plan --profile``. ``replan_on_restart`` (with
    ``profile_out`` and a cluster): the next start re-plans from that profile for its nodes
    (:mod:`het_plugin.runtime.restart_replan`); ``resume_from``: the checkpoint folder the script loads, so that a
    re-plan it would not load under is not taken. ``use_all_nodes``: the run plans with every node it launches
    (stored in the section; without it a cluster planned at start-up may leave node groups out, and a launch
    including them stops naming them).
    """
    cfg, source = load_ds_config(config)
    if timeout_s is not None:
        timeout_s = check_timeout(timeout_s, "timeout_s")
    batch = BatchSettings.of(cfg, source)
    batch.check_divisible(source)
    spec = model_from_arg(model)
    if spec is not None:
        spec = model_for_config(spec, batch)
    if layer_pattern is not None:
        _check_pattern(layer_pattern)

    plan: Optional[Plan] = None
    section = HetSection(cluster=None, model=spec.model_dump() if spec else None, tp=tp, pp=pp, dp=batch.dp,
                         layer_pattern=layer_pattern, timeout_s=timeout_s, profile_out=profile_out,
                         profile_every=profile_every, replan_on_restart=True if replan_on_restart else None,
                         resume_from=os.path.abspath(resume_from) if resume_from else None,
                         use_all_nodes=True if use_all_nodes else None)
    if isinstance(cluster, Plan):
        plan = cluster
    elif str(cluster) == AUTO:
        section.cluster = AUTO
    else:
        section.cluster = os.path.abspath(cluster)
        loaded = load_source(str(cluster))
        if isinstance(loaded, Plan):
            plan = loaded
        else:
            section.cluster_digest = loaded.digest
            Degrees(loaded.world_size, tp=tp or 1, pp=pp, dp=batch.dp, names=DEEPSPEED_NAMES, source=source)
            if spec is not None:
                spec = _global_batch_from_accumulation(spec, batch, loaded.world_size, tp or 1, pp)
                plan = make_plan(loaded, spec, tp=tp or 1, pp=pp, dp=batch.dp,
                                 micro_batch_size=batch.micro_batch_size, optimizer_instances=False)
    section.profile_settings(source)
    if plan is not None:
        check_plan(plan, pp=pp, tp=tp, dp=batch.dp, source=source)
        check_batch_settings(plan, cfg, source)
        section.cluster_digest = plan.cluster_digest
        section.tp, section.pp, section.dp = plan.tp, plan.pp, plan.dp
        section.model = plan.model
        section.plan_hash = plan.hash
        if embed_plan or section.cluster is None:
            section.plan = json.loads(json.dumps(plan.to_dict(), default=repr))
        if all(getattr(batch, f) is None for f in ("train_batch_size", "micro_batch_size", "grad_accum")):
            cfg["train_micro_batch_size_per_gpu"] = plan.micro_batch_size
            cfg["gradient_accumulation_steps"] = plan.num_micro_batches
            cfg["train_batch_size"] = plan.micro_batch_size * plan.num_micro_batches * plan.dp
    cfg[SECTION] = section.to_dict()
    return cfg


def _global_batch_from_accumulation(spec: ModelSpec, batch: BatchSettings, world_size: int, tp: int,
                                    pp: Optional[int]) -> ModelSpec:
    """A config with micro-batch and accumulation but no train_batch_size: DeepSpeed's batch is
    micro * accumulation * dp, so plan with that one."""
    if batch.train_batch_size is not None or None in (batch.micro_batch_size, batch.grad_accum, pp):
        return spec
    if world_size % (tp * pp):
        return spec
    gbs = batch.micro_batch_size * batch.grad_accum * (world_size // (tp * pp))
    return spec.model_copy(update={"global_batch_size": gbs})


def _check_pattern(pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ConfigError(f"layer_pattern {pattern!r} is not a regular expression: {exc}",
                          field=f"{SECTION}.layer_pattern", fix="use e.g. 'TransformerLayer' or 'Block$'") from None


def write_config(config: dict, path: Union[str, Path]) -> None:
    Path(path).write_text(json.dumps(config, indent=2) + "\n")
