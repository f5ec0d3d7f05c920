"""The group mechanism without processes: RankGenerator lists become the plan's, transports, backends."""
from __future__ import annotations


import pytest

from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.megatron import groups as hgroups
from het_plugin.megatron.mcore import resolve_megatron_plan
from het_plugin.core.planner import placeable_degrees
from het_plugin.views.report import startup_summary
from het_plugin.runtime.applied import AppliedPlan
from het_plugin.core.errors import ConfigError
from het_plugin.core.planner import make_plan
from het_plugin.core.plan import Plan

from megatron_common import DATA, MODEL


def test_rank_generator_returns_the_plans_groups(plan8):
    from megatron.core import parallel_state as ps
    original = ps.RankGenerator.get_ranks
    with hgroups.planned_groups(AppliedPlan.start(plan8, 0, "gloo"), parallel_state=ps):
        gen = ps.RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp")
        for kind in ("tp", "pp", "dp", "dp-cp", "tp-pp", "tp-dp", "tp-dp-cp", "cp", "tp-cp"):
            assert gen.get_ranks(kind) == [g.ranks for g in plan8.groups[kind]], kind
        # the expert generator (ep=1) is numbered the same way and gets the same permutation
        expert = ps.RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp")
        assert expert.get_ranks("tp-ep-pp") == [g.ranks for g in plan8.groups["tp-pp"]]
    assert ps.RankGenerator.get_ranks is original
    assert ps.RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp").get_ranks("pp") == \
        [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_identity_plan_leaves_megatrons_lists():
    from megatron.core import parallel_state as ps
    plan = make_plan(load_cluster(DATA / "megatron-homogeneous-4.yaml"), MODEL, tp=2, pp=2)
    assert plan.is_identity
    plain = ps.RankGenerator(tp=2, ep=1, dp=1, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    expected = {k: plain.get_ranks(k) for k in ("tp", "pp", "dp", "tp-pp")}
    with hgroups.planned_groups(AppliedPlan.start(plan, 0, "gloo"), parallel_state=ps):
        assert {k: plain.get_ranks(k) for k in expected} == expected


def test_resolve_plan_respects_degrees_and_says_what_would_work(tmp_path):
    cluster = DATA / "megatron-ib-roce-4.yaml"
    plan = resolve_megatron_plan(cluster, model=MODEL, world_size=4, tp=1, pp=2)
    assert (plan.tp, plan.pp, plan.dp) == (1, 2, 2)
    with pytest.raises(ConfigError) as e:
        resolve_megatron_plan(cluster, model=MODEL, world_size=4, tp=2, pp=2)
    assert "cannot be placed" in str(e.value) and "tp=1 pp=2" in str(e.value)
    with pytest.raises(ConfigError, match="launched"):
        resolve_megatron_plan(cluster, model=MODEL, world_size=8)
    # a plan file: loaded, and degrees that contradict it are refused
    path = tmp_path / "plan.json"
    plan.save(path)
    assert resolve_megatron_plan(path, world_size=4).hash == plan.hash
    with pytest.raises(ConfigError, match="pipeline_model_parallel_size"):
        resolve_megatron_plan(path, world_size=4, pp=4)
    with pytest.raises(ConfigError, match="world_size"):
        resolve_megatron_plan(path, world_size=2)
    other = MODEL.model_copy(update={"num_layers": 7})
    with pytest.raises(ConfigError, match="num_layers=5, this run has 7"):
        resolve_megatron_plan(path, model=other, world_size=4)
    assert resolve_megatron_plan(path, model=MODEL, world_size=4).hash == plan.hash


def test_placeable_degrees_hold_on_the_cluster():
    cluster = load_cluster(DATA / "megatron-ib-roce-8.yaml")
    ok = placeable_degrees(cluster, MODEL)
    assert (2, 2) in ok and (1, 4) in ok
    assert all(tp <= 2 for tp, _ in ok), "TP stays inside a 2-accelerator node"


def test_summary_names_clusters_layers_and_transports(plan8):
    text = startup_summary(plan8, "Megatron")
    assert plan8.hash in text
    for s, n in enumerate(plan8.layers_per_stage):
        assert f"stage {s}: {n} layers" in text
    assert "ib/H100" in text and "roce/A100-80" in text and "pp=socket" in text
    assert isinstance(Plan.from_dict(plan8.to_dict()), Plan)


def test_create_group_wrapper_sets_network_order_and_backend(plan8, monkeypatch):
    """Each creation: GLOO_SOCKET_IFNAME from the group's transport, sort_ranks=False for a permuted member
    list, Megatron's own args."""
    import os
    import types

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    seen = []

    def fake_new_group(**kwargs):
        seen.append({"ifname": os.environ.get("GLOO_SOCKET_IFNAME"), **kwargs})
        return object()

    def megatron_create_group(ranks=None, timeout=None, backend=None, pg_options=None,
                              use_local_synchronization=False, group_desc=None):
        # what parallel_state.create_group does: call torch.distributed.new_group
        return dist.new_group(ranks=ranks, timeout=timeout, backend=backend, pg_options=pg_options,
                              use_local_synchronization=use_local_synchronization, group_desc=group_desc)

    monkeypatch.setattr(dist, "new_group", fake_new_group)
    monkeypatch.setenv("HET_PLUGIN_GLOO_IFNAMES", "ib=fab0,roce=fab1,socket=eth0,local=lo")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    fake_ps = types.SimpleNamespace(RankGenerator=ps.RankGenerator, create_group=megatron_create_group)
    pp = plan8.groups["pp"][2].ranks
    dp_roce = next(g.ranks for g in plan8.groups["dp"] if g.transport == "roce")
    with hgroups.planned_groups(AppliedPlan.start(plan8, 0, "gloo"), parallel_state=fake_ps) as applied:
        fake_ps.create_group(pp, group_desc="PIPELINE_MODEL_PARALLEL_GROUP")
        fake_ps.create_group(dp_roce, backend="gloo", group_desc="DATA_PARALLEL_GROUP_GLOO")
        fake_ps.create_group(plan8.groups["tp"][0].ranks, group_desc="TENSOR_MODEL_PARALLEL_GROUP")
    assert fake_ps.create_group is megatron_create_group and dist.new_group is fake_new_group
    assert [s["ifname"] for s in seen] == ["eth0", "fab1", "lo"]
    for s in seen:
        assert s.get("sort_ranks", True) is (s["ranks"] == sorted(s["ranks"])), s
    assert pp != sorted(pp), "the plan permutes this pipeline (else the test shows nothing)"
    assert seen[0]["ranks"] == pp and seen[1]["backend"] == "gloo"
    assert [c.transport for c in applied.records] == ["socket", "roce", "local"]
    assert [c.desc for c in applied.records][0] == "PIPELINE_MODEL_PARALLEL_GROUP"
    assert "GLOO_SOCKET_IFNAME" not in os.environ


def test_build_groups_passes_plan_degrees_and_megatrons_settings(plan8, monkeypatch, capsys):
    import torch.distributed as dist

    from het_plugin.megatron import mcore as core

    calls = []
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 5)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(core, "original_initialize_model_parallel", lambda: lambda **kw: calls.append(kw))
    applied = core.build_groups(plan8, {"tensor_model_parallel_size": 1, "nccl_communicator_config_path": "mine.yaml",
                                        "distributed_timeout_minutes": 7})
    (kw,) = calls
    assert (kw["tensor_model_parallel_size"], kw["pipeline_model_parallel_size"]) == (plan8.tp, plan8.pp)
    assert kw["distributed_timeout_minutes"] == 7
    assert kw["nccl_communicator_config_path"] == "mine.yaml", "the user's NCCL config reaches Megatron as given"
    assert core.current_plan() is applied and applied.rank == 5 and applied.policy.default_backend == "nccl"
    assert "het_plugin: plan" not in capsys.readouterr().out, "only rank 0 prints the summary"
    with pytest.raises(ConfigError, match="order"):
        core.build_groups(plan8, {"order": "tp-cp-ep-pp-dp"})
    with pytest.raises(ConfigError, match="virtual"):
        core.build_groups(plan8, {"virtual_pipeline_model_parallel_size": 2})


def test_build_groups_on_a_homogeneous_cluster_passes_megatrons_settings_through(monkeypatch, tmp_path, capsys):
    import torch.distributed as dist

    from het_plugin.megatron import mcore as core

    plan = make_plan(load_cluster(DATA / "megatron-homogeneous-4.yaml"), MODEL, tp=2, pp=2)
    calls = []
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(core, "original_initialize_model_parallel", lambda: lambda **kw: calls.append(kw))
    core.build_groups(plan, {"nccl_communicator_config_path": None}, plan_out=tmp_path / "p.json")
    assert calls[0]["nccl_communicator_config_path"] is None
    assert Plan.load(tmp_path / "p.json").hash == plan.hash
    assert capsys.readouterr().out.count("homogeneous: the framework's own groups") == 1


def test_gtp_rematerialisation_is_refused_on_a_permuted_plan_only(plan8):
    from het_plugin.megatron import mcore as core
    with pytest.raises(ConfigError) as e:
        core.check_kwargs_fit(plan8, {"gtp_remat_size": 2})
    assert e.value.field == "gtp_remat_size" and "gtp_remat_size=1" in e.value.fix
    core.check_kwargs_fit(plan8, {"gtp_remat_size": 1})
    identity = make_plan(load_cluster(DATA / "megatron-homogeneous-4.yaml"), MODEL, tp=2, pp=2)
    core.check_kwargs_fit(identity, {"gtp_remat_size": 2})       # Megatron's own numbering: Megatron's to judge
