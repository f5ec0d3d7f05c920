"""Discovery across processes: ranks on fabricated nodes gather over the store into one cluster file."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.discovery import discover_node
from integration_tests.support.launch import run_ranks
from tests.sysfs_tree import ethernet_node, ib_node, roce_node

RANK_SCRIPT = Path(__file__).parent / "ranks" / "discover_rank.py"
ACCEL = {"HET_PLUGIN_ACCELERATOR": "A100-80"}


def _node_env(root: Path, name: str) -> dict:
    return {"HET_PLUGIN_SYSFS_ROOT": str(root), "HET_PLUGIN_NODE_NAME": name}


def test_ib_pair_and_roce_pair_gather_into_one_cluster_on_every_rank(tmp_path):
    nodes = [("ib-a", ib_node(tmp_path / "ib-a")), ("ib-b", ib_node(tmp_path / "ib-b")),
             ("roce-a", roce_node(tmp_path / "roce-a")), ("roce-b", roce_node(tmp_path / "roce-b"))]
    outs = run_ranks(RANK_SCRIPT, 4, env=ACCEL, rank_env=[_node_env(root, name) for name, root in nodes],
                     ranks_per_node=1, timeout=150)
    results = [o.result for o in outs]
    assert all(r and "data" in r for r in results), [o.stderr[-2000:] for o in outs]
    first = results[0]
    for r in results:   # one cluster description everywhere, and the collective agrees
        assert r["data"] == first["data"] and r["all_digests"] == [first["digest"]] * 4
    assert [r["my_node"] for r in results] == ["ib-a", "ib-b", "roce-a", "roce-b"]
    assert [r["my_cluster"] for r in results] == ["ib-800g", "ib-800g", "roce-800g", "roce-800g"]
    data = first["data"]
    shape = [(c["name"], c["fabric"]["type"], c["fabric"]["gbps"],
              [(g["accelerator"], g["accelerators_per_node"], g["hostnames"]) for g in c["nodes"]])
             for c in data["clusters"]]
    assert shape == [("ib-800g", "ib", 800.0, [("A100-80", 1, ["ib-a", "ib-b"])]),
                     ("roce-800g", "roce", 800.0, [("A100-80", 1, ["roce-a", "roce-b"])])]
    assert data["links"] == [{"between": ["ib-800g", "roce-800g"], "type": "ethernet", "gbps": 25.0,
                              "latency_us": 50.0}]
    assert "launch" not in data   # the ranks are already in file order


def test_a_rank_with_a_bad_override_stops_every_rank_with_the_same_error(tmp_path):
    root = ib_node(tmp_path / "n")
    rank_env = [_node_env(root, f"n{r}") for r in range(4)]
    rank_env[3]["HET_PLUGIN_ACCELERATOR"] = "Z100"
    outs = run_ranks(RANK_SCRIPT, 4, env=ACCEL, rank_env=rank_env, ranks_per_node=1, timeout=150, check=False)
    assert [o.returncode for o in outs] == [3, 3, 3, 3], [o.stderr[-2000:] for o in outs]
    errors = {o.result["error"] for o in outs}
    assert len(errors) == 1
    (error,) = errors
    assert "rank(s) [3] could not discover their node" in error and "Z100" in error
    assert all(o.result["type"] == "ConfigError" for o in outs)


def _het_plugin_script() -> Path:
    script = Path(sys.executable).parent / "het-plugin"
    if not script.exists():
        found = shutil.which("het-plugin")
        if not found:
            pytest.skip("the het-plugin console script is not installed")
        script = Path(found)
    return script


def test_cli_discover_gather_under_the_launcher_prints_a_cluster_file_that_loads(tmp_path):
    """Two nodes x two ranks: a fabricated IB node, and this machine's real /sys as an Ethernet node."""
    ib_root = ib_node(tmp_path / "ib")
    rank_env = [_node_env(ib_root, "ib-a"), _node_env(ib_root, "ib-a"),
                {"HET_PLUGIN_NODE_NAME": "here"}, {"HET_PLUGIN_NODE_NAME": "here"}]
    for e in rank_env[2:]:
        e["HET_PLUGIN_SYSFS_ROOT"] = "/sys"
    outs = run_ranks(_het_plugin_script(), 4, ["discover", "--gather", "--timeout", "60"], env=ACCEL,
                     rank_env=rank_env, ranks_per_node=2, timeout=150)
    assert [o.stdout for o in outs[1:]] == ["", "", ""]        # rank 0 prints, once
    path = tmp_path / "discovered.yaml"
    path.write_text(outs[0].stdout)
    cluster = load_cluster(path)

    here = discover_node("/sys", name="here", env={})
    if here.rdma:
        pytest.skip("this machine has RDMA ports; the expected shape below assumes an Ethernet-only host")
    eth_gbps = here.ethernet_gbps or 10.0                      # 10: the documented assumption
    assert [(n.name, n.cluster, n.fabric.type, n.fabric.gbps, n.num_accelerators) for n in cluster.nodes] == [
        ("ib-a", "ib-800g", "ib", 800.0, 2), ("here", "ethernet", "ethernet", eth_gbps, 2)]
    assert cluster.rank_node == [0, 0, 1, 1]
    link = cluster.cluster_link("ib-800g", "ethernet")
    assert (link.kind, link.gbps) == ("ethernet", min(25.0, eth_gbps))
    if here.ethernet_gbps is None:
        assert "# note: node here: its Ethernet NICs report no speed; assuming 10 Gbit/s" in outs[0].stdout
