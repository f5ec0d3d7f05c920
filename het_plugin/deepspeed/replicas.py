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

Even plans never reach this module: DeepSpeed runs untouched. ZeRO stage >= 2 reduces gradients at
every micro-batch, so replicas with different counts would issue different numbers of collectives: refused.
"""
from __future__ import annotations

import copy
import types
from typing import Any, Iterator, Optional, Sequence

from ..core.ranks.batches import ReplicaSampler
from ..core.errors import ConfigError, HetPluginError
from ..core.plan import Plan
from ..runtime.replicas import ReplicaShare
from .config import SECTION, BatchSettings

FIX_CONFIG = ("give the config the plan's batch: train_batch_size = global batch, train_micro_batch_size_per_gpu = "
              "the plan's micro-batch size, gradient_accumulation_steps = the plan's even count (or leave them out); "
              "het_plugin sets each rank's accumulation steps to its replica's count")


class ReplicaDataError(HetPluginError, RuntimeError):
    """A replica's data ran out before the iteration it was reading ended."""


# ---- checks before any group exists ------------------------------------------------------------------

def check_batch_settings(plan: Plan, config: dict, source: str = "<config>") -> None:
    """An uneven plan fixes the batch: the config may restate it but not contradict it (even plans: no-op)."""
    if not plan.uneven_replicas:
        return
    batch = BatchSettings.of(config, source)
    counts = plan.replica_counts
    expected = {"train_batch_size": (batch.train_batch_size, plan.global_batch_size),
                "train_micro_batch_size_per_gpu": (batch.micro_batch_size, plan.micro_batch_size),
                "gradient_accumulation_steps": (batch.grad_accum, plan.num_micro_batches)}
    for key, (given, wanted) in expected.items():
        if given is not None and given != wanted:
            raise ConfigError(f"{key} is {given}, but the plan splits a global batch of {plan.global_batch_size} "
                              f"samples ({plan.micro_batch_size} per micro-batch) unevenly over {plan.dp} replicas, "
                              f"micro-batches {counts} (even count {plan.num_micro_batches}); {key} must be {wanted}",
                              source=source, field=key, fix=FIX_CONFIG)
    stage = zero_stage(config)
    if stage >= 2:
        raise ConfigError(f"ZeRO stage {stage} reduces gradients at every micro-batch, so replicas running "
                          f"different numbers of micro-batches {counts} would issue different numbers of collectives",
                          source=source, field="zero_optimization.stage",
                          fix="use ZeRO stage 0 or 1 with an uneven replica split, or a plan with the even split")


def zero_stage(config: dict) -> int:
    zero = config.get("zero_optimization") or {}
    return int(zero.get("stage", 0)) if isinstance(zero, dict) else 0


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
    n = share.even_count
    engine.het_replica = share
    original_backward = engine.backward

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        if scale_wrt_gas:
            loss = loss / n
        return original_backward(loss, retain_graph=retain_graph, scale_wrt_gas=False)

    original_per_tensor = engine._backward_prologue_per_tensor

    def backward_prologue_per_tensor(self, grad):
        # DeepSpeed's hook for loss.backward() outside engine.backward: grad / gas there, grad / n here
        # (where DeepSpeed leaves the gradient alone, so do we).
        scaled = original_per_tensor(grad)
        return scaled if scaled is grad else grad / n

    original_scale = engine._scale_loss_by_gas

    def scale_loss_by_gas(self, prescaled_loss, eval_micro_batches=None):
        # The pipeline's total loss (sum over this replica's micro-batches) / n, averaged over dp by DeepSpeed:
        # the global batch's mean loss. Evaluation (eval_micro_batches given) is DeepSpeed's own.
        divisor = n if eval_micro_batches is None else eval_micro_batches
        return original_scale(prescaled_loss, eval_micro_batches=divisor)

    engine.backward = types.MethodType(backward, engine)
    if hasattr(engine, "_INSTRUCTION_MAP"):
        _weight_pipeline_backward(engine, share)
    engine._backward_prologue_per_tensor = types.MethodType(backward_prologue_per_tensor, engine)
    engine._scale_loss_by_gas = types.MethodType(scale_loss_by_gas, engine)
    _count_true_global_batch(engine, share)
    if hasattr(engine, "set_dataiterator"):
        _guard_data_iterator(engine, share)
    if training_data is not None:
        _read_replica_range(engine, share, training_data)
    from .samplers import guard_loaders
    guard_loaders(engine, share)          # deepspeed_io / set_dataloader read the replica's range (samplers.py)


def _weight_pipeline_backward(engine, share: ReplicaShare) -> None:
    """The pipeline's last stage calls ``DeepSpeedEngine.backward`` through ``super()`` (past the instance's
    ``backward``), dispatched from the class's instruction map: this engine gets its own map whose backward
    step scales the loss by count / n first, so DeepSpeed's division by gas (= count) leaves loss / n."""
    import torch
    from deepspeed.runtime.pipe import schedule

    from .loss_weight import weighted_loss
    pipeline_backward = engine._INSTRUCTION_MAP[schedule.BackwardPass]
    factor = share.count / share.even_count

    def exec_backward_pass(self, buffer_id):
        if self.is_last_stage() and isinstance(self.loss, torch.Tensor):
            self.loss = weighted_loss(self.loss, factor)     # in fp32: bf16 seeds stay the even split's
        return pipeline_backward(self, buffer_id)

    engine._INSTRUCTION_MAP = {**engine._INSTRUCTION_MAP, schedule.BackwardPass: exec_backward_pass}


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

class ReplicaSampleOrder:
    """Sample indices (a ``sampler`` for DeepSpeed's loader, batch size = micro): the replica's micro-batches
    of every complete global batch of ``total_samples`` (:class:`het_plugin.core.ranks.batches.ReplicaSampler`), as
    positions in the data order: ``order`` (None: 0, 1, 2, ...), or with ``shuffle_seed`` the permutation a
    shuffling DistributedSampler deals out, redrawn by :meth:`set_epoch` as DistributedSampler's is (so each
    epoch's global batches hold the samples the even split's would)."""

    def __init__(self, total_samples: int, share: ReplicaShare, consumed_samples: int = 0,
                 order: Optional[Sequence[int]] = None, shuffle_seed: Optional[int] = None, epoch: int = 0):
        self.batch_sampler = ReplicaSampler(total_samples, consumed_samples, share.batches, share.replica)
        self.total_samples = total_samples
        self.shuffle_seed = shuffle_seed
        self.order = order
        self.set_epoch(epoch)

    def set_epoch(self, epoch: int) -> None:
        """DistributedSampler's ``set_epoch``: a shuffled order is redrawn with seed + epoch."""
        self.epoch = epoch
        if self.shuffle_seed is not None:
            self.order = shuffled_order(self.shuffle_seed + epoch, self.total_samples)

    def __iter__(self) -> Iterator[int]:
        for micro_batch in self.batch_sampler:
            yield from (micro_batch if self.order is None else (self.order[i] for i in micro_batch))

    def __len__(self) -> int:
        return len(self.batch_sampler) * self.batch_sampler.batches.micro_batch_size


def shuffled_order(seed: int, total_samples: int) -> list[int]:
    """The permutation DistributedSampler(shuffle=True) draws for ``seed`` (its seed + epoch)."""
    import torch
    gen = torch.Generator()
    gen.manual_seed(seed)
    return torch.randperm(total_samples, generator=gen).tolist()


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
    original = engine.set_dataiterator

    def set_dataiterator(self, iterator):
        _refuse_even_sampler(iterator, share)
        if isinstance(iterator, CountedIterator):
            return original(iterator)
        current = getattr(self, "data_iterator", None)
        if isinstance(current, CountedIterator) and current.inner is iterator:
            return original(current)                # train_batch(it) with the same iterator every step
        return original(CountedIterator(iterator, share))

    engine.set_dataiterator = types.MethodType(set_dataiterator, engine)


def _refuse_even_sampler(iterator, share: ReplicaShare) -> None:
    """A loader whose sampler is not this replica's range (any class: samplers.refuse_unranged) is refused."""
    from .samplers import refuse_unranged
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
