"""Mixed-NIC pre-flight (het_plugin.core.nccl_env, `het-plugin check`): nodes from fabricated sysfs trees,
environments that NCCL would hang on, the derived per-node settings, and the CLI's exit codes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from het_plugin.cli import main as cli_main
from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.discovery import cluster_from_views, discover_node
from het_plugin.core.errors import ConfigError
from het_plugin.core.nccl_env import check_launch, groups_from_plan
from het_plugin.core.nccl_names import NameFilter
from het_plugin.views.nccl_env import render_env
from sysfs_tree import ACTIVE, RATES, Hca, NetIf, Port, ib_node, loopback, roce_node, write_tree

HOLMES = Path(__file__).resolve().parents[2] / "het_plugin" / "core" / "inputs" / "presets" / "clusters" / "holmes-ib-roce.yaml"


def view(root, name, **env):
    return discover_node(root, name=name, env={"HET_PLUGIN_ACCELERATOR": "A100-80",
                                               "HET_PLUGIN_ACCELERATOR_COUNT": "8", **env})


def set_roce_gids(root: Path, devices, index: int) -> None:
    """RoCE v2 IPv4 GID at ``index`` (and RoCE v1 below it), as the kernel shows them."""
    for dev in devices:
        port = root / "class" / "infiniband" / dev / "ports" / "1"
        (port / "gid_attrs" / "types").mkdir(parents=True, exist_ok=True)
        (port / "gids").mkdir(exist_ok=True)
        for i in range(index + 1):
            v2 = i == index or i == 1
            (port / "gid_attrs" / "types" / str(i)).write_text("RoCE v2\n" if v2 else "IB/RoCE v1\n")
            gid = "0000:0000:0000:0000:0000:ffff:0a00:0001" if i == index else "fe80:0000:0000:0000:0000:0000:0000:0001"
            (port / "gids" / str(i)).write_text(gid + "\n")


def check(views, env=None, gid_index=None, **kwargs):
    cluster = cluster_from_views(views)
    return check_launch(cluster, env or {}, views=views, gid_index=gid_index, **kwargs)


def fields(result):
    return [r.field for r in result.refusals]


# The ib_roce nodes cross clusters: left unset, NCCL_SOCKET_IFNAME makes NCCL take IPoIB on the IB nodes.
ETH = {"NCCL_SOCKET_IFNAME": "=eth0"}


@pytest.fixture
def ib_roce(tmp_path):
    """2 IB nodes (mlx5_0..3 + ib0..3 IPoIB, eth0) and 2 RoCE nodes (mlx5_0..1 on ens1f0/ens1f1, eth0)."""
    views = [view(ib_node(tmp_path / f"ib{i}"), f"ib-{i}") for i in range(2)]
    roots = [roce_node(tmp_path / f"roce{i}", hcas=2) for i in range(2)]
    for r in roots:
        set_roce_gids(r, ["mlx5_0", "mlx5_1"], 3)
    views += [view(r, f"roce-{i}") for i, r in enumerate(roots)]
    from het_plugin.cli.check import _gid_indices
    return views, {v.name: _gid_indices(v) for v in views}


# ---- derived settings --------------------------------------------------------------------------------

def test_derived_settings_per_node_and_cluster(ib_roce):
    views, gids = ib_roce
    unset = check(views, gid_index=gids)     # NCCL_SOCKET_IFNAME unset: NCCL would take IPoIB (ib0) on IB nodes
    assert fields(unset) == ["NCCL_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"]
    assert [r.nodes for r in unset.refusals] == [("ib-0",), ("ib-1",)]
    assert "unset on node ib-0, so NCCL takes the IPoIB interface(s) ib0, ib1, ib2, ib3" in unset.refusals[0].problem
    assert "export NCCL_SOCKET_IFNAME==eth0" in unset.refusals[0].fix
    derived = {n: r.settings for n, r in unset.nodes.items()}
    result = check(views, {}, gid_index=gids, node_env=derived)    # the derived settings: accepted
    assert result.ok, [r.text() for r in result.refusals]
    ib, roce = result.nodes["ib-0"], result.nodes["roce-1"]
    assert ib.uses == {"ib": ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"], "socket": ["eth0"]}
    assert ib.settings == {"NCCL_IB_HCA": "=mlx5_0,mlx5_1,mlx5_2,mlx5_3", "NCCL_SOCKET_IFNAME": "=eth0",
                           "GLOO_SOCKET_IFNAME": "eth0", "HET_PLUGIN_GLOO_IFNAMES": "ib=ib0,socket=eth0"}
    assert roce.uses["roce"] == ["mlx5_0 (GID 3)", "mlx5_1 (GID 3)"]
    assert roce.settings["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1"
    assert roce.settings["NCCL_IB_GID_INDEX"] == "3"
    assert roce.settings["HET_PLUGIN_GLOO_IFNAMES"] == "roce=ens1f0,socket=eth0"
    per_cluster = result.cluster_settings()
    assert per_cluster["roce-400g"]["common"]["NCCL_IB_GID_INDEX"] == "3"
    assert per_cluster["ib-800g"]["nodes"] == ["ib-0", "ib-1"] and per_cluster["ib-800g"]["per_node"] == {}
    text = render_env(result, per="cluster")
    assert "# cluster ib-800g: ib-0, ib-1\nexport NCCL_IB_HCA==mlx5_0,mlx5_1,mlx5_2,mlx5_3\n" in text
    assert render_env(result, node="roce-0").splitlines()[0] == "export NCCL_IB_HCA==mlx5_0,mlx5_1"


def test_gid_index_from_sysfs_and_a_contradicting_setting(ib_roce):
    views, gids = ib_roce
    assert gids["roce-0"] == {("mlx5_0", 1): 3, ("mlx5_1", 1): 3} and gids["ib-0"] == {}
    result = check(views, {**ETH, "NCCL_IB_GID_INDEX": "1"}, gid_index=gids)   # index 1 is RoCE v2 link-local
    assert fields(result) == ["NCCL_IB_GID_INDEX", "NCCL_IB_GID_INDEX"]
    assert "mlx5_0 is 3" in result.refusals[0].problem and "export NCCL_IB_GID_INDEX=3" in result.refusals[0].fix
    assert check(views, {**ETH, "NCCL_IB_GID_INDEX": "3"}, gid_index=gids).ok


# ---- refusals ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["IB", "ib", "Socket"])
def test_nccl_net_forcing_one_network_is_refused(ib_roce, value):
    result = check(ib_roce[0], {**ETH, "NCCL_NET": value})
    assert fields(result) == ["NCCL_NET"]
    assert "overrides the network of every NCCL communicator" in result.refusals[0].problem
    assert "unset NCCL_NET" in result.refusals[0].fix


def test_nccl_net_matching_every_group_passes(tmp_path):
    views = [view(ib_node(tmp_path / f"n{i}"), f"n{i}") for i in range(2)]   # one IB cluster: ib groups only
    assert check(views, {"NCCL_NET": "ib"}).ok
    assert fields(check(views, {"NCCL_NET": "Socket"})) == ["NCCL_NET"]


def test_nccl_ib_hca_naming_a_device_a_node_lacks(tmp_path):
    views = [view(ib_node(tmp_path / "a"), "a", HET_PLUGIN_FABRIC_NAME="f"),
             view(ib_node(tmp_path / "b", hcas=3), "b", HET_PLUGIN_FABRIC_NAME="f")]   # b: mlx5_0..2
    env = {"NCCL_IB_HCA": "=mlx5_1,mlx5_3", "NCCL_IGNORE_NET_MISMATCH": "0"}
    result = check(views, env)
    assert fields(result)[0] == "NCCL_IB_HCA"
    first = result.refusals[0]
    assert first.nodes == ("b",) and "names mlx5_3, which node b does not have" in first.problem
    assert "export NCCL_IB_HCA==mlx5_0,mlx5_1,mlx5_2" in first.fix
    # the same names on both nodes pass
    assert check(views, {"NCCL_IB_HCA": "=mlx5_0,mlx5_2", "NCCL_IGNORE_NET_MISMATCH": "0"}).ok


def test_nccl_ib_hca_selecting_nothing_falls_back_to_sockets(tmp_path):
    views = [view(ib_node(tmp_path / f"n{i}"), f"n{i}") for i in range(2)]
    result = check(views, {"NCCL_IB_HCA": "^mlx5"})
    assert fields(result) == ["NCCL_IB_HCA", "NCCL_IB_HCA"]
    assert "selects no HCA" in result.refusals[0].problem


def test_one_communicator_joining_ib_and_roce_hcas(tmp_path):
    def mixed(root):   # mlx5_0..1 InfiniBand, mlx5_2 RoCE on ens3f0: an IB node (more IB bandwidth)
        cards = [Hca(f"mlx5_{i}", [Port("InfiniBand", RATES["HDR"], ACTIVE)], [NetIf(f"ib{i}", "200000", type="32")])
                 for i in range(2)]
        cards.append(Hca("mlx5_2", [Port("Ethernet", RATES["HDR"], ACTIVE, netdev="ens3f0")], [NetIf("ens3f0", "200000")]))
        return write_tree(root, cards, [NetIf("eth0"), loopback()])
    views = [view(mixed(tmp_path / f"n{i}"), f"n{i}") for i in range(2)]
    result = check(views)   # NCCL_IB_HCA unset: NCCL opens every HCA
    assert fields(result) == ["NCCL_IB_HCA", "NCCL_IB_HCA"]
    assert "joins InfiniBand HCAs (mlx5_0, mlx5_1) and mlx5_2 (RoCE) in one communicator" in result.refusals[0].problem
    assert "export NCCL_IB_HCA==mlx5_0,mlx5_1" in result.refusals[0].fix
    assert result.nodes["n0"].settings["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1"     # the derived setting leaves RoCE out
    assert fields(check(views, {"NCCL_IB_HCA": "mlx5"})) == ["NCCL_IB_HCA", "NCCL_IB_HCA"]   # prefix: all three
    assert check(views, {"NCCL_IB_HCA": "=mlx5_0,mlx5_1"}).ok


@pytest.mark.parametrize("setting", [None, "1", "0"])
@pytest.mark.parametrize("version", [(2, 18, 1), (2, 26, 2), (2, 30, 7), None])
def test_groups_spanning_different_nic_counts_warn(tmp_path, setting, version):
    """NCCL 2.30 accepts mixed counts by default and NCCL_IB_HCA is per process: a warning, not a refusal --
    except NCCL_IGNORE_NET_MISMATCH=0 on NCCL >= 2.30 (or an unknown version), where NCCL's init stops."""
    views = [view(ib_node(tmp_path / "a"), "a", HET_PLUGIN_FABRIC_NAME="f"),
             view(ib_node(tmp_path / "b", hcas=4, down=[3]), "b", HET_PLUGIN_FABRIC_NAME="f")]   # b: 3 active
    env = {} if setting is None else {"NCCL_IGNORE_NET_MISMATCH": setting}
    result = check(views, env, nccl_version=version)
    stops = setting == "0" and (version is None or version >= (2, 30, 0))
    assert fields(result) == (["NCCL_IGNORE_NET_MISMATCH"] if stops else [])
    counts = "(NICs, ports of one NIC merged as NCCL merges them) (a: 4, b: 3)"
    if stops:
        assert counts in result.refusals[0].problem and "NCCL_IGNORE_NET_MISMATCH=0 on node" in result.refusals[0].problem
        assert result.refusals[0].fix.startswith("unset NCCL_IGNORE_NET_MISMATCH")
    else:
        assert any(counts in w and "left as it is" in w for w in result.warnings), result.warnings
    no_such = [w for w in result.warnings if "has no such variable" in w]
    assert bool(no_such) == (setting is not None and version is not None and version < (2, 30, 0))
    if no_such:
        assert f"NCCL {'.'.join(map(str, version))} has no such variable" in no_such[0]
    # the same count on every node: no warning
    same = check(views, {"NCCL_IB_HCA": "=mlx5_0,mlx5_1,mlx5_2", **env}, nccl_version=version)
    assert same.ok and not any("different numbers" in w for w in same.warnings)


def test_nic_count_merges_the_ports_of_one_nic_as_nccl_does():
    from het_plugin.core.nccl_env import Hca as H, nic_count
    dual = [H("mlx5_0", 1, "ib"), H("mlx5_0", 2, "ib"), H("mlx5_1", 1, "ib")]
    assert nic_count(dual, {}, (2, 30, 7)) == 2                          # NCCL_IB_MERGE_NICS=1 (default)
    assert nic_count(dual, {"NCCL_IB_MERGE_NICS": "0"}, (2, 30, 7)) == 3
    assert nic_count(dual, {}, (2, 18, 1)) == 3                          # no merging before 2.20



def test_socket_ifname_that_does_not_match_every_node(tmp_path):
    ib = view(ib_node(tmp_path / "ib"), "ib-0")
    roce = view(write_tree(tmp_path / "roce", [Hca("mlx5_0", [Port("Ethernet", RATES["HDR"], ACTIVE, netdev="ens1f0")],
                                                   [NetIf("ens1f0", "200000")])],
                           [NetIf("enp1s0"), loopback()]), "roce-0")
    result = check([ib, roce], {"NCCL_SOCKET_IFNAME": "=eth0"})
    assert fields(result) == ["NCCL_SOCKET_IFNAME"]
    r = result.refusals[0]
    assert r.nodes == ("roce-0",) and "matches no interface of node roce-0 (it has enp1s0, ens1f0)" in r.problem
    assert "export NCCL_SOCKET_IFNAME==enp1s0" in r.fix
    assert result.nodes["roce-0"].settings["NCCL_SOCKET_IFNAME"] == "=enp1s0"      # derived: per node
    assert check([ib, roce], {"NCCL_SOCKET_IFNAME": "=eth0,enp1s0"}).ok
    # a prefix matching one interface here and two there: different counts, NCCL accepts them (a warning)
    mixed = check([ib, roce], {"NCCL_SOCKET_IFNAME": "en,eth"})
    assert mixed.ok and any("interfaces NCCL's sockets use (ib-0: 1, roce-0: 2)" in w for w in mixed.warnings)
    # one character: NCCL ignores it (src/misc/socket.cc: strlen > 1) and picks IPoIB itself on the IB node
    short = check([ib, roce], {"NCCL_SOCKET_IFNAME": "e"})
    assert fields(short) == ["NCCL_SOCKET_IFNAME"] and "one character long" in " ".join(short.warnings)


def test_raise_if_refused_names_field_and_fix(ib_roce):
    with pytest.raises(ConfigError) as exc:
        check(ib_roce[0], {"NCCL_NET": "IB", "NCCL_SOCKET_IFNAME": "=bond0"}).raise_if_refused()
    assert exc.value.field == "NCCL_NET" and exc.value.fix.startswith("unset NCCL_NET")
    assert "more:" in exc.value.problem and "NCCL_SOCKET_IFNAME" in exc.value.problem
    check(ib_roce[0], ETH).raise_if_refused()    # nothing to refuse: returns


# ---- NCCL's filter syntax ----------------------------------------------------------------------------

def test_name_filter_follows_nccl_prefix_exact_exclude_and_port():
    assert NameFilter.parse("mlx5_1").selects("mlx5_10")          # prefix: mlx5_1 also matches mlx5_10
    assert not NameFilter.parse("=mlx5_1").selects("mlx5_10")
    exclude = NameFilter.parse("^=mlx5_1,mlx5_4")
    assert not exclude.selects("mlx5_1") and not exclude.selects("mlx5_4") and exclude.selects("mlx5_10")
    assert not NameFilter.parse("^mlx5").selects("mlx5_3")
    ports = NameFilter.parse("=mlx5_0:1,mlx5_1:1")
    assert ports.selects("mlx5_0", 1) and not ports.selects("mlx5_0", 2)
    assert NameFilter.parse("mlx5_0::0:0").selects("mlx5_0", 2)   # empty port: every port
    assert NameFilter.parse("=eth0", ports=False).selects("eth0") and not NameFilter.parse("=eth0", ports=False).selects("eth01")


# ---- from a plan and from a cluster file ---------------------------------------------------------------

def test_plan_groups_and_the_file_nics():
    from het_plugin.core.planner import make_plan
    from het_plugin.core.launch import model_from_arg
    cluster = load_cluster(HOLMES)
    plan = make_plan(cluster, model_from_arg("gpt-7.5b"))
    groups = groups_from_plan(plan)
    assert {g.transport for g in groups} >= {"ib", "roce", "socket"}
    assert groups[-1].label == "world group" and len(groups[-1].nodes) == 8
    result = check_launch(plan, {}, cluster=cluster)
    assert result.ok and result.nodes["roce-2"].settings["HET_PLUGIN_GLOO_IFNAMES"] == "roce=ens1f0,socket=eth0"
    assert fields(check_launch(plan, {"NCCL_NET": "Socket"}, cluster=cluster)) == ["NCCL_NET"]
    bare = check_launch(plan, {})            # a plan alone names no NICs: nothing checked, and said so
    assert bare.nodes == {} and "no NIC information for node(s) ib-0" in bare.warnings[0]


# ---- the CLI -----------------------------------------------------------------------------------------

def test_cli_exit_codes_and_formats(tmp_path, capsys, monkeypatch):
    for key in ("NCCL_NET", "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "NCCL_IGNORE_NET_MISMATCH", "NCCL_IB_GID_INDEX"):
        monkeypatch.delenv(key, raising=False)
    assert cli_main(["check", str(HOLMES), "--no-discover", "--format", "env", "--node", "roce-1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("export NCCL_IB_HCA==mlx5_0,mlx5_1\nexport NCCL_SOCKET_IFNAME==eth0\n")
    monkeypatch.setenv("NCCL_NET", "IB")
    assert cli_main(["check", str(HOLMES), "--no-discover", "--format", "env"]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and "het-plugin check: refused: NCCL_NET: NCCL_NET=IB overrides" in cap.err
    assert cli_main(["check", str(HOLMES), "--no-discover", "--format", "json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["refusals"][0]["field"] == "NCCL_NET"
    assert doc["clusters"]["ib"]["common"]["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1,mlx5_2,mlx5_3"
    monkeypatch.delenv("NCCL_NET")
    assert cli_main(["check"]) == 2 and "nothing to check" in capsys.readouterr().err


def test_cli_uses_this_nodes_discovery_over_the_file(tmp_path, capsys, monkeypatch):
    for key in ("NCCL_NET", "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "NCCL_IGNORE_NET_MISMATCH", "NCCL_IB_GID_INDEX"):
        monkeypatch.delenv(key, raising=False)
    root = ib_node(tmp_path / "ib0", hcas=4, down=[3])        # this node is ib-0, and its mlx5_3 is down
    args = ["check", str(HOLMES), "--sysfs-root", str(root), "--node-name", "ib-0"]
    monkeypatch.setenv("NCCL_IB_HCA", "=mlx5_0,mlx5_1,mlx5_2,mlx5_3")
    assert cli_main(args) == 2
    cap = capsys.readouterr()
    assert "names mlx5_3, which node ib-0 does not have" in cap.err
    assert "warning: " in cap.out and "different numbers of network devices" in cap.out and "(ib-0: 3, ib-1: 4" in cap.out
    monkeypatch.setenv("NCCL_IB_HCA", "=mlx5_0,mlx5_1")     # one launcher value: two HCAs on every node
    monkeypatch.setenv("NCCL_IGNORE_NET_MISMATCH", "0")
    assert cli_main(args) == 2          # this node's IPoIB (ib0) is NCCL's own pick with NCCL_SOCKET_IFNAME unset
    assert "NCCL_SOCKET_IFNAME is unset on node ib-0" in capsys.readouterr().err
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "=eth0")
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "node ib-0 (cluster ib, NICs from discovery)" in out and "pre-flight: ok" in out
