"""Which samples each data-parallel replica reads when replicas take different shares of the batch.

With heterogeneous data parallelism (``Plan.replica_micro_batches``) replica ``d`` runs ``counts[d]``
micro-batches per iteration instead of the even ``num_micro_batches``. The samples of one iteration stay
those of the even split (the global batch ``i`` is samples ``[i*G, (i+1)*G)`` of the data order, as with
Megatron's ``MegatronPretrainingSampler``); replica ``d`` reads the contiguous range
``Plan.replica_samples(d)`` of it, so every sample is read exactly once per iteration and every replica runs
out of data at the same iteration. Pure Python (lists of indices): usable as a ``torch.utils.data.DataLoader``
``batch_sampler`` and testable without torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from ..errors import ConfigError


FIX_SPLIT = "re-create the plan with `het-plugin plan -o` (or remove replica_micro_batches for the even split)"


@dataclass(frozen=True)
class ReplicaBatches:
    """The replica split of one global batch, as one value: micro-batches per iteration of every replica (dp
    order) and their size. Validated here once; the global batch, each replica's weight, loss factor and sample
    range all follow from it (the Plan, the cost model, both adapters and the samplers read them here)."""
    counts: tuple[int, ...]
    micro_batch_size: int

    def __post_init__(self):
        if self.micro_batch_size < 1:
            raise ConfigError(f"micro_batch_size {self.micro_batch_size}: a micro-batch holds at least one sample",
                              field="micro_batch_size", fix="use a micro-batch size of 1 or more")
        if not self.counts or any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in self.counts):
            raise ConfigError(f"replica micro-batches {list(self.counts)}: every replica needs at least one",
                              field="replica_micro_batches",
                              fix="give every data-parallel replica at least one micro-batch (or re-plan)")

    @classmethod
    def from_plan(cls, plan) -> "ReplicaBatches":
        return plan.replica_split

    @classmethod
    def even(cls, dp: int, num_micro_batches: int, micro_batch_size: int) -> "ReplicaBatches":
        return cls((num_micro_batches,) * dp, micro_batch_size)

    @classmethod
    def of(cls, counts, dp: int, num_micro_batches: int, micro_batch_size: int,
           source: str = "<plan>") -> "ReplicaBatches":
        """A plan's split: ``counts`` (none: the even split) must be dp counts of at least 1 adding up to
        dp * num_micro_batches, the global batch every replica agreed on."""
        counts = list(counts)
        if not counts:
            return cls.even(dp, num_micro_batches, micro_batch_size)
        if len(counts) != dp:
            raise ConfigError(f"replica_micro_batches has {len(counts)} entries for dp={dp} replicas", source=source,
                              field="replica_micro_batches", fix=FIX_SPLIT)
        for d, n in enumerate(counts):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ConfigError(f"replica {d} has {n!r} micro-batches; each replica needs at least 1",
                                  source=source, field="replica_micro_batches", fix=FIX_SPLIT)
        if sum(counts) != dp * num_micro_batches:
            raise ConfigError(f"replica_micro_batches {counts} add up to {sum(counts)} micro-batches, the global "
                              f"batch holds dp x num_micro_batches = {dp} x {num_micro_batches} = "
                              f"{dp * num_micro_batches}", source=source, field="replica_micro_batches", fix=FIX_SPLIT)
        return cls(tuple(counts), micro_batch_size)

    @property
    def dp(self) -> int:
        return len(self.counts)

    @property
    def even_count(self) -> int:
        """The micro-batches every replica runs on the even split of the same global batch."""
        return sum(self.counts) // self.dp

    @property
    def uneven(self) -> bool:
        return len(set(self.counts)) > 1

    @property
    def global_batch_size(self) -> int:
        return sum(self.counts) * self.micro_batch_size

    def weight(self, replica: int) -> float:
        """The replica's share of the global batch: its gradient (a mean over its own samples) times this,
        summed over replicas, is the gradient of the global batch's mean. 1/dp on the even split."""
        return self.counts[replica] / sum(self.counts)

    def loss_scale(self, replica: int) -> float:
        """Factor on the replica's loss where a framework divides by the replica's own count and averages over
        dp replicas: ``count / even_count`` (1.0 on the even split)."""
        return self.counts[replica] * self.dp / sum(self.counts)

    def samples(self, replica: int) -> tuple[int, int]:
        """[start, stop) of the replica's samples within one global batch."""
        start = sum(self.counts[:replica]) * self.micro_batch_size
        return start, start + self.counts[replica] * self.micro_batch_size

    def micro_batches(self, replica: int, iteration: int) -> list[list[int]]:
        """The replica's micro-batches of iteration ``iteration``, as sample indices of the data order."""
        start, stop = self.samples(replica)
        base = iteration * self.global_batch_size
        mbs = self.micro_batch_size
        return [list(range(base + s, base + s + mbs)) for s in range(start, stop, mbs)]


class ReplicaSampler:
    """Batch sampler over ``total_samples`` samples: yields replica ``replica``'s micro-batches, its count of
    them per iteration, starting after ``consumed_samples`` (global, a whole number of global batches, as
    Megatron counts them). Incomplete global batches at the end are dropped, so all replicas run the same
    number of iterations."""

    def __init__(self, total_samples: int, consumed_samples: int, batches: ReplicaBatches, replica: int):
        g = batches.global_batch_size
        if not 0 <= replica < len(batches.counts):
            raise ConfigError(f"replica {replica} is not one of the plan's {len(batches.counts)} data-parallel "
                              "replicas", field="replica", fix="launch the plan's world size")
        if consumed_samples % g:
            raise ConfigError(f"consumed_samples {consumed_samples} is not a whole number of global batches of "
                              f"{g} samples: a replica's share of a partly consumed batch is not defined",
                              field="consumed_samples", fix="resume from a checkpoint taken at an iteration boundary "
                              "with the same global batch size")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.batches = batches
        self.replica = replica

    def __len__(self) -> int:
        """Micro-batches this replica will yield."""
        return self.iterations * self.batches.counts[self.replica]

    @property
    def iterations(self) -> int:
        return max(0, (self.total_samples - self.consumed_samples) // self.batches.global_batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        first = self.consumed_samples // self.batches.global_batch_size
        for i in range(first, first + self.iterations):
            yield from self.batches.micro_batches(self.replica, i)

