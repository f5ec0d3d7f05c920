"""A script that builds its own process groups (Megatron-LM's ``pretrain(..., skip_model_parallel_init=True,
pg_collection=...)``, the MiMo pattern: a ``HyperCommGrid`` before ``pretrain``) is served (issue 31): its first
group starts the plan (the ranks agree, through the one start-up), its groups follow the plan, the check at
setup judges the collection it passes; what cannot be placed is refused before the model is built (a multi-module
topology) or before any group (degrees changed after planning). Megatron's real parallel_state and HyperCommGrid on torch's fake process
group (one rank's view), the agreement answered by this rank alone."""
from __future__ import annotations

import inspect
import types

import pytest

from het_plugin.core.errors import ConfigError
from het_plugin.megatron import applied_state, group_check, late_groups, launch_state, lm
from het_plugin.megatron import collection as hcoll
from het_plugin.megatron import mcore as core
from het_plugin.runtime import agreement
from het_plugin.runtime.patches import PATCHES

ps = pytest.importorskip("megatron.core.parallel_state")
hyper = pytest.importorskip("megatron.core.hyper_comm_grid")
RANK = 1


def megatron_args(plan, **changed):
    """Megatron-LM's args after parse_args planned a file (prepare_args wrote the plan's degrees)."""
    values = dict(tensor_model_parallel_size=plan.tp, pipeline_model_parallel_size=plan.pp, context_parallel_size=1,
                  micro_batch_size=plan.micro_batch_size, global_batch_size=None, rampup_batch_size=None,
                  heterogeneous_timeout=None, heterogeneous_nic="cluster.yaml", use_distributed_optimizer=False)
    values.update(changed)
    return types.SimpleNamespace(**values)


@pytest.fixture
def launch(plan8, monkeypatch):
    """Rank 1 of plan8 (a permutation) after parse_args: the plan waits in the launch state, no group exists."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    monkeypatch.delenv("WORLD_SIZE", raising=False)          # HyperCommGrid reads it before the world group
    monkeypatch.setattr(agreement, "agree_on_plan", lambda make, **kw: make())   # one rank's view of the agreement
    monkeypatch.setattr(applied_state, "_current", None)
    monkeypatch.setattr(launch_state, "_state", launch_state.LaunchState())
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=plan8.world_size)

    def start(**changed):
        launch_state.write(launch_state.LaunchState(args=megatron_args(plan8, **changed), source="cluster.yaml",
                                                    plan=plan8))
        late_groups.install_start(lm.start_explicit_groups)
    yield start
    late_groups.uninstall_start()
    core.forget_plan()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def ranks(group):
    import torch.distributed as dist
    return dist.get_process_group_ranks(group)


def mine(plan, kind):
    return next(list(g.ranks) for g in plan.groups[kind] if RANK in g.ranks)


def grid_collection(grid):
    """What MiMo's ``pg_collection_from_grid`` does: the collection read off the grid."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    pgc = ProcessGroupCollection()
    for field, dims in (("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("dp_cp", ["dp", "cp"]), ("cp", "cp"),
                        ("mp", ["tp", "pp"]), ("tp_dp_cp", ["tp", "dp", "cp"])):
        setattr(pgc, field, grid.create_pg(dims))
    return pgc


def test_a_scripts_own_hyper_comm_grid_before_pretrain_starts_the_plan_and_follows_it(plan8, launch):
    launch()
    own = hyper.HyperCommGrid([2, 1, 2, 2], ["tp", "cp", "dp", "pp"])
    assert applied_state.current_plan() is None
    pgc = grid_collection(own)                       # the first create_pg runs the start-up
    applied = applied_state.current_plan()
    assert applied is not None and applied.plan is plan8
    assert not ps.model_parallel_is_initialized(), "Megatron's globals stay the script's to build (none here)"
    for field, kind in (("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("mp", "tp-pp")):
        assert sorted(ranks(getattr(pgc, field))) == sorted(mine(plan8, kind)), field
    assert ranks(pgc.pp) == mine(plan8, "pp"), "pipeline members in stage order"
    assert any(r.desc == "HYPER_COMM_GRID" and r.transport == "socket" for r in applied.records)
    # Megatron's numbering would have put other ranks together: the plan moved this group
    assert sorted(ranks(pgc.dp)) != sorted(next(g for g in PATCHES.original(hyper.HyperCommGrid, "get_rank_enum")(
        own, "dp") if RANK in g))
    assert group_check.check_groups(pgc) >= 7
    # the collection het_plugin offers for such a script: every field from the plan (no Megatron globals to read)
    offered = hcoll.planned_collection()
    assert sorted(ranks(offered.tp)) == sorted(mine(plan8, "tp")) and group_check.check_groups(offered) > 7
    assert PATCHES.labels(hyper.HyperCommGrid, "create_pg") == [late_groups.LABEL], "the start trigger is gone"


def test_a_collection_asked_for_before_any_group_starts_the_plan(plan8, launch):
    launch()
    collection = hcoll.planned_collection(from_plan=True)
    assert applied_state.current_plan().plan is plan8
    assert sorted(ranks(collection.dp_cp)) == sorted(mine(plan8, "dp-cp"))
    assert ranks(collection.pp) == mine(plan8, "pp")
    assert not PATCHES.labels(ps, "create_group") or late_groups.START_LABEL not in PATCHES.labels(ps, "create_group")


def test_a_multi_module_topology_is_refused_before_the_model_is_built(plan8, launch, monkeypatch):
    """MiMo's non-colocated modules: a grid per module over its own ranks (rank_offset), its collection handed to
    pretrain as a MultiModuleProcessGroupCollection. The grids' windows are numbered by the plan (as RL inference
    shards are), but the modules are not the one model the plan places: refused at setup_model_and_optimizer,
    before the model is built, naming the module's group."""
    launch()
    encoder = hyper.HyperCommGrid([2, 1, 1, 2], ["tp", "cp", "dp", "pp"], rank_offset=0)
    language = hyper.HyperCommGrid([2, 1, 1, 2], ["tp", "cp", "dp", "pp"], rank_offset=4)
    modules = {"images": grid_collection(encoder), "language": grid_collection(language)}
    assert sorted(ranks(modules["images"].tp)) == sorted(mine(plan8, "tp")), "the window follows the plan"
    built = []
    training = types.SimpleNamespace(setup_model_and_optimizer=lambda *a, **kw: built.append(kw) or "model")
    group_check.install(training)
    try:
        with pytest.raises(ConfigError) as e:
            training.setup_model_and_optimizer("model_type", pg_collection=types.SimpleNamespace(module_pgs=modules))
    finally:
        PATCHES.undo(group_check.LABEL)
    assert built == [] and e.value.field.startswith("images:") and "without --heterogeneous-nic" in e.value.fix


def test_degrees_the_script_changed_after_planning_are_refused_before_any_group(plan8, launch):
    """MiMo copies its --llm-tp into tensor_model_parallel_size after parse_args planned."""
    import torch.distributed as dist
    launch(tensor_model_parallel_size=4)
    made = []
    real = dist.new_group
    grid = hyper.HyperCommGrid([4, 1, 1, 2], ["tp", "cp", "dp", "pp"])
    with pytest.MonkeyPatch.context() as m:
        m.setattr(dist, "new_group", lambda *a, **kw: made.append(kw) or real(*a, **kw))
        with pytest.raises(ConfigError) as e:
            grid.create_pg("tp")
    assert e.value.field == "--tensor-model-parallel-size" and "tp=2" in str(e.value)
    assert made == [] and applied_state.current_plan() is None


def test_pretrain_with_skip_model_parallel_init_is_served(plan8, launch, monkeypatch):
    """megatron.training (0.19) pretrain calls initialize_megatron(skip_model_parallel_init=True) through its module:
    there het_plugin starts the plan after Megatron's own initialisation, and after setup_model_and_optimizer the
    collection the script passed is checked: the planned one passes, one in Megatron's numbering stops the run."""
    import torch.distributed as dist
    training = pytest.importorskip("megatron.training.training",
                                   reason="megatron-core 0.16.1's wheel has no megatron.training")
    if "skip_model_parallel_init" not in inspect.signature(training.pretrain).parameters:
        pytest.skip("this megatron.training (before 0.19) has no skip_model_parallel_init: nothing to serve")
    assert "skip_model_parallel_init" in inspect.signature(training.initialize_megatron).parameters
    calls = []
    monkeypatch.setattr(training, "initialize_megatron", lambda **kw: calls.append(kw))   # Megatron's: CUDA only
    built = []
    monkeypatch.setattr(training, "setup_model_and_optimizer",
                        lambda *a, **kw: built.append(a) or ("model", "optimizer", "sched"))
    launch()
    late_groups.uninstall_start()        # the script made no group before pretrain
    group_check.install(training, start=lm.start_explicit_groups)
    try:
        training.initialize_megatron(skip_model_parallel_init=True)
        assert calls == [{"skip_model_parallel_init": True}], "Megatron's own initialisation runs first"
        assert applied_state.current_plan().plan is plan8 and not ps.model_parallel_is_initialized()
        planned = hcoll.planned_collection(from_plan=True)
        assert training.setup_model_and_optimizer("model_type", pg_collection=planned)[0] == "model"
        from megatron.core.process_groups_config import ProcessGroupCollection
        theirs = ProcessGroupCollection()
        late_groups.uninstall()          # a group made where het_plugin does not reach: Megatron's numbering
        gen = ps.RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp")
        theirs.dp = dist.new_group(next(g for g in gen.get_ranks("dp") if RANK in g))
        with pytest.raises(ConfigError) as e:
            training.setup_model_and_optimizer("model_type", pg_collection=theirs)
        assert e.value.field == "dp" and "planned_collection(from_plan=True)" in e.value.fix
        assert len(built) == 1, "refused before the model is built"
    finally:
        PATCHES.undo(group_check.LABEL)
