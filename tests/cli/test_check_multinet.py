"""`het-plugin check --multinet`: NCCL's multi-network settings per node or cluster, and their refusals."""
from __future__ import annotations

from pathlib import Path

from het_plugin.cli import main as cli_main
from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.core.inputs.model import preset_model
from het_plugin.core.nccl_version import parse_build
from het_plugin.core.planner import make_plan

HOLMES = Path(__file__).resolve().parents[2] / "examples" / "clusters" / "holmes-ib-roce.yaml"
KEYS = ("NCCL_NET", "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "NCCL_IGNORE_NET_MISMATCH", "NCCL_IB_GID_INDEX",
        "NCCL_ALLNET_ENABLE", "NCCL_COLLNET_ENABLE", "NCCL_ALGO", "NCCL_IB_FABRICID_MAXRAIL")


def clean(monkeypatch):
    for key in KEYS:
        monkeypatch.delenv(key, raising=False)


def test_env_per_cluster_and_per_node(capsys, monkeypatch):
    clean(monkeypatch)
    args = ["check", str(HOLMES), "--no-discover", "--format", "env", "--multinet", "--nccl-version", "2.26.2+cross-dc"]
    assert cli_main(args + ["--per", "cluster"]) == 0
    out = capsys.readouterr().out
    assert "# cluster roce" in out and "export NCCL_IB_HCA==mlx5_0:1:1,mlx5_1:1:1" in out
    assert out.count("export NCCL_ALLNET_ENABLE=1") == 2 and out.count("export NCCL_SCATTER_XDC=1") == 2
    assert "(ib=0, roce=1)" in out
    assert cli_main(args + ["--node", "ib-2"]) == 0
    node = capsys.readouterr().out
    assert node.startswith("export NCCL_IB_HCA==mlx5_0:1:0,mlx5_1:1:0,mlx5_2:1:0,mlx5_3:1:0\n")
    assert "#" not in node                     # eval-able: no header for one node


def test_collnet_is_said_on_stderr(capsys, monkeypatch):
    clean(monkeypatch)
    monkeypatch.setenv("NCCL_COLLNET_ENABLE", "1")
    assert cli_main(["check", str(HOLMES), "--no-discover", "--format", "env", "--multinet"]) == 0
    assert "warning: NCCL_COLLNET_ENABLE" in capsys.readouterr().err


def test_a_plan_relying_on_it_is_refused_for_a_release(tmp_path, capsys, monkeypatch):
    clean(monkeypatch)
    plan = make_plan(load_cluster(HOLMES), preset_model("gpt-7.5b"), tp=8, pp=1, nccl=parse_build("cross-dc"))
    assert plan.multinet
    path = tmp_path / "plan.json"
    plan.save(path)
    assert cli_main(["check", str(path), "--no-discover", "--nccl-version", "2.30.7"]) == 2
    err = capsys.readouterr().err
    assert "refused: NCCL version" in err and "2.30.7" in err and "re-plan" in err
    assert cli_main(["check", str(path), "--no-discover", "--nccl-version", "2.26.2+cross-dc"]) == 0


def test_plan_takes_the_nccl_version(capsys, monkeypatch):
    clean(monkeypatch)
    assert cli_main(["plan", str(HOLMES), "--tp", "8", "--pp", "1", "--nccl-version", "cross-dc", "--format", "json"]) == 0
    assert '"multinet"' in capsys.readouterr().out
    assert cli_main(["plan", str(HOLMES), "--nccl-version", "2.26.2+xdc"]) == 2
    assert "--nccl-version" in capsys.readouterr().err
