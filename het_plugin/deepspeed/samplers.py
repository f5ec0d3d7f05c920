"""Under an uneven replica split, every loader the engine is handed reads the replica's range, or is refused.

Replica ``d`` of an uneven plan runs ``counts[d]`` micro-batches per iteration and must read its contiguous
range of each global batch (``plan.replica_samples(d)``). A sampler that splits evenly (torch's
``DistributedSampler``, a strided ``range(dp_rank, n, dp)``, a per-replica generator) reads an even shard at
an uneven count: the replicas then train on other samples than the even split's, without a word. What
het_plugin can see, it checks or fixes here:

* ``engine.deepspeed_io(dataset)`` for training: without ``data_sampler`` (DeepSpeed would build a
  shuffling ``DistributedSampler``) or with a ``DistributedSampler``, the loader reads the replica's range of
  that sampler's order (:class:`ReplicaSampleOrder`); any other sampler is
  refused. Evaluation routes are DeepSpeed's own.
* ``engine.set_dataloader(loader)`` and ``train_batch(data_iter)`` (through the engine's
  ``set_dataiterator``): a loader (``DataLoader``, ``DeepSpeedDataLoader``, a ``RepeatingLoader`` or a
  loader's iterator) whose sampler is not het_plugin's replica sampler for this replica is refused, whatever
  the sampler's class.

The fix offered is one call, :func:`replica_sampler` (as DeepSpeed's ``data_sampler=`` or a DataLoader's
``sampler=``), or ``training_data=`` to ``initialize``. A bare iterator (a generator of the script's own) has
no sampler to look at: it is counted (``ReplicaDataError`` when it runs dry), and docs/deepspeed.md says it must
read the replica's range.
"""
from __future__ import annotations

import inspect
from typing import Any, Iterator, Optional, Sequence

from ..core.errors import ConfigError
from ..core.ranks.batches import ReplicaSampler
from ..runtime.patches import PATCHES
from ..runtime.replicas import ReplicaShare
from .config import SECTION

LABEL = "deepspeed.samplers"
TRAIN_ROUTE = "train"          # deepspeed.runtime.engine ROUTE_TRAIN
FIX = ("read the replica's range: pass data_sampler=het_plugin.deepspeed.replica_sampler(engine, len(dataset)) to "
       "engine.deepspeed_io (or sampler=... with batch_size=train_micro_batch_size_per_gpu to a DataLoader), or give "
       "the dataset as training_data= to deepspeed.initialize")


def replica_sampler(engine, total_samples: int, consumed_samples: int = 0):
    """Sample indices of this rank's replica range of every global batch (in order), for DeepSpeed's
    ``deepspeed_io(dataset, data_sampler=...)`` or ``DataLoader(dataset, batch_size=micro, sampler=...)``.
    Any plan, even or not; the engine must come from a wrapped config."""
    return ReplicaSampleOrder(total_samples, _share(engine), consumed_samples)


def _share(engine) -> ReplicaShare:
    plan = getattr(engine, "het_plan", None)
    if plan is None:
        raise ConfigError("the engine was not built under a heterogeneous section", field=SECTION,
                          fix="build the engine with the wrapped config (deepspeed.initialize with the import hook, "
                              "or het_plugin.deepspeed.initialize)")
    return ReplicaShare.from_plan(plan, engine.het_applied.rank)


def index_source(obj: Any, depth: int = 0) -> Optional[Any]:
    """What decides which samples ``obj`` (a loader, a loader's iterator, a RepeatingLoader, het_plugin's counted
    iterator) reads: its batch sampler when that is not torch's ``BatchSampler`` wrapper, else its sampler;
    None when no loader is visible (a bare iterator)."""
    if obj is None or depth > 4:
        return None
    from torch.utils.data import BatchSampler, DataLoader
    if isinstance(obj, ReplicaSampler) or _is_replica_order(obj):
        return obj
    if isinstance(obj, DataLoader) or hasattr(obj, "_index_sampler"):       # a loader, or a loader's iterator
        chosen = obj.batch_sampler if isinstance(obj, DataLoader) else obj._index_sampler
        if chosen is None:
            chosen = obj.sampler if isinstance(obj, DataLoader) else None
        return chosen.sampler if isinstance(chosen, BatchSampler) else chosen
    if hasattr(obj, "data_sampler"):                       # DeepSpeedDataLoader
        return obj.data_sampler
    for inner in ("inner", "loader"):                      # CountedIterator, RepeatingLoader
        if hasattr(obj, inner):
            return index_source(getattr(obj, inner), depth + 1)
    return None


def _is_replica_order(obj) -> bool:
    return isinstance(obj, ReplicaSampleOrder)


def reads_replica_range(source: Any, share: ReplicaShare) -> bool:
    """``source`` is het_plugin's sampler of this replica's range (for this plan's split)."""
    sampler = source.batch_sampler if _is_replica_order(source) else source
    return isinstance(sampler, ReplicaSampler) and sampler.replica == share.replica \
        and sampler.batches == share.batches


def refuse_unranged(loader: Any, share: ReplicaShare, field: str = "data_iter") -> None:
    """A ConfigError when ``loader`` visibly reads through a sampler other than this replica's range."""
    source = index_source(loader)
    if source is None or reads_replica_range(source, share):
        return
    described = type(source).__name__
    if described == "DistributedSampler":
        described += f" (the even split over {getattr(source, 'num_replicas', '?')} replicas)"
    raise ConfigError(f"the {type(loader).__name__} handed to the engine reads through a {described}, but "
                      f"{share.describe()}: it would read an even shard at this replica's count", field=field, fix=FIX)


def guard_loaders(engine, share: ReplicaShare) -> None:
    """The engine's ``deepspeed_io`` gives the replica's range (or refuses), ``set_dataloader`` refuses a
    loader that does not read it (instance patches, label ``deepspeed.samplers``)."""

    def io_with_range(deepspeed_io):
        def planned(dataset, *args, **kwargs):
            bound = inspect.signature(deepspeed_io).bind(dataset, *args, **kwargs)
            bound.apply_defaults()
            arguments = bound.arguments
            if arguments.get("route", TRAIN_ROUTE) == TRAIN_ROUTE:
                arguments["data_sampler"] = _replica_order(dataset, arguments.get("data_sampler"), share)
            return deepspeed_io(**arguments)
        return planned

    PATCHES.apply(engine, "deepspeed_io", io_with_range, label=LABEL)
    if hasattr(engine, "set_dataloader"):
        def checked(set_dataloader):
            def planned(loader):
                refuse_unranged(loader, share, field="set_dataloader")
                return set_dataloader(loader)
            return planned
        PATCHES.apply(engine, "set_dataloader", checked, label=LABEL)


def _replica_order(dataset, sampler, share: ReplicaShare):
    """The sampler a training loader over ``dataset`` gets: the replica's range of ``sampler``'s order."""
    from torch.utils.data import DistributedSampler

    if _is_replica_order(sampler):
        if not reads_replica_range(sampler, share):
            raise ConfigError(f"deepspeed_io got the sampler of replica {sampler.batch_sampler.replica}, but "
                              f"{share.describe()}", field="data_sampler", fix=FIX)
        return sampler
    if not hasattr(dataset, "__len__"):
        raise ConfigError(f"deepspeed_io got an iterable dataset, but {share.describe()}: each replica must read "
                          "its own range of every global batch", field="deepspeed_io", fix=FIX)
    if sampler is None:         # DeepSpeedDataLoader's own: DistributedSampler(shuffle=True, seed=0)
        return ReplicaSampleOrder(len(dataset), share, shuffle_seed=0)
    if isinstance(sampler, DistributedSampler):
        order = {"shuffle_seed": sampler.seed, "epoch": sampler.epoch} if sampler.shuffle else {}
        return ReplicaSampleOrder(len(dataset), share, **order)
    raise ConfigError(f"deepspeed_io got data_sampler={type(sampler).__name__}, but {share.describe()}: "
                      "het_plugin cannot give a sampler of its own the replica's range", field="data_sampler", fix=FIX)


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
