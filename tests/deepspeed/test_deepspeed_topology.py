"""PlanTopology against DeepSpeed's own topologies, the plan's partition, and per-group transports."""
from __future__ import annotations

import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("deepspeed")

from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology  # noqa: E402

from het_plugin.core.inputs.cluster import cluster_from_dict  # noqa: E402
from het_plugin.deepspeed import groups as dsgroups  # noqa: E402
from het_plugin.deepspeed.partition import counted_layers, layers_in_parts, plan_parts  # noqa: E402
from het_plugin.deepspeed.process_topology import PlanTopology  # noqa: E402
from het_plugin.core.errors import ConfigError  # noqa: E402
from het_plugin.core.inputs.model import ModelSpec  # noqa: E402
from het_plugin.core.ranks.placement import place  # noqa: E402
from het_plugin.core.planner import assemble_plan, uniform_layers  # noqa: E402
from het_plugin.runtime.applied import AppliedPlan  # noqa: E402
from het_plugin.core.ranks.dims import ParallelDims  # noqa: E402

MODEL = ModelSpec(name="m", num_layers=8, hidden_size=16, num_attention_heads=1, vocab_size=16, seq_length=4,
                  global_batch_size=64, micro_batch_size=1)


def homogeneous(nodes: int, per_node: int) -> dict:
    return {"name": "homo", "clusters": [{"name": "ib", "fabric": {"type": "ib", "gbps": 400},
                                          "nodes": [{"count": nodes, "accelerator": "A100-80",
                                                     "accelerators_per_node": per_node}]}]}


def interleaved(per_node: int, amd: bool = False) -> dict:
    """IB (H100) and RoCE (A100, or MI250X when ``amd``) nodes launched alternately."""
    return {"name": "het", "clusters": [
        {"name": "ib", "fabric": {"type": "ib", "gbps": 400},
         "nodes": [{"count": 2, "accelerator": "H100", "accelerators_per_node": per_node, "hostnames": ["i0", "i1"]}]},
        {"name": "roce", "fabric": {"type": "roce", "gbps": 200},
         "nodes": [{"count": 2, "accelerator": "MI250X" if amd else "A100-80", "accelerators_per_node": per_node,
                    "hostnames": ["r0", "r1"]}]}],
        "links": [{"between": ["ib", "roce"], "gbps": 25}],
        "launch": {"node_order": ["i0", "r0", "i1", "r1"]}}


def plan_for(data: dict, pp: int, tp: int, dp: int, layers=None, reverse_domains: bool = False):
    cluster = cluster_from_dict(data)
    order = list(reversed(cluster.domains)) if reverse_domains else None
    placement = place(cluster, ParallelDims(tp=tp, pp=pp, dp=dp), order)
    return assemble_plan(cluster, MODEL, placement, layers or uniform_layers(MODEL.num_layers, pp), 1)


@pytest.mark.parametrize("nodes, per_node, pp, tp", [
    (1, 1, 1, 1), (2, 2, 2, 1), (2, 2, 1, 2), (2, 4, 2, 2), (4, 2, 4, 2), (2, 4, 4, 1), (4, 4, 2, 4), (8, 1, 8, 1),
])
def test_homogeneous_plan_topology_is_deepspeeds(nodes, per_node, pp, tp):
    world = nodes * per_node
    plan = plan_for(homogeneous(nodes, per_node), pp, tp, world // (pp * tp))
    ours = PlanTopology(plan)
    theirs = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=world // (pp * tp))
    assert plan.is_identity
    assert ours.mapping == theirs.mapping
    for axis in ("pipe", "data", "model"):
        assert ours.get_axis_comm_lists(axis) == theirs.get_axis_comm_lists(axis)


@pytest.mark.parametrize("per_node, pp, tp", [(1, 2, 1), (2, 2, 2), (2, 2, 1), (2, 4, 1)])
def test_permuted_plan_topology_answers_every_query_from_the_plan(per_node, pp, tp):
    world = 4 * per_node
    dp = world // (pp * tp)
    plan = plan_for(interleaved(per_node), pp, tp, dp)
    assert not plan.is_identity
    topo = PlanTopology(plan)
    # Groups: DeepSpeed's axis lists are the plan's groups, member order included.
    assert topo.get_axis_comm_lists("data") == [g.ranks for g in plan.groups["dp"]]
    assert topo.get_axis_comm_lists("pipe") == [g.ranks for g in plan.groups["pp"]]
    assert topo.get_axis_comm_lists("model") == [g.ranks for g in plan.groups["tp"]]
    for rank in range(world):
        coord = plan.coord(rank)
        assert topo.get_coord(rank) == topo.ProcessCoord(pipe=coord["pp"], data=coord["dp"], model=coord["tp"])
        assert topo.get_rank(pipe=coord["pp"], data=coord["dp"], model=coord["tp"]) == rank
    for stage in range(pp):
        expected = sorted(plan.rank_of_logical[stage * tp * dp:(stage + 1) * tp * dp])
        assert sorted(topo.filter_match(pipe=stage)) == expected
        assert sorted(topo.get_axis_list("pipe", stage)) == expected
    # The parent's linear search and our index agree.
    parent = super(PlanTopology, topo)
    assert all(parent.get_coord(r) == topo.get_coord(r) for r in range(world))
    with pytest.raises(ValueError):
        topo.get_coord(world)


def test_stage_neighbours_follow_the_plan():
    """DeepSpeed's engine sends to stage_to_global(stage + 1): it must be the plan's next pipeline member."""
    plan = plan_for(interleaved(2), 2, 2, 2)
    topo = PlanTopology(plan)
    for group in plan.groups["pp"]:
        first, second = group.ranks
        me = topo.get_coord(first)
        assert topo.get_rank(**me._replace(pipe=1)._asdict()) == second


# ---- partition ------------------------------------------------------------------------------------

NAMES = ["InProj"] + ["Block"] * 8 + ["Head"]


def test_plan_parts_place_unplanned_layers_with_their_neighbours():
    counted = counted_layers(NAMES, "Block")
    assert counted == list(range(1, 9))
    assert plan_parts(len(NAMES), counted, [5, 3]) == [0, 6, 10]      # InProj on stage 0, Head on the last
    assert plan_parts(len(NAMES), counted, [2, 3, 3]) == [0, 3, 6, 10]
    assert counted_layers([None, "Block", "TransformerBlock", "head"], "^block$") == [1]


def test_plan_parts_without_pattern_count_every_entry():
    assert plan_parts(4, counted_layers(["a", None, "b", "c"], None), [1, 3]) == [0, 1, 4]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=6), st.integers(0, 3), st.integers(0, 3))
def test_plan_parts_give_each_stage_its_planned_count(split, lead, tail):
    names = ["Embed"] * lead + ["Block"] * sum(split) + ["Head"] * tail
    counted = counted_layers(names, "Block")
    parts = plan_parts(len(names), counted, split)
    assert parts[0] == 0 and parts[-1] == len(names)
    assert all(a < b for a, b in zip(parts, parts[1:]))
    assert layers_in_parts(parts, counted) == split


def test_plan_parts_reject_a_plan_for_a_different_layer_count():
    with pytest.raises(ConfigError) as err:
        plan_parts(len(NAMES), counted_layers(NAMES, None), [5, 3])
    assert err.value.field == "heterogeneous.model.num_layers" and "10 counted layers" in str(err.value)
    with pytest.raises(ConfigError, match="empty"):
        plan_parts(3, [0, 1, 2], [3, 0])


# ---- per-group transport --------------------------------------------------------------------------

def test_group_transports_come_from_the_plan():
    plan = plan_for(interleaved(2), 2, 2, 2)
    applied = AppliedPlan.start(plan, 0, "gloo")
    for kind in ("tp", "dp", "pp"):
        for g in plan.groups[kind]:
            assert applied.spec(list(reversed(g.ranks))).transport == g.transport
    assert {g.transport for g in plan.groups["dp"]} == {"ib", "roce"}
    assert applied.spec(range(8)).transport == "socket"           # the world group: both clusters
    assert applied.spec([3]).transport == "local"


def test_groups_spanning_vendors_are_host_staged():
    import het_plugin.comm  # noqa: F401   the shim's backend, as the adapter registers it (deepspeed/groups.py)
    plan = plan_for(interleaved(1, amd=True), 2, 1, 2)
    assert plan.transport_of(range(4)) == "host-staged"
    assert {g.transport for g in plan.groups["pp"]} == {"host-staged"}
    assert AppliedPlan.start(plan, 0, "gloo").spec(plan.groups["pp"][0].ranks).transport == "host-staged"


def test_nccl_options_select_the_network(monkeypatch):
    import torch.distributed as tdist

    from het_plugin.runtime.group_policy import with_net_name

    class FakeOptions:
        def __init__(self):
            self.config = types.SimpleNamespace(net_name=None)

    monkeypatch.setattr(tdist, "ProcessGroupNCCL", types.SimpleNamespace(Options=FakeOptions), raising=False)
    assert with_net_name(None, "IB").config.net_name == "IB"
    assert with_net_name(None, "Socket").config.net_name == "Socket"
    monkeypatch.delattr(tdist, "ProcessGroupNCCL")
    assert with_net_name(None, "IB") is None, "a torch without NCCL: nothing to select"


def test_planning_model_derived_from_the_layer_list():
    import torch
    from deepspeed.pipe import LayerSpec

    from het_plugin.deepspeed.config import BatchSettings
    from het_plugin.deepspeed.pipe import layer_name, model_from_layers

    specs = [LayerSpec(torch.nn.Embedding, 10, 48)] + [LayerSpec(torch.nn.Linear, 48, 48) for _ in range(6)]
    counted = counted_layers([layer_name(s) for s in specs], "Linear")
    assert counted == list(range(1, 7))
    spec = model_from_layers(specs, counted, BatchSettings(24, 2, 3), dp=4, tp=4)
    assert spec.num_layers == 6 and spec.global_batch_size == 24 and spec.micro_batch_size == 2
    assert spec.hidden_size % spec.num_attention_heads == 0 and spec.num_attention_heads == 4
    assert abs(spec.hidden_size - 14) <= 2          # 48*48+48 parameters ~ 12*h*h with h = 14


class FakeDist:
    """Records what the DeepSpeed patch site hands torch.distributed.new_group."""

    def __init__(self, monkeypatch, backend: str):
        import os

        import torch.distributed as tdist
        self.calls = []

        def new_group(ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization=False,
                      group_desc=None, device_id=None, sort_ranks=True):
            self.calls.append({"ranks": ranks, "backend": backend, "pg_options": pg_options, "sort_ranks": sort_ranks,
                               "ifname": os.environ.get("GLOO_SOCKET_IFNAME")})
            return object()

        class FakeOptions:
            def __init__(self):
                self.config = types.SimpleNamespace(net_name=None)

        monkeypatch.setattr(tdist, "new_group", new_group)
        monkeypatch.setattr(tdist, "get_backend", lambda group=None: backend)
        monkeypatch.setattr(tdist, "ProcessGroupNCCL", types.SimpleNamespace(Options=FakeOptions), raising=False)


def test_new_group_on_nccl_sets_net_name_and_keeps_plan_order(monkeypatch):
    fake = FakeDist(monkeypatch, "nccl")
    plan = plan_for(interleaved(2), 2, 2, 2, reverse_domains=True)      # the RoCE nodes hold stage 0
    applied = AppliedPlan.start(plan, 0)
    planned = plan.groups["dp"] + plan.groups["pp"] + plan.groups["tp"]
    for g in planned:
        dsgroups.new_group(applied, g.ranks)
    for call, g in zip(fake.calls, planned):
        # only 'Socket' is forced; RDMA groups keep NCCL's own network (no cluster file declares one here)
        expected = {"ib": None, "roce": None, "socket": "Socket", "local": None}[g.transport]
        assert call["ranks"] == g.ranks and call["backend"] is None
        assert (call["pg_options"].config.net_name if call["pg_options"] else None) == expected
        assert call["sort_ranks"] == (g.ranks == sorted(g.ranks))
    assert {c["pg_options"].config.net_name for c in fake.calls if c["pg_options"]} == {"Socket"}
    assert any(g.transport in ("ib", "roce") for g in planned)
    assert any(c["sort_ranks"] is False for c in fake.calls)            # pipeline groups run [roce, ib]
    assert [r.transport for r in applied.records] == [g.transport for g in planned]


def test_new_group_on_gloo_sets_the_interface_per_transport(monkeypatch):
    fake = FakeDist(monkeypatch, "gloo")
    monkeypatch.setenv("HET_PLUGIN_GLOO_IFNAMES", "ib=fab_ib,roce=fab_roce,socket=eth9,local=lo")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "before")
    plan = plan_for(interleaved(2), 2, 2, 2)
    applied = AppliedPlan.start(plan, 0)
    for g in plan.groups["dp"] + plan.groups["pp"]:
        dsgroups.new_group(applied, g.ranks)
    wanted = {"ib": "fab_ib", "roce": "fab_roce", "socket": "eth9", "local": "lo"}
    assert [c["ifname"] for c in fake.calls] == [wanted[g.transport] for g in plan.groups["dp"] + plan.groups["pp"]]
    assert all(c["pg_options"] is None for c in fake.calls)
    import os
    assert os.environ["GLOO_SOCKET_IFNAME"] == "before"


def test_new_group_across_vendors_uses_the_shim(monkeypatch):
    comm = pytest.importorskip("het_plugin.comm")
    fake = FakeDist(monkeypatch, "gloo")
    plan = plan_for(interleaved(1, amd=True), 2, 1, 2)
    applied = AppliedPlan.start(plan, 0)
    for g in plan.groups["pp"] + plan.groups["dp"]:
        dsgroups.new_group(applied, g.ranks)
    backends = [c["backend"] for c in fake.calls]
    assert backends == ["het_shim"] * len(plan.groups["pp"]) + [None] * len(plan.groups["dp"])
    for call in fake.calls[:len(plan.groups["pp"])]:     # each shim group gets the plan's vendors itself
        assert isinstance(call["pg_options"], comm.ShimOptions)
        assert call["pg_options"].vendors == {r: plan.vendor_of(r) for r in range(plan.world_size)}
    assert comm.declared_vendor_map() is None, "no process-wide state"
