"""Megatron's --num-distributed-optimizer-instances under a plan: applied, a user's value honoured or refused."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from het_plugin.core.errors import ConfigError
from het_plugin.core.inputs.cluster import cluster_from_dict
from het_plugin.core.planner import assemble_plan, uniform_layers
from het_plugin.core.ranks.dims import ParallelDims
from het_plugin.core.ranks.placement import default_placement
from het_plugin.megatron.dist_opt import FLAG, apply_instances, spanning_instance

from megatron_common import MODEL


def cluster(ib_nodes: int, roce_nodes: int):
    spec = lambda name, kind, count: {"name": name, "fabric": {"type": kind, "gbps": 200},      # noqa: E731
                                      "nodes": [{"count": count, "accelerator": "A100-80", "accelerators_per_node": 2}]}
    return cluster_from_dict({"name": f"ib{ib_nodes}-roce{roce_nodes}",
                              "clusters": [spec("ib", "ib", ib_nodes), spec("roce", "roce", roce_nodes)],
                              "links": [{"between": ["ib", "roce"], "type": "ethernet", "gbps": 25}]})


def plan(ib_nodes: int, roce_nodes: int, instances: int):
    c = cluster(ib_nodes, roce_nodes)
    dims = ParallelDims(tp=2, pp=1, dp=c.world_size // 2)
    return assemble_plan(c, MODEL, default_placement(c, dims), uniform_layers(MODEL.num_layers, 1), 2,
                         distributed_optimizer=True, distributed_optimizer_instances=instances)


def args(instances: int = 1, dist_opt: bool = True):
    return SimpleNamespace(num_distributed_optimizer_instances=instances, use_distributed_optimizer=dist_opt)


def test_the_plans_instances_are_applied_through_megatrons_argument():
    p, a = plan(2, 2, 2), args()
    assert apply_instances(a, p) is None
    assert a.num_distributed_optimizer_instances == 2


def test_without_the_distributed_optimizer_it_is_left_and_said():
    p, a = plan(2, 2, 2), args(dist_opt=False)
    line = apply_instances(a, p)
    assert a.num_distributed_optimizer_instances == 1 and "--use-distributed-optimizer" in line


def test_one_instance_per_fabric_stays_inside_each():
    assert spanning_instance(plan(2, 2, 1), 2) is None
    assert spanning_instance(plan(2, 2, 1), 4) is None     # a rank per instance: nothing spans


def test_a_users_value_that_keeps_instances_in_one_cluster_is_honoured():
    p, a = plan(2, 2, 2), args(4)
    line = apply_instances(a, p)
    assert a.num_distributed_optimizer_instances == 4 and "kept" in line


def test_three_ib_nodes_and_one_roce_node_refuse_two_instances_with_the_reason():
    p = plan(3, 1, 1)
    why = spanning_instance(p, 2)
    assert why is not None and "ib and roce" in why
    with pytest.raises(ConfigError) as e:
        apply_instances(args(2), p)
    assert FLAG in str(e.value) and "cross the link" in str(e.value)


def test_a_count_that_does_not_divide_dp_is_refused_before_megatron_asserts():
    with pytest.raises(ConfigError, match="does not divide"):
        apply_instances(args(3), plan(2, 2, 1))


def test_a_homogeneous_plan_keeps_megatrons_own_groups_and_the_users_value():
    c = cluster_from_dict({"name": "h", "clusters": [{"name": "a", "fabric": {"type": "ib", "gbps": 200}, "nodes": [
        {"count": 4, "accelerator": "A100-80", "accelerators_per_node": 2}]}]})
    dims = ParallelDims(tp=2, pp=1, dp=4)
    p = assemble_plan(c, MODEL, default_placement(c, dims), uniform_layers(MODEL.num_layers, 1), 2,
                      distributed_optimizer=True)
    assert p.is_identity
    a = args(2)
    assert apply_instances(a, p) is not None and a.num_distributed_optimizer_instances == 2


# ---- wired into the adapters: Megatron-LM's args and config container, the Megatron-Core drop-in -----------------

def lm_args(instances: int = 1, dist_opt: bool = True, take: bool = False):
    """What Megatron-LM's parse_args gives apply_plan_to_args (the flags it reads; the rest default)."""
    return SimpleNamespace(num_layers=MODEL.num_layers, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                           context_parallel_size=1, micro_batch_size=1, global_batch_size=8,
                           use_distributed_optimizer=dist_opt, num_distributed_optimizer_instances=instances,
                           overlap_grad_reduce=True, heterogeneous_take_plan_settings=take)


def test_megatron_lm_args_get_the_plans_instances_with_the_distributed_optimizer():
    from het_plugin.megatron.args import apply_plan_to_args
    from het_plugin.megatron.settings import offer
    p, a = plan(2, 2, 2), lm_args()
    assert "num_distributed_optimizer_instances=2" in apply_plan_to_args(a, p)
    assert a.num_distributed_optimizer_instances == 2 and offer(a, p) is None


def test_megatron_lm_args_without_the_distributed_optimizer_stay_at_one_and_rank_0_names_both():
    from het_plugin.megatron.args import apply_plan_to_args
    from het_plugin.megatron.settings import offer
    p, a = plan(2, 2, 2), lm_args(dist_opt=False)
    assert not any("instances" in c for c in apply_plan_to_args(a, p))
    assert a.num_distributed_optimizer_instances == 1 and not a.use_distributed_optimizer
    said = offer(a, p)
    assert "--use-distributed-optimizer" in said and f"{FLAG} is left at 1" in said
    taken = lm_args(dist_opt=False, take=True)              # --heterogeneous-take-plan-settings: both applied
    apply_plan_to_args(taken, p)
    assert taken.use_distributed_optimizer and taken.num_distributed_optimizer_instances == 2
    assert offer(taken, p) is None


def test_megatron_lm_args_keep_a_users_count_or_refuse_one_that_spans_clusters():
    from het_plugin.megatron.args import apply_plan_to_args
    from het_plugin.megatron.settings import offer
    p, a = plan(2, 2, 2), lm_args(4)
    assert not any("instances" in c for c in apply_plan_to_args(a, p))
    assert a.num_distributed_optimizer_instances == 4 and "kept" in offer(a, p)
    with pytest.raises(ConfigError) as e:
        apply_plan_to_args(lm_args(2), plan(3, 1, 1))
    assert e.value.field == FLAG and "ib and roce" in str(e.value)


def test_a_homogeneous_plan_sets_nothing_in_megatron_lm_args():
    from het_plugin.megatron.args import apply_plan_to_args
    c = cluster_from_dict({"name": "h", "clusters": [{"name": "a", "fabric": {"type": "ib", "gbps": 200}, "nodes": [
        {"count": 4, "accelerator": "A100-80", "accelerators_per_node": 2}]}]})
    p = assemble_plan(c, MODEL, default_placement(c, ParallelDims(tp=2, pp=1, dp=4)),
                      uniform_layers(MODEL.num_layers, 1), 2, distributed_optimizer=True)
    a = lm_args()
    assert not any("instances" in x for x in apply_plan_to_args(a, p))
    assert a.num_distributed_optimizer_instances == 1


def container(dist_opt: bool, instances: int = 1):
    from megatron.core.distributed import DistributedDataParallelConfig
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=dist_opt,
                                        num_distributed_optimizer_instances=instances)
    return SimpleNamespace(model=None, ddp=ddp, optimizer=None)


def test_the_config_containers_ddp_config_gets_the_plans_instances():
    from het_plugin.megatron.lm import apply_plan_to_container
    p = plan(2, 2, 2)
    on = container(True)
    assert "ddp.num_distributed_optimizer_instances=2" in apply_plan_to_container(on, p, take_settings=False)
    assert on.ddp.num_distributed_optimizer_instances == 2
    off = container(False)
    assert apply_plan_to_container(off, p, take_settings=False) == []
    assert off.ddp.num_distributed_optimizer_instances == 1
    taken = container(False)
    apply_plan_to_container(taken, p, take_settings=True)
    assert taken.ddp.use_distributed_optimizer and taken.ddp.num_distributed_optimizer_instances == 2
    mine = container(True, 4)
    assert apply_plan_to_container(mine, p, take_settings=False) == []
    assert mine.ddp.num_distributed_optimizer_instances == 4
    with pytest.raises(ConfigError, match="cross the link"):
        apply_plan_to_container(container(True, 2), plan(3, 1, 1), take_settings=False)


def test_the_drop_in_names_the_plans_count_keeps_the_callers_and_refuses_one_that_spans():
    """The drop-in never adds instances itself: the script's DDP, which it does not see, must agree (a tiny trainer
    whose groups got 2 instances and whose DDP had 1 let its replicas drift apart)."""
    from het_plugin.megatron.dist_opt import ARG, groups_kwargs
    p = plan(2, 2, 2)
    kwargs, note = groups_kwargs(p, {"expert_model_parallel_size": 1})
    assert kwargs == {"expert_model_parallel_size": 1} and f"{ARG}=2" in note and "ddp_config_for_plan" in note
    kwargs, note = groups_kwargs(p, {ARG: 4})
    assert kwargs == {ARG: 4} and "kept" in note
    assert groups_kwargs(p, {ARG: 2}) == ({ARG: 2}, None)
    assert groups_kwargs(plan(2, 2, 1), {}) == ({}, None), "one instance planned: Megatron's default, nothing set"
    with pytest.raises(ConfigError) as e:
        groups_kwargs(plan(3, 1, 1), {ARG: 2})
    assert e.value.field == ARG and "ib and roce" in str(e.value)


def test_ddp_config_for_plan_takes_instances_only_when_asked():
    from het_plugin.megatron.pipeline_layout import ddp_config_for_plan
    p = plan(2, 2, 2)
    assert ddp_config_for_plan(p).num_distributed_optimizer_instances == 1        # as initialize_model_parallel's
    assert ddp_config_for_plan(p, num_distributed_optimizer_instances=2).num_distributed_optimizer_instances == 2
    assert ddp_config_for_plan(plan(2, 2, 1)).num_distributed_optimizer_instances == 1


def test_build_groups_refuses_a_count_whose_instances_span_before_any_group(monkeypatch):
    import torch.distributed as dist

    from het_plugin.megatron import mcore
    calls = []
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(mcore, "original_initialize_model_parallel", lambda: lambda **kw: calls.append(kw))
    with pytest.raises(ConfigError, match="cross the link"):
        mcore.build_groups(plan(3, 1, 1), {"num_distributed_optimizer_instances": 2})
    assert calls == []


@pytest.fixture
def holmes_groups():
    """Megatron-Core's own initialize_model_parallel under the Holmes plan, on torch's fake process group at rank 0
    (64 ranks in one process): every group recorded with its transport."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron.core import parallel_state as ps

    from het_plugin.core.inputs.cluster import load_cluster
    from het_plugin.core.inputs.model import preset_model
    from het_plugin.core.planner import make_plan
    from het_plugin.megatron import groups as hgroups
    from het_plugin.megatron.dist_opt import ARG, groups_kwargs
    from het_plugin.megatron.mcore import original_initialize_model_parallel
    from het_plugin.runtime.applied import AppliedPlan
    examples = Path(__file__).resolve().parents[2] / "examples"
    p = make_plan(load_cluster(examples / "clusters" / "holmes-ib-roce.yaml"), preset_model("gpt-7.5b"))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=p.world_size)
    try:
        applied = AppliedPlan.start(p, 0, "nccl")
        kwargs, _ = groups_kwargs(p, {"tensor_model_parallel_size": p.tp, "create_gloo_process_groups": False,
                                     ARG: p.distributed_optimizer_instances})      # as a script running the plan passes it
        with hgroups.planned_groups(applied, parallel_state=ps):
            original_initialize_model_parallel()(**kwargs)
        yield p, applied.records
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def test_holmes_under_two_instances_megatrons_groups_keep_each_instance_in_one_fabric(holmes_groups):
    p, records = holmes_groups
    assert (p.tp, p.pp, p.dp, p.distributed_optimizer_instances) == (2, 1, 32, 2)
    clusters = lambda ranks: {p.node_of(r).cluster for r in ranks}     # noqa: E731
    by_desc = {}
    for r in records:
        by_desc.setdefault(r.desc, []).append(r)
    intra = by_desc["INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP"] + by_desc["INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP"]
    assert len(intra) == 2 * 2 + 2            # a block per instance of each of tp's 2 dp groups; an instance each
    for g in intra:
        assert len(clusters(g.ranks)) == 1 and g.transport in {"ib", "roce"}, (g.desc, g.ranks, g.transport)
    assert {c for g in intra for c in clusters(g.ranks)} == {"ib", "roce"}
    # the shards cross once per rank pair: Megatron's inter-instance groups hold one rank of each fabric
    inter = by_desc["HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_L1"]
    assert len(inter) == p.world_size // 2
    for g in inter:
        assert len(g.ranks) == 2 and clusters(g.ranks) == {"ib", "roce"}
        assert g.transport not in {"ib", "roce", "local"}, (g.ranks, g.transport)
    # the same blocks as the plan's own dp groups cut the way Megatron cuts them (dist_opt.spanning_instance)
    from het_plugin.megatron.dist_opt import spanning_instance
    assert spanning_instance(p, p.distributed_optimizer_instances) is None
    blocks = sorted(sorted(g.ranks[i * 16:(i + 1) * 16]) for g in p.groups["dp-cp"] for i in range(2))
    assert sorted(sorted(g.ranks) for g in by_desc["INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP"]) == blocks
