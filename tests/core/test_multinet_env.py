"""The environment for NCCL's multi-network communicators: generated per node, and checked (fake NCCL versions)."""
from __future__ import annotations

from pathlib import Path

from het_plugin.core.inputs.cluster import cluster_from_dict, load_cluster
from het_plugin.core.multinet_env import (ALGO, ALLNET, COLLNET, IB_HCA, MAXRAIL, SCATTER, check_build, check_env,
                                          fabric_ids, hca_entries, multinet_settings)
from het_plugin.core.nccl_version import parse_build

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "clusters"


def holmes():
    return load_cluster(EXAMPLES / "holmes-ib-roce.yaml")


def two_ib(linked: bool = False):
    """Two InfiniBand clusters, each its own fabric (joined by Ethernet unless ``linked`` by IB)."""
    spec = lambda name: {"name": name, "fabric": {"type": "ib", "gbps": 400},      # noqa: E731
                         "nodes": [{"count": 2, "accelerator": "H100", "accelerators_per_node": 8,
                                    "nics": [{"type": "ib", "gbps": 400, "devices": ["mlx5_0", "mlx5_1"]},
                                             {"type": "ethernet", "gbps": 25, "interfaces": ["eth0"]}]}]}
    return cluster_from_dict({"name": "two-ib", "clusters": [spec("a"), spec("b")],
                              "links": [{"between": ["a", "b"], "type": "ib" if linked else "ethernet",
                                         "gbps": 400 if linked else 25}]})


def envs(cluster, **common):
    settings = multinet_settings(cluster)
    return {n: {**s, **common} for n, s in settings.items()}


def errors(findings):
    return [f for f in findings if f.level == "error"]


# ---- generated --------------------------------------------------------------------------------------------

def test_each_fabric_gets_its_own_rail_and_every_node_its_ports_with_it():
    c = holmes()
    assert fabric_ids(c) == {"ib": 0, "roce": 1}
    s = multinet_settings(c)
    assert s["ib-0"] == {ALLNET: "1", IB_HCA: "=mlx5_0:1:0,mlx5_1:1:0,mlx5_2:1:0,mlx5_3:1:0", SCATTER: "1"}
    assert s["roce-3"][IB_HCA] == "=mlx5_0:1:1,mlx5_1:1:1"


def test_clusters_joined_by_their_own_rdma_kind_are_one_fabric():
    assert fabric_ids(two_ib(linked=True)) == {"a": 0, "b": 0}
    assert fabric_ids(two_ib()) == {"a": 0, "b": 1}


def test_the_generated_environment_passes_its_own_checks():
    for c in (holmes(), two_ib()):
        assert check_env(c, envs(c), needed=True) == []


def test_hca_entries_read_port_and_fabric_id():
    assert hca_entries("=mlx5_0:1:3,mlx5_1") == [("mlx5_0", 1, 3), ("mlx5_1", None, None)]
    assert hca_entries("^mlx5_2") == [] and hca_entries(None) == []


# ---- checked ----------------------------------------------------------------------------------------------

def test_a_plan_relying_on_it_needs_allnet_on_every_node():
    c = holmes()
    env = envs(c)
    env["roce-2"] = {**env["roce-2"], ALLNET: "0"}
    (f,) = errors(check_env(c, env, needed=True))
    assert f.variable == ALLNET and f.value == "0" and f.nodes == ("roce-2",) and "=1" in f.fix
    assert check_env(c, {n: {} for n in env}, needed=False) == []       # not asked for, not set: nothing to say


def test_two_ib_fabrics_without_fabric_ids_share_nccls_default_rail():
    c = two_ib()
    env = {n: {ALLNET: "1", IB_HCA: "=mlx5_0,mlx5_1"} for n in multinet_settings(c)}
    (f,) = errors(check_env(c, env, needed=True))
    assert f.variable == IB_HCA and f.value == "=mlx5_0,mlx5_1"
    assert "separate fabrics" in f.problem and "NCCL default" in f.problem and "a: 0; b: 1" in f.fix
    assert check_env(two_ib(linked=True), {n: {ALLNET: "1"} for n in env}, needed=True) == []


def test_ib_and_roce_without_ids_are_apart_by_nccls_defaults_a_warning_only():
    c = holmes()
    env = {n: {ALLNET: "1", IB_HCA: "=mlx5_0,mlx5_1"} for n in multinet_settings(c)}
    found = check_env(c, env, needed=True)
    assert not errors(found) and found[0].level == "warning" and found[0].variable == IB_HCA


def test_ib_and_roce_ports_on_one_rail_are_refused():
    c = holmes()
    env = envs(c)
    for n in env:                                    # the RoCE cluster given the IB fabric's ID
        if n.startswith("roce"):
            env[n] = {**env[n], IB_HCA: "=mlx5_0:1:0,mlx5_1:1:0"}
    (f,) = errors(check_env(c, env, needed=True))
    assert "InfiniBand and RoCE ports" in f.problem and "try RDMA" in f.problem


def test_same_rail_in_two_data_centers_still_connects_ib_to_roce():
    """fabricId = dc * MAXRAIL + rail: a different data center on the same rail is DCL1, still connected."""
    c = holmes()
    env = envs(c, **{MAXRAIL: "16"})
    for n in env:
        if n.startswith("roce"):
            env[n] = {**env[n], IB_HCA: "=mlx5_0:1:16,mlx5_1:1:16"}      # dc 1, rail 0: the IB fabric's rail
    (f,) = errors(check_env(c, env, needed=True))
    assert "data centers 0 and 1" in f.problem


def test_collnet_under_allnet_is_said_and_collnet_only_algorithms_refused():
    c = holmes()
    warn = check_env(c, envs(c, **{COLLNET: "1"}), needed=True)
    assert warn and warn[0].variable == COLLNET and warn[0].level == "warning"
    (f,) = errors(check_env(c, envs(c, **{ALGO: "CollNetDirect,CollNetChain"}), needed=True))
    assert f.variable == ALGO
    assert not errors(check_env(c, envs(c, **{ALGO: "Ring,CollNetDirect"}), needed=True))


def test_nccl_versions_that_cannot_have_it():
    assert check_build(None, (2, 30, 7), needed=False) == []
    (f,) = check_build(None, (2, 30, 7), needed=True)                 # a release newer than the branch
    assert f.level == "error" and f.value == "2.30.7"
    (f,) = check_build(None, (2, 21, 5), needed=True)
    assert f.level == "error"
    (f,) = check_build(None, (2, 26, 2), needed=True)                 # what the branch reports: not provable
    assert f.level == "warning" and "ignore CollNet" in f.fix
    (f,) = check_build(None, None, needed=True)
    assert f.level == "warning"
    assert check_build(parse_build("2.26.2+cross-dc"), None, needed=True) == []
    (f,) = check_build(parse_build("2.30.7"), None, needed=True)
    assert f.level == "error" and "re-plan" in f.fix
