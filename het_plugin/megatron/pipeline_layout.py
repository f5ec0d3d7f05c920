"""The plan's layers per stage -> Megatron-Core's ``pipeline_model_parallel_layout``, and DDP settings.

``pipeline_model_parallel_layout`` takes arbitrary per-stage counts (``num_layers_in_first/last_pipeline_stage``
only moves the first and last stage). Syntax (Megatron-Core 0.16 to 0.19): stages separated by ``|``, ``E`` the
embedding, ``t`` one transformer layer, ``m`` one MTP layer, ``L`` the loss; ``"Etttt|tt|tL"`` is 4, 2
and 1 layers.

Interleaved pipelines: a layout of ``pp * vpp`` segments gives Megatron ``vpp`` virtual stages per rank
(``PipelineParallelLayerLayout`` derives ``virtual_pipeline_model_parallel_size`` from the count). Segment
``k`` is virtual stage ``k // pp`` of pipeline rank ``k % pp``: the segments run in the model's layer order,
rank by rank within each virtual stage. ``E`` must open the first segment and ``L`` close the last (its
validator checks the flattened layout), and the MTP layers must sit in the last virtual stage of a rank
other than the first (here: the last rank). Megatron's validator accepts empty segments; het_plugin gives
every virtual stage at least one layer.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Sequence

from ..core.errors import ConfigError
from ..core.plan import Plan


def layout_string(layers_per_stage: Sequence[int], mtp_layers: int = 0) -> str:
    """``[4, 2, 1]`` -> ``"Etttt|tt|tL"`` (embedding on the first stage, loss on the last); MTP modules
    (``m``, Megatron requires all of them in one place, after every decoder layer) go on the last stage."""
    if not layers_per_stage or any(n < 0 for n in layers_per_stage) or mtp_layers < 0:
        raise ValueError(f"layers_per_stage must be non-negative counts, got {list(layers_per_stage)}")
    return virtual_layout_string([[n] for n in layers_per_stage], mtp_layers)


def virtual_layout_string(virtual_layers: Sequence[Sequence[int]], mtp_layers: int = 0) -> str:
    """Per pipeline rank, the layers of each of its virtual stages -> a layout of ``pp * vpp`` segments in
    Megatron's order (segment ``c * pp + r`` is virtual stage ``c`` of rank ``r``). ``[[2, 1], [1, 2]]`` ->
    ``"Ett|t|t|ttL"``: layers 1-2 on rank 0, 3 on rank 1, 4 on rank 0, 5-6 on rank 1."""
    rows = [list(r) for r in virtual_layers]
    if (not rows or any(len(r) != len(rows[0]) for r in rows) or not rows[0]
            or any(n < 0 for r in rows for n in r) or mtp_layers < 0):
        raise ValueError(f"virtual_layers must be pp lists of vpp non-negative counts, got {rows}")
    pp, vpp = len(rows), len(rows[0])
    segments = ["t" * rows[k % pp][k // pp] for k in range(pp * vpp)]
    segments[0] = "E" + segments[0]
    segments[-1] = segments[-1] + "m" * mtp_layers + "L"
    return "|".join(segments)


def layout_for_plan(plan: Plan) -> Optional[str]:
    """The layout string for the plan, or None where Megatron's own even split is the same split (every
    virtual stage of every rank with the same layers; Megatron then puts MTP on the last stage too)."""
    counts = [n for row in plan.virtual_layers for n in row]
    if plan.pp == 1 or len(set(counts)) == 1:
        return None
    return virtual_layout_string(plan.virtual_layers, int(plan.model.get("mtp_layers", 0) or 0))


SPLIT_FIELDS = ("pipeline_model_parallel_layout", "num_layers_in_first_pipeline_stage",
                "num_layers_in_last_pipeline_stage")


def apply_plan_to_config(config: Any, plan: Plan) -> Any:
    """Check a TransformerConfig (or its kwargs dict) against the plan and give it the plan's layer split.

    Returns a new config (``dataclasses.replace``; a dict gets a copy). The degrees must be the plan's:
    the model pieces are built for the groups the plan made. An interleaved plan (``plan.vpp > 1``) also sets
    ``virtual_pipeline_model_parallel_size`` and, where the plan assumed it, ``overlap_p2p_comm`` (with
    ``batch_p2p_comm`` off: Megatron's interleaved schedule refuses both together). A TransformerConfig that
    already has a virtual pipeline size must have been built from an even split (Megatron checks it); pass the
    kwargs dict to build the config with the plan's uneven one.
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
    have_vpp = get("virtual_pipeline_model_parallel_size")          # None: the plan's
    if have_vpp is not None and have_vpp != plan.vpp and plan.accepts_vpp(have_vpp):
        # an identity plan with Megatron's own even split: the config interleaves it as without het_plugin
        return config
    if have_vpp is not None and have_vpp != plan.vpp:
        raise ConfigError(f"the model config has virtual_pipeline_model_parallel_size={have_vpp}, the plan "
                          f"{plan.vpp} virtual stages per pipeline rank", field="virtual_pipeline_model_parallel_size",
                          fix=f"build the config with virtual_pipeline_model_parallel_size="
                              f"{plan.vpp if plan.vpp > 1 else None} (plan.vpp), or re-plan with `het-plugin plan "
                              f"--vpp {have_vpp}`")
    updates: dict[str, Any] = {}
    if plan.vpp > 1:
        updates["virtual_pipeline_model_parallel_size"] = plan.vpp
    if plan.overlap_p2p_comm:
        updates.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    layout = layout_for_plan(plan)
    if layout is not None:
        user_split = [f for f in SPLIT_FIELDS if get(f) is not None]
        if user_split:
            raise ConfigError(f"{user_split[0]} is set, but het_plugin sets the pipeline split from the plan "
                              f"({plan.virtual_layers if plan.vpp > 1 else plan.layers_per_stage})",
                              field=user_split[0], fix=f"leave {user_split[0]} unset")
        updates["pipeline_model_parallel_layout"] = layout
    updates = {k: v for k, v in updates.items() if get(k) != v}
    if isinstance(config, dict):
        return {**config, **updates}
    return replace(config, **updates) if updates else config


def ddp_config_for_plan(plan: Plan, **overrides: Any):
    """A DistributedDataParallelConfig with gradient-reduction overlap switched on where the plan assumed it. The
    optimizer instances are the caller's (``num_distributed_optimizer_instances=`` here and in
    ``initialize_model_parallel``: both or neither, dist_opt.groups_kwargs)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    kwargs = {"overlap_grad_reduce": plan.overlap_grad_reduce,
              "use_distributed_optimizer": plan.distributed_optimizer}
    kwargs.update(overrides)
    return DistributedDataParallelConfig(**kwargs)
