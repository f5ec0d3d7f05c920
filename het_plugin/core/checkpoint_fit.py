"""Will a checkpoint load under a plan? The one pure answer, before anything loads (issue 21).

A checkpoint records how it was written: the framework's format, the parallel layout (degrees and layer split),
the world size, the optimizer and how its state is sharded. The adapters read that from the checkpoint (the
framework-specific readers: Megatron's in ``het_plugin.megatron``, DeepSpeed's in
:mod:`het_plugin.deepspeed.checkpoint_shape`) into a :class:`CheckpointShape`; :func:`resume_problem` compares it
with the plan a run is about to use and returns why it would not load (None: it loads), naming the format and the
fix. Re-planning on restart (:mod:`het_plugin.runtime.restart_replan`) asks the same question of a candidate plan
and keeps the old one when the answer is no.

What each format can follow (sources: Megatron-LM core_r0.19.0 docs and ``dist_checkpointing``; DeepSpeed 0.19.8
``runtime/pipe/module.py`` ``ckpt_layer_path`` / ``load_state_dir`` and ``runtime/engine.py`` ``_get_ckpt_name``
/ ``_get_zero_ckpt_name``; docs/deepspeed.md and docs/megatron.md table them):

* Megatron ``torch_dist``: model weights are keyed by global layer index and reshard across any layout. The
  distributed optimizer's ``dp_reshardable`` state reshards across data parallelism only (a model-parallel change:
  another TP, PP or layer split fails in the loader); ``fully_reshardable`` follows every change. A plain
  (non-distributed) optimizer's state is sharded with the model: it follows. The checkpoint's optimizer type must
  be the run's (a distributed-optimizer checkpoint into a plain optimizer, or back, fails).
* Megatron ``torch`` (legacy) and ``fsdp_dtensor``: files per (tp, pp) rank holding stage-local layers: only
  the same TP, PP and layer split load (another split loads the wrong layers silently).
* DeepSpeed pipeline (``PipelineModule``): weights are one file per global layer (``layer_XX-*model_states.pt``):
  any partition, placement and data parallelism, at the same TP (the model axis is in the file name). The optimizer
  and engine state are per (stage, TP rank) (``mp_rank_XX_model_states.pt``; ZeRO-1:
  ``zero_pp_rank_D_mp_rank_XX_optim_states.pt``, per data-parallel rank too): they follow only the same split and
  degrees, unless converted to a universal checkpoint (``ds_to_universal``) and loaded with
  ``checkpoint.load_universal``.

A placement-only change (the same degrees and split, stages on other ranks) loads in Megatron's formats: files
are keyed by parallel coordinates, not by launch rank. DeepSpeed's per-stage engine files are not: they are named
by the sorted launch ranks of each pipeline (:func:`deepspeed_file_index`), so a placement that changes that order
is refused for the optimizer state (the weights still follow).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from .errors import ConfigError
from .plan import Plan

MEGATRON, DEEPSPEED = "Megatron", "DeepSpeed"

# Megatron checkpoint formats (--ckpt-format) and distributed-optimizer sharding types
# (distrib_optim_sharding_type in the checkpoint; --dist-ckpt-optim-fully-reshardable saves the second).
TORCH_DIST, TORCH_LEGACY, FSDP_DTENSOR = "torch_dist", "torch", "fsdp_dtensor"
DP_RESHARDABLE, FULLY_RESHARDABLE = "dp_reshardable", "fully_reshardable"
# DeepSpeed: the engine/optimizer state as saved per rank, or converted by ds_to_universal.
DS_PER_RANK, DS_UNIVERSAL = "per_rank", "universal"


@dataclass(frozen=True)
class CheckpointShape:
    """What a checkpoint records about how it was written (the interface between the frameworks' checkpoint
    readers and :func:`resume_problem`). ``None`` in a field: the checkpoint does not say (not checked)."""
    framework: str                          # MEGATRON or DEEPSPEED
    path: str                               # the checkpoint directory (for messages)
    format: str                 # Megatron: torch_dist | torch | fsdp_dtensor; DeepSpeed: per_rank | universal
    world_size: Optional[int] = None
    tp: Optional[int] = None
    pp: Optional[int] = None
    dp: Optional[int] = None
    layers_per_stage: Optional[Sequence[int]] = None   # the split it was saved with (Megatron: from the layout)
    distributed_optimizer: Optional[bool] = None       # Megatron: saved with --use-distributed-optimizer
    optimizer_sharding: Optional[str] = None           # Megatron: dp_reshardable | fully_reshardable
    zero_stage: Optional[int] = None                   # DeepSpeed
    has_optimizer: bool = True                         # optimizer state present (and to be loaded)
    plan_hash: Optional[str] = None                    # the plan it was saved under (het_plugin records it)
    iteration: Optional[int] = None
    # DeepSpeed: the mp_rank_XX index each (stage, TP rank) of the writing replica saved its engine file under,
    # stage-major (deepspeed_file_index); None: not recorded
    stage_files: Optional[Sequence[int]] = None

    def layout(self) -> tuple:
        return (self.tp, self.pp, tuple(self.layers_per_stage) if self.layers_per_stage is not None else None)


@dataclass(frozen=True)
class ResumeProblem:
    """Why a checkpoint would not load under a plan: the problem, the fix, and the setting to change."""
    problem: str
    fix: str
    field: str = "checkpoint"
    changes: tuple[str, ...] = ()

    def error(self, source: Optional[str] = None) -> ConfigError:
        return ConfigError(self.problem, source=source, field=self.field, fix=self.fix)


def layout_changes(shape: CheckpointShape, plan: Plan) -> list[str]:
    """What the plan changes in the checkpoint's parallel layout ("tp 2 -> 1", "layer split [3, 1] -> [1, 3]")."""
    out = []
    for name, saved, now in (("tp", shape.tp, plan.tp), ("pp", shape.pp, plan.pp)):
        if saved is not None and saved != now:
            out.append(f"{name} {saved} -> {now}")
    if shape.layers_per_stage is not None and list(shape.layers_per_stage) != list(plan.layers_per_stage):
        out.append(f"layer split {list(shape.layers_per_stage)} -> {list(plan.layers_per_stage)}")
    return out


def dp_changes(shape: CheckpointShape, plan: Plan) -> list[str]:
    out = []
    if shape.dp is not None and shape.dp != plan.dp:
        out.append(f"dp {shape.dp} -> {plan.dp}")
    if shape.world_size is not None and shape.world_size != plan.world_size:
        out.append(f"world size {shape.world_size} -> {plan.world_size}")
    return out


def resume_problem(shape: Optional[CheckpointShape], plan: Plan, *,
                   distributed_optimizer: Optional[bool] = None) -> Optional[ResumeProblem]:
    """Why ``shape`` would not load under ``plan`` (None: it loads). ``distributed_optimizer``: whether the run
    uses Megatron's distributed optimizer (None: the plan's ``distributed_optimizer``)."""
    if shape is None:
        return None
    if shape.framework == MEGATRON:
        return _megatron(shape, plan, plan.distributed_optimizer if distributed_optimizer is None
                         else distributed_optimizer)
    if shape.framework == DEEPSPEED:
        return _deepspeed(shape, plan)
    raise ValueError(f"unknown checkpoint framework {shape.framework!r}")


def _changed(changes: Sequence[str]) -> str:
    return ", ".join(changes)


def _megatron(shape: CheckpointShape, plan: Plan, dist_opt: bool) -> Optional[ResumeProblem]:
    model = layout_changes(shape, plan)
    where = f"the checkpoint {shape.path}"
    if shape.format in (TORCH_LEGACY, FSDP_DTENSOR) and model:
        what = ("--ckpt-format torch (legacy) keeps each (tp, pp) rank's layers by their stage-local index"
                if shape.format == TORCH_LEGACY else
                "--ckpt-format fsdp_dtensor keys parameters by stage-local index (Megatron-LM #7452)")
        return ResumeProblem(
            f"{where} cannot follow this plan ({_changed(model)}): {what}, so it would load the wrong layers",
            "resume under the plan it was saved with, or convert it to torch_dist first (Megatron-LM's "
            "tools/checkpoint/checkpoint_inspector.py / --ckpt-convert-format torch_dist) and save once",
            "--ckpt-format", tuple(model))
    if not shape.has_optimizer:
        return None
    if shape.distributed_optimizer is not None and shape.distributed_optimizer != dist_opt:
        saved = "with" if shape.distributed_optimizer else "without"
        flag = "--use-distributed-optimizer"
        return ResumeProblem(
            f"{where} was saved {saved} the distributed optimizer; this run {'uses' if dist_opt else 'does not use'} "
            "it, and Megatron cannot load optimizer state across that change",
            f"resume {saved} {flag} (as saved), or pass --no-load-optim (the optimizer state starts afresh)",
            flag)
    if (shape.format == TORCH_DIST and dist_opt and shape.optimizer_sharding == DP_RESHARDABLE and model):
        return ResumeProblem(
            f"{where} holds distributed-optimizer state in the dp_reshardable format, which does not reshard "
            f"across a model-parallel change ({_changed(model)})",
            "resume once under the plan it was saved with, adding --dist-ckpt-optim-fully-reshardable, and save; "
            "that checkpoint loads under the new plan (or pass --no-load-optim: the optimizer state starts afresh)",
            "--dist-ckpt-optim-fully-reshardable", tuple(model))
    return None


def deepspeed_file_index(plan: Plan) -> list[list[int]]:
    """Per data-parallel replica, the ``mp_rank_XX`` index of each (stage, TP rank), stage-major. DeepSpeed names a
    pipeline rank's engine file by its position among the *sorted launch ranks* of its model-parallel group (all
    stages and TP ranks of its replica: ``PipelineParallelGrid``, ``runtime/pipe/topology.py``: ``ranks =
    sorted(...)``, ``ds_model_rank = ranks.index(global_rank)``), which is the stage order only when the plan
    puts stages on ascending ranks."""
    out = []
    for d in range(plan.dp):
        members = [(s, t, plan.rank_of_logical[plan.dims.logical_rank(pp=s, dp=d, tp=t)])
                   for s in range(plan.pp) for t in range(plan.tp)]
        ordered = sorted(r for _, _, r in members)
        out.append([ordered.index(r) for _, _, r in members])
    return out


def _file_order_problem(shape: CheckpointShape, plan: Plan) -> Optional[str]:
    if shape.stage_files is None:
        return None
    saved = list(shape.stage_files)
    for d, index in enumerate(deepspeed_file_index(plan)):
        if index != saved:
            return (f"replica {d} of this plan would read the engine files in the order {index} (stage-major "
                    f"mp_rank_XX), the checkpoint's stages wrote {saved}: DeepSpeed names them by the sorted launch "
                    "ranks of each pipeline, so a stage would load another stage's optimizer state")
    return None


def _universal_fix(shape: CheckpointShape) -> str:
    """The conversion that lets ZeRO state follow any plan, as a command to run; ``ds_to_universal`` merges ZeRO
    partitions (``*_optim_states.pt``), so a torch optimizer without ZeRO has none to offer. ``--inject_missing_state``:
    a plain ``PipelineModule`` records no ``universal_checkpoint_info`` (Megatron-DeepSpeed's modules do), which the
    conversion otherwise asserts (DeepSpeed 0.19.8 ``checkpoint/ds_to_universal.py`` ``_check_for_required_state``)."""
    if not shape.zero_stage:
        return ("resume under the plan it was saved with (a torch optimizer's state without ZeRO does not convert: "
                "ds_to_universal reads ZeRO partitions only; a run that will change plans trains with "
                "\"zero_optimization\": {\"stage\": 1}), ")
    return (f"convert it once: python -m deepspeed.checkpoint.ds_to_universal --input_folder {shape.path} "
            f"--output_folder {shape.path}_universal --inject_missing_state, then set \"checkpoint\": "
            "{\"load_universal\": true} in the DeepSpeed config; ")


def _deepspeed(shape: CheckpointShape, plan: Plan) -> Optional[ResumeProblem]:
    where = f"the checkpoint {shape.path}"
    if shape.tp is not None and shape.tp != plan.tp:
        return ResumeProblem(
            f"{where} was saved at tensor (model-axis) degree {shape.tp}, the plan has {plan.tp}: DeepSpeed's "
            "per-layer files are per model-axis rank", "keep the model axis (re-plan with --tp "
            f"{shape.tp}), or convert with deepspeed.checkpoint.ds_to_universal and set checkpoint.load_universal",
            "tp", (f"tp {shape.tp} -> {plan.tp}",))
    if shape.format == DS_UNIVERSAL or not shape.has_optimizer:
        return None
    changes = layout_changes(shape, plan) + (dp_changes(shape, plan) if shape.zero_stage else [])
    order = None if changes else _file_order_problem(shape, plan)
    if order is not None:
        return ResumeProblem(
            f"{where} holds optimizer state per pipeline stage, but under this placement {order}",
            "resume on a placement that keeps each pipeline's stages on ascending launch ranks, "
            f"{_universal_fix(shape)}or load the weights only (load_optimizer_states=False: the optimizer starts "
            "afresh)",
            "checkpoint.load_universal", ("engine file order",))
    if changes:
        kind = f"ZeRO stage {shape.zero_stage}" if shape.zero_stage else "optimizer"
        return ResumeProblem(
            f"{where} holds {kind} state per pipeline stage{' and data-parallel rank' if shape.zero_stage else ''} "
            f"(mp_rank_XX files), which cannot follow this plan ({_changed(changes)}); the weights (per-layer "
            "files) could",
            f"{_universal_fix(shape)}or load the weights only (load_checkpoint(..., load_module_only=True): the "
            "optimizer starts afresh); docs/deepspeed.md, \"Checkpoints across plans\"",
            "checkpoint.load_universal", tuple(changes))
    return None
