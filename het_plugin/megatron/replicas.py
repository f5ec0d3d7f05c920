"""Heterogeneous data parallelism on stock Megatron: each replica runs its plan count of micro-batches, its
loss weighted by its share, reading its own samples (docs/megatron.md, "Heterogeneous data parallelism").

Applied by :func:`het_plugin.megatron.mcore.build_groups` only when the plan's replicas are uneven; an even
plan leaves every Megatron function as it is.

* **Schedules.** ``get_forward_backward_func()`` returns one of three functions of
  ``megatron.core.pipeline_parallel.schedules``, looked up there at each call, so wrapping those module
  attributes reaches every script (Megatron-LM's ``train_step`` and ``evaluate`` and Megatron-Core scripts)
  without an edit. The wrapper, on a rank of replica ``d``:
  - ``num_microbatches``: the even count (what a script derives from the global batch, Megatron-LM's
    ``get_num_microbatches()``) becomes ``counts[d]``; ``counts[d]`` itself stays; anything else is refused
    naming the replica and the numbers (the batch the plan was not made for). A ``micro_batch_size`` other
    than the plan's is refused too.
  - gradient weight: Megatron divides each micro-batch loss by the count it runs and DDP averages over dp;
    during a training call ``config.grad_scale_func`` (which the schedule applies to the last stage's
    backward signal and to the MoE/MTP auxiliary-loss scales) is multiplied by ``counts[d] / N``, so the
    reduced gradient is the global batch's mean (:mod:`het_plugin.runtime.replicas`). With
    ``calculate_per_token_loss`` Megatron sums over dp and divides by the global token count: left alone.
  - data: a ``StopIteration`` out of the script's forward step (its data iterator ran dry before the
    replica's count) becomes a ConfigError naming the replica, the micro-batch and the count.
* **Megatron-LM data.** ``megatron.training.datasets.data_samplers.MegatronPretrainingSampler`` (what
  ``build_pretraining_data_loader`` builds for ``--dataloader-type single``) is replaced by
  :func:`replica_sampler`'s class: the replica's contiguous range of every global batch.
* Megatron-LM's micro-batch calculator stays the even count: ``get_num_microbatches()`` is global-batch
  bookkeeping there too (consumed samples, the learning-rate schedule's increment, MoE/MTP log scales),
  which must be the same on every rank.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Optional

from ..core.errors import ConfigError
from .applied_state import current_plan
from ..runtime.patches import PATCHES
from ..runtime.replicas import ReplicaShare
from ..core.ranks.batches import ReplicaBatches, ReplicaSampler

SCHEDULES = ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
             "forward_backward_pipelining_with_interleaving")
SOURCE = "Megatron forward_backward_func"
PATCH_LABEL = "megatron.replicas"      # the schedules and Megatron-LM's sampler, for an uneven plan


def replica_share() -> Optional[ReplicaShare]:
    """This rank's replica share of the plan het_plugin applied (None before initialisation or without it)."""
    applied = current_plan()
    return applied.replica_share if applied is not None else None


# ---- the schedules ---------------------------------------------------------------------------------

def _model_config(model):
    from megatron.core.utils import get_model_config
    return get_model_config(model[0] if isinstance(model, (list, tuple)) else model)


class _ScaledGrads:
    """``config.grad_scale_func`` times ``scale`` for the duration of one schedule call."""

    def __init__(self, config, scale: float):
        self.config, self.scale = config, scale

    def __enter__(self):
        self.original = self.config.grad_scale_func
        original, scale = self.original, self.scale

        def grad_scale_func(tensor):
            return (original(tensor) if original is not None else tensor) * scale

        self.config.grad_scale_func = grad_scale_func
        return self

    def __exit__(self, *exc):
        self.config.grad_scale_func = self.original
        return False


def _counting_step(forward_step_func, share: ReplicaShare, chunks: int):
    """The script's forward step; a dry data iterator becomes the replica's error (``chunks``: model chunks,
    each reading the iteration's micro-batches, as Megatron's interleaved schedule calls them)."""
    calls = [0]

    @functools.wraps(forward_step_func)
    def forward_step(*args, **kwargs):
        calls[0] += 1
        try:
            return forward_step_func(*args, **kwargs)
        except StopIteration as exc:
            micro_batch = (calls[0] - 1) // max(1, chunks) + 1
            raise share.ran_dry(micro_batch) from exc

    return forward_step


def wrap_schedule(schedule):
    """One schedule function, running this rank's replica count and weight (module docstring)."""
    @functools.wraps(schedule)
    def replica_schedule(*args, **kwargs):
        share = replica_share()
        if share is None or not share.uneven or args:
            return schedule(*args, **kwargs)
        forward_only = bool(kwargs.get("forward_only", False))
        share.check_batch(None, kwargs.get("micro_batch_size"), source=SOURCE)
        kwargs["num_microbatches"] = share.count_for(kwargs["num_microbatches"], source=SOURCE)
        model = kwargs.get("model")
        chunks = len(model) if isinstance(model, (list, tuple)) else 1
        kwargs["forward_step_func"] = _counting_step(kwargs["forward_step_func"], share, chunks)
        config = _model_config(model)
        _check_no_cross_replica_collectives(config, share)
        if forward_only or getattr(config, "calculate_per_token_loss", False) or share.loss_scale == 1.0:
            return schedule(**kwargs)
        with _ScaledGrads(config, share.loss_scale):
            return schedule(**kwargs)

    return replica_schedule


def _check_no_cross_replica_collectives(config, share: ReplicaShare) -> None:
    """Collectives a forward step runs across data-parallel replicas would pair the micro-batches of replicas
    with different counts and hang: Megatron's global auxiliary load-balancing loss all-reduces over the
    tp x dp x cp group in every MoE layer's forward. Same config on every rank: every rank stops alike."""
    kinds = getattr(config, "moe_router_load_balancing_type", None)
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    if any("global_aux_loss" in str(k) for k in kinds):
        raise ConfigError(f"moe_router_load_balancing_type={kinds} all-reduces over the data-parallel replicas in "
                          f"every micro-batch's forward, but {share.describe()}: replicas with different counts "
                          "would wait for each other forever", source=SOURCE, field="moe_router_load_balancing_type",
                          fix="use aux_loss or seq_aux_loss, or a plan with the even split (het-plugin plan "
                              "--replica-split even)")


def install(plan) -> None:
    """Wrap the schedules (and Megatron-LM's sampler, when megatron.training is loaded) for an uneven plan;
    restore Megatron's own for an even one (a process may apply several plans, e.g. tests)."""
    _wrap(plan.uneven_replicas)


def uninstall() -> None:
    """Megatron's own schedules and sampler again."""
    _wrap(False)


def _wrap(uneven: bool) -> None:
    if not uneven:
        PATCHES.undo(PATCH_LABEL)      # nothing was wrapped: an even plan imports nothing
        return
    from megatron.core.pipeline_parallel import schedules
    for name in SCHEDULES:
        if getattr(schedules, name, None) is not None:
            PATCHES.apply(schedules, name, wrap_schedule, label=PATCH_LABEL)
    samplers = sys.modules.get("megatron.training.datasets.data_samplers")
    if samplers is not None:
        PATCHES.apply(samplers, "MegatronPretrainingSampler", replica_sampler_class, label=PATCH_LABEL)


# ---- data ------------------------------------------------------------------------------------------

def replica_sampler(total_samples: int, consumed_samples: int = 0):
    """Batch sampler for a Megatron-Core script's DataLoader (``batch_sampler=``): this rank's replica's
    micro-batches of every global batch (sample indices of the data order), its count of them per iteration, from
    ``consumed_samples`` (a whole number of global batches). Every sample of global batch ``i`` (samples
    ``[i*G, (i+1)*G)``, as Megatron's ``MegatronPretrainingSampler`` reads them) is read once, by one replica."""
    applied = current_plan()
    if applied is None:
        raise ConfigError("no plan applied in this process", field="replica_sampler",
                          fix="call het_plugin.megatron.initialize_model_parallel first")
    plan = applied.plan
    return ReplicaSampler(total_samples, consumed_samples, ReplicaBatches.from_plan(plan),
                          plan.replica_of(applied.rank))


def replica_sampler_class(base):
    """A subclass of Megatron-LM's ``MegatronPretrainingSampler`` (``base``) that reads the replica's range of
    each global batch; constructed as Megatron-LM's data loader constructs the original."""

    class ReplicaPretrainingSampler(base):
        def __init__(self, total_samples, consumed_samples, micro_batch_size, data_parallel_rank,
                     data_parallel_size, drop_last=True, **kwargs: Any):
            super().__init__(total_samples, consumed_samples, micro_batch_size, data_parallel_rank,
                             data_parallel_size, drop_last, **kwargs)
            share = replica_share()
            self.replica_batches = None
            if share is None or micro_batch_size != share.micro_batch_size:
                return        # another batch shape (e.g. an evaluation micro-batch size): the even split
            if data_parallel_size != share.dp:
                raise ConfigError(f"data_parallel_size={data_parallel_size}, but the plan has {share.dp} replicas",
                                  field="data_parallel_size", fix="launch the plan's world size and degrees")
            self.replica_batches = replica_sampler(total_samples, consumed_samples)

        def __len__(self):
            return len(self.replica_batches) if self.replica_batches is not None else super().__len__()

        def __iter__(self):
            if self.replica_batches is None:
                return super().__iter__()
            return iter(self.replica_batches)

    ReplicaPretrainingSampler.__qualname__ = ReplicaPretrainingSampler.__name__
    return ReplicaPretrainingSampler
