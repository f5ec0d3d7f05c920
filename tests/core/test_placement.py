"""Placement properties over random heterogeneous clusters, transports, and the homogeneous no-op."""
from __future__ import annotations

import os
from math import gcd

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from het_plugin.core.inputs.cluster import cluster_from_dict  # noqa: E402
from het_plugin.core.ranks.placement import default_placement, domain_orders, place, stage_domains, cluster_transport
from het_plugin.core.ranks.dims import GROUP_KINDS, ParallelDims  # noqa: E402

PARTS = ["A100-80", "H100", "MI250X", "MI300X", "other-vendor"]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def clusters(draw, max_clusters: int = 3):
    """1-3 clusters, each with its own fabric and 1-2 node groups of (possibly) different vendors."""
    specs = []
    for ci in range(draw(st.integers(1, max_clusters))):
        groups = [{"count": draw(st.integers(1, 3)), "accelerator": draw(st.sampled_from(PARTS)),
                   "accelerators_per_node": draw(st.sampled_from([1, 2, 4, 8]))}
                  for _ in range(draw(st.integers(1, 2)))]
        specs.append({"name": f"c{ci}",
                      "fabric": {"type": draw(st.sampled_from(["ib", "roce", "ethernet"])),
                                 "gbps": draw(st.sampled_from([100, 400, 800]))},
                      "nodes": groups})
    links = [{"between": [a["name"], b["name"]], "gbps": draw(st.sampled_from([10, 25, 100])),
              "type": draw(st.sampled_from(["ethernet", "ethernet", "ib", "roce"]))}
             for i, a in enumerate(specs) for b in specs[i + 1:]]
    return cluster_from_dict({"name": "random", "clusters": specs, "links": links})


@st.composite
def placed(draw):
    """A random cluster, degrees that fit it, and one of the domain orders the planner may choose."""
    cluster = draw(clusters())
    per_node = gcd(*(n.num_accelerators for n in cluster.nodes))
    tp = draw(st.sampled_from(divisors(per_node)))
    cp = draw(st.sampled_from(divisors(per_node // tp)))
    rest = cluster.world_size // (tp * cp)
    pp = draw(st.sampled_from(divisors(rest)))
    dims = ParallelDims(tp=tp, cp=cp, pp=pp, dp=rest // pp)
    orders = list(domain_orders(cluster))
    order = draw(st.sampled_from(orders))
    return cluster, dims, place(cluster, dims, order)


PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(placed())
def test_placement_is_a_permutation(case):
    cluster, dims, p = case
    assert sorted(p.rank_of_canonical) == list(range(cluster.world_size))


@PROPS
@given(placed())
def test_groups_of_each_kind_are_disjoint_and_cover_all_ranks(case):
    cluster, dims, p = case
    for kind in GROUP_KINDS:
        groups = p.physical_groups(kind)
        flat = [r for g in groups for r in g]
        assert sorted(flat) == list(range(cluster.world_size)), kind
        size = 1
        for part in kind.split("-"):
            size *= getattr(dims, part)
        assert all(len(g) == size for g in groups), kind


@PROPS
@given(placed())
def test_tp_and_cp_never_span_nodes_or_vendors(case):
    cluster, dims, p = case
    for kind in ("tp", "cp", "tp-cp"):
        for g in p.physical_groups(kind):
            assert len({cluster.rank_node[r] for r in g}) == 1, (kind, g)
            assert cluster_transport(cluster, g) == "local"


@PROPS
@given(placed())
def test_dp_stays_in_one_domain_when_the_degrees_allow(case):
    cluster, dims, p = case
    domain_ranks = {}
    for n in cluster.nodes:
        domain_ranks[n.domain] = domain_ranks.get(n.domain, 0) + n.num_accelerators
    fits = all(count % dims.stage_size == 0 for count in domain_ranks.values())
    if not fits:
        return
    assert all(len(doms) == 1 for doms in stage_domains(cluster, p))
    for kind in ("dp", "dp-cp", "tp-dp-cp"):
        for g in p.physical_groups(kind):
            nodes = [cluster.node_of(r) for r in g]
            assert len({n.domain for n in nodes}) == 1, (kind, g)
            t = cluster_transport(cluster, g)
            fabric = nodes[0].fabric.type
            assert t == "local" or t == (fabric if fabric != "ethernet" else "socket"), (kind, t, fabric)


@PROPS
@given(placed())
def test_pipeline_crosses_each_cluster_boundary_once(case):
    cluster, dims, p = case
    for g in p.physical_groups("pp"):
        stage_clusters = [cluster.node_of(r).cluster for r in g]
        crossings = sum(a != b for a, b in zip(stage_clusters, stage_clusters[1:]))
        assert crossings == len(set(stage_clusters)) - 1, stage_clusters


@PROPS
@given(placed())
def test_transport_matches_the_members(case):
    cluster, dims, p = case
    for kind in ("dp", "pp", "embedding"):
        for g in p.physical_groups(kind):
            nodes = [cluster.node_of(r) for r in g]
            t = cluster_transport(cluster, g)
            if len({n.index for n in nodes}) == 1:
                assert t == "local"
            elif len({n.vendor for n in nodes}) > 1:
                assert t == "host-staged"
            elif len({n.cluster for n in nodes}) > 1:
                names = sorted({n.cluster for n in nodes})
                kinds = {n.fabric.type for n in nodes} | {cluster.cluster_link(a, b).kind
                                                          for a in names for b in names if a < b}
                rdma = len(kinds) == 1 and next(iter(kinds)) in ("ib", "roce")
                assert t == (next(iter(kinds)) if rdma else "socket")   # RDMA only when every hop is one kind
            else:
                fabric = nodes[0].fabric.type
                assert t == (fabric if fabric in ("ib", "roce") else "socket")


@settings(max_examples=60, deadline=None)
@given(clusters(), st.data())
def test_default_placement_is_identity_and_place_is_too_on_one_domain(cluster, data):
    rest = cluster.world_size
    pp = data.draw(st.sampled_from(divisors(rest)))
    dims = ParallelDims(pp=pp, dp=rest // pp)
    assert default_placement(cluster, dims).is_identity
    if len(cluster.domains) == 1:
        assert place(cluster, dims).is_identity


def test_holmes_shape_keeps_tp_dp_inside_fabrics(examples_dir):
    from het_plugin.core.inputs.cluster import load_cluster
    cluster = load_cluster(examples_dir / "clusters" / "holmes-ib-roce.yaml")
    p = place(cluster, ParallelDims(tp=8, pp=2, dp=4))
    for kind, expected in (("tp", {"local"}), ("dp", {"ib", "roce"})):
        assert {cluster_transport(cluster, g) for g in p.physical_groups(kind)} == expected
    assert {cluster_transport(cluster, g) for g in p.physical_groups("pp")} == {"socket"}
    # stage 0 in the IB cluster, stage 1 in the RoCE cluster
    assert [[cluster.node_of(r).cluster for r in p.stage_ranks(s)][0] for s in range(2)] == ["ib", "roce"]


def test_domain_orders_keep_clusters_contiguous():
    cluster = cluster_from_dict({"clusters": [
        {"name": "a", "fabric": {"type": "ib", "gbps": 100},
         "nodes": [{"count": 1, "accelerator": "H100", "accelerators_per_node": 2},
                   {"count": 1, "accelerator": "MI300X", "accelerators_per_node": 2}]},
        {"name": "b", "fabric": {"type": "roce", "gbps": 100},
         "nodes": [{"count": 1, "accelerator": "H100", "accelerators_per_node": 2}]}],
        "links": [{"between": ["a", "b"], "gbps": 25}]})
    orders = list(domain_orders(cluster))
    assert orders[0] == tuple(cluster.domains)
    assert len(orders) == len(set(orders)) == 4   # 2 cluster orders x 2 orders inside 'a'
    for order in orders:
        names = [c for c, _ in order]
        assert names == sorted(names, key=names.index)   # a cluster's domains are adjacent
        assert len([i for i in range(1, 3) if names[i] != names[i - 1]]) == 1


def test_place_rejects_a_wrong_domain_order(examples_dir):
    from het_plugin.core.inputs.cluster import load_cluster
    cluster = load_cluster(examples_dir / "clusters" / "holmes-ib-roce.yaml")
    with pytest.raises(ValueError, match="domain order"):
        place(cluster, ParallelDims(dp=64), [("ib", "A100-80")])


def test_baseline_forces_sockets_on_mixed_fabrics(examples_dir):
    from het_plugin.core.inputs.cluster import load_cluster
    from het_plugin.core.ranks.placement import baseline_transport
    holmes = load_cluster(examples_dir / "clusters" / "holmes-ib-roce.yaml")
    homog = load_cluster(examples_dir / "clusters" / "homogeneous-ib.yaml")
    ib_ranks = list(range(0, 32, 8))
    assert cluster_transport(holmes, ib_ranks) == "ib" and baseline_transport(holmes, ib_ranks) == "socket"
    assert baseline_transport(homog, ib_ranks) == "ib"


@pytest.mark.parametrize("tp,cp,pp,dp", [(1, 1, 1, 32), (8, 1, 4, 1), (2, 2, 2, 4), (4, 2, 1, 4), (1, 4, 8, 1),
                                         (2, 1, 4, 4), (8, 1, 1, 4), (1, 1, 32, 1), (4, 1, 2, 4)])
def test_homogeneous_placement_is_megatron_and_deepspeed_default(tp, cp, pp, dp):
    ps = pytest.importorskip("megatron.core.parallel_state")
    ds_topology = pytest.importorskip("deepspeed.runtime.pipe.topology")
    cluster = cluster_from_dict({"clusters": [{"name": "ib", "fabric": {"type": "ib", "gbps": 800},
                                               "nodes": [{"count": 4, "accelerator": "H100",
                                                          "accelerators_per_node": 8}]}]})
    assert cluster.is_homogeneous
    p = place(cluster, ParallelDims(tp=tp, cp=cp, pp=pp, dp=dp))
    assert p.is_identity
    gen = ps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    for kind in GROUP_KINDS:
        assert p.physical_groups(kind) == gen.get_ranks(kind), kind
    assert p.physical_groups("embedding") == [ps.default_embedding_ranks(g) for g in gen.get_ranks("pp")]
    if cp == 1:
        topo = ds_topology.PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
        for kind, axis in (("pp", "pipe"), ("dp", "data"), ("tp", "model")):
            assert p.physical_groups(kind) == topo.get_axis_comm_lists(axis), kind
