"""DeepSpeed checkpoints across plans (issue 21, item 2): what a checkpoint records, checked before it loads.

:func:`install` (called by :func:`het_plugin.deepspeed.initialize` on the engine it returns) wraps the engine's

* ``save_checkpoint``: the checkpoint also records the plan it was saved under (``client_state["het_plugin"]``:
  plan hash, layer split, degrees, world size), in every ``mp_rank_XX_model_states.pt`` file;
* ``load_checkpoint``: every rank first reads the checkpoint's shape (:func:`read_shape`: DeepSpeed's own
  ``checkpoint_parallel_dimensions``, ``dp_world_size``, ZeRO stage and optimizer state, and het_plugin's record)
  and asks :func:`het_plugin.core.checkpoint_fit.resume_problem`; a checkpoint whose state cannot follow the plan is
  refused with the format and the fix (a ConfigError on every rank, before DeepSpeed reads a tensor), instead of
  torch's ``loaded state dict contains a parameter group that doesn't match`` deep in the loader.

Sources (DeepSpeed 0.19.8): ``runtime/pipe/module.py`` ``ckpt_layer_path`` (weights: ``layer_{global index:02d}-
*model_states.pt``, reloaded by global index under any partition: ``load_state_dir``); ``runtime/engine.py``
``_get_ckpt_name`` / ``_save_checkpoint`` (``mp_rank_{stage and model-axis rank:02d}_model_states.pt`` holds the
non-ZeRO optimizer state, ``checkpoint_parallel_dimensions`` and the client state), ``_get_zero_ckpt_name``
(ZeRO-1: ``zero_pp_rank_{dp}_mp_rank_{..}_optim_states.pt``), ``load_universal_checkpoint`` (the config's
``checkpoint.load_universal``: the ``latest_universal`` tag of a ``ds_to_universal`` conversion).
"""
from __future__ import annotations

import functools
import inspect
import logging
from pathlib import Path
from typing import Any, Optional

from ..core.checkpoint_fit import (DEEPSPEED, DS_PER_RANK, DS_UNIVERSAL, CheckpointShape, deepspeed_file_index,
                                   resume_problem)

log = logging.getLogger("het_plugin.deepspeed")

RECORD_KEY = "het_plugin"


def plan_record(plan) -> dict[str, Any]:
    """What a checkpoint records about the plan it was saved under."""
    return {"plan_hash": plan.hash, "layers_per_stage": list(plan.layers_per_stage), "tp": plan.tp, "pp": plan.pp,
            "dp": plan.dp, "world_size": plan.world_size,
            "stage_files": deepspeed_file_index(plan)[0]}      # replica 0 (data-parallel rank 0) writes them


def _tag(load_dir: str, tag: Optional[str], universal: bool) -> Optional[str]:
    if tag is not None:
        return str(tag)
    latest = Path(load_dir) / ("latest_universal" if universal else "latest")
    return latest.read_text().strip() if latest.is_file() else None


def read_shape(load_dir: str, tag: Optional[str] = None, *, universal: bool = False,
               load_optimizer_states: bool = True) -> Optional[CheckpointShape]:
    """The shape of the checkpoint ``load_dir``/``tag`` (None: no checkpoint there, or one without the
    stage-0 engine file). Reads the first stage's ``mp_rank_00_model_states.pt`` on the CPU."""
    tag = _tag(load_dir, tag, universal)
    if tag is None:
        return None
    path = Path(load_dir) / tag / "mp_rank_00_model_states.pt"
    if not path.is_file():
        return None
    import torch
    state = torch.load(path, map_location="cpu", weights_only=False)
    record = state.get(RECORD_KEY) or {}
    dims = state.get("checkpoint_parallel_dimensions") or {}
    config = state.get("ds_config") or {}
    zero = int((config.get("zero_optimization") or {}).get("stage", 0) or 0)
    has_optimizer = load_optimizer_states and (state.get("optimizer") is not None or zero > 0)
    return CheckpointShape(
        framework=DEEPSPEED, path=str(Path(load_dir) / tag), format=DS_UNIVERSAL if universal else DS_PER_RANK,
        world_size=record.get("world_size"), tp=dims.get("tp", record.get("tp")), pp=dims.get("pp", record.get("pp")),
        dp=state.get("dp_world_size", record.get("dp")), layers_per_stage=record.get("layers_per_stage"),
        zero_stage=zero, has_optimizer=bool(has_optimizer), plan_hash=record.get("plan_hash"),
        iteration=state.get("global_steps"), stage_files=record.get("stage_files"))


def check_load(engine, load_dir: str, tag: Optional[str] = None, *, load_optimizer_states: bool = True,
               load_module_only: bool = False) -> Optional[CheckpointShape]:
    """Refuse (a ConfigError) a checkpoint whose state cannot follow ``engine.het_plan``; returns its shape."""
    plan = getattr(engine, "het_plan", None)
    if plan is None:
        return None
    universal = bool(getattr(engine, "load_universal_checkpoint", lambda: False)())
    shape = read_shape(str(load_dir), tag, universal=universal,
                       load_optimizer_states=load_optimizer_states and not load_module_only)
    problem = resume_problem(shape, plan)
    if problem is not None:
        raise problem.error(source=str(load_dir))
    if shape is not None and shape.plan_hash not in (None, plan.hash) and getattr(engine, "global_rank", 0) == 0:
        log.warning("het_plugin: resuming %s (saved under plan %s) under plan %s: %s", shape.path, shape.plan_hash,
                    plan.hash, "its state follows the new plan (docs/deepspeed.md, \"Checkpoints across plans\")")
    return shape


def install(engine) -> None:
    """Record the plan in the engine's checkpoints and check each load first (see the module docstring)."""
    save, load = getattr(engine, "save_checkpoint", None), getattr(engine, "load_checkpoint", None)
    if save is None or load is None:         # not a DeepSpeed engine (a stand-in): nothing to check
        return

    @functools.wraps(save)
    def save_checkpoint(save_dir, tag=None, client_state=None, *args, **kwargs):
        state = dict(client_state or {})
        if getattr(engine, "het_plan", None) is not None:
            state.setdefault(RECORD_KEY, plan_record(engine.het_plan))
        return save(save_dir, tag, state, *args, **kwargs)

    @functools.wraps(load)
    def load_checkpoint(load_dir, tag=None, *args, **kwargs):
        bound = inspect.signature(load).bind(load_dir, tag, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        check_load(engine, load_dir, tag, load_optimizer_states=a.get("load_optimizer_states", True),
                   load_module_only=a.get("load_module_only", False))
        return load(load_dir, tag, *args, **kwargs)

    engine.save_checkpoint, engine.load_checkpoint = save_checkpoint, load_checkpoint

