"""``initialize``: ``deepspeed.initialize`` that applies a wrapped config's plan.

Without a ``"heterogeneous"`` section the call goes to ``deepspeed.initialize`` untouched. With one:

* pipeline models must come from :class:`het_plugin.deepspeed.PipelineModule` (which already placed the
  stages and checked the plan on every rank); the config's batch settings must match the plan's dp;
* any other model is plain data parallelism (ZeRO or not): every rank resolves and checks the plan
  (pp = tp = 1), and when the plan reorders ranks DeepSpeed gets an ``mpu`` (a
  ``PipelineParallelGrid`` over :class:`PlanTopology`) whose data-parallel group has the plan's rank
  order, created with the plan's transport. On an identity plan nothing is passed: DeepSpeed's defaults;
* a plan with an uneven replica split (``replica_micro_batches``) gives each rank its replica's
  ``gradient_accumulation_steps``, gradient weight and data range (:mod:`het_plugin.deepspeed.replicas`).

DeepSpeed sees the config without the section.
"""
from __future__ import annotations

import copy
import inspect

from ..core.errors import ConfigError
from .config import SECTION, BatchSettings, check_plan, load_ds_config, section_of, strip_section
from ..runtime.applied import AppliedPlan
from ..runtime.startup import bounded, startup
from .groups import planned_groups
from .replicas import ReplicaShare, apply_replica_split, check_batch_settings, rank_config
from .plan_source import RunShape, section_planning
from .checkpoints import install as check_checkpoints
from .hook_state import unapplied_reason
from .recorder_hooks import install as time_engine
from ..runtime.patches import PATCHES


def initialize(*args, profile_out=None, **kwargs):
    """Same signature and return value as ``deepspeed.initialize``; ``profile_out`` (or the section's): rank 0
    writes the run's measured profile there (:mod:`het_plugin.deepspeed.recorder_hooks`)."""
    return initialize_with_plan(original_initialize(), args, kwargs, profile_out=profile_out)


def original_initialize():
    """DeepSpeed's own ``initialize`` (under any of het_plugin's patches, the import hook's included)."""
    import deepspeed

    return PATCHES.original(deepspeed, "initialize")


def initialize_with_plan(ds_initialize, args, kwargs, *, profile_out=None, process_section=None):
    """``ds_initialize`` (DeepSpeed's own ``initialize``) applying the plan of, in order: the config passed
    (``config=`` or ``args.deepspeed_config``), the PipelineModule's (built under a plan), ``process_section``
    (``(section, source)``: what the import hook found in the launch's arguments or environment)."""
    bound = inspect.signature(ds_initialize).bind(*args, **kwargs)
    arguments = bound.arguments
    ds_args = arguments.get("args")
    config = arguments.get("config", arguments.get("config_params"))
    from_args = config is None and getattr(ds_args, "deepspeed_config", None) is not None
    if from_args:
        config = ds_args.deepspeed_config
    if config is None:
        return ds_initialize(*args, **kwargs)
    cfg, source = load_ds_config(config)
    section = section_of(cfg, source)
    model = arguments.get("model")
    from deepspeed.pipe import PipelineModule as DeepSpeedPipelineModule
    if section is None and isinstance(model, DeepSpeedPipelineModule) and getattr(model, "het_plan", None) is not None:
        section = getattr(model, "het_section", None)     # built under a plan the script's own config does not carry
    if section is None and process_section is not None:
        section, _ = process_section
    if section is None:
        if profile_out is not None:
            raise ConfigError("profile_out needs a plan: the config has no heterogeneous section", source=source,
                              field="profile_out", fix="wrap the config (het-plugin wrap-config), or drop profile_out")
        return ds_initialize(*args, **kwargs)
    if section.pp is not None and section.pp > 1 and not isinstance(model, DeepSpeedPipelineModule) \
            and arguments.get("mpu") is None:       # an mpu is refused on its own (_data_parallel_setup)
        raise ConfigError(f"the plan has {section.pp} pipeline stages, but the model passed to deepspeed.initialize is "
                          f"a {type(model).__name__}, not a deepspeed.pipe.PipelineModule: the plan's stages would "
                          "be ignored", source=source, field=f"{SECTION}.pp",
                          fix=f"build the model as deepspeed.pipe.PipelineModule(layers, num_stages={section.pp}), "
                              "or re-wrap the config with --pp 1 (plain data parallelism)")
    profile = section.profile_settings(source, profile_out)

    arguments.pop("config_params", None)
    arguments["config"] = strip_section(cfg)
    if from_args:
        ds_args = copy.copy(ds_args)
        ds_args.deepspeed_config = None
        arguments["args"] = ds_args
    batch = BatchSettings.of(cfg, source)
    model = arguments.get("model")
    from deepspeed.pipe import PipelineModule as DeepSpeedPipelineModule
    if isinstance(model, DeepSpeedPipelineModule):
        plan = _pipeline_plan(model, section, source)
        check_plan(plan, dp=batch.dp, source=source)
        check_batch_settings(plan, cfg, source)
        applied = model.het_applied
    else:
        applied = _data_parallel_setup(arguments, section, batch, source, cfg)
    share = None
    if applied.plan.uneven_replicas:        # even plans: DeepSpeed's own batch, weights and data, untouched
        share = ReplicaShare.from_plan(applied.plan, applied.rank)
        arguments["config"] = rank_config(arguments["config"], share)
    result = ds_initialize(**arguments)
    engine = result[0]
    engine.het_plan = applied.plan
    engine.het_applied = applied
    check_checkpoints(engine)             # the plan recorded in its checkpoints; loads checked first
    if share is not None:
        apply_replica_split(engine, share, arguments.get("training_data"))
        result = (engine, result[1], engine.training_dataloader, *result[3:])
    if profile is not None:
        time_engine(engine, applied.plan, applied.rank, profile)
    return result


def _pipeline_plan(model, section, source):
    plan = getattr(model, "het_plan", None)
    if plan is None:
        raise ConfigError("the config has a heterogeneous section but the PipelineModule was built without its plan: "
                          f"{unapplied_reason()}", source=source, field=SECTION,
                          fix="let het_plugin's import hook see the wrapped config when the PipelineModule is built: "
                              "pass it as --deepspeed_config FILE on the command line or export "
                              "HET_PLUGIN_DEEPSPEED_CONFIG=FILE (scripts that hard-code their config); or build it with "
                              "het_plugin.deepspeed.PipelineModule(..., config=<the same config>)")
    # with replan_on_restart the module's plan may be this start's re-plan (plan_source.section_planning)
    if section.plan_hash is not None and plan.hash != section.plan_hash and not section.replan_on_restart:
        raise ConfigError(f"the PipelineModule was built with plan {plan.hash}, this config holds "
                          f"{section.plan_hash}", source=source, field=f"{SECTION}.plan_hash",
                          fix="pass the same wrapped config to PipelineModule(config=) and initialize()")
    return plan


def _data_parallel_setup(arguments, section, batch, source, cfg) -> AppliedPlan:
    """Resolve the plan for plain data parallelism and, if it reorders ranks, hand DeepSpeed an mpu."""
    if arguments.get("mpu") is not None:
        raise ConfigError("an mpu was passed together with a heterogeneous section; het_plugin builds the "
                          "data-parallel group itself for non-pipeline models", source=source, field="mpu",
                          fix="drop mpu=, or drop the heterogeneous section")
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid

    from .pipe import model_from_module
    from .process_topology import PlanTopology

    dist.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                          distributed_port=arguments.get("distributed_port", deepspeed.TORCH_DISTRIBUTED_DEFAULT_PORT),
                          dist_init_required=arguments.get("dist_init_required"))
    world_size, rank = dist.get_world_size(), dist.get_rank()
    shape = RunShape(world_size=world_size, pp=1, tp=1)
    model = arguments["model"]

    def check(resolved) -> None:
        check_plan(resolved.plan, dp=batch.dp, source=source)
        check_batch_settings(resolved.plan, cfg, source)

    planning = section_planning(section, shape, source=source, check=check,
                                derive_model=lambda: model_from_module(model, batch, world_size))
    request = shape.start_request(section, source, rank)
    started = startup(request, planning)
    plan, applied = started.plan, started.applied
    with bounded(request):
        if not plan.is_identity:
            with planned_groups(applied, "het_plugin.deepspeed.initialize (the data-parallel grid)",
                                section.timeout_s):
                arguments["mpu"] = PipelineParallelGrid(topology=PlanTopology(plan))
    return applied
