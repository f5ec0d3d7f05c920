"""Megatron's --num-distributed-optimizer-instances under a plan: applied, a user's value honoured or refused."""
from __future__ import annotations

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
