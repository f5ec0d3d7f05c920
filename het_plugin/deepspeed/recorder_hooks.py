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
"""
from __future__ import annotations

import functools

from ..runtime.recorder import ProfileRecorder, ProfileSettings, default_store


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


def _left_out(engine, recorder: ProfileRecorder, names) -> None:
    """The engine's ``names`` (where it has them) run outside the measured training time."""
    for name in names:
        fn = getattr(engine, name, None)
        if fn is None:
            continue

        def call(*args, _fn=fn, **kwargs):
            with recorder.timer.excluded():
                return _fn(*args, **kwargs)

        setattr(engine, name, functools.wraps(fn)(call))


def _pipeline_hooks(engine, recorder: ProfileRecorder) -> None:
    from deepspeed.runtime.pipe import schedule
    timer = recorder.timer
    table = dict(engine._INSTRUCTION_MAP)
    for instruction, kind in ((schedule.ForwardPass, "forward"), (schedule.BackwardPass, "backward")):
        run = table[instruction]

        def timed(self, *args, _run=run, _kind=kind, **kwargs):
            with timer.timing(_kind):
                return _run(self, *args, **kwargs)

        table[instruction] = timed
    engine._INSTRUCTION_MAP = table          # the instance's map; the class keeps DeepSpeed's own
    train_batch = engine.train_batch

    @functools.wraps(train_batch)
    def timed_train_batch(*args, **kwargs):
        with timer.iteration():
            out = train_batch(*args, **kwargs)
        recorder.after_iteration()
        return out

    engine.train_batch = timed_train_batch


def _engine_hooks(engine, recorder: ProfileRecorder) -> None:
    timer = recorder.timer
    forward, backward, step = engine.forward, engine.backward, engine.step
    reduce = getattr(engine, "allreduce_gradients", None)
    in_backward = [False]

    @functools.wraps(forward)
    def timed_forward(*args, **kwargs):
        if not engine.training:                  # evaluation: not training time
            with timer.excluded():
                return forward(*args, **kwargs)
        if not timer.active:
            timer.begin_iteration()
        with timer.timing("forward"):
            return forward(*args, **kwargs)

    @functools.wraps(backward)
    def timed_backward(*args, **kwargs):
        in_backward[0] = True
        try:
            with timer.timing("backward"):
                return backward(*args, **kwargs)
        finally:
            in_backward[0] = False

    def timed_reduce(*args, **kwargs):
        if not in_backward[0]:
            return reduce(*args, **kwargs)
        with timer.timing("reduce"):            # inside a backward span: taken out of it (StageTimer)
            return reduce(*args, **kwargs)

    if reduce is not None:
        engine.allreduce_gradients = functools.wraps(reduce)(timed_reduce)

    @functools.wraps(step)
    def timed_step(*args, **kwargs):
        boundary = engine.is_gradient_accumulation_boundary()
        out = step(*args, **kwargs)
        if boundary and timer.active:
            timer.end_iteration()
            recorder.after_iteration()
        return out

    engine.forward, engine.backward, engine.step = timed_forward, timed_backward, timed_step
