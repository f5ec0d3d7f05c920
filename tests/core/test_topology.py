"""Logical numbering equals Megatron-Core's RankGenerator and DeepSpeed's PipeModelDataParallelTopology.

The real frameworks are imported: if either changes its numbering, these tests fail.
"""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from het_plugin.core.ranks.dims import GROUP_KINDS, ParallelDims  # noqa: E402

ps = pytest.importorskip("megatron.core.parallel_state")
pytestmark = pytest.mark.megatron     # compared with the installed Megatron: make test runs it on 0.16.1 and 0.19.2
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


# Megatron-Core's own rank-generator table (tests/unit_tests/test_parallel_state.py,
# test_rank_generator_for_tp_dp_pp): (nodes, accelerators per node, tp, pp, cp, ep).
MEGATRON_TABLE = [
    (1, 1, 1, 1, 1, 1), (1, 8, 8, 1, 1, 1), (1, 8, 2, 2, 1, 1), (1, 8, 2, 4, 1, 1), (3, 8, 8, 3, 1, 1),
    (4, 8, 2, 4, 1, 1), (8, 8, 8, 8, 1, 1), (8, 8, 2, 1, 1, 4), (8, 8, 2, 2, 2, 4), (8, 8, 2, 1, 4, 8),
    (8, 8, 2, 2, 2, 8), (16, 8, 4, 8, 1, 1), (16, 8, 4, 8, 1, 4), (16, 8, 4, 8, 4, 1), (16, 8, 8, 8, 1, 1),
    (16, 8, 4, 8, 1, 1), (16, 8, 8, 8, 1, 1), (32, 8, 4, 8, 1, 1), (32, 8, 8, 8, 1, 1), (32, 8, 4, 8, 1, 4),
    (32, 8, 8, 8, 4, 1), (64, 8, 4, 2, 8, 8), (64, 8, 4, 8, 1, 1), (64, 8, 8, 8, 1, 1), (96, 8, 4, 8, 1, 1),
    (128, 8, 4, 2, 8, 8), (128, 8, 4, 8, 1, 1), (256, 8, 4, 8, 1, 1), (316, 8, 4, 8, 1, 1), (384, 8, 4, 8, 1, 1),
    (512, 8, 4, 8, 1, 1), (768, 8, 4, 8, 1, 1), (1024, 8, 4, 8, 1, 1), (1280, 8, 4, 8, 1, 1),
    (1344, 8, 4, 8, 1, 1),
]
ORDERS = ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"]        # Megatron's default and --use-tp-pp-dp-mapping
EXPERT_TOKENS = ("tp", "ep", "tp-ep", "tp-ep-pp", "dp")


def _megatron_generators(dims: ParallelDims):
    decoder = ps.RankGenerator(tp=dims.tp, ep=1, dp=dims.dp, pp=dims.pp, cp=dims.cp, order=dims.order)
    expert = ps.RankGenerator(tp=dims.etp, ep=dims.ep, dp=dims.expert_dp, pp=dims.pp, cp=1, order=dims.order)
    return decoder, expert


def _assert_megatrons_groups(dims: ParallelDims):
    decoder, expert = _megatron_generators(dims)
    for kind in GROUP_KINDS:
        assert dims.groups(kind) == decoder.get_ranks(kind), kind
    for token in EXPERT_TOKENS:
        assert dims.groups(f"expert-{token}") == expert.get_ranks(token), f"expert-{token}"
    pp_groups = decoder.get_ranks("pp")
    assert dims.groups("embedding") == [ps.default_embedding_ranks(g) for g in pp_groups]
    for s in range(dims.pp):
        assert dims.stage_logical(s) == sorted(g[s] for g in pp_groups)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("nodes,per_node,tp,pp,cp,ep", MEGATRON_TABLE)
def test_megatrons_rank_generator_table_in_both_orders(nodes, per_node, tp, pp, cp, ep, order):
    world = nodes * per_node
    dp = world // (tp * pp * cp)
    if not order.endswith("pp") and pp > 1 and tp * cp * dp // (tp * ep) != dp:
        # Megatron's initialize_model_parallel refuses this (expert and dense dp differ without pp last)
        with pytest.raises(ValueError, match="does not end in pp"):
            ParallelDims(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, order=order)
        return
    dims = ParallelDims(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, order=order)
    assert dims.world_size == world
    _assert_megatrons_groups(dims)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("tp,cp,pp,dp,ep,etp", [(2, 1, 2, 4, 4, 1), (4, 1, 1, 4, 2, 2), (1, 2, 2, 4, 8, 1),
                                                (2, 2, 1, 2, 2, 4), (8, 1, 2, 1, 2, 4), (1, 1, 3, 8, 4, 2)])
def test_expert_tensor_parallel_sizes_other_than_tp(tp, cp, pp, dp, ep, etp, order):
    if not order.endswith("pp") and pp > 1 and tp * cp * dp // (etp * ep) != dp:
        with pytest.raises(ValueError, match="does not end in pp"):    # as Megatron's initialize_model_parallel
            ParallelDims(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, etp=etp, order=order)
        return
    _assert_megatrons_groups(ParallelDims(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, etp=etp, order=order))


@pytest.mark.parametrize("order", ["tp-cp-ep-pp-dp", "tp-dp-pp", "pp-dp-tp-cp-ep", "tp-pp-cp-dp-ep"])
def test_any_order_megatron_accepts_round_trips_to_the_default_order(order):
    dims = ParallelDims(tp=2, cp=1, pp=3, dp=4, order=order)     # cp > 1 with pp not last: Megatron refuses
    _assert_megatrons_groups(dims)
    to_canon = dims.to_canonical()
    assert sorted(to_canon) == list(range(dims.world_size))
    canon = dims.canonical()
    for r in range(dims.world_size):
        assert canon.coord(to_canon[r]) == dims.coord(r)


def test_orders_and_expert_sizes_megatron_refuses_are_refused():
    with pytest.raises(ValueError, match="leaves out ep"):
        ParallelDims(tp=2, dp=4, ep=2, order="tp-cp-dp-pp")
    with pytest.raises(ValueError, match="at most once"):
        ParallelDims(order="tp-tp-dp-pp")
    with pytest.raises(ValueError, match="etp\\*ep = 2\\*4 does not divide tp\\*cp\\*dp = 4"):
        ParallelDims(tp=2, dp=2, ep=4)
