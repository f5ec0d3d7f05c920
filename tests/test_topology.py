"""Logical numbering equals Megatron-Core's RankGenerator and DeepSpeed's PipeModelDataParallelTopology.

The real frameworks are imported: if either changes its numbering, these tests fail.
"""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from het_plugin.topology import GROUP_KINDS, ParallelDims  # noqa: E402

ps = pytest.importorskip("megatron.core.parallel_state")
ds_topology = pytest.importorskip("deepspeed.runtime.pipe.topology")

# (tp, cp, pp, dp): a table covering each degree alone, pairs, and all together.
DEGREES = [
    (1, 1, 1, 1), (8, 1, 1, 1), (1, 1, 8, 1), (1, 1, 1, 8), (1, 4, 1, 1),
    (2, 1, 1, 4), (2, 1, 4, 1), (1, 1, 2, 4), (2, 2, 1, 2), (1, 2, 2, 2),
    (2, 1, 2, 2), (4, 1, 2, 8), (8, 1, 4, 2), (2, 2, 2, 2), (4, 2, 2, 4),
    (2, 1, 3, 5), (1, 1, 6, 3), (4, 1, 1, 16), (2, 4, 2, 1), (1, 8, 2, 3),
]


@pytest.mark.parametrize("tp,cp,pp,dp", DEGREES)
def test_every_group_kind_equals_megatron_rank_generator(tp, cp, pp, dp):
    dims = ParallelDims(tp=tp, cp=cp, pp=pp, dp=dp)
    gen = ps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    for kind in GROUP_KINDS:
        assert dims.groups(kind) == gen.get_ranks(kind), kind
    assert dims.groups("embedding") == [ps.default_embedding_ranks(g) for g in gen.get_ranks("pp")]
    assert dims.groups("position_embedding") == [ps.default_position_embedding_ranks(g) for g in gen.get_ranks("pp")]


@pytest.mark.parametrize("tp,cp,pp,dp", [d for d in DEGREES if d[1] == 1])
def test_groups_equal_deepspeed_topology(tp, cp, pp, dp):
    dims = ParallelDims(tp=tp, pp=pp, dp=dp)
    topo = ds_topology.PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    assert dims.groups("pp") == topo.get_axis_comm_lists("pipe")
    assert dims.groups("dp") == topo.get_axis_comm_lists("data")
    assert dims.groups("tp") == topo.get_axis_comm_lists("model")
    for rank in range(dims.world_size):
        c = dims.coord(rank)
        assert topo.get_rank(pipe=c["pp"], data=c["dp"], model=c["tp"]) == rank


@pytest.mark.parametrize("tp,cp,pp,dp", DEGREES)
def test_coord_round_trip(tp, cp, pp, dp):
    dims = ParallelDims(tp=tp, cp=cp, pp=pp, dp=dp)
    seen = set()
    for rank in range(dims.world_size):
        c = dims.coord(rank)
        assert dims.logical_rank(**c) == rank
        seen.add(tuple(sorted(c.items())))
    assert len(seen) == dims.world_size
    # a stage is a contiguous block of tp*cp*dp logical ranks (placement relies on this)
    assert all(dims.coord(r)["pp"] == r // dims.stage_size for r in range(dims.world_size))


def test_bad_degrees():
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        ParallelDims(tp=0)
    with pytest.raises(ValueError, match="ep"):
        ParallelDims(ep=2)
    with pytest.raises(ValueError, match="unknown group kind"):
        ParallelDims(tp=2).groups("tp-xp")
