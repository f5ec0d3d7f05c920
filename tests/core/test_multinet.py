"""NCCL's multi-network communicator as a transport ('multinet'), charged as the cross-dc branch runs it, and
the NCCL builds that have it (fake versions: no GPU)."""
from __future__ import annotations

from pathlib import Path

import pytest

from het_plugin.core import cost
from het_plugin.core.cost.analysis import _collective_path
from het_plugin.core.cost.network import MultinetPath, Tier
from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.inputs.model import preset_model
from het_plugin.core.nccl_version import ALLNET_RELEASE, CURRENT_RELEASE, NcclBuild, parse_build
from het_plugin.core.plan import Plan
from het_plugin.core.planner import assemble_plan, make_plan, uniform_layers
from het_plugin.core.ranks.dims import ParallelDims
from het_plugin.core.ranks.placement import cluster_transport, default_placement, multinet_transport
from het_plugin.core.ranks.transport import Member, Transport, nccl_net_name, transport_rule

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "clusters"


def holmes():
    return load_cluster(EXAMPLES / "holmes-ib-roce.yaml")


def kind(a: str, b: str) -> str:
    return {"a": "ib", "b": "roce"}[a] if a == b else "ethernet"


# ---- which NCCL has it ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text, multinet", [
    (None, False), ("2.30.7", False), ("2.26.2", False),        # releases: none carries NCCL_ALLNET_ENABLE
    ("2.26.2+cross-dc", True), ("cross-dc", True),             # NVIDIA/nccl's cross-dc branch
    ("rccl:2.21.5", False), ("rccl:2.26.2+cross-dc", False),   # RCCL: none
])
def test_which_builds_join_networks(text, multinet):
    assert parse_build(text).multinet is multinet


def test_no_release_is_assumed_to_have_it_and_the_default_is_the_newest_release():
    assert ALLNET_RELEASE is None
    assert NcclBuild().version == CURRENT_RELEASE and not NcclBuild().multinet


def test_a_bad_build_names_the_accepted_forms():
    with pytest.raises(ValueError, match="cross-dc"):
        parse_build("2.26.2+xdc")
    with pytest.raises(ValueError, match="2.30.7"):
        parse_build("new")


# ---- the transport rule ----------------------------------------------------------------------------------

@pytest.mark.parametrize("members, want", [
    ([("n0", "a"), ("n1", "a"), ("n2", "b")], "multinet"),     # two IB nodes and a RoCE node: IB hop stays RDMA
    ([("n0", "a"), ("n2", "b"), ("n3", "b")], "multinet"),
    ([("n0", "a"), ("n2", "b")], "socket"),                    # one node per side: every hop crosses anyway
    ([("n0", "a"), ("n1", "a")], "ib"),                        # inside one fabric: unchanged
])
def test_multinet_only_where_a_fabric_holds_two_of_the_nodes(members, want):
    ms = [Member(n, c, "nvidia") for n, c in members]
    assert transport_rule(ms, kind, multinet=True) == want
    assert transport_rule(ms, kind) == ("socket" if want == "multinet" else want)


def test_rccl_and_vendor_mixes_never_get_it():
    amd = [Member(n, c, "amd") for n, c in (("n0", "a"), ("n1", "a"), ("n2", "b"))]
    assert transport_rule(amd, kind, multinet=True) == "socket"
    mixed = amd[:2] + [Member("n2", "b", "nvidia")]
    assert transport_rule(mixed, kind, multinet=True) == "host-staged"


def test_a_multinet_communicator_gets_no_forced_network():
    """NCCL_ALLNET_ENABLE=1 picks a network per peer; a net_name would pin one and undo it."""
    assert nccl_net_name("multinet", "IB") is None
    assert nccl_net_name("socket") == "Socket"


# ---- the cost: rings ordered by fabric, crossings scattered -------------------------------------------------

def _paths(members):
    c = holmes()
    return (_collective_path(cost.Network(c, cluster_transport), members),
            _collective_path(cost.Network(c, multinet_transport), members))


def test_a_spanning_group_is_faster_on_the_multinet_ring_than_on_sockets():
    (sock, t_sock), (multi, t_multi) = _paths(list(range(8)))        # one rank on each of the 8 nodes
    assert (t_sock, t_multi) == ("socket", "multinet")
    assert isinstance(multi, MultinetPath) and multi.n_dc == 2 and multi.scatter == 4
    for nbytes in (1e6, 1e9):
        assert multi.allreduce_s(nbytes) < sock.allreduce_s(nbytes)
        assert multi.allreduce_s(nbytes, None, 0.5) < sock.allreduce_s(nbytes, None, 0.5)


def test_one_node_per_side_keeps_sockets_and_the_model_agrees():
    (sock, t_sock), (same, t_same) = _paths([0, 4])
    assert t_sock == t_same == "socket"
    ring = MultinetPath(2, sock.levels[-1].tier, sock.levels[-1].tier, 8, 1, 2, 1)
    assert ring.allreduce_s(1e9) >= sock.allreduce_s(1e9) * 0.999


def _path(scatter: int, members: int = 16, n_dc: int = 2) -> MultinetPath:
    rdma, tcp = Tier("ib", 800, 2), Tier("socket", 25, 50)
    return MultinetPath(members, rdma, tcp, 8, scatter, n_dc, members // n_dc)


def test_scattering_the_crossings_over_more_nodes_divides_the_slow_hop():
    one, four = _path(1), _path(4)
    big = 4e9
    assert four.ring_s(big) < one.ring_s(big) / 3        # the TCP hop bounds the ring: 4 NICs carry it
    assert four.ring_s(big) > one.ring_s(big) / 4 * 0.99  # ... and never more than 4x


def test_ring_crosses_once_per_fabric_boundary_each_step():
    """The ring's bytes over a crossing equal those over any inside link (the ring is one loop): twice the
    fabrics' count does not charge more bytes, only the slowest link decides."""
    two, three = _path(1, 12, 2), _path(1, 12, 3)
    assert two.ring_s(1e9) == pytest.approx(three.ring_s(1e9))


def test_nccl_picks_the_tree_for_small_messages_on_many_ranks_and_the_ring_for_large():
    p = _path(4, 256, 2)
    assert p.nccl_picks_tree(1e4) and not p.nccl_picks_tree(1e10)
    assert p.allreduce_s(1e4) == p.tree_s(1e4)
    assert p.allreduce_s(1e10) == p.ring_s(1e10)
    assert p.allreduce_s(1e4, None, 0.5) == p.ring_s(1e4, None, 0.5)    # reduce-scatter: ring only


# ---- plans -----------------------------------------------------------------------------------------------

def test_a_plan_with_multinet_groups_round_trips_and_checks():
    c = holmes()
    dims = ParallelDims(tp=8, pp=1, dp=8)
    m = preset_model("gpt-7.5b")
    plan = assemble_plan(c, m, default_placement(c, dims), uniform_layers(m.num_layers, 1), 1,
                         transport_fn=multinet_transport)
    assert {g.transport for g in plan.groups["dp"]} == {"multinet"}
    assert plan.multinet and plan.rule_transport(list(range(plan.world_size))) == "multinet"
    again = Plan.from_dict(plan.to_dict())
    assert again.hash == plan.hash and again.multinet


def test_the_planner_uses_it_only_for_a_build_that_has_it():
    c, m = holmes(), preset_model("gpt-7.5b")
    released = make_plan(c, m, tp=8, pp=1)
    branch = make_plan(c, m, tp=8, pp=1, nccl=parse_build("2.26.2+cross-dc"))
    kinds = lambda p: {g.transport for gs in p.groups.values() for g in gs}      # noqa: E731
    assert Transport.MULTINET not in kinds(released)
    assert Transport.MULTINET in kinds(branch)
    assert branch.prediction.iteration_s <= released.prediction.iteration_s


def test_a_homogeneous_plan_is_the_same_whatever_the_nccl():
    c, m = load_cluster(EXAMPLES / "homogeneous-ib.yaml"), preset_model("gpt-7.5b")
    assert make_plan(c, m).hash == make_plan(c, m, nccl=parse_build("cross-dc")).hash
