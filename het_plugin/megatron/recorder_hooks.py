"""Megatron's hooks for the measured profile (:mod:`het_plugin.runtime.recorder`): applied by
:func:`het_plugin.megatron.mcore.build_groups` when a profile is asked for (``--heterogeneous-profile-out``,
``initialize_model_parallel(profile_out=...)``).

Megatron-Core's schedules (``megatron.core.pipeline_parallel.schedules``) run each micro-batch through the module
functions ``forward_step`` and ``backward_step``, looked up at each call, and a training iteration is one call of
the function ``get_forward_backward_func()`` returns (also looked up in that module at each call). Wrapping those
five module attributes times every script (Megatron-LM's ``train_step``, Megatron-Core scripts) without an edit;
``forward_only`` calls (evaluation) are not timed. The pipeline's send and receive happen between those calls,
so a forward or backward span is the stage's compute (and, on the last stage, the loss).

Checkpoint saves and evaluation run between two training iterations; their wall time is taken out of the
measured iteration interval (:meth:`StageTimer.excluded`): Megatron-LM's ``save_checkpoint_and_time`` and
``evaluate_and_print_results`` (module functions of ``megatron.training.training``, looked up at each call in
``train``; core_r0.19.0) and ``megatron.core.dist_checkpointing.save`` (what a Megatron-Core script saves with).
"""
from __future__ import annotations

import functools
import sys
from typing import Optional

from ..runtime.patches import PATCHES
from ..runtime.recorder import ProfileRecorder, ProfileSettings, default_store

STEPS = ("forward_step", "backward_step")
SCHEDULES = ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
             "forward_backward_pipelining_with_interleaving")

PATCH_LABEL = "megatron.recorder"     # the timing wrappers on the schedule module's functions

#: (module, functions) whose calls are not training time (looked up at each call by their callers)
EXCLUDED = (("megatron.training.training", ("save_checkpoint_and_time", "evaluate_and_print_results")),
            ("megatron.core.dist_checkpointing", ("save",)))

_recorder: Optional[ProfileRecorder] = None


def recorder() -> Optional[ProfileRecorder]:
    """The recorder of the plan applied in this process (None without a profile)."""
    return _recorder


def _timed_step(fn, kind: str):
    @functools.wraps(fn, updated=())
    def step(*args, **kwargs):
        rec = _recorder
        if rec is None:
            return fn(*args, **kwargs)
        with rec.timer.timing(kind):
            return fn(*args, **kwargs)

    return step


def _timed_schedule(fn):
    @functools.wraps(fn, updated=())
    def schedule(*args, **kwargs):
        rec = _recorder
        if rec is None or args or kwargs.get("forward_only", False):
            return fn(*args, **kwargs)
        model = kwargs.get("model")
        chunks = len(model) if isinstance(model, (list, tuple)) else 1
        with rec.timer.iteration(chunks):
            out = fn(**kwargs)
        rec.after_iteration()
        return out

    return schedule


def _left_out(fn):
    @functools.wraps(fn, updated=())
    def call(*args, **kwargs):
        rec = _recorder
        if rec is None:
            return fn(*args, **kwargs)
        with rec.timer.excluded():
            return fn(*args, **kwargs)

    return call


def uninstall() -> None:
    """Megatron's functions without the timing (the previous recorder writes its last profile)."""
    global _recorder
    if _recorder is not None:
        _recorder.close()
        _recorder = None
    PATCHES.undo(PATCH_LABEL)


def install(plan, rank: int, settings: ProfileSettings, framework: str = "Megatron", cluster=None) -> ProfileRecorder:
    """Time this rank's forward and backward per micro-batch and its iterations for ``settings`` (``cluster``: the
    Cluster the plan came from, for the re-plan command)."""
    global _recorder
    uninstall()
    from megatron.core.pipeline_parallel import schedules

    _recorder = ProfileRecorder(plan, rank, settings, framework, store=default_store(), cluster=cluster)
    for name in STEPS:
        PATCHES.apply(schedules, name, functools.partial(_timed_step, kind=name.split("_")[0]), label=PATCH_LABEL)
    for name in SCHEDULES:
        if getattr(schedules, name, None) is not None:
            PATCHES.apply(schedules, name, _timed_schedule, label=PATCH_LABEL)
    for module_name, names in EXCLUDED:      # only where loaded: a Megatron-Core script has no megatron.training
        module = sys.modules.get(module_name)
        for name in names if module is not None else ():
            if getattr(module, name, None) is not None:
                PATCHES.apply(module, name, _left_out, label=PATCH_LABEL)
    return _recorder
