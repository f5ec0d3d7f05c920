"""Heterogeneous data parallelism on stock DeepSpeed: each replica runs its own number of micro-batches.

A plan with ``replica_micro_batches`` gives data-parallel replica ``d`` ``counts[d]`` micro-batches per
iteration instead of the even ``num_micro_batches`` (the global batch is unchanged). On DeepSpeed that is:

* **Config, per rank** (:func:`rank_config`): ``gradient_accumulation_steps`` = the replica's count and
  ``train_batch_size`` = micro x count x dp, so DeepSpeed's check ``train_batch_size = micro * gas * dp``
  holds on every rank; after start-up the engine's ``train_batch_size()`` is set back to the true global
  batch (throughput, ``global_samples`` and sample-based schedules then agree on every rank).
* **Gradient weight** (:func:`apply_replica_split`): DeepSpeed divides each micro-batch's loss by gas and
  averages gradients over dp ranks, so replica ``d`` would weigh ``1/dp`` whatever its share. Dividing by
  the plan's even count ``n = num_micro_batches`` instead (``backward``, the per-tensor hook of
  torch-style backward, the pipeline's last-stage backward step, and ``_scale_loss_by_gas`` of the
  pipeline loss) makes it ``counts[d]/(n*dp)`` = ``replica_weight(d)``: the reduced gradient and the
  pipeline's aggregated loss are those of the even split.
* **Data**: ``training_data`` is read through :class:`ReplicaSampleOrder` (the replica's contiguous range
  of each global batch of DeepSpeed's own data order, :class:`het_plugin.core.ranks.batches.ReplicaSampler`, so each
  iteration reads the even split's samples); a data iterator given to
  ``train_batch`` is counted and a dry one stops with :class:`ReplicaDataError` naming the numbers.

The engine's methods and instruction map are replaced as layers of :data:`het_plugin.runtime.patches.PATCHES`
(label ``deepspeed.replicas``, order ``BEHAVIOUR``: inside the measured profile's timers whichever was installed
first); :func:`remove_replica_split` takes them off. Even plans never reach this module: DeepSpeed runs untouched. ZeRO stage >= 2 reduces gradients at
every micro-batch, so replicas with different counts would issue different numbers of collectives: refused.
"""
from __future__ import annotations

import copy
import functools
from typing import Any, Optional

from ..core.ranks.batches import ReplicaSampler
from ..core.errors import ConfigError, HetPluginError
from ..runtime.patches import BEHAVIOUR, PATCHES
from ..runtime.replicas import ReplicaShare
from .config import SECTION, check_batch_settings  # noqa: F401   (the batch check is the config's; named here too)
from .loss_weight import weighted_loss
from .samplers import LABEL as SAMPLERS_LABEL, ReplicaSampleOrder, guard_loaders, refuse_unranged, shuffled_order  # noqa: F401 (named here too)

PATCH_LABEL = "deepspeed.replicas"   # this module's engine hooks in het_plugin.runtime.patches.PATCHES


class ReplicaDataError(HetPluginError, RuntimeError):
    """A replica's data ran out before the iteration it was reading ended."""


def rank_config(config: dict, share: ReplicaShare) -> dict:
    """This rank's DeepSpeed config: accumulation = its replica's count, so DeepSpeed's batch check holds."""
    cfg = copy.deepcopy(config)
    cfg["train_micro_batch_size_per_gpu"] = share.micro_batch_size
    cfg["gradient_accumulation_steps"] = share.count
    cfg["train_batch_size"] = share.local_train_batch_size
    return cfg


# ---- the engine ----------------------------------------------------------------------------------------

def apply_replica_split(engine, share: ReplicaShare, training_data: Any = None) -> None:
    """Weight this rank's gradients and loss by its replica's share; read ``training_data`` by replica range."""
    dp_rank = _engine_dp_rank(engine)
    if dp_rank is not None and dp_rank != share.replica:
        raise ConfigError(f"DeepSpeed made this rank data-parallel rank {dp_rank}, the plan replica {share.replica}",
                          field=f"{SECTION}.plan", fix="build the model with het_plugin.deepspeed (PipelineModule / "
                                                       "initialize) and the same wrapped config on every rank")
    engine.het_replica = share
    for name, make in _weights(share.even_count):
        PATCHES.apply(engine, name, make, label=PATCH_LABEL, order=BEHAVIOUR)
    if hasattr(engine, "_INSTRUCTION_MAP"):
        _weight_pipeline_backward(engine, share)
    _count_true_global_batch(engine, share)
    if hasattr(engine, "set_dataiterator"):
        _guard_data_iterator(engine, share)
    if training_data is not None:
        _read_replica_range(engine, share, training_data)
    guard_loaders(engine, share)          # deepspeed_io / set_dataloader read the replica's range (samplers.py)


def remove_replica_split(engine) -> int:
    """Take this module's hooks, and the loader checks it installed, off ``engine`` (the other labels' hooks stay,
    re-made over DeepSpeed's own)."""
    return PATCHES.undo(PATCH_LABEL, owner=engine) + PATCHES.undo(SAMPLERS_LABEL, owner=engine)


def _weights(n: int):
    """``(attribute, wrapper factory)`` of the engine's loss and gradient scaling: divide by the plan's even
    count ``n`` where DeepSpeed divides by gas."""

    def backward(inner):
        @functools.wraps(inner)
        def scaled_backward(loss, retain_graph=False, scale_wrt_gas=True):
            if scale_wrt_gas:
                loss = loss / n
            return inner(loss, retain_graph=retain_graph, scale_wrt_gas=False)
        return scaled_backward

    def backward_prologue_per_tensor(inner):
        # DeepSpeed's hook for loss.backward() outside engine.backward: grad / gas there, grad / n here
        # (where DeepSpeed leaves the gradient alone, so do we).
        @functools.wraps(inner)
        def scaled_prologue(grad):
            scaled = inner(grad)
            return scaled if scaled is grad else grad / n
        return scaled_prologue

    def scale_loss_by_gas(inner):
        # The pipeline's total loss (sum over this replica's micro-batches) / n, averaged over dp by DeepSpeed:
        # the global batch's mean loss. Evaluation (eval_micro_batches given) is DeepSpeed's own.
        @functools.wraps(inner)
        def scaled_loss(prescaled_loss, eval_micro_batches=None):
            return inner(prescaled_loss, eval_micro_batches=n if eval_micro_batches is None else eval_micro_batches)
        return scaled_loss

    return (("backward", backward), ("_backward_prologue_per_tensor", backward_prologue_per_tensor),
            ("_scale_loss_by_gas", scale_loss_by_gas))


def _weight_pipeline_backward(engine, share: ReplicaShare) -> None:
    """The pipeline's last stage calls ``DeepSpeedEngine.backward`` through ``super()`` (past the instance's
    ``backward``), dispatched from the class's instruction map: this engine gets its own map whose backward
    step scales the loss by count / n first, so DeepSpeed's division by gas (= count) leaves loss / n."""
    import torch
    from deepspeed.runtime.pipe import schedule
    factor = share.count / share.even_count

    def weighted_map(table):
        pipeline_backward = table[schedule.BackwardPass]

        def exec_backward_pass(self, buffer_id):
            if self.is_last_stage() and isinstance(self.loss, torch.Tensor):
                self.loss = weighted_loss(self.loss, factor)     # in fp32: bf16 seeds stay the even split's
            return pipeline_backward(self, buffer_id)

        return {**table, schedule.BackwardPass: exec_backward_pass}

    PATCHES.apply(engine, "_INSTRUCTION_MAP", weighted_map, label=PATCH_LABEL, order=BEHAVIOUR)


def _engine_dp_rank(engine) -> Optional[int]:
    mpu = getattr(engine, "mpu", None)
    if mpu is not None and hasattr(mpu, "get_data_parallel_rank"):
        return mpu.get_data_parallel_rank()
    return getattr(engine, "global_rank", None)


def _count_true_global_batch(engine, share: ReplicaShare) -> None:
    """DeepSpeed's batch check has passed with the local train_batch_size; everything that counts samples
    afterwards (global_samples, throughput, sample-based LR steps) should see the global batch, on every rank."""
    engine._config.train_batch_size = share.global_batch_size
    timer = getattr(engine, "batch_timer", None)
    if timer is not None and hasattr(timer, "batch_size"):
        timer.batch_size = share.global_batch_size


# ---- data -------------------------------------------------------------------------------------------------

def replica_batch_sampler(engine, total_samples: int, consumed_samples: int = 0) -> ReplicaSampler:
    """For users who build their own loader: ``DataLoader(dataset, batch_sampler=replica_batch_sampler(engine,
    len(dataset)))`` reads exactly this rank's replica range of every global batch (any plan, even or not)."""
    plan = getattr(engine, "het_plan", None)
    if plan is None:
        raise ConfigError("the engine was not built by het_plugin.deepspeed.initialize with a heterogeneous section",
                          field=SECTION, fix="build the engine with hds.initialize and the wrapped config")
    share = ReplicaShare.from_plan(plan, engine.het_applied.rank)
    return ReplicaSampler(total_samples, consumed_samples, share.batches, share.replica)


def _read_replica_range(engine, share: ReplicaShare, dataset) -> None:
    """Replace the loaders DeepSpeed built over ``training_data`` (a DistributedSampler's even split)."""
    if not hasattr(dataset, "__len__"):
        raise ConfigError("training_data is an iterable dataset; with an uneven replica split each replica must "
                          "read its own range of every global batch", field="training_data",
                          fix="pass a map-style Dataset, or build the loader with hds.replica_batch_sampler")
    pipeline = hasattr(engine, "set_dataloader")
    # The even split's data order: DeepSpeed's pipeline loader reads in order; its plain loader deals out a
    # shuffled permutation (DistributedSampler's default). Each global batch keeps the even split's samples.
    sampler = None if pipeline else _sampler_of(engine.training_dataloader)
    order = ReplicaSampleOrder(len(dataset), share, **_even_split_shuffle(sampler))
    if len(order) == 0:
        raise ConfigError(f"training_data has {len(dataset)} samples, less than one global batch of "
                          f"{share.global_batch_size}", field="training_data", fix="give at least one global batch")
    engine.training_dataloader = engine.deepspeed_io(dataset, data_sampler=order)
    if pipeline:                                # the pipeline engine reads a repeating loader on its end stages
        from deepspeed.utils import RepeatingLoader
        engine.set_dataloader(RepeatingLoader(engine.deepspeed_io(dataset, data_sampler=order)))


def _even_split_shuffle(sampler) -> dict:
    """How a shuffling DistributedSampler orders the data (its global batch ``i`` is positions
    ``[i*G, (i+1)*G)`` of its permutation, dealt round-robin): its seed and epoch; {} when it reads in order."""
    from torch.utils.data import DistributedSampler
    if not isinstance(sampler, DistributedSampler) or not sampler.shuffle:
        return {}
    return {"shuffle_seed": sampler.seed, "epoch": sampler.epoch}


class CountedIterator:
    """A pipeline's data iterator that knows how many micro-batches the replica needs per iteration."""

    def __init__(self, inner, share: ReplicaShare):
        self.inner = inner
        self.share = share
        self.taken = 0

    def __iter__(self):
        return self

    def __next__(self):
        try:
            batch = next(self.inner)
        except StopIteration:
            count = self.share.count
            done, into = divmod(self.taken, count)
            raise ReplicaDataError(
                f"the data iterator of {self.share.describe()} ran dry after {self.taken} micro-batches: "
                f"{done} full iterations and {into} of the {count} micro-batches of iteration {done + 1}; it must "
                f"yield {count} x iterations micro-batches (wrap it in deepspeed.utils.RepeatingLoader, or build "
                f"the loader with hds.replica_batch_sampler so every replica's data ends at the same iteration)"
            ) from None
        self.taken += 1
        return batch


def _guard_data_iterator(engine, share: ReplicaShare) -> None:
    def guarded(inner):
        @functools.wraps(inner)
        def set_dataiterator(iterator):
            _refuse_even_sampler(iterator, share)
            if isinstance(iterator, CountedIterator):
                return inner(iterator)
            current = getattr(engine, "data_iterator", None)
            if isinstance(current, CountedIterator) and current.inner is iterator:
                return inner(current)                   # train_batch(it) with the same iterator every step
            return inner(CountedIterator(iterator, share))
        return set_dataiterator

    PATCHES.apply(engine, "set_dataiterator", guarded, label=PATCH_LABEL, order=BEHAVIOUR)


def _refuse_even_sampler(iterator, share: ReplicaShare) -> None:
    """A loader whose sampler is not this replica's range (any class: samplers.refuse_unranged) is refused."""
    refuse_unranged(iterator, share, field="data_iter")


def _sampler_of(obj, depth: int = 0):
    if obj is None or depth > 3:
        return None
    for name in ("data_sampler", "sampler"):        # DeepSpeedDataLoader, DataLoader
        s = getattr(obj, name, None)
        if s is not None and not callable(getattr(s, "__next__", None)):
            inner = getattr(s, "sampler", None)       # a BatchSampler around it
            return inner if type(s).__name__ == "BatchSampler" and inner is not None else s
    index_sampler = getattr(obj, "_index_sampler", None)   # a DataLoader's iterator
    if index_sampler is not None:
        return getattr(index_sampler, "sampler", index_sampler)
    return _sampler_of(getattr(obj, "loader", None), depth + 1)   # RepeatingLoader
