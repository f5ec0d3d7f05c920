"""Groups Megatron makes after initialize_model_parallel follow the plan (issue 31, deliverable 1), and the check
after the model and optimizer are built stops a run whose groups do not: Megatron's real parallel_state on torch's
fake process group (one rank's view) under a plan that permutes the launch."""
from __future__ import annotations

import pytest

from het_plugin.core.errors import ConfigError
from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.planner import make_plan
from het_plugin.megatron import group_check, late_groups
from het_plugin.megatron import applied_state
from het_plugin.megatron import mcore as core
from het_plugin.runtime.patches import PATCHES

from megatron_common import DATA, MODEL

ps = pytest.importorskip("megatron.core.parallel_state")
KWARGS = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, create_gloo_process_groups=False)


@pytest.fixture
def started(plan8):
    """build_groups on rank 1 of plan8 (the launch interleaves the fabrics: the plan is a permutation)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not plan8.is_identity
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=plan8.world_size)
    applied = core.build_groups(plan8, KWARGS)
    yield applied
    core.forget_plan()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def ranks(group):
    import torch.distributed as dist
    return dist.get_process_group_ranks(group)


def megatrons_own(plan, kind, rank):
    """The group of ``kind`` holding ``rank`` in Megatron's numbering (what a group made outside the plan has)."""
    gen = ps.RankGenerator(tp=plan.tp, ep=1, dp=plan.dp, pp=plan.pp, cp=plan.cp, order="tp-cp-ep-dp-pp")
    return next(g for g in PATCHES.original(ps.RankGenerator, "get_ranks")(gen, kind) if rank in g)


@pytest.mark.skipif(not hasattr(ps, "create_all_gather_groups"), reason="megatron-core 0.19+ (absent in 0.16)")
def test_the_all_gather_groups_are_the_plans_data_parallel_groups(plan8, started):
    want = next(g.ranks for g in plan8.groups["dp-cp"] if 1 in g.ranks)
    assert sorted(want) != sorted(megatrons_own(plan8, "dp-cp", 1)), "the plan moves this group (else no test)"
    dp_cp_ag, _ = ps.create_all_gather_groups()
    assert sorted(ranks(dp_cp_ag)) == sorted(want)
    made = [r for r in started.records if r.desc == "DATA_PARALLEL_GROUP_WITH_CP_AG"]
    assert sorted(sorted(r.ranks) for r in made) == sorted(sorted(g.ranks) for g in plan8.groups["dp-cp"])
    from megatron.core.process_groups_config import ProcessGroupCollection
    collection = ProcessGroupCollection.use_mpu_process_groups()
    collection.dp_cp_ag = dp_cp_ag
    assert group_check.check_groups(collection) > 10


def test_a_rank_generator_built_after_initialisation_gives_the_plans_groups(plan8, started):
    gen = ps.RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    for kind in ("tp", "pp", "dp", "tp-pp"):
        assert gen.get_ranks(kind) == [g.ranks for g in plan8.groups[kind]], kind
    group = ps.create_group(next(g.ranks for g in plan8.groups["pp"] if 1 in g.ranks), group_desc="LATE_PP")
    assert started.records[-1].desc == "LATE_PP" and started.records[-1].transport == "socket"
    assert ranks(group) == next(g.ranks for g in plan8.groups["pp"] if 1 in g.ranks), "members in stage order"


def test_a_hyper_comm_grid_is_numbered_by_the_plan(plan8, started):
    from megatron.core.hyper_comm_grid import HyperCommGrid
    grid = HyperCommGrid([2, 1, 2, 2], ["tp", "cp", "dp", "pp"])
    for dims, kind in (("dp", "dp"), ("pp", "pp"), (["tp", "pp"], "tp-pp")):
        group = grid.create_pg(dims)
        assert sorted(ranks(group)) == sorted(next(g.ranks for g in plan8.groups[kind] if 1 in g.ranks)), kind
    assert any(r.desc == "HYPER_COMM_GRID" and r.transport == "socket" for r in started.records)
    # the enumeration a caller builds its own groups from (Megatron-LM main's inference embedding groups)
    assert grid.get_rank_enum("pp") == [g.ranks for g in plan8.groups["pp"]]


def test_destroying_megatrons_groups_ends_the_run_long_patches(plan8, started):
    assert PATCHES.labels(ps.RankGenerator, "get_ranks") == [late_groups.LABEL]
    ps.destroy_model_parallel()
    assert PATCHES.labels(ps.RankGenerator, "get_ranks") == [] and PATCHES.labels(ps, "create_group") == []


def test_a_group_made_outside_the_plan_stops_the_run_naming_it(plan8, started):
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection
    late_groups.uninstall()            # as if made by a path het_plugin does not reach
    own = megatrons_own(plan8, "dp-cp", 1)
    collection = ProcessGroupCollection.use_mpu_process_groups()
    collection.dp_cp_ag = dist.new_group(own)
    with pytest.raises(ConfigError) as e:
        group_check.check_groups(collection)
    assert e.value.field == "dp_cp_ag" and str(sorted(own)) in str(e.value)


def test_megatron_lms_setup_is_checked_and_groups_never_built_by_the_plan_are_refused(monkeypatch):
    import types
    monkeypatch.setattr(applied_state, "_current", None)
    training = types.SimpleNamespace(setup_model_and_optimizer=lambda *a, **kw: ("model", "optimizer", "scheduler"),
                                     initialize_megatron=lambda *a, **kw: "initialized")
    group_check.install(training)
    try:
        assert training.initialize_megatron(extra_args_provider=None) == "initialized"
        with pytest.raises(ConfigError) as e:      # no plan was ever applied (lazy_mpu_init, no start-up ran)
            training.setup_model_and_optimizer("model_type", pg_collection=object())
        assert e.value.field == "skip_model_parallel_init" and "initialize_model_parallel" in e.value.fix
    finally:
        PATCHES.undo(group_check.LABEL)


def test_a_homogeneous_plan_patches_nothing_after_initialisation(tmp_path):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    plan = make_plan(load_cluster(DATA / "megatron-homogeneous-4.yaml"), MODEL, tp=2, pp=2)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        core.build_groups(plan, dict(KWARGS))
        assert PATCHES.labels(ps, "create_group") == [] and PATCHES.labels(ps.RankGenerator, "get_ranks") == []
        assert group_check.check_groups() == 0
    finally:
        core.forget_plan()
        ps.destroy_model_parallel()
        dist.destroy_process_group()
