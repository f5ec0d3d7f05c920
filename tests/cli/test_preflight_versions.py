"""Pre-flight rules that depend on the NCCL version and on what a cluster file declares (het_plugin.core.nccl_env):
pure fixtures, fake NCCL version tuples (2.18, 2.21, 2.26, 2.30), NodeNics built by hand (milliseconds)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from het_plugin.cli import main as cli_main
from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.errors import ConfigError
from het_plugin.core.nccl_env import GroupUse, Hca, NodeNics, preflight

V218, V221, V226, V230 = (2, 18, 5), (2, 21, 5), (2, 26, 2), (2, 30, 7)
HOLMES = Path(__file__).resolve().parents[2] / "het_plugin" / "core" / "inputs" / "presets" / "clusters" / "holmes-ib-roce.yaml"


def roce(name, gid=3, ports=2):
    return NodeNics(name, tuple(Hca(f"mlx5_{i}", 1, "roce", (f"ens{i}f0",), gid) for i in range(ports)), ("eth0",))


def ib(name, hcas=4):
    return NodeNics(name, tuple(Hca(f"mlx5_{i}", 1, "ib", (f"ib{i}",)) for i in range(hcas)), ("eth0",))


def run(groups, nics, env=None, version=None, **kw):
    return preflight(groups, {n.name: n for n in nics}, env or {}, nccl_version=version, **kw)


def fields(result):
    return [r.field for r in result.refusals]


ROCE_DP = [GroupUse("dp group", ("r0", "r1"), "roce")]
IB_DP = [GroupUse("dp group", ("i0", "i1"), "ib")]


# ---- NCCL_IB_GID_INDEX: automatic RoCE v2 selection only from 2.21 --------------------------------------

@pytest.mark.parametrize("version, refused", [(V218, True), (V221, False), (V226, False), (V230, False)])
def test_unset_gid_index_before_2_21_is_refused(version, refused):
    result = run(ROCE_DP, [roce("r0"), roce("r1")], version=version)
    assert fields(result) == (["NCCL_IB_GID_INDEX", "NCCL_IB_GID_INDEX"] if refused else [])
    if refused:
        r = result.refusals[0]
        assert "NCCL_IB_GID_INDEX is unset on node r0" in r.problem and "NCCL 2.18.5 (before 2.21)" in r.problem
        assert "export NCCL_IB_GID_INDEX=3" in r.fix
    # the derived setting fixes it on every version
    derived = {n: rep.settings for n, rep in result.nodes.items()}
    assert derived["r0"]["NCCL_IB_GID_INDEX"] == "3"
    assert run(ROCE_DP, [roce("r0"), roce("r1")], version=version, node_env=derived).ok


def test_gid_index_zero_is_fine_on_old_nccl_and_minus_one_is_not():
    assert run(ROCE_DP, [roce("r0", gid=0), roce("r1", gid=0)], version=V218).ok
    minus = run(ROCE_DP, [roce("r0"), roce("r1")], {"NCCL_IB_GID_INDEX": "-1"}, version=V218)
    assert fields(minus) == ["NCCL_IB_GID_INDEX"] * 2 and "from NCCL 2.21, this is NCCL 2.18.5" in minus.refusals[0].problem
    assert run(ROCE_DP, [roce("r0"), roce("r1")], {"NCCL_IB_GID_INDEX": "-1"}, version=V221).ok


def test_unknown_version_warns_about_the_gid_index():
    result = run(ROCE_DP, [roce("r0"), roce("r1")])
    assert result.ok and any("NCCL version is unknown" in w and "2.21" in w for w in result.warnings)


# ---- IB and RoCE in one communicator: fails fast from 2.26, may hang before ------------------------------

@pytest.mark.parametrize("version, says", [(V218, "NCCL 2.18.5 (before 2.26) does not check it and may hang"),
                                           (V226, "NCCL 2.26.2 stops at connect"),
                                           (V230, "NCCL 2.30.7 stops at connect"),
                                           (None, "NCCL >= 2.26 stops at connect")])
def test_ib_and_roce_in_one_communicator_names_the_version(version, says):
    mixed = NodeNics("m0", (Hca("mlx5_0", 1, "ib", ("ib0",)), Hca("mlx5_1", 1, "roce", ("ens1",))), ("eth0",))
    other = NodeNics("m1", mixed.hcas, ("eth0",))
    result = run([GroupUse("dp group", ("m0", "m1"), "ib")], [mixed, other], version=version)
    assert fields(result) == ["NCCL_IB_HCA", "NCCL_IB_HCA"]
    assert says in result.refusals[0].problem and "export NCCL_IB_HCA==mlx5_0" in result.refusals[0].fix


# ---- NCCL_IGNORE_NET_MISMATCH exists only from 2.30 -----------------------------------------------------

@pytest.mark.parametrize("version", [V218, V221, V226])
def test_ignore_net_mismatch_before_2_30_does_nothing(version):
    result = run(IB_DP, [ib("i0"), ib("i1")], {"NCCL_IGNORE_NET_MISMATCH": "0"}, version=version)
    assert result.ok
    text = " ".join(result.warnings)
    assert f"NCCL {'.'.join(map(str, version))} has no such variable (added in NCCL 2.30)" in text


def test_mismatch_zero_refused_only_where_nccl_stops():
    nics = [ib("i0", 4), ib("i1", 2)]
    strict = run(IB_DP, nics, {"NCCL_IGNORE_NET_MISMATCH": "0"}, version=V230)
    assert fields(strict) == ["NCCL_IGNORE_NET_MISMATCH"] and "(i0: 4, i1: 2)" in strict.refusals[0].problem
    assert "NCCL 2.30.7 here" in strict.refusals[0].problem
    assert run(IB_DP, nics, {"NCCL_IGNORE_NET_MISMATCH": "0"}, version=V226).ok
    assert run(IB_DP, nics, {}, version=V230).ok


# ---- NCCL_SOCKET_IFNAME unset or matching nothing --------------------------------------------------------

CROSS = [GroupUse("pp group", ("i0", "r0"), "socket"), GroupUse("dp group", ("i0", "i1"), "ib")]


def test_socket_ifname_unset_picks_ipoib_on_an_ib_node():
    result = run(CROSS, [ib("i0"), ib("i1"), roce("r0")], version=V230)
    assert fields(result) == ["NCCL_SOCKET_IFNAME"] and result.refusals[0].nodes == ("i0",)
    assert "takes the IPoIB interface(s) ib0, ib1, ib2, ib3" in result.refusals[0].problem
    assert "export NCCL_SOCKET_IFNAME==eth0" in result.refusals[0].fix
    # i1 is in no group crossing clusters: its IPoIB is reachable by its peers
    assert run(IB_DP, [ib("i0"), ib("i1")], version=V230).ok


def test_socket_ifname_matching_nothing_disables_the_ib_plugin():
    result = run(IB_DP, [ib("i0"), ib("i1")], {"NCCL_SOCKET_IFNAME": "=bond0"}, version=V230)
    assert fields(result) == ["NCCL_SOCKET_IFNAME"] * 2
    assert "NCCL_SOCKET_IFNAME==bond0 matches no interface of node i0" in result.refusals[0].problem
    assert "IB plugin" in result.refusals[0].problem and "export NCCL_SOCKET_IFNAME==eth0" in result.refusals[0].fix


# ---- split children sharing resources -------------------------------------------------------------------

def test_split_share_with_different_networks_is_refused():
    groups = CROSS + [GroupUse("world group", ("i0", "i1", "r0"), "socket")]
    env = {"NCCL_COMM_SPLIT_SHARE_RESOURCES": "1", "NCCL_SOCKET_IFNAME": "=eth0"}
    result = run(groups, [ib("i0"), ib("i1"), roce("r0", gid=0)], env, version=V230)
    assert fields(result) == ["NCCL_COMM_SPLIT_SHARE_RESOURCES"]
    r = result.refusals[0]
    assert "NCCL_COMM_SPLIT_SHARE_RESOURCES=1" in r.problem and "'Socket'" in r.problem and "NCCL's default" in r.problem
    assert r.fix.startswith("unset NCCL_COMM_SPLIT_SHARE_RESOURCES")
    assert run(groups, [ib("i0"), ib("i1"), roce("r0", gid=0)], {**env, "NCCL_COMM_SPLIT_SHARE_RESOURCES": "0"},
               version=V230).ok
    assert run(IB_DP, [ib("i0"), ib("i1")], env, version=V230).ok      # one network everywhere: sharing is fine


# ---- NCCL_NET against the declared network ----------------------------------------------------------------

def test_nccl_net_against_a_declared_rdma_network():
    declared = [GroupUse("dp group", ("i0", "i1"), "ib", "IB-CAST")]
    nics = [ib("i0"), ib("i1")]
    assert run(declared, nics, {"NCCL_NET": "ib-cast"}, version=V230).ok            # case-insensitive, as NCCL
    wrong = run(declared, nics, {"NCCL_NET": "IB"}, version=V230)
    assert fields(wrong) == ["NCCL_NET"] and "needs 'IB-CAST'" in wrong.refusals[0].problem
    assert run(IB_DP, nics, {"NCCL_NET": "AWS Libfabric"}, version=V230).ok         # undeclared: the site's choice


# ---- optional cluster-file fields -> the environment to set -----------------------------------------------

def _holmes_with(tmp_path, **fabric):
    data = yaml.safe_load(HOLMES.read_text())
    data["clusters"][0]["fabric"].update(fabric)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_cluster_fields_are_emitted_as_environment(tmp_path, capsys, monkeypatch):
    for key in ("NCCL_NET", "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "NCCL_IGNORE_NET_MISMATCH", "NCCL_IB_GID_INDEX"):
        monkeypatch.delenv(key, raising=False)
    path = _holmes_with(tmp_path, nccl_net="IB-CAST", ib_tc=106, rail_only=True)
    assert cli_main(["check", str(path), "--no-discover", "--format", "env", "--node", "ib-0",
                     "--nccl-version", "2.30.7"]) == 0
    out = capsys.readouterr().out
    assert "export NCCL_IB_TC=106\n" in out and "export NCCL_CROSS_NIC=0\n" in out
    assert "NCCL_NET" not in out and "NCCL_IGNORE_NET_MISMATCH" not in out
    assert cli_main(["check", str(path), "--no-discover", "--format", "env", "--node", "roce-0",
                     "--nccl-version", "2.30.7"]) == 0
    assert "NCCL_IB_TC" not in capsys.readouterr().out             # the RoCE cluster declares none


def test_cluster_fields_are_validated(tmp_path):
    data = yaml.safe_load(HOLMES.read_text())
    data["links"][0]["type"] = "ib"
    data["clusters"][0]["fabric"]["nccl_net"] = "IB-CAST"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as exc:
        load_cluster(path)
    assert "name different NCCL networks ('IB-CAST' and None)" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        load_cluster(_holmes_with(tmp_path, type="ethernet", ib_tc=3))
    assert "ib_tc describe an RDMA fabric" in str(exc.value)
    with pytest.raises(ConfigError):
        load_cluster(_holmes_with(tmp_path, ib_tc=300))
    plain, declared = load_cluster(HOLMES), load_cluster(_holmes_with(tmp_path, nccl_net="IB-CAST"))
    assert declared.nccl_nets == {"ib": "IB-CAST"} and declared.digest != plain.digest
    assert load_cluster(_holmes_with(tmp_path, rail_only=False)).digest == plain.digest   # defaults: same digest


def test_cli_rejects_a_malformed_version(capsys):
    assert cli_main(["check", str(HOLMES), "--no-discover", "--nccl-version", "two"]) == 2
    assert "--nccl-version" in capsys.readouterr().err
