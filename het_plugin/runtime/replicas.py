"""This rank's share of the global batch under heterogeneous data parallelism, and the checks on it that
both adapters make.

A plan with ``replica_micro_batches`` gives data-parallel replica ``d`` ``counts[d]`` micro-batches per
iteration instead of the even ``num_micro_batches`` (N). The frameworks divide each micro-batch loss by the
count they run and then average the reduced gradient over the ``dp`` replicas, so replica ``d``'s
contribution comes out as ``mean_d / dp`` where the global batch's mean needs ``mean_d * counts[d] / (dp*N)``.
Multiplying the replica's loss (its backward signal) by :attr:`ReplicaShare.loss_scale` ``= counts[d] / N``
(``replica_weight(d) * dp``) closes the gap; on the even split it is 1 and nothing is touched.
Scaling the backward signal, not the reduced gradient, keeps expert parameters right too: their gradients
mix tokens from several replicas, each carrying its own replica's scale.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..core.errors import ConfigError
from ..core.ranks.batches import ReplicaBatches

FIX_PLAN = "launch with the plan's global batch and micro-batch size, or re-create the plan for this launch"


@dataclass(frozen=True)
class ReplicaShare:
    """One rank's replica of the plan's replica split (:class:`ReplicaBatches`: the one value the counts,
    the global batch, the weights and the sample ranges come from)."""
    replica: int                 # the rank's dp coordinate in the plan
    batches: ReplicaBatches      # every replica's micro-batches per iteration, and their size

    @classmethod
    def from_plan(cls, plan, rank: int) -> "ReplicaShare":
        return cls(replica=plan.replica_of(rank), batches=plan.replica_split)

    @property
    def count(self) -> int:
        """Micro-batches this replica runs per iteration."""
        return self.batches.counts[self.replica]

    @property
    def even_count(self) -> int:
        """The plan's num_micro_batches: what every replica runs on the even split."""
        return self.batches.even_count

    @property
    def dp(self) -> int:
        return self.batches.dp

    @property
    def micro_batch_size(self) -> int:
        return self.batches.micro_batch_size

    @property
    def counts(self) -> tuple[int, ...]:
        return self.batches.counts

    @property
    def uneven(self) -> bool:
        return self.batches.uneven

    @property
    def samples(self) -> tuple[int, int]:
        """[start, stop) of the replica's samples within one global batch."""
        return self.batches.samples(self.replica)

    @property
    def local_train_batch_size(self) -> int:
        """micro x this replica's count x dp: the per-rank batch a framework's own batch check expects
        (DeepSpeed's train_batch_size = micro * gas * dp)."""
        return self.micro_batch_size * self.count * self.dp

    @property
    def global_batch_size(self) -> int:
        return self.batches.global_batch_size

    @property
    def weight(self) -> float:
        """The replica's share of the global batch (``Plan.replica_weight``): 1/dp on the even split."""
        return self.batches.weight(self.replica)

    @property
    def loss_scale(self) -> float:
        """Factor on this replica's loss when the framework divides by the replica's own count and averages
        over dp replicas: ``count / even_count`` (1.0 on the even split)."""
        return self.batches.loss_scale(self.replica)

    def describe(self) -> str:
        start, stop = self.samples
        return (f"replica {self.replica} runs {self.count} micro-batches of {self.micro_batch_size} samples per "
                f"iteration (samples [{start}, {stop}) of each global batch of {self.global_batch_size}; the even "
                f"split would be {self.even_count})")

    def check_batch(self, global_batch_size: Optional[int], micro_batch_size: Optional[int], *, source: str,
                    gbs_field: str = "global_batch_size", mbs_field: str = "micro_batch_size") -> None:
        """The launch's global batch and micro-batch size must be the plan's: the counts only add up to the
        global batch the plan was made for (a different one would skew every replica's weight)."""
        if micro_batch_size is not None and micro_batch_size != self.micro_batch_size:
            raise ConfigError(f"{mbs_field}={micro_batch_size}, but the plan's replica micro-batch counts are for "
                              f"micro-batches of {self.micro_batch_size} samples: {self.describe()}", source=source,
                              field=mbs_field, fix=FIX_PLAN)
        if global_batch_size is not None and global_batch_size != self.global_batch_size:
            raise ConfigError(f"{gbs_field}={global_batch_size}, but the plan's replicas split a global batch of "
                              f"{self.global_batch_size} samples: {self.describe()}", source=source,
                              field=gbs_field, fix=FIX_PLAN)

    def count_for(self, num_microbatches: int, *, source: str, field: str = "num_microbatches") -> int:
        """The count a schedule call runs: the even count a script computes from the global batch becomes this
        replica's count; the replica's own count stays; anything else is a batch the plan was not made for."""
        if num_microbatches in (self.even_count, self.count):
            return self.count
        raise ConfigError(f"{field}={num_microbatches}, but the plan splits the global batch of "
                          f"{self.global_batch_size} samples as {self.even_count} micro-batches per replica on the "
                          f"even split: {self.describe()}", source=source, field=field,
                          fix=f"pass {field}={self.even_count} (het_plugin gives each replica its count) with the "
                              "plan's global batch, or re-create the plan for this batch")

    def ran_dry(self, micro_batch: int, *, what: str = "data iterator") -> ConfigError:
        """The error for a replica whose data ended before its count of micro-batches (``micro_batch``:
        1-based number of the one that found no data)."""
        return ConfigError(f"replica {self.replica}'s {what} ran dry at micro-batch {micro_batch} of "
                           f"{self.count} in this iteration: {self.describe()}", field="replica_micro_batches",
                           fix="feed each replica its own sample range of every global batch (het_plugin.core.ranks.batches."
                               "ReplicaSampler, or the adapter's sampler), with at least one whole global batch left")
