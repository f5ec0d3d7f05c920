"""``PipelineModule`` with the plan's placement, layer split and per-group networks.

Same constructor as ``deepspeed.pipe.PipelineModule`` plus ``config=`` (the wrapped DeepSpeed config you
also pass to :func:`het_plugin.deepspeed.initialize`) and ``layer_pattern=``. Without a
``"heterogeneous"`` section it *is* DeepSpeed's PipelineModule. With one:

* the pipeline degree comes from ``num_stages`` (or ``topology``'s 'pipe' axis), the tensor degree from
  ``topology``'s 'model' axis, the layers from ``layers``; the plan must agree (ConfigError otherwise);
* every rank computes or loads the plan and checks its hash with the others before any group exists;
* ``topology`` becomes :class:`PlanTopology` and the partition is the plan's layers per stage, replacing
  ``partition_method`` (rank 0 says so once); on a homogeneous identity plan the script's own topology and
  ``partition_method`` stay: the plan changes nothing there;
* the grid's model-parallel rank (gradient clipping) is DeepSpeed's for the same coordinates
  (:mod:`het_plugin.deepspeed.grid_ranks`);
* groups are created with the plan's transports (:mod:`het_plugin.deepspeed.groups`); what was
  applied (plan and every group created) is ``module.het_applied``, the plan also ``module.het_plan``;
* pipeline send/receive go over the plan's pipeline groups (:mod:`het_plugin.deepspeed.p2p`; DeepSpeed
  sends them on the world group), unless the plan is a homogeneous identity plan;
* the section's ``timeout_s`` (else ``HET_PLUGIN_TIMEOUT``, else 300 s) bounds the plan check and group
  creation: a rank that fails or disappears stops every rank within it.
"""
from __future__ import annotations

import inspect
import math
from typing import NamedTuple, Optional

import torch
from deepspeed.pipe import LayerSpec
from deepspeed.pipe import PipelineModule as _DeepSpeedPipelineModule

from ..core.errors import ConfigError
from ..core.inputs.model import ModelSpec
from ..views.report import startup_summary
from ..runtime.exchange import configured_timeout
from ..runtime.startup import startup
from .config import SECTION, BatchSettings, HetSection, load_ds_config, section_of
from .foreign_groups import check_no_launch_order_groups
from .grid_ranks import align_model_parallel_rank
from .groups import planned_groups
from .p2p import route_pipeline_hops
from .partition import counted_layers, plan_parts
from .replicas import check_batch_settings
from .plan_source import RunShape, section_planning
from .process_topology import PlanTopology
from . import script_topology
from .tied import start_tied_weights_on_first_stage

ASSUMED_SEQ_LENGTH = 2048


class PipelineModule(_DeepSpeedPipelineModule):
    def __init__(self, layers, num_stages=None, topology=None, *args, config=None,
                 layer_pattern: Optional[str] = None, **kwargs):
        object.__setattr__(self, "_het_parts", None)
        object.__setattr__(self, "_het_explicit", True)      # the import hook leaves this one alone
        cfg, source = load_ds_config(config) if config is not None else (None, "<config>")
        section = section_of(cfg, source)
        init = super().__init__
        if section is None:
            init(layers, num_stages, topology, *args, **kwargs)
            self.het_plan = None
            self.het_applied = None
            self.het_section = None
            return
        build_with_plan(self, init, layers, num_stages, topology, args, kwargs, Wrapped(cfg, section, source),
                        layer_pattern)

    def _partition_layers(self, method="uniform"):
        """The plan's split; DeepSpeed's methods when there is no plan (or the plan keeps DeepSpeed's)."""
        if not planned_partition(self):
            super()._partition_layers(method=method)


def planned_partition(module) -> bool:
    """Set the module's layer range from the plan's split; False when it has none (DeepSpeed's methods run)."""
    parts = getattr(module, "_het_parts", None)
    if parts is None:
        return False
    module.parts = list(parts)
    stage_id = module._topo.get_coord(module.global_rank).pipe
    module._set_bounds(start=module.parts[stage_id], stop=module.parts[stage_id + 1])
    return True


def _partition_method(args, kwargs) -> tuple[str, bool]:
    """The script's partition_method (DeepSpeed's default 'parameters') and whether it gave one."""
    params = list(inspect.signature(_DeepSpeedPipelineModule.__init__).parameters)[4:]   # after topology
    given = dict(zip(params, args))
    given.update(kwargs)
    if "partition_method" in given:
        return str(given["partition_method"]), True
    return "parameters", False


class Wrapped(NamedTuple):
    """A wrapped DeepSpeed config: the config, its ``"heterogeneous"`` section, and where it came from."""
    cfg: dict
    section: HetSection
    source: str


def build_with_plan(module, init, layers, num_stages, topology, args, kwargs, wrapped: Wrapped,
                    layer_pattern: Optional[str] = None) -> None:
    """DeepSpeed's ``PipelineModule.__init__`` (``init``, bound to ``module``) under the section's plan: what
    :class:`PipelineModule` and the import hook (:mod:`het_plugin.deepspeed.hook`) both do."""
    cfg, section, source = wrapped
    object.__setattr__(module, "_het_parts", None)
    import deepspeed.comm as dist
    if not dist.is_initialized():
        raise RuntimeError("call deepspeed.init_distributed() before building a PipelineModule "
                           "(as with DeepSpeed's own)")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    pp, tp, topo_dp = _user_degrees(num_stages, topology)
    specs = list(layers)
    pattern = layer_pattern if layer_pattern is not None else section.layer_pattern
    counted = counted_layers([layer_name(s) for s in specs], pattern)
    shape = RunShape(world_size=world_size, pp=pp, tp=tp, num_layers=len(counted))
    batch = BatchSettings.of(cfg, source)
    if section.pp is not None and section.pp != pp:      # also when the plan is made here, at start-up
        raise ConfigError(f"the config was wrapped for {section.pp} pipeline stages but the model has {pp}",
                          source=source, field=f"{SECTION}.pp",
                          fix=f"re-wrap with pp={pp} (`het-plugin wrap-config --pp {pp}`), or build the "
                              f"PipelineModule with num_stages={section.pp}")

    def check(resolved) -> None:
        plan = resolved.plan
        if topo_dp is not None and topo_dp != plan.dp:
            raise ConfigError(f"the topology has data degree {topo_dp}, the plan (and the {world_size} launched "
                              f"ranks) {plan.dp}", source=source, field="topology",
                              fix=f"build the topology with num_dp={plan.dp}")
        if batch.dp is not None and batch.dp != plan.dp:
            raise ConfigError(f"train_batch_size / (micro * accumulation) = {batch.dp} data-parallel replicas, "
                              f"the plan has {plan.dp}", source=source, field="train_batch_size",
                              fix=f"make train_batch_size = micro * accumulation * {plan.dp}")
        check_batch_settings(plan, cfg, source)      # an uneven replica split fixes the batch
        check_no_launch_order_groups(plan, source)   # Megatron-DeepSpeed's mpu (foreign_groups)
        script_topology.check(plan, topology, source)   # the script's own topology objects (issue 33)
        # The split must fit this layer list (raises the layer-count ConfigError on every rank).
        plan_parts(len(specs), counted, plan.layers_per_stage, source)

    planning = section_planning(section, shape, source=source, check=check,
                                derive_model=lambda: model_from_layers(specs, counted, batch,
                                                                       shape.degrees(source).dp, tp))
    started = startup(shape.start_request(section, source, rank), planning)
    plan, applied = started.plan, started.applied
    method, method_given = _partition_method(args, kwargs)
    parts = plan_parts(len(specs), counted, plan.layers_per_stage, source)
    native = applied.policy.native_network
    if native:
        # Homogeneous identity plan: the script's own topology (or DeepSpeed's default) and partition_method.
        split_line = (f"layer split: the script's partition_method={method!r}, topology as the script builds it "
                      "(homogeneous cluster: the plan changes nothing)")
    else:
        object.__setattr__(module, "_het_parts", parts)
        script_topology.adopt(plan, topology)           # they read the plan's coordinates from now on
        start_tied_weights_on_first_stage(module, plan)   # tied weights start from stage 0's copy, as DeepSpeed's
        split_line = (f"layers per stage {plan.layers_per_stage}: layer list boundaries {parts} "
                      f"(PipelineModule.parts), replacing partition_method={method!r}"
                      f"{'' if method_given else ' (DeepSpeed default)'}")
    if rank == 0:
        print(startup_summary(plan, "DeepSpeed pipeline", [split_line]), flush=True)
    with configured_timeout(section.timeout_s, f"{SECTION}.timeout_s", source), \
            planned_groups(applied, "DeepSpeed's PipelineModule", section.timeout_s):
        if native:
            init(specs, num_stages, topology, *args, **kwargs)
        else:
            init(specs, None, PlanTopology(plan), *args, **kwargs)
    module.het_plan = plan
    module.het_applied = applied
    module.het_section = section
    align_model_parallel_rank(module._grid, plan)      # DeepSpeed's clip norm counts the slice's "first" rank
    route_pipeline_hops(module._grid, applied)      # DeepSpeed's p2p would use the world group


def _user_degrees(num_stages, topology) -> tuple[int, int, Optional[int]]:
    """(pp, tp, dp or None) of the model the user built."""
    if topology is not None:
        axes = topology.get_axis_names()
        extra = [a for a in axes if a not in ("pipe", "data", "model")]
        if extra:
            raise ConfigError(f"topology axes {axes}: het_plugin places pipe, data and model axes only",
                              field="topology", fix="use PipeModelDataParallelTopology or PipeDataParallelTopology")
        return (max(topology.get_dim("pipe"), 1), max(topology.get_dim("model"), 1),
                max(topology.get_dim("data"), 1))
    if num_stages is None:
        raise RuntimeError("must provide num_stages or topology")
    return int(num_stages), 1, None


def layer_name(spec) -> Optional[str]:
    """The class name DeepSpeed's ``type:`` partitioning matches against."""
    if isinstance(spec, LayerSpec):
        return spec.typename.__name__
    if isinstance(spec, torch.nn.Module):
        return spec.__class__.__name__
    return getattr(spec, "__name__", None)


def model_from_layers(specs, counted: list[int], batch: BatchSettings, dp: Optional[int], tp: int = 1) -> ModelSpec:
    """A planning model when the config has none: identical GPT-shaped layers whose hidden size h comes
    from the first counted layer's parameter count (about 12*h*h), tp heads, no embedding cost, sequence
    length ASSUMED_SEQ_LENGTH, and the config's batch settings."""
    params = _param_count(specs[counted[0]]) if counted else 0
    return _synthetic_model(len(counted), round(math.sqrt(params / 12)), batch, dp, tp)


def model_from_module(module: torch.nn.Module, batch: BatchSettings, dp: int) -> ModelSpec:
    """Planning model for plain data parallelism: one layer holding all parameters (only the ordering of
    the data-parallel group depends on it)."""
    params = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return _synthetic_model(1, round(math.sqrt(params / 12)), batch, dp, 1)


def _synthetic_model(num_layers: int, hidden: int, batch: BatchSettings, dp: Optional[int], tp: int) -> ModelSpec:
    hidden = max(tp, hidden + (-hidden) % tp)          # tp heads must divide it
    micro = batch.micro_batch_size
    gbs = batch.train_batch_size
    if gbs is None:
        gbs = (micro or 1) * (batch.grad_accum or 1) * (dp or 1)
    return ModelSpec(name="deepspeed-layers", num_layers=max(1, num_layers), hidden_size=hidden,
                     num_attention_heads=tp, vocab_size=1, seq_length=ASSUMED_SEQ_LENGTH,
                     global_batch_size=gbs, micro_batch_size=micro if micro and gbs % micro == 0 else None)


def _param_count(spec) -> int:
    if isinstance(spec, LayerSpec):
        spec = spec.build()
    if isinstance(spec, torch.nn.Module):
        return sum(p.numel() for p in spec.parameters() if p.requires_grad)
    return 0
