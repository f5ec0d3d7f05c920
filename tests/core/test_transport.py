"""The one transport rule: the planner (Cluster), the Plan (node table + links) and the shim agree."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from het_plugin.core.inputs.cluster import cluster_from_dict
from het_plugin.core.errors import ConfigError
from het_plugin.core.inputs.model import ModelSpec
from het_plugin.core.ranks.placement import place, cluster_transport
from het_plugin.core.plan import FORMAT_VERSION, Plan
from het_plugin.core.planner import assemble_plan
from het_plugin.core.ranks.dims import ParallelDims
from het_plugin.core.ranks.transport import Member, transport_rule

from tests.core.test_placement import placed  # noqa: E402  (tests/ is on sys.path under pytest)

KINDS = {("a", "a"): "ib", ("b", "b"): "roce", ("c", "c"): "ib", ("e", "e"): "ethernet",
         ("a", "b"): "ethernet", ("a", "c"): "ib", ("a", "e"): "ethernet", ("b", "c"): "ethernet",
         ("b", "e"): "ethernet", ("c", "e"): "ethernet"}


def kind(x: str, y: str) -> str:
    return KINDS[tuple(sorted((x, y)))]


@pytest.mark.parametrize("members, want", [
    ([("n0", "a", "nv")], "local"),
    ([("n0", "a", "nv"), ("n0", "a", "nv")], "local"),
    ([("n0", "a", "nv"), ("n1", "a", "nv")], "ib"),
    ([("n0", "b", "nv"), ("n1", "b", "nv")], "roce"),
    ([("n0", "a", "nv"), ("n1", "c", "nv")], "ib"),           # two IB clusters joined by IB
    ([("n0", "a", "nv"), ("n1", "b", "nv")], "socket"),       # IB meets RoCE
    ([("n0", "e", "nv"), ("n1", "e", "nv")], "socket"),       # plain Ethernet fabric
    ([("n0", "a", "nv"), ("n1", "a", "amd")], "host-staged"),
    ([("n0", "a", "nv"), ("n0", "a", "amd")], "local"),       # one node is one node, whatever it holds
])
def test_rule(members, want):
    assert transport_rule([Member(*m) for m in members], kind) == want


def _two_ib_clusters_linked_by_ib():
    return cluster_from_dict({
        "name": "two-ib", "links": [{"between": ["x", "y"], "type": "ib", "gbps": 200}],
        "clusters": [{"name": name, "fabric": {"type": "ib", "gbps": 200},
                      "nodes": [{"count": 2, "accelerator": "H100", "accelerators_per_node": 2}]}
                     for name in ("x", "y")]})


def _plan(cluster, dims, order=None):
    model = ModelSpec(num_layers=dims.pp * 2, hidden_size=64, num_attention_heads=4, vocab_size=1000,
                      seq_length=128, global_batch_size=dims.dp * 2)
    return assemble_plan(cluster, model, place(cluster, dims, order), [2] * dims.pp, 1)


def test_plan_uses_the_cluster_links_for_groups_it_does_not_list():
    """Was: Plan.transport_of said 'socket' for the world group across two IB clusters joined by IB (it
    never assumed RDMA between clusters) while the planner said 'ib'."""
    cluster = _two_ib_clusters_linked_by_ib()
    plan = _plan(cluster, ParallelDims(tp=2, pp=2, dp=2))
    world = list(range(plan.world_size))
    assert frozenset(world) not in plan._transport_by_members       # not a planned group: the rule decides
    assert plan.transport_of(world) == cluster_transport(cluster, world) == "ib"
    loaded = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert loaded.transport_of(world) == "ib"


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(placed(), st.data())
def test_plan_and_planner_agree_on_any_rank_set(case, data):
    cluster, dims, placement = case
    plan = _plan(cluster, dims, placement.domain_order)
    for _ in range(5):
        ranks = data.draw(st.lists(st.integers(0, cluster.world_size - 1), min_size=1, max_size=8, unique=True))
        assert plan.transport_of(ranks) == cluster_transport(cluster, ranks)
        assert plan.rule_transport(ranks) == cluster_transport(cluster, ranks)


def test_an_older_plan_names_both_versions_and_the_fix():
    plan = _plan(_two_ib_clusters_linked_by_ib(), ParallelDims(tp=2, pp=2, dp=2))
    data = plan.to_dict()
    data["format_version"] = 1
    with pytest.raises(ConfigError) as info:
        Plan.from_dict(data, "old.json")
    text = str(info.value)
    assert "format_version 1" in text and f"format_version {FORMAT_VERSION}" in text
    assert "het-plugin plan" in info.value.fix and info.value.source == "old.json"


def test_stored_groups_must_follow_from_degrees_and_permutation():
    plan = _plan(_two_ib_clusters_linked_by_ib(), ParallelDims(tp=2, pp=2, dp=2))
    data = plan.to_dict()
    del data["hash"]
    data["groups"]["dp"][0]["ranks"] = list(reversed(data["groups"]["dp"][0]["ranks"]))
    with pytest.raises(ConfigError) as info:
        Plan.from_dict(data)
    assert info.value.field == "groups.dp"
    data = plan.to_dict()
    del data["hash"]
    data["groups"]["tp"][0]["transport"] = "socket"
    with pytest.raises(ConfigError, match="'socket'.*'local'") as info:
        Plan.from_dict(data)
    assert info.value.field == "groups.tp"


def test_group_of_is_indexed():
    plan = _plan(_two_ib_clusters_linked_by_ib(), ParallelDims(tp=2, pp=2, dp=2))
    for kind_ in plan.groups:
        for r in range(plan.world_size):
            assert r in plan.group_of(kind_, r).ranks
    with pytest.raises(KeyError, match="no 'nope' group"):
        plan.group_of("nope", 0)
