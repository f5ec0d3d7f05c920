"""The emulator's multi-network routing, without root: with ``multinet`` a node routes every other cluster's
fabric subnet on-link over eth0 and shapes it as that cluster's Ethernet class; the transport map binds 'multinet'
groups to fab0. Off (the default), nothing changes. The routes themselves are exercised in
integration_tests/test_emulate.py (root)."""
from __future__ import annotations

from het_plugin.core.inputs.cluster import cluster_from_dict
from het_plugin.tools.emulate import make_layout


def three_clusters():
    def cluster(name, fabric):
        nodes = [{"count": 2, "accelerator": "A100-80", "accelerators_per_node": 1}]
        return {"name": name, "fabric": {"type": fabric, "gbps": 200}, "nodes": nodes}
    return cluster_from_dict({
        "name": "three",
        "clusters": [cluster("a", "ib"), cluster("b", "roce"),
                     {"name": "c", "fabric": {"type": "ethernet", "gbps": 25},
                      "nodes": [{"count": 1, "accelerator": "A100-80", "accelerators_per_node": 1}]}],
        "links": [{"between": ["a", "b"], "type": "ethernet", "gbps": 10},
                  {"between": ["a", "c"], "type": "ethernet", "gbps": 25},
                  {"between": ["b", "c"], "type": "ethernet", "gbps": 25}]})


def test_multinet_routes_other_fabrics_over_ethernet_in_their_class():
    lay = make_layout(three_clusters(), "abc123", 1000, multinet=True)
    a0, b0, c0 = lay.nodes[0], lay.nodes[2], lay.nodes[4]
    # a's node: b's fabric subnet over eth0 (c has no fabric); never its own
    assert a0.routes == ("198.19.1.0/24",) and b0.routes == ("198.19.0.0/24",)
    assert c0.routes == ("198.19.0.0/24", "198.19.1.0/24") and c0.fab is None
    to_b = next(c for c in a0.eth.classes if c.label == "to b")
    assert to_b.destinations == ("198.18.1.0/24", "198.19.1.0/24") and to_b.kbit == 10_000
    assert "multinet=fab0" in a0.gloo_ifnames() and "multinet=eth0" in c0.gloo_ifnames()
    assert "other clusters' fabrics over eth0" in lay.describe()


def test_without_multinet_nothing_is_routed():
    lay = make_layout(three_clusters(), "abc123", 1000)
    assert all(n.routes == () for n in lay.nodes)
    assert all(c.destinations in ((), (c.dst,)) for n in lay.nodes for c in n.eth.classes)
    assert "multinet" not in lay.nodes[0].gloo_ifnames() and "own cluster only" in lay.describe()
