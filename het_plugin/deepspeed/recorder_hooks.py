"""DeepSpeed's hooks for the measured profile (:mod:`het_plugin.runtime.recorder`): applied by
:func:`het_plugin.deepspeed.initialize` when the wrapped config's section has ``profile_out`` (or
``initialize(..., profile_out=...)``).

* ``PipelineEngine``: a training iteration is one ``train_batch`` call; each micro-batch's forward and backward are
  the ``ForwardPass`` and ``BackwardPass`` instructions, which the engine looks up in ``_INSTRUCTION_MAP`` at each
  step: the engine gets its own copy of that map with the two timed (sends and receives are other
  instructions). ``eval_batch`` runs outside an iteration: not timed.
* Any other engine (data parallelism, ZeRO): ``forward`` and ``backward`` in training mode are timed; an
  iteration ends with the ``step`` at a gradient-accumulation boundary. ``backward`` reduces the gradients at
  the boundary (``allreduce_gradients``): that wait is not compute (the predictor charges the reduction
  itself), so it is timed apart and taken out of the backward time.
* Checkpoint saves (``save_checkpoint``) and evaluation (``eval_batch``, a forward outside training mode) are
  taken out of the measured iteration interval (:meth:`StageTimer.excluded`).

Every hook is a layer of :data:`het_plugin.runtime.patches.PATCHES` (label ``deepspeed.recorder``, order
``OBSERVE``): it sits around the replica split's loss scaling (:mod:`het_plugin.deepspeed.replicas`) whichever
was installed first, and :func:`uninstall` takes it off.
"""
from __future__ import annotations

import functools

from ..runtime.patches import OBSERVE, PATCHES
from ..runtime.recorder import ProfileRecorder, ProfileSettings, default_store

PATCH_LABEL = "deepspeed.recorder"   # this module's engine hooks in het_plugin.runtime.patches.PATCHES


def install(engine, plan, rank: int, settings: ProfileSettings) -> ProfileRecorder:
    """Time ``engine``'s micro-batches and iterations; returns the recorder (also ``engine.het_profile``)."""
    applied = getattr(engine, "het_applied", None)
    # train_batch (and forward .. step of other engines) holds the optimizer step: the slot-cost fit knows it
    recorder = ProfileRecorder(plan, rank, settings, "DeepSpeed", store=default_store(),
                               cluster=getattr(applied, "cluster", None), schedule_holds_step=True)
    from deepspeed.runtime.pipe.engine import PipelineEngine
    if isinstance(engine, PipelineEngine):
        _pipeline_hooks(engine, recorder)
    else:
        _engine_hooks(engine, recorder)
    _left_out(engine, recorder, ("save_checkpoint", "eval_batch"))
    engine.het_profile = recorder
    return recorder


def uninstall(engine) -> int:
    """Take the timing hooks off ``engine`` (the other labels' hooks stay, re-made over DeepSpeed's own)."""
    return PATCHES.undo(PATCH_LABEL, owner=engine)


def _hook(engine, name: str, make) -> None:
    PATCHES.apply(engine, name, make, label=PATCH_LABEL, order=OBSERVE)


def _left_out(engine, recorder: ProfileRecorder, names) -> None:
    """The engine's ``names`` (where it has them) run outside the measured training time."""

    def excluded(inner):
        @functools.wraps(inner)
        def call(*args, **kwargs):
            with recorder.timer.excluded():
                return inner(*args, **kwargs)
        return call

    for name in names:
        if getattr(engine, name, None) is not None:
            _hook(engine, name, excluded)


def _pipeline_hooks(engine, recorder: ProfileRecorder) -> None:
    from deepspeed.runtime.pipe import schedule
    timer = recorder.timer

    def timed_map(table):
        table = dict(table)                  # the instance's map; the class keeps DeepSpeed's own
        for instruction, kind in ((schedule.ForwardPass, "forward"), (schedule.BackwardPass, "backward")):
            def timed(self, *args, _run=table[instruction], _kind=kind, **kwargs):
                with timer.timing(_kind):
                    return _run(self, *args, **kwargs)
            table[instruction] = timed
        return table

    def timed_train_batch(train_batch):
        @functools.wraps(train_batch)
        def call(*args, **kwargs):
            with timer.iteration():
                out = train_batch(*args, **kwargs)
            recorder.after_iteration()
            return out
        return call

    _hook(engine, "_INSTRUCTION_MAP", timed_map)
    _hook(engine, "train_batch", timed_train_batch)


def _engine_hooks(engine, recorder: ProfileRecorder) -> None:
    timer = recorder.timer
    in_backward = [False]

    def timed_forward(forward):
        @functools.wraps(forward)
        def call(*args, **kwargs):
            if not engine.training:                  # evaluation: not training time
                with timer.excluded():
                    return forward(*args, **kwargs)
            if not timer.active:
                timer.begin_iteration()
            with timer.timing("forward"):
                return forward(*args, **kwargs)
        return call

    def timed_backward(backward):
        @functools.wraps(backward)
        def call(*args, **kwargs):
            in_backward[0] = True
            try:
                with timer.timing("backward"):
                    return backward(*args, **kwargs)
            finally:
                in_backward[0] = False
        return call

    def timed_reduce(reduce):
        @functools.wraps(reduce)
        def call(*args, **kwargs):
            if not in_backward[0]:
                return reduce(*args, **kwargs)
            with timer.timing("reduce"):            # inside a backward span: taken out of it (StageTimer)
                return reduce(*args, **kwargs)
        return call

    def timed_step(step):
        @functools.wraps(step)
        def call(*args, **kwargs):
            boundary = engine.is_gradient_accumulation_boundary()
            out = step(*args, **kwargs)
            if boundary and timer.active:
                timer.end_iteration()
                recorder.after_iteration()
            return out
        return call

    if getattr(engine, "allreduce_gradients", None) is not None:
        _hook(engine, "allreduce_gradients", timed_reduce)
    for name, make in (("forward", timed_forward), ("backward", timed_backward), ("step", timed_step)):
        _hook(engine, name, make)
