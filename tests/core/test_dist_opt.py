"""Megatron's partial distributed optimizer in the cost model and the planner (cost.dist_opt)."""
from __future__ import annotations

from pathlib import Path

import pytest

from het_plugin.core import cost
from het_plugin.core.cost.dist_opt import instance_blocks, instance_options, instance_span, with_instances
from het_plugin.core.cost.network import GIB, OPTIMIZER_STATE_BYTES
from het_plugin.core.inputs.cluster import cluster_from_dict, load_cluster
from het_plugin.core.inputs.model import preset_model
from het_plugin.core.planner import make_plan, uniform_layers
from het_plugin.core.ranks.dims import ParallelDims
from het_plugin.core.ranks.placement import cluster_transport, default_placement

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "clusters"
MODEL = preset_model("gpt-7.5b")


def holmes():
    return load_cluster(EXAMPLES / "holmes-ib-roce.yaml")


def predict(c, dims, instances, **kw):
    return cost.predict(c, MODEL, default_placement(c, dims), uniform_layers(MODEL.num_layers, dims.pp), 1,
                        distributed_optimizer=True, instances=instances, **kw)


def test_blocks_are_megatrons_consecutive_instances_and_the_groups_across_them():
    blocks, across = instance_blocks([10, 11, 12, 13, 14, 15], 3)
    assert blocks == [[10, 11], [12, 13], [14, 15]]
    assert across == [[10, 12, 14], [11, 13, 15]]
    with pytest.raises(ValueError):
        instance_blocks([1, 2, 3], 2)


def test_instance_options_are_one_or_two_per_fabric():
    assert instance_options(32, 2) == [2, 4]
    assert instance_options(6, 2) == [2]          # 4 does not divide 6
    assert instance_options(2, 2) == []           # an instance of one rank per fabric would be plain DP


def test_memory_and_optimizer_step_are_per_instance():
    c = holmes()
    dims = ParallelDims(tp=8, pp=1, dp=8)
    one, two = predict(c, dims, 1), predict(c, dims, 2)
    params = (MODEL.embedding_params * 2 + MODEL.num_layers * MODEL.params_per_layer) / 8   # per rank (untied)
    extra = params * OPTIMIZER_STATE_BYTES * (2 / 8 - 1 / 8) / GIB
    assert two.memory_gib_per_stage[0] - one.memory_gib_per_stage[0] == pytest.approx(extra, rel=0.05)
    assert two.optimizer_s == pytest.approx(2 * one.optimizer_s)


def test_an_instance_per_fabric_moves_only_the_shards_over_sockets():
    c = holmes()
    dims = ParallelDims(tp=8, pp=1, dp=8)           # every DP group spans both fabrics on sockets
    one, two = predict(c, dims, 1), predict(c, dims, 2)
    assert two.dp_exposed_s < one.dp_exposed_s / 2
    assert two.iteration_s < one.iteration_s


def test_three_ib_nodes_and_one_roce_node_an_instance_spans_and_costs_more():
    spec = lambda name, kind, n: {"name": name, "fabric": {"type": kind, "gbps": 400},      # noqa: E731
                                  "nodes": [{"count": n, "accelerator": "A100-80", "accelerators_per_node": 8}]}
    c = cluster_from_dict({"name": "3-1", "clusters": [spec("ib", "ib", 3), spec("roce", "roce", 1)],
                           "links": [{"between": ["ib", "roce"], "type": "ethernet", "gbps": 25}]})
    dims = ParallelDims(tp=8, pp=1, dp=4)
    analysis = cost.analyze(c, default_placement(c, dims), cluster_transport)
    assert "instance 1" in instance_span(c, analysis, 2) and instance_span(c, analysis, 4) is None
    spanning = with_instances(c, analysis, 2)
    assert any(p.levels[-1].tier.kind == "socket" for st in spanning.stages for p in st.instance_paths)


def test_the_planner_chooses_an_instance_per_fabric_where_data_parallelism_spans_them():
    plan = make_plan(holmes(), MODEL, tp=8, pp=1)
    assert plan.distributed_optimizer and plan.distributed_optimizer_instances == 2
    assert "in 2 instances" in plan.prediction.description
    plain = make_plan(holmes(), MODEL, tp=8, pp=2)     # DP inside each fabric: nothing to gain
    assert plain.distributed_optimizer_instances == 1


def test_deepspeed_plans_without_optimizer_instances():
    """DeepSpeed's pipeline engine has no partial ZeRO: its plans (and their baseline) never use instances."""
    plan = make_plan(holmes(), MODEL, tp=8, pp=1, optimizer_instances=False)
    assert plan.distributed_optimizer_instances == 1
    assert all(a.get("distributed_optimizer_instances", 1) == 1 for a in plan.alternatives)


def test_the_plan_field_is_written_only_when_set():
    from het_plugin.core.plan import Plan
    plain = make_plan(holmes(), MODEL, tp=8, pp=2)
    assert "distributed_optimizer_instances" not in plain.to_dict() and "baseline_previous" not in plain.to_dict()
    two = make_plan(holmes(), MODEL, tp=8, pp=1)
    d = two.to_dict()
    assert d["distributed_optimizer_instances"] == 2
    assert Plan.from_dict(d).hash == two.hash and Plan.from_dict(plain.to_dict()).hash == plain.hash


def test_a_plan_whose_instance_spans_fabrics_says_so():
    """Three IB nodes and one RoCE node, two instances: the second holds the IB node left over and the RoCE one."""
    from het_plugin.core.planner import assemble_plan
    spec = lambda name, kind, n: {"name": name, "fabric": {"type": kind, "gbps": 400},      # noqa: E731
                                  "nodes": [{"count": n, "accelerator": "A100-80", "accelerators_per_node": 8}]}
    c = cluster_from_dict({"name": "3-1", "clusters": [spec("ib", "ib", 3), spec("roce", "roce", 1)],
                           "links": [{"between": ["ib", "roce"], "type": "ethernet", "gbps": 25}]})
    place = default_placement(c, ParallelDims(tp=8, pp=1, dp=4))
    plan = assemble_plan(c, MODEL, place, uniform_layers(MODEL.num_layers, 1), 1, distributed_optimizer=True,
                         distributed_optimizer_instances=2)
    assert any("instance 1" in w and "ib and roce" in w for w in plan.warnings)
    fine = assemble_plan(c, MODEL, place, uniform_layers(MODEL.num_layers, 1), 1, distributed_optimizer=True,
                         distributed_optimizer_instances=4)
    assert not any("instance" in w and "spans clusters" in w for w in fine.warnings)
