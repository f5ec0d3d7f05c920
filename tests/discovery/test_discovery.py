"""Discovery: sysfs trees written in the kernel's format, torch's device names, grouping into clusters,
the links override, the store gather (in-process ranks on one HashStore) and the CLI."""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from het_plugin.cli import main as cli_main
from het_plugin.core.inputs.cluster import cluster_from_dict, load_cluster
from het_plugin.discovery import (AcceleratorInfo, DiscoveryError, NodeView, RankView, build_cluster_data,
                                  cluster_from_views, discover_node, format_yaml, from_device_name, gather_discovery)
from het_plugin.discovery.accelerator import detect, from_torch
from het_plugin.discovery.sysfs import parse_rate
from het_plugin.core.errors import ConfigError
from sysfs_tree import (ACTIVE, DOWN, INIT, RATES, Hca, NetIf, Port, ethernet_node, ib_node, loopback,
                              roce_node, write_tree)

A100 = {"HET_PLUGIN_ACCELERATOR": "A100-80"}


def node(root, name, accel="A100-80", count=8, **env) -> NodeView:
    e = {"HET_PLUGIN_ACCELERATOR": accel, "HET_PLUGIN_ACCELERATOR_COUNT": str(count), **env}
    return discover_node(root, name=name, env=e)


# ---- one node from sysfs ---------------------------------------------------------------------------

def test_ib_node_counts_active_hdr_ports_and_its_ethernet(tmp_path):
    v = discover_node(ib_node(tmp_path), name="n", env=A100)
    assert [(p.device, p.port, p.type, p.gbps) for p in v.rdma] == [(f"mlx5_{i}", 1, "ib", 200.0) for i in range(4)]
    assert [p.netdevs for p in v.rdma] == [(f"ib{i}",) for i in range(4)]   # IPoIB via device/net
    assert (v.fabric_type, v.fabric_gbps) == ("ib", 800.0)
    assert [(n.name, n.gbps) for n in v.ethernet] == [("eth0", 25.0)]
    reasons = "\n".join(v.ignored)
    assert "lo: loopback" in reasons and "docker0: virtual" in reasons and "ib0: IPoIB" in reasons


def test_roce_node_is_link_layer_ethernet_and_keeps_its_netdevs_with_the_port(tmp_path):
    v = discover_node(roce_node(tmp_path, hcas=2, rate=RATES["NDR"]), name="n", env=A100)
    assert [(p.device, p.type, p.gbps, p.netdevs) for p in v.rdma] == [
        ("mlx5_0", "roce", 400.0, ("ens1f0",)), ("mlx5_1", "roce", 400.0, ("ens1f1",))]
    assert (v.fabric_type, v.fabric_gbps) == ("roce", 800.0)
    assert [n.name for n in v.ethernet] == ["eth0"]          # ens1f0/1 are listed with their ports
    assert any("ens1f0: carries an active RoCE port" in n for n in v.notes)


def test_ethernet_only_node_uses_its_fastest_nic(tmp_path):
    root = write_tree(tmp_path, (), [NetIf("eno1", speed="1000"), NetIf("ens3", speed="100000"), loopback(),
                                     NetIf("br0", virtual=True)])
    v = discover_node(root, name="n", env=A100)
    assert v.rdma == () and v.fabric_type == "ethernet" and v.fabric_gbps == 100.0
    assert [(n.name, n.gbps) for n in v.ethernet] == [("eno1", 1.0), ("ens3", 100.0)]
    assert any(s.startswith("br0: virtual") for s in v.ignored)


@pytest.mark.parametrize("state", [DOWN, INIT, "3: ARMED"])
def test_a_port_that_is_not_active_is_ignored_and_reported(tmp_path, state):
    cards = [Hca("mlx5_0"), Hca("mlx5_1", [Port(state=state, phys_state="3: Disabled")])]
    v = discover_node(write_tree(tmp_path, cards, [NetIf("eth0")]), name="n", env=A100)
    assert [p.device for p in v.rdma] == ["mlx5_0"] and v.fabric_gbps == 200.0
    assert v.ignored == (f"mlx5_1 port 1: state {state!r}, not ACTIVE",)


def test_all_ports_down_leaves_an_ethernet_node(tmp_path):
    v = discover_node(ib_node(tmp_path, hcas=2, down=[0, 1]), name="n", env=A100)
    assert v.rdma == () and (v.fabric_type, v.fabric_gbps) == ("ethernet", 25.0)
    assert sum("not ACTIVE" in s for s in v.ignored) == 2


@pytest.mark.parametrize("text,gbps", [
    ("200 Gb/sec (4X HDR)", 200.0), ("14 Gb/sec (1X FDR)", 14.0), ("2.5 Gb/sec (1X SDR)", 2.5),
    ("800 Gb/sec (4X XDR)", 800.0), ("10 Gb/sec (4X SDR)", 10.0), ("14.0 Gb/sec (1X FDR)", 14.0),
    ("400 Gb/sec (4X NDR)", 400.0), ("53.125 Gb/sec (1X HDR)", 53.125), ("25 Gb/sec (1X EDR)", 25.0),
    ("0 Gb/sec (1X SDR)", None), ("Invalid argument", None), ("", None), (None, None), ("100 Mb/sec", None),
    ("Gb/sec 100", None),
])
def test_rate_parsing(text, gbps):
    assert parse_rate(text) == gbps


def test_weird_ports_are_left_out_with_the_reason(tmp_path):
    cards = [Hca("mlx5_0", [Port(rate=RATES["FDR1X"]), Port(rate="garbage"), Port(rate=None),
                            Port(rate="EINVAL"), Port(rate=RATES["SDR1X"])]),
             Hca("siw0", [Port(link_layer="Unknown")]), Hca("mlx5_2", [Port(state=None)])]
    v = discover_node(write_tree(tmp_path, cards, [NetIf("eth0")]), name="n", env=A100)
    assert [(p.device, p.port, p.gbps) for p in v.rdma] == [("mlx5_0", 1, 14.0), ("mlx5_0", 5, 2.5)]
    assert v.fabric_gbps == 16.5
    assert v.ignored == ("mlx5_0 port 2: rate 'garbage' is not '<number> Gb/sec ...'",
                         "mlx5_0 port 3: rate None is not '<number> Gb/sec ...'",
                         "mlx5_0 port 4: rate None is not '<number> Gb/sec ...'",
                         "mlx5_2 port 1: state unreadable",
                         "siw0 port 1: link_layer 'Unknown', neither InfiniBand nor Ethernet")


def test_node_with_ib_and_roce_takes_the_faster_fabric_and_lists_both(tmp_path):
    cards = [Hca("mlx5_0", [Port("InfiniBand", RATES["EDR"])]),
             Hca("mlx5_1", [Port("Ethernet", RATES["HDR"], netdev="ens1f0")], [NetIf("ens1f0", speed="200000")])]
    v = discover_node(write_tree(tmp_path, cards, [NetIf("eth0")]), name="n", env=A100)
    assert v.rdma_bandwidth == {"ib": 100.0, "roce": 200.0}
    assert (v.fabric_type, v.fabric_gbps) == ("roce", 200.0)
    cards[1].ports[0].rate = RATES["EDR"]                      # a tie: InfiniBand wins
    v2 = discover_node(write_tree(tmp_path / "tie", cards, [NetIf("eth0")]), name="n", env=A100)
    assert (v2.fabric_type, v2.fabric_gbps) == ("ib", 100.0)


@pytest.mark.parametrize("speed,gbps", [("-1", None), ("EINVAL", None), (None, None), ("4294967295", None),
                                        ("0", None), ("10000", 10.0), ("400000", 400.0), ("n/a", None)])
def test_ethernet_speed_in_mbps_or_unknown(tmp_path, speed, gbps):
    v = discover_node(write_tree(tmp_path, (), [NetIf("eth0", speed=speed)]), name="n", env=A100)
    assert [(n.name, n.gbps) for n in v.ethernet] == [("eth0", gbps)]
    assert (gbps is None) == any("eth0: speed unknown" in s for s in v.notes)


def test_interfaces_that_are_down_not_ethernet_or_bond_members_are_left_out(tmp_path):
    nics = [NetIf("eth0", operstate="down"), NetIf("eth1", operstate="unknown", carrier="1"),
            NetIf("eth2", operstate="unknown", carrier="0"), NetIf("wwan0", type="65534"),
            NetIf("bond0", speed="50000", bond=True), NetIf("ens1", master="bond0"), NetIf("ens2", master="bond0")]
    v = discover_node(write_tree(tmp_path, (), nics), name="n", env=A100)
    assert [(n.name, n.gbps) for n in v.ethernet] == [("bond0", 50.0), ("eth1", 25.0)]
    assert set(v.ignored) == {"eth0: operstate 'down', not up", "eth2: operstate 'unknown', not up",
                              "wwan0: type '65534', not Ethernet (1)", "ens1: member of bond bond0 (counted there)",
                              "ens2: member of bond bond0 (counted there)"}


def test_empty_root_is_a_node_without_nics_not_a_crash(tmp_path):
    v = discover_node(tmp_path, name="n", env=A100)
    assert v.rdma == () and v.ethernet == () and v.fabric_gbps is None
    assert any("no network interfaces seen" in s for s in v.notes)


def test_environment_sets_root_name_and_fabric(tmp_path):
    root = ib_node(tmp_path)
    env = {"HET_PLUGIN_SYSFS_ROOT": str(root), "HET_PLUGIN_NODE_NAME": "node-7", "HET_PLUGIN_FABRIC_NAME": "east",
           **A100}
    v = discover_node(env=env)
    assert (v.name, v.sysfs_root, v.fabric_name, v.fabric_gbps) == ("node-7", str(root), "east", 800.0)
    assert discover_node(root, name="explicit", env=env).name == "explicit"


def test_view_survives_json(tmp_path):
    v = node(ib_node(tmp_path, down=[1]), "n")
    assert NodeView.from_dict(json.loads(json.dumps(v.to_dict()))) == v


def test_render_names_what_was_read_and_left_out(tmp_path):
    text = node(ib_node(tmp_path, down=[2]), "node-a").render()
    assert "node: node-a" in text and "fabric: ib 600 Gbit/s" in text
    assert "mlx5_2 port 1: state '1: DOWN', not ACTIVE" in text and "accelerator: A100-80" in text


# ---- this machine's real sysfs -----------------------------------------------------------------

def test_real_sysfs_agrees_with_what_the_kernel_shows():
    net = Path("/sys/class/net")
    before = set(os.listdir(net))
    v = discover_node("/sys", name="here", env={})
    after = set(os.listdir(net))
    for nic in v.ethernet:   # each kept NIC is a physical, up Ethernet interface with the speed sysfs shows
        d = net / nic.name
        assert (d / "device").exists() or (d / "bonding").is_dir()
        assert (d / "type").read_text().strip() == "1"
        assert nic.operstate in ("up", "unknown")
        try:
            mbps = int((d / "speed").read_text())
        except (OSError, ValueError):
            mbps = -1
        assert nic.gbps == (mbps / 1000 if mbps > 0 and mbps != 0xFFFFFFFF else None)
    kept = {n.name for n in v.ethernet}
    left_out = {line.split(":", 1)[0] for line in v.ignored + v.notes}
    for name in before & after:   # other jobs create and delete veths meanwhile: check the stable ones
        assert name in kept or name in left_out, name
    assert "lo" not in kept and "lo: loopback" in v.ignored
    if not Path("/sys/class/infiniband").exists():
        assert v.rdma == () and v.fabric_type == "ethernet"
    for p in v.rdma:
        assert "ACTIVE" in Path(f"/sys/class/infiniband/{p.device}/ports/{p.port}/state").read_text()


def test_real_torch_on_this_machine_is_a_clear_no_accelerator():
    import torch
    info, count, notes = from_torch()
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA/ROCm device")
    assert (info, count) == (None, 0) and "sees no CUDA/ROCm device" in notes[0]
    v = discover_node("/sys", name="here", env={})
    assert v.accelerator is None and "accelerator: none detected" in v.render()


# ---- accelerators ------------------------------------------------------------------------------

@pytest.mark.parametrize("name,vendor,mem,arch,part", [
    ("NVIDIA A100-SXM4-80GB", "nvidia", 79.2, None, "A100-80"),
    ("NVIDIA A100-SXM4-40GB", "nvidia", 39.4, None, "A100-40"),
    ("NVIDIA A100-PCIE-40GB", "nvidia", 39.4, None, "A100-40"),
    ("NVIDIA A100 80GB PCIe", "nvidia", 79.2, None, "A100-80"),
    ("NVIDIA A100-SXM4", "nvidia", 79.2, None, "A100-80"),          # no size in the name: the memory says
    ("NVIDIA H100 80GB HBM3", "nvidia", 79.1, None, "H100"),
    ("NVIDIA H100 PCIe", "nvidia", 79.1, None, "H100"),
    ("NVIDIA H200", "nvidia", 139.8, None, "H200"),
    ("AMD Instinct MI250X/MI250", "amd", 64.0, "gfx90a:sramecc+:xnack-", "MI250X"),
    ("AMD Instinct MI300X", "amd", 192.0, "gfx942:sramecc+:xnack-", "MI300X"),
    ("", "amd", 64.0, "gfx90a:sramecc+:xnack-", "MI250X"),           # older ROCm: empty name, arch tells
])
def test_torch_device_names_map_to_the_catalog(name, vendor, mem, arch, part):
    info = from_device_name(name, vendor, mem, arch)
    assert (info.name, info.in_catalog, info.vendor) == (part, True, vendor)


def test_a_part_not_in_the_catalog_keeps_its_name_and_memory():
    info = from_device_name("NVIDIA L40S", "nvidia", 44.5)
    assert (info.name, info.in_catalog, info.memory_gib, info.peak_tflops) == ("NVIDIA-L40S", False, 44.5, None)


def _fake_torch(name, count, hip=None, mem_gib=80, arch=None):
    props = SimpleNamespace(total_memory=int(mem_gib * 2**30), gcnArchName=arch)
    cuda = SimpleNamespace(is_available=lambda: count > 0, device_count=lambda: count,
                           get_device_name=lambda i: name, get_device_properties=lambda i: props)
    return SimpleNamespace(__version__="x", version=SimpleNamespace(hip=hip, cuda=None if hip else "12.4"), cuda=cuda)


def test_from_torch_cuda_and_rocm_builds():
    info, count, _ = from_torch(_fake_torch("NVIDIA H100 80GB HBM3", 8))
    assert (info.name, info.vendor, count) == ("H100", "nvidia", 8)
    info, count, _ = from_torch(_fake_torch("AMD Instinct MI250X/MI250", 8, hip="6.2", mem_gib=64, arch="gfx90a"))
    assert (info.name, info.vendor, count) == ("MI250X", "amd", 8)
    info, count, notes = from_torch(_fake_torch("", 0, hip="6.2"))
    assert (info, count) == (None, 0) and "ROCm build" in notes[0]


def test_environment_overrides_the_accelerator_and_count():
    info, count, notes = detect({"HET_PLUGIN_ACCELERATOR": "mi300x"}, _fake_torch("NVIDIA H100 80GB HBM3", 4))
    assert (info.name, info.source, count) == ("MI300X", "env", 4)
    assert any("overrides what torch sees" in n for n in notes)
    spec = "{name: ascend-910b, vendor: Huawei, memory_gib: 64, peak_tflops: 320}"
    info, count, _ = detect({"HET_PLUGIN_ACCELERATOR": spec, "HET_PLUGIN_ACCELERATOR_COUNT": "16"},
                            _fake_torch("", 0))
    assert (info.name, info.vendor, info.in_catalog, info.peak_tflops, count) == ("ascend-910b", "huawei", False,
                                                                                  320, 16)
    assert info.cluster_spec() == {"name": "ascend-910b", "vendor": "huawei", "memory_gib": 64, "peak_tflops": 320,
                                   "intra_node_gbps": 256.0, "efficiency": 0.5}   # the schema's defaults


@pytest.mark.parametrize("env,field,needle", [
    ({"HET_PLUGIN_ACCELERATOR": "Z100"}, None, "unknown accelerator 'Z100'"),
    ({"HET_PLUGIN_ACCELERATOR": "{name: x, vendor: y, memory_gib: 64}"}, "peak_tflops", "peak_tflops"),
    ({"HET_PLUGIN_ACCELERATOR": "{name: x, vendor"}, None, "not a YAML mapping"),
    ({"HET_PLUGIN_ACCELERATOR": "H100", "HET_PLUGIN_ACCELERATOR_COUNT": "0"}, None, "not a positive whole number"),
    ({"HET_PLUGIN_ACCELERATOR": "H100", "HET_PLUGIN_ACCELERATOR_COUNT": "eight"}, None, "not a positive"),
])
def test_bad_overrides_are_config_errors_naming_the_variable(env, field, needle):
    with pytest.raises(ConfigError) as err:
        detect(env, _fake_torch("", 0))
    assert err.value.source.startswith("HET_PLUGIN_ACCELERATOR") and err.value.field == field
    assert needle in str(err.value) and err.value.fix


# ---- grouping views into clusters -------------------------------------------------------------

@pytest.fixture
def holmes_views(tmp_path):
    """Two InfiniBand nodes and two RoCE nodes (4 x 200 Gbit/s each, 25 GbE eth0), 8 A100 each."""
    return [node(ib_node(tmp_path / "i0"), "ib-0"), node(ib_node(tmp_path / "i1"), "ib-1"),
            node(roce_node(tmp_path / "r0"), "roce-0"), node(roce_node(tmp_path / "r1"), "roce-1")]


def test_ib_pair_and_roce_pair_form_two_clusters_joined_by_their_ethernet(holmes_views):
    data = build_cluster_data(holmes_views)
    c = cluster_from_dict(data)
    assert [(x["name"], x["fabric"]["type"], x["fabric"]["gbps"]) for x in data["clusters"]] == [
        ("ib-800g", "ib", 800.0), ("roce-800g", "roce", 800.0)]
    assert [(n.name, n.cluster, n.num_accelerators) for n in c.nodes] == [
        ("ib-0", "ib-800g", 8), ("ib-1", "ib-800g", 8), ("roce-0", "roce-800g", 8), ("roce-1", "roce-800g", 8)]
    link = c.cluster_link("ib-800g", "roce-800g")
    assert (link.kind, link.gbps) == ("ethernet", 25.0)
    assert "launch" not in data and c.world_size == 32 and not c.is_homogeneous
    ib_nics = data["clusters"][0]["nodes"][0]["nics"]
    assert ib_nics[0] == {"type": "ib", "gbps": 200.0, "devices": ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"],
                          "interfaces": ["ib0", "ib1", "ib2", "ib3"]}
    assert ib_nics[1] == {"type": "ethernet", "gbps": 25.0, "interfaces": ["eth0"]}
    roce_nic = data["clusters"][1]["nodes"][0]["nics"][0]
    assert roce_nic["interfaces"] == ["ens1f0", "ens1f1", "ens2f0", "ens2f1"]


def test_discovered_holmes_shape_matches_the_hand_written_example(tmp_path, examples_dir):
    """Same fabrics, links and devices as examples/clusters/holmes-ib-roce.yaml (cut to 2+2 nodes; its RoCE
    nodes have two 200 Gbit/s ports, its IB nodes four HCAs)."""
    ref = load_cluster(examples_dir / "clusters" / "holmes-ib-roce.yaml")
    views = [node(ib_node(tmp_path / "i0"), "ib-0"), node(ib_node(tmp_path / "i1"), "ib-1"),
             node(roce_node(tmp_path / "r0", hcas=2), "roce-0"), node(roce_node(tmp_path / "r1", hcas=2), "roce-1")]
    got = cluster_from_views(views)
    ref_ib, ref_roce = ref.nodes[0], ref.nodes[-1]
    for mine, theirs in ((got.nodes[0], ref_ib), (got.nodes[-1], ref_roce)):
        assert (mine.fabric.type, mine.fabric.gbps) == (theirs.fabric.type, theirs.fabric.gbps)
        assert (mine.accelerator, mine.num_accelerators) == (theirs.accelerator, theirs.num_accelerators)
    assert got.cluster_link(*got.cluster_names).gbps == ref.cluster_link(*ref.cluster_names).gbps


def test_a_dual_port_hca_is_named_per_port_as_nccl_ib_hca_takes_it(tmp_path):
    root = write_tree(tmp_path, [Hca("mlx5_0", [Port(), Port()]), Hca("mlx5_1")], [NetIf("eth0")])
    data = build_cluster_data([node(root, "n", count=2)])
    assert data["clusters"][0]["fabric"]["gbps"] == 600.0
    assert data["clusters"][0]["nodes"][0]["nics"][0]["devices"] == ["mlx5_0:1", "mlx5_0:2", "mlx5_1"]


def test_nodes_on_one_fabric_are_one_homogeneous_cluster(tmp_path):
    views = [node(ib_node(tmp_path / f"n{i}"), f"n{i}") for i in range(3)]
    data = build_cluster_data(views)
    c = cluster_from_dict(data)
    assert len(data["clusters"]) == 1 and data["links"] == [] and c.is_homogeneous
    assert data["clusters"][0]["nodes"][0]["hostnames"] == ["n0", "n1", "n2"]


def test_ethernet_only_nodes_form_one_cluster_at_the_slowest_speed(tmp_path):
    notes: list[str] = []
    views = [node(ethernet_node(tmp_path / "a", "100000"), "a"), node(ethernet_node(tmp_path / "b", "25000"), "b")]
    data = build_cluster_data(views, notes=notes)
    assert [(c["name"], c["fabric"]["gbps"]) for c in data["clusters"]] == [("ethernet", 25.0)]
    assert [g["hostnames"] for g in data["clusters"][0]["nodes"]] == [["a"], ["b"]]   # NICs differ: two groups
    assert any("using the slowest, 25" in n for n in notes)


def test_mixed_ib_and_ethernet_nodes(tmp_path):
    views = [node(ib_node(tmp_path / "i"), "ib-a", count=4), node(ethernet_node(tmp_path / "e", "100000"), "eth-a",
                                                                 accel="MI250X", count=8)]
    c = cluster_from_views(views)
    assert [(n.cluster, n.fabric.type, n.vendor, n.num_accelerators) for n in c.nodes] == [
        ("ib-800g", "ib", "nvidia", 4), ("ethernet", "ethernet", "amd", 8)]
    assert c.cluster_link("ib-800g", "ethernet").gbps == 25.0   # the IB node's 25 GbE is the bottleneck
    assert c.rank_node == [0] * 4 + [1] * 8


def test_interleaved_launch_order_becomes_node_order(tmp_path):
    ib0, r0, ib1, r1 = (node(ib_node(tmp_path / "a"), "ib-0", count=2), node(roce_node(tmp_path / "b"), "roce-0", count=2),
                        node(ib_node(tmp_path / "c"), "ib-1", count=2), node(roce_node(tmp_path / "d"), "roce-1", count=2))
    ranks = [RankView(r, r % 2, v) for r, v in enumerate([ib0, ib0, r0, r0, ib1, ib1, r1, r1])]
    data = build_cluster_data(list(reversed(ranks)))      # the order views arrive in does not matter
    assert data["launch"] == {"node_order": ["ib-0", "roce-0", "ib-1", "roce-1"]}
    c = cluster_from_dict(data)
    assert [c.node_of(r).name for r in range(8)] == [v.node.name for v in ranks]
    assert [c.node_of(r).cluster for r in (0, 2, 4, 6)] == ["ib-800g", "roce-800g", "ib-800g", "roce-800g"]


def test_ranks_not_in_node_major_blocks_are_refused(tmp_path):
    a, b = node(ib_node(tmp_path / "a"), "a"), node(ib_node(tmp_path / "b"), "b")
    with pytest.raises(ConfigError, match=r"ranks on node 'a' are \[0, 2\], not one consecutive block"):
        build_cluster_data([RankView(0, 0, a), RankView(1, 0, b), RankView(2, 1, a), RankView(3, 1, b)])
    with pytest.raises(ConfigError, match="rank 0 on node 'a' has local rank 1, but is number 0"):
        build_cluster_data([RankView(0, 1, a), RankView(1, 0, a)])
    with pytest.raises(ConfigError, match=r"repeated \[1\], missing \[2\]"):
        build_cluster_data([RankView(0, 0, a), RankView(1, 0, b), RankView(1, 1, b)])


def test_ranks_claiming_one_node_with_different_hardware_are_refused(tmp_path):
    a = node(ib_node(tmp_path / "a"), "same")
    b = node(roce_node(tmp_path / "b"), "same")
    with pytest.raises(ConfigError, match="ranks 0 and 1 both say they are on node 'same'") as err:
        build_cluster_data([RankView(0, 0, a), RankView(1, 1, b)])
    assert "HET_PLUGIN_NODE_NAME" in err.value.fix
    # A veth created between two ranks' scans changes only what was left out: still one node.
    from dataclasses import replace
    later = replace(a, ignored=a.ignored + ("veth9: virtual interface (no device link)",))
    assert cluster_from_dict(build_cluster_data([RankView(0, 0, a), RankView(1, 1, later)])).nodes[0].num_accelerators == 2


def test_a_node_without_accelerator_is_a_config_error_naming_it(tmp_path):
    with_acc = node(ib_node(tmp_path / "a"), "a", count=1)
    without = discover_node(ib_node(tmp_path / "b"), name="b", env={})
    with pytest.raises(ConfigError, match=r"no accelerator detected on node\(s\) b \(ranks 1-2\)") as err:
        build_cluster_data([RankView(0, 0, with_acc), RankView(1, 0, without), RankView(2, 1, without)])
    assert "HET_PLUGIN_ACCELERATOR" in err.value.fix


def test_an_uncatalogued_part_alone_gets_a_placeholder_but_not_next_to_other_parts(tmp_path):
    l40s = AcceleratorInfo("NVIDIA-L40S", "nvidia", False, memory_gib=44.5, device_name="NVIDIA L40S")
    odd = NodeView("x", accelerator=l40s, accelerator_count=2, ethernet=())
    notes: list[str] = []
    c = cluster_from_dict(build_cluster_data([odd], notes=notes, unknown_ethernet_gbps=25))
    assert (c.nodes[0].accelerator.name, c.nodes[0].accelerator.memory_gib) == ("NVIDIA-L40S", 44.5)
    assert any("placeholder" in n for n in notes)
    known = node(ethernet_node(tmp_path), "y", count=2)
    with pytest.raises(ConfigError, match=r"\['NVIDIA-L40S'\] are not in the catalog, and the cluster mixes"):
        build_cluster_data([odd, known])


def test_unknown_ethernet_speed_is_assumed_and_said(tmp_path):
    root = write_tree(tmp_path, (), [NetIf("eth0", speed="-1")])
    notes: list[str] = []
    data = build_cluster_data([node(root, "vm")], notes=notes)
    assert data["clusters"][0]["fabric"]["gbps"] == 10.0 and "assuming 10 Gbit/s" in notes[0]
    assert build_cluster_data([node(root, "vm")], env={"HET_PLUGIN_ETHERNET_GBPS": "40"})["clusters"][0][
        "fabric"]["gbps"] == 40.0
    with pytest.raises(ConfigError) as err:
        build_cluster_data([node(root, "vm")], env={"HET_PLUGIN_ETHERNET_GBPS": "fast"})
    assert err.value.source == "HET_PLUGIN_ETHERNET_GBPS"


def test_fabric_name_separates_same_speed_fabrics_and_joins_a_degraded_node(tmp_path):
    east = [node(ib_node(tmp_path / f"e{i}"), f"e{i}", HET_PLUGIN_FABRIC_NAME="east") for i in range(2)]
    west = [node(ib_node(tmp_path / "w0"), "w0", HET_PLUGIN_FABRIC_NAME="west"),
            node(ib_node(tmp_path / "w1", down=[3]), "w1", HET_PLUGIN_FABRIC_NAME="west")]
    notes: list[str] = []
    c = cluster_from_dict(build_cluster_data(east + west, notes=notes))
    assert c.cluster_names == ["east", "west"] and [n.fabric.gbps for n in c.nodes] == [800, 800, 600, 600]
    assert any("cluster west: nodes inject [600.0, 800.0]" in n for n in notes)
    # Without names, the degraded node is a cluster of its own (speed differs): documented behaviour.
    plain = [node(tmp_path / "e0", "n0"), node(tmp_path / "w1", "n1"), node(tmp_path / "e1", "n2")]
    c = cluster_from_dict(build_cluster_data(plain))
    assert c.cluster_names == ["ib-800g", "ib-600g"] and [n.name for n in c.nodes] == ["n0", "n1", "n2"]
    mixed = [node(ib_node(tmp_path / "m0"), "m0", HET_PLUGIN_FABRIC_NAME="one"),
             node(roce_node(tmp_path / "m1"), "m1", HET_PLUGIN_FABRIC_NAME="one")]
    with pytest.raises(ConfigError, match="fabric name 'one' covers node 'm0' \\(ib\\) and node 'm1' \\(roce\\)"):
        build_cluster_data(mixed)


def test_links_file_overrides_pairs_and_sets_a_default(tmp_path, holmes_views):
    eth = node(ethernet_node(tmp_path / "e"), "eth-0")
    f = tmp_path / "links.yaml"
    f.write_text("links:\n  - {between: [roce-800g, ib-800g], gbps: 100, latency_us: 20}\ndefault: {gbps: 40}\n")
    c = cluster_from_views(holmes_views + [eth], links=str(f))
    assert c.cluster_link("ib-800g", "roce-800g") == type(c.cluster_link("ib-800g", "roce-800g"))("ethernet", 100, 20)
    assert c.cluster_link("ib-800g", "ethernet").gbps == 40 and c.cluster_link("roce-800g", "ethernet").gbps == 40
    # The same file through the environment; without it, the Ethernet speed seen.
    assert cluster_from_views(holmes_views, env={"HET_PLUGIN_LINKS": str(f)}).cluster_link("ib-800g", "roce-800g").gbps == 100
    assert cluster_from_views(holmes_views, env={}).cluster_link("ib-800g", "roce-800g").gbps == 25


@pytest.mark.parametrize("text,field", [
    ("links:\n  - {between: [ib-800g, nowhere], gbps: 10}\n", "links[0].between"),
    ("links:\n  - {between: [ib-800g, roce-800g], gbps: -1}\n", "links[0].gbps"),
    ("default: {gbps: 10}\nlinkz: []\n", "linkz"),
    ("links: [\n", None),
])
def test_bad_links_files_are_config_errors(tmp_path, holmes_views, text, field):
    f = tmp_path / "links.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as err:
        build_cluster_data(holmes_views, links=str(f))
    assert err.value.field == field and err.value.fix


def test_an_ib_cluster_without_ethernet_needs_a_links_file(tmp_path):
    ib_only = write_tree(tmp_path / "i", [Hca("mlx5_0", [Port()], [NetIf("ib0", type="32")])], [loopback()])
    views = [node(ib_only, "ib-a"), node(roce_node(tmp_path / "r"), "roce-a")]
    with pytest.raises(ConfigError, match=r"no Ethernet NIC seen in cluster\(s\) \['ib-200g'\]") as err:
        build_cluster_data(views)
    assert "HET_PLUGIN_LINKS" in err.value.fix
    c = cluster_from_views(views, links={"links": [{"between": ["ib-200g", "roce-800g"], "gbps": 50}]})
    assert c.cluster_link("ib-200g", "roce-800g").gbps == 50


def test_yaml_text_loads_as_the_same_cluster(tmp_path, holmes_views):
    notes = ["something assumed"]
    data = build_cluster_data(holmes_views)
    path = tmp_path / "c.yaml"
    path.write_text(format_yaml(data, notes))
    assert path.read_text().startswith("# cluster discovered") and "# note: something assumed" in path.read_text()
    assert load_cluster(path).digest == cluster_from_dict(data).digest


def test_node_views_need_a_count_to_stand_for_ranks(tmp_path):
    v = discover_node(ib_node(tmp_path), name="n", env=A100)
    with pytest.raises(ConfigError, match="accelerator count unknown"):
        build_cluster_data([v])


# ---- gathering over a store (ranks as threads sharing one HashStore) ---------------------------

def _gather_threads(envs, timeout_s=20.0, world_size=None):
    """Ranks as threads; one key for all (a process-wide call counter would differ per thread)."""
    import torch.distributed as dist
    store = dist.HashStore()
    world = world_size or len(envs)
    out: list = [None] * len(envs)

    def run(r):
        try:
            out[r] = gather_discovery(store, r, world, local_rank=int(envs[r].get("LOCAL_RANK", 0)), env=envs[r],
                                      timeout_s=timeout_s, key="threads")
        except Exception as exc:   # noqa: BLE001 - the test inspects it
            out[r] = exc
    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(envs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 40)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out


def test_every_rank_gets_the_same_cluster(tmp_path):
    trees = {"ib-0": ib_node(tmp_path / "a"), "roce-0": roce_node(tmp_path / "b")}
    envs = [{"HET_PLUGIN_SYSFS_ROOT": str(trees[n]), "HET_PLUGIN_NODE_NAME": n, "LOCAL_RANK": str(r % 2), **A100}
            for r, n in enumerate(["ib-0", "ib-0", "roce-0", "roce-0"])]
    found = _gather_threads(envs)
    assert all(not isinstance(f, Exception) for f in found), found
    assert all(f.data == found[0].data for f in found)
    c = found[0].cluster
    assert [(n.name, n.cluster, n.num_accelerators) for n in c.nodes] == [("ib-0", "ib-800g", 2),
                                                                          ("roce-0", "roce-800g", 2)]
    assert [f.view.rank for f in found] == [0, 1, 2, 3]


def test_one_rank_with_a_bad_override_stops_every_rank_with_its_message(tmp_path):
    root = ib_node(tmp_path)
    envs = [{"HET_PLUGIN_SYSFS_ROOT": str(root), "HET_PLUGIN_NODE_NAME": f"n{r}", **A100} for r in range(3)]
    envs[1]["HET_PLUGIN_ACCELERATOR"] = "Z100"
    found = _gather_threads(envs)
    assert all(isinstance(f, ConfigError) for f in found), found
    assert {str(f) for f in found} == {str(found[0])}
    assert "rank(s) [1] could not discover their node" in str(found[0]) and "Z100" in str(found[0])


def test_ranks_with_different_links_settings_are_refused(tmp_path):
    root = ib_node(tmp_path)
    f = tmp_path / "links.yaml"
    f.write_text("default: {gbps: 40}\n")
    envs = [{"HET_PLUGIN_SYSFS_ROOT": str(root), "HET_PLUGIN_NODE_NAME": f"n{r}", **A100} for r in range(2)]
    envs[1]["HET_PLUGIN_LINKS"] = str(f)
    found = _gather_threads(envs)
    assert all(isinstance(f, ConfigError) and "ranks [1] have a different links setting" in str(f) for f in found)


def test_a_rank_that_never_reports_is_named_not_waited_for_forever(tmp_path):
    root = ib_node(tmp_path)
    envs = [{"HET_PLUGIN_SYSFS_ROOT": str(root), "HET_PLUGIN_NODE_NAME": "n0", **A100}]
    found = _gather_threads(envs, timeout_s=0.5, world_size=2)   # rank 1 never starts
    assert isinstance(found[0], DiscoveryError) and "rank(s) 1 never reached cluster discovery" in str(found[0])


def test_a_restarted_job_does_not_read_the_previous_attempts_result(tmp_path):
    import torch.distributed as dist
    store = dist.HashStore()
    stale = {"error": {"config": False, "problem": "left over from attempt 0"}}
    store.set("het_plugin/discover/0/k/cluster", json.dumps(stale))
    root = roce_node(tmp_path)
    out: list = [None, None]

    def run(r):
        env = {"HET_PLUGIN_SYSFS_ROOT": str(root), "HET_PLUGIN_NODE_NAME": f"n{r}", "TORCHELASTIC_RESTART_COUNT": "1",
               **A100}
        try:
            out[r] = gather_discovery(store, r, 2, env=env, key="k", timeout_s=20)
        except Exception as exc:  # noqa: BLE001
            out[r] = exc
    threads = [threading.Thread(target=run, args=(r,)) for r in (1, 0)]   # rank 1 first: it would see the stale key
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [n.name for n in out[1].cluster.nodes] == ["n0", "n1"], out


def test_ranks_per_node_differing_from_the_device_count_is_noted(tmp_path):
    v = node(ib_node(tmp_path), "n", count=8)
    notes: list[str] = []
    data = build_cluster_data([RankView(0, 0, v), RankView(1, 1, v)], notes=notes)
    assert data["clusters"][0]["nodes"][0]["accelerators_per_node"] == 2
    assert "node n: 2 rank(s) on 8 accelerator(s)" in notes[0]


def test_single_process_gathers_without_a_launcher(tmp_path):
    env = {"HET_PLUGIN_SYSFS_ROOT": str(roce_node(tmp_path)), "HET_PLUGIN_NODE_NAME": "solo", **A100}
    found = gather_discovery(env=env)
    assert [(n.name, n.cluster, n.num_accelerators) for n in found.cluster.nodes] == [("solo", "roce-800g", 1)]


# ---- the CLI ------------------------------------------------------------------------------------

def test_cli_discover_prints_this_nodes_view(tmp_path, capsys, monkeypatch):
    root = ib_node(tmp_path, down=[1])
    monkeypatch.setenv("HET_PLUGIN_ACCELERATOR", "H100")
    assert cli_main(["discover", "--sysfs-root", str(root), "--node-name", "n1"]) == 0
    out = capsys.readouterr().out
    assert "node: n1" in out and "fabric: ib 600 Gbit/s" in out and "mlx5_1 port 1: state '1: DOWN'" in out
    assert cli_main(["discover", "--sysfs-root", str(root), "--format", "json"]) == 0
    assert NodeView.from_dict(json.loads(capsys.readouterr().out)).fabric_gbps == 600.0


def test_cli_gather_in_one_process_prints_a_loadable_cluster_file(tmp_path, capsys, monkeypatch):
    root = ethernet_node(tmp_path, "40000")
    monkeypatch.setenv("HET_PLUGIN_ACCELERATOR", "MI300X")
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert cli_main(["discover", "--gather", "--sysfs-root", str(root), "--node-name", "solo"]) == 0
    path = tmp_path / "c.yaml"
    path.write_text(capsys.readouterr().out)
    c = load_cluster(path)
    assert [(n.name, n.cluster, n.fabric.gbps, n.accelerator.name) for n in c.nodes] == [
        ("solo", "ethernet", 40.0, "MI300X")]
    monkeypatch.delenv("HET_PLUGIN_ACCELERATOR")
    assert cli_main(["discover", "--gather", "--sysfs-root", str(root)]) == 2
    assert "HET_PLUGIN_ACCELERATOR" in capsys.readouterr().err
