"""The plan's layers per stage -> Megatron-Core's ``pipeline_model_parallel_layout``, and DDP settings.

``pipeline_model_parallel_layout`` takes arbitrary per-stage counts (``num_layers_in_first/last_pipeline_stage``
only moves the first and last stage). Syntax (Megatron-Core 0.16): stages separated by ``|``, ``E`` the
embedding, ``t`` one transformer layer, ``m`` one MTP layer, ``L`` the loss; ``"Etttt|tt|tL"`` is 4, 2
and 1 layers.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Sequence

from ..errors import ConfigError
from ..plan import Plan


def layout_string(layers_per_stage: Sequence[int], mtp_layers: int = 0) -> str:
    """``[4, 2, 1]`` -> ``"Etttt|tt|tL"`` (embedding on the first stage, loss on the last); MTP modules
    (``m``, Megatron requires all of them in one place, after every decoder layer) go on the last stage."""
    if not layers_per_stage or any(n < 0 for n in layers_per_stage) or mtp_layers < 0:
        raise ValueError(f"layers_per_stage must be non-negative counts, got {list(layers_per_stage)}")
    stages = ["t" * n for n in layers_per_stage]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "m" * mtp_layers + "L"
    return "|".join(stages)


def layout_for_plan(plan: Plan) -> Optional[str]:
    """The layout string for the plan, or None where Megatron's own even split is the same split
    (Megatron then puts MTP on the last stage too)."""
    counts = plan.layers_per_stage
    if plan.pp == 1 or len(set(counts)) == 1:
        return None
    return layout_string(counts, int(plan.model.get("mtp_layers", 0) or 0))


SPLIT_FIELDS = ("pipeline_model_parallel_layout", "num_layers_in_first_pipeline_stage",
                "num_layers_in_last_pipeline_stage")


def apply_plan_to_config(config: Any, plan: Plan) -> Any:
    """Check a TransformerConfig (or its kwargs dict) against the plan and give it the plan's layer split.

    Returns a new config (``dataclasses.replace``; a dict gets a copy). The degrees must be the plan's:
    the model pieces are built for the groups the plan made.
    """
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    for field, want in (("tensor_model_parallel_size", plan.tp), ("pipeline_model_parallel_size", plan.pp),
                        ("context_parallel_size", plan.cp)):
        have = get(field, 1) or 1
        if have != want:
            raise ConfigError(f"the model config has {field}={have}, the plan {want}", field=field,
                              fix=f"build the config with {field}={want} (plan.{field.split('_')[0]})")
    if get("num_layers") != sum(plan.layers_per_stage):
        raise ConfigError(f"the model config has num_layers={get('num_layers')}, the plan splits "
                          f"{sum(plan.layers_per_stage)}", field="num_layers", fix="plan for this model")
    user_split = [f for f in SPLIT_FIELDS if get(f) is not None]
    layout = layout_for_plan(plan)
    if layout is None:
        return dict(config) if isinstance(config, dict) else config
    if user_split:
        raise ConfigError(f"{user_split[0]} is set, but het_plugin sets the pipeline split from the plan "
                          f"({plan.layers_per_stage})", field=user_split[0], fix=f"leave {user_split[0]} unset")
    if isinstance(config, dict):
        return {**config, "pipeline_model_parallel_layout": layout}
    return replace(config, pipeline_model_parallel_layout=layout)


def ddp_config_for_plan(plan: Plan, **overrides: Any):
    """A DistributedDataParallelConfig with gradient-reduction overlap switched on where the plan assumed it."""
    from megatron.core.distributed import DistributedDataParallelConfig

    kwargs = {"overlap_grad_reduce": plan.overlap_grad_reduce,
              "use_distributed_optimizer": plan.distributed_optimizer}
    kwargs.update(overrides)
    return DistributedDataParallelConfig(**kwargs)
