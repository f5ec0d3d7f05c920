"""NCCL options under a plan (issue 31, deliverable 3), on Megatron's real initialize_model_parallel (torch's fake
process group, one rank's view) with a recording stand-in for ProcessGroupNCCL.Options (CPU torch has none):
each group its own options object, the user's per-group settings kept under the plan's network, a note where the
plan replaces the user's net_name, and SHARP refused on a group the plan puts on sockets."""
from __future__ import annotations

import logging
import types

import pytest

from het_plugin.core.errors import ConfigError
from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.planner import make_plan
from het_plugin.megatron import groups as hgroups
from het_plugin.megatron.mcore import original_initialize_model_parallel
from het_plugin.runtime.applied import AppliedPlan
from het_plugin.runtime.group_policy import network_of
from het_plugin.runtime.nccl_options import OptionNotes, copied

from megatron_common import DATA, MODEL

ps = pytest.importorskip("megatron.core.parallel_state")


class Options:
    """Stands in for torch's ProcessGroupNCCL.Options (its constructor argument and its ``config``)."""
    def __init__(self, is_high_priority_stream=False):
        self.is_high_priority_stream = is_high_priority_stream
        self.config = types.SimpleNamespace()


@pytest.fixture(scope="module")
def plan():
    """3 IB nodes + 1 RoCE node, ep=2: expert-DP groups cross fabrics, half their level-0 sub-groups do not."""
    model = MODEL.model_copy(update={"micro_batch_size": 1})
    return make_plan(load_cluster(DATA / "megatron-ib3-roce1-8.yaml"), model, tp=1, pp=1, ep=2)


@pytest.fixture
def nccl_world(monkeypatch):
    """torch's fake process group plus a ProcessGroupNCCL whose Options record; yields start(rank) -> made."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    monkeypatch.setattr(dist, "ProcessGroupNCCL", types.SimpleNamespace(Options=Options), raising=False)
    made = []
    original = dist.new_group

    def recording(*args, pg_options=None, group_desc=None, **kwargs):
        made.append((list(kwargs.get("ranks") or args[0]), group_desc, pg_options))
        return original(*args, group_desc=group_desc, **kwargs)

    monkeypatch.setattr(dist, "new_group", recording)

    def start(rank, plan, **kwargs):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.world_size)
        applied = AppliedPlan.start(plan, rank, "nccl")
        with hgroups.planned_groups(applied, parallel_state=ps):
            original_initialize_model_parallel()(expert_model_parallel_size=2, create_gloo_process_groups=False,
                                                 **kwargs)
        return made

    yield start
    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_shared_options_object_carries_no_network_into_other_groups(plan, nccl_world):
    made = nccl_world(2, plan, num_distributed_optimizer_instances=2, high_priority_stream_groups=["intra_ep_dp"])
    level0 = [(r, o) for r, d, o in made if d == "HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_L0"]
    assert sorted(r for r, _ in level0) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert plan.transport_of([1, 3]) == "ib" and plan.transport_of([4, 6]) == "socket"
    for ranks, options in level0:
        assert options.is_high_priority_stream, "the user's priority stays on every sub-group"
        assert getattr(options.config, "net_name", None) == network_of(plan, ranks), ranks
    written = [o for _, _, o in made if getattr(getattr(o, "config", None), "net_name", None)]
    assert written and len({id(o) for o in written}) == len(written), "each group its own options object"


def test_the_users_settings_compose_with_the_plans_network_and_an_override_is_said_once(plan, nccl_world, tmp_path,
                                                                                        caplog):
    path = tmp_path / "nccl.yaml"
    path.write_text("ep_dp: {net_name: IB, max_ctas: 4, cga_cluster_size: 2}\nep: {net_name: IB, min_ctas: 2}\n")
    with caplog.at_level(logging.WARNING, logger="het_plugin.megatron"):
        made = nccl_world(0, plan, nccl_communicator_config_path=str(path))
    expert_dp = [(r, o) for r, d, o in made if d == "EXPERT_DATA_PARALLEL_GROUP"]
    assert len(expert_dp) == 2
    for ranks, options in expert_dp:
        assert plan.transport_of(ranks) == "socket"
        assert vars(options.config) == {"net_name": "Socket", "max_ctas": 4, "cga_cluster_size": 2}
    ep = [o for r, d, o in made if d == "EXPERT_MODEL_PARALLEL_GROUP"]
    assert ep and all(vars(o.config) == {"net_name": "IB", "min_ctas": 2} for o in ep), \
        "a group the plan leaves to NCCL's choice keeps the user's network"
    notes = [r.getMessage() for r in caplog.records if "net_name 'IB'" in r.getMessage()]
    assert len(notes) == 1 and "EXPERT_DATA_PARALLEL_GROUP" in notes[0] and "'Socket'" in notes[0]


def test_only_rank_0_says_it(plan, nccl_world, tmp_path, caplog):
    path = tmp_path / "nccl.yaml"
    path.write_text("ep_dp: {net_name: IB}\n")
    with caplog.at_level(logging.WARNING, logger="het_plugin.megatron"):
        nccl_world(3, plan, nccl_communicator_config_path=str(path))
    assert not [r for r in caplog.records if "net_name" in r.getMessage()]


def test_sharp_on_a_group_the_plan_puts_on_sockets_is_refused_with_the_fix(plan, nccl_world):
    assert plan.transport_of(plan.groups["dp-cp"][0].ranks) == "socket"
    with pytest.raises(ConfigError) as e:
        nccl_world(0, plan, use_sharp=True)
    assert e.value.field == "use_sharp" and "--use-sharp" in e.value.fix
    assert "DATA_PARALLEL_GROUP_WITH_CP" in str(e.value)


def test_sharp_inside_one_fabric_passes_and_a_config_can_ask_for_collnet():
    notes = OptionNotes(0)
    assert notes.check("DATA_PARALLEL_GROUP_WITH_CP", [0, 2], None, None, env={"NCCL_COLLNET_ENABLE": "1"}) is None
    asked = Options()
    asked.config.collnet_enable = 1
    with pytest.raises(ConfigError, match="collnet_enable"):
        notes.check("DATA_PARALLEL_GROUP", [0, 7], asked, "Socket", env={})


def test_a_copy_keeps_every_setting_and_shares_nothing():
    mine = Options(is_high_priority_stream=True)
    mine.config.max_ctas, mine.config.net_name = 8, "IB"
    twin = copied(mine)
    assert twin is not mine and twin.config is not mine.config
    assert twin.is_high_priority_stream and vars(twin.config) == vars(mine.config)
    twin.config.net_name = "Socket"
    assert mine.config.net_name == "IB"


def test_groups_a_caller_makes_from_a_grids_enumeration_get_the_plans_network(plan8, monkeypatch):
    """Megatron-LM main's inference shards and MiMo make the embedding groups ([first, last] and [first] of each
    pipeline list of HyperCommGrid.get_rank_enum) with dist.new_group themselves: under the plan those get the
    plan's network and member order through the group policy, recorded; a new_group over other members is torch's
    own. A recording fake of new_group under the run-long patches."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from het_plugin.megatron import late_groups
    hyper = pytest.importorskip("megatron.core.hyper_comm_grid")
    monkeypatch.setattr(dist, "ProcessGroupNCCL", types.SimpleNamespace(Options=Options), raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("NCCL_COLLNET_ENABLE", raising=False)     # Megatron's SHARP test above may leave it set
    made = []
    original = dist.new_group

    def recording(ranks=None, **kwargs):
        made.append((list(ranks), dict(kwargs)))
        kwargs.pop("pg_options", None)            # the stand-in Options are not the fake backend's
        return original(ranks, **kwargs)

    monkeypatch.setattr(dist, "new_group", recording)
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=plan8.world_size)
    applied = AppliedPlan.start(plan8, 1, "nccl")
    try:
        assert late_groups.install(applied)
        grid = hyper.HyperCommGrid([2, 1, 2, 2], ["tp", "cp", "dp", "pp"])
        pipelines = grid.get_rank_enum("pp")
        assert pipelines == [g.ranks for g in plan8.groups["pp"]]
        for pp in pipelines:
            made.clear()
            dist.new_group(ranks=[pp[0], pp[-1]])
            ((members, kwargs),) = made
            assert members == [pp[0], pp[-1]], "stage order: the first stage is group rank 0"
            assert plan8.transport_of(pp) == "socket"
            assert kwargs["pg_options"].config.net_name == network_of(plan8, pp) == "Socket"
            dist.new_group(ranks=[pp[0]], pg_options=Options(is_high_priority_stream=True))
            assert made[-1][1]["pg_options"].is_high_priority_stream, "the caller's options stay"
        assert sum(r.desc == "HYPER_COMM_GRID_RANKS" for r in applied.records) == 2 * len(pipelines)
        made.clear()
        outside = sorted(next(g.ranks for g in plan8.groups["dp"] if 1 in g.ranks))
        dist.new_group(ranks=outside)
        assert made == [(outside, {})], "not from the grid's lists: torch's own"
        before = len(applied.records)
        grid.create_pg("pp")                       # het_plugin's own creation: through the policy once
        assert [r.desc for r in applied.records[before:]] == ["HYPER_COMM_GRID"] * len(pipelines)
    finally:
        late_groups.uninstall()
        dist.destroy_process_group()
