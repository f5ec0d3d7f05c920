"""The emulated network's layout (pure, no root): addresses, rates, which nodes get a fabric, preconditions."""
from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from het_plugin.core.inputs.cluster import cluster_from_dict, load_cluster
from het_plugin.tools.emulate import EmulatorUnavailable, make_layout
from het_plugin.tools.emulate import system
from het_plugin.core.errors import ConfigError
from het_plugin.runtime.netselect import gloo_ifnames

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "clusters"
BENCH = ipaddress.ip_network("198.18.0.0/15")


@pytest.mark.parametrize("name", ["holmes-ib-roce", "two-clusters-25gbe", "hethub-mix", "homogeneous-ib"])
def test_addresses_names_and_rates(name):
    cluster = load_cluster(EXAMPLES / f"{name}.yaml")
    lay = make_layout(cluster, "0a1b2c", 1000)
    addrs = [i.address for n in lay.nodes for i in n.interfaces]
    assert len(set(addrs)) == len(addrs)
    assert all(ipaddress.ip_address(a) in BENCH for a in addrs)
    for n in lay.nodes:
        for itf in n.interfaces:
            assert len(itf.peer) <= 15 and itf.peer.startswith("hp0a1b2c")
        assert n.namespace.startswith("hpemu-0a1b2c-")
        node = cluster.nodes[n.index]
        # RDMA clusters get a fabric at the fabric's rate; Ethernet-only clusters do not
        assert (n.fab is not None) == (node.fabric.type in ("ib", "roce"))
        if n.fab:
            assert n.fab.kbit == round(node.fabric.gbps * 1000)
        for c in n.eth.classes[:-1]:
            other = cluster.cluster_names[int(c.dst.split(".")[2])]
            assert c.kbit == min(n.eth.kbit, round(cluster.cluster_link(node.cluster, other).gbps * 1000))
        assert n.eth.classes[-1].dst is None
    assert sum(n.num_ranks for n in lay.nodes) == cluster.world_size
    assert [b for b in lay.bridges if len(b) > 15] == []


def test_fabric_subnets_are_per_cluster():
    lay = make_layout(load_cluster(EXAMPLES / "holmes-ib-roce.yaml"), "abcdef", 1000)
    nets = {n.cluster: ipaddress.ip_interface(f"{n.fab.address}/{n.fab.prefix}").network for n in lay.nodes}
    assert nets["ib"] != nets["roce"] and not nets["ib"].overlaps(nets["roce"])
    eth = {ipaddress.ip_interface(f"{n.eth.address}/{n.eth.prefix}").network for n in lay.nodes}
    assert len(eth) == 1          # one shared Ethernet


def test_gloo_ifnames_parse_with_netselect():
    lay = make_layout(load_cluster(EXAMPLES / "hethub-mix.yaml"), "abcdef", 1000)
    for n in lay.nodes:
        m = gloo_ifnames({"HET_PLUGIN_GLOO_IFNAMES": n.gloo_ifnames()})
        assert m["socket"] == "eth0" and m["local"] == "lo"
        assert ("ib" in m) == (n.fab is not None)


def test_scale_divides_rates():
    c = load_cluster(EXAMPLES / "holmes-ib-roce.yaml")
    a, b = make_layout(c, "abcdef", 1000), make_layout(c, "abcdef", 100)
    assert b.nodes[0].fab.kbit == 10 * a.nodes[0].fab.kbit
    with pytest.raises(ConfigError, match="scale"):
        make_layout(c, "abcdef", 0)


def test_too_many_nodes_is_a_config_error():
    big = cluster_from_dict({"clusters": [{"name": "a", "fabric": {"type": "ib", "gbps": 100},
                                           "nodes": [{"count": 300, "accelerator": "A100-80",
                                                      "accelerators_per_node": 1}]}]})
    with pytest.raises(ConfigError, match="at most"):
        make_layout(big, "abcdef", 1000)


def test_not_root_gives_one_clear_message(monkeypatch):
    monkeypatch.setattr(system.os, "geteuid", lambda: 1000)
    with pytest.raises(EmulatorUnavailable, match="needs root"):
        system.check_preconditions()


def test_leftover_names_are_recognised_only_when_ours():
    assert system.run_of_name("hpemu-0a1b2c-n3") == "0a1b2c"
    assert system.run_of_name("hp0a1b2cE") == "0a1b2c"
    assert system.run_of_name("hp0a1b2ce12") == "0a1b2c"
    assert system.run_of_name("hpemu-probe123") is None
    assert system.run_of_name("hpnet0") is None
    assert system.run_of_name("eth0") is None
