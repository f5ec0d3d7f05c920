"""Which samples each data-parallel replica reads under an uneven split (het_plugin.core.ranks.batches)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from het_plugin.core.ranks.batches import ReplicaBatches, ReplicaSampler
from het_plugin.core.errors import ConfigError


@settings(max_examples=80, deadline=None)
@given(counts=st.lists(st.integers(1, 6), min_size=1, max_size=5), mbs=st.integers(1, 4),
       iterations=st.integers(1, 4), extra=st.integers(0, 30), start=st.integers(0, 2))
def test_every_sample_of_each_global_batch_is_read_exactly_once(counts, mbs, iterations, extra, start):
    batches = ReplicaBatches(tuple(counts), mbs)
    g = batches.global_batch_size
    total = (start + iterations) * g + min(extra, g - 1)        # a trailing incomplete batch is dropped
    read = [list(ReplicaSampler(total, start * g, batches, d)) for d in range(len(counts))]
    for d, mbs_read in enumerate(read):
        assert len(mbs_read) == iterations * counts[d] == len(ReplicaSampler(total, start * g, batches, d))
        assert all(len(mb) == mbs for mb in mbs_read)
    for i in range(start, start + iterations):                  # iteration by iteration: the same samples
        this = sorted(x for d, mbs_read in enumerate(read)
                      for mb in mbs_read[(i - start) * counts[d]:(i - start + 1) * counts[d]] for x in mb)
        assert this == list(range(i * g, (i + 1) * g))


def test_replica_ranges_follow_the_counts_and_even_split_matches_dp_order():
    b = ReplicaBatches((3, 1), 2)
    assert b.samples(0) == (0, 6) and b.samples(1) == (6, 8)
    assert b.micro_batches(1, 2) == [[22, 23]]
    even = ReplicaBatches.even(dp=2, num_micro_batches=2, micro_batch_size=2)
    assert even.global_batch_size == b.global_batch_size == 8
    assert [even.samples(d) for d in range(2)] == [(0, 4), (4, 8)]


@pytest.mark.parametrize("make, field", [
    (lambda: ReplicaBatches((2, 0), 1), "replica_micro_batches"),
    (lambda: ReplicaBatches((2, 2), 0), "micro_batch_size"),
    (lambda: ReplicaSampler(100, 5, ReplicaBatches((2, 2), 1), 0), "consumed_samples"),
    (lambda: ReplicaSampler(100, 0, ReplicaBatches((2, 2), 1), 2), "replica"),
])
def test_bad_split_or_resume_point_is_named(make, field):
    with pytest.raises(ConfigError) as info:
        make()
    assert info.value.field == field and info.value.fix
