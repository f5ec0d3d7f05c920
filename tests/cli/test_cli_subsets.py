"""`het-plugin plan` on a cluster with nodes not worth using: the node list, the launcher files, --use-all-nodes,
the cost objective and its errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from het_plugin.cli import main
from het_plugin.core.plan import Plan

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "clusters" / "h100-old-ethernet.yaml"


def run(capsys, *argv):
    rc = main(["plan", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_leaves_the_old_nodes_out_and_writes_the_launch(capsys, tmp_path):
    hostfile, nodes, out = tmp_path / "hostfile", tmp_path / "nodes.txt", tmp_path / "plan.json"
    rc, text, err = run(capsys, EXAMPLE, "--hostfile-out", hostfile, "--nodes-out", nodes, "-o", out)
    assert rc == 0, err
    assert "left out: 2 of 10 nodes (16 of 80 devices)" in text
    assert "nodes (8, in launch order = node_rank): main-0 main-1" in text
    assert "torchrun: --nnodes 8 --nproc-per-node 8" in text
    assert hostfile.read_text() == "".join(f"main-{i} slots=8\n" for i in range(8))
    assert nodes.read_text().split() == [f"main-{i}" for i in range(8)]
    plan = Plan.load(out)
    assert plan.world_size == 64 and plan.left_out["nodes"] == ["annex-0", "annex-1"]
    # a saved plan writes its node list too, and is shown with what it left out
    again = tmp_path / "again"
    rc, text, err = run(capsys, out, "--hostfile-out", again)
    assert rc == 0, err
    assert again.read_text() == hostfile.read_text() and "left out: 2 of 10 nodes" in text


def test_use_all_nodes_plans_every_node(capsys, tmp_path):
    rc, text, err = run(capsys, EXAMPLE, "--use-all-nodes", "--format", "json")
    assert rc == 0, err
    plan = json.loads(text)
    assert plan["world_size"] == 80 and "left_out" not in plan


@pytest.mark.parametrize("argv, field, words", [
    (["--min-throughput", "1000"], "--min-throughput", "without --objective cost"),
    (["--objective", "cost"], "price_per_device_hour", "needs a price for every node group"),
    (["--objective", "cost", "--min-throughput", "-5"], "--min-throughput", "not a positive number"),
])
def test_bad_node_options(capsys, argv, field, words):
    assert main(["plan", str(EXAMPLE), *argv]) == 2
    err = capsys.readouterr().err
    assert field in err and words in err


def test_saved_plan_refuses_planning_options(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert run(capsys, EXAMPLE, "-o", out)[0] == 0
    assert main(["plan", str(out), "--use-all-nodes"]) == 2
    assert "a saved plan is shown as it is" in capsys.readouterr().err


def test_cost_objective_from_the_command_line(capsys, tmp_path):
    text = EXAMPLE.read_text().replace("accelerators_per_node: 8\n        nics", "accelerators_per_node: 8\n"
                                       "        price_per_device_hour: 3.0\n        nics", 1)
    text = text.replace("accelerators_per_node: 8\n        nics", "accelerators_per_node: 8\n"
                        "        price_per_device_hour: 0.5\n        nics", 1)
    priced = tmp_path / "priced.yaml"
    priced.write_text(text)
    rc, out, err = run(capsys, priced, "--objective", "cost", "--format", "json")
    assert rc == 0, err
    plan = json.loads(out)
    cost = plan["price_per_hour"] * plan["prediction"]["iteration_s"]
    rc, out, err = run(capsys, priced, "--use-all-nodes", "--format", "json")
    every = json.loads(out)
    assert cost <= every["price_per_hour"] * every["prediction"]["iteration_s"]
    rc, out, err = run(capsys, priced)
    assert "cost: " in out and "per million tokens" in out


def test_pictures_of_a_plan_that_leaves_nodes_out(capsys, tmp_path):
    """The schedule is re-predicted on the kept nodes' cluster (the whole file's digest is another)."""
    rc, text, err = run(capsys, EXAMPLE, "--timeline", tmp_path / "t.svg", "--svg", tmp_path / "p.svg")
    assert rc == 0, err
    assert "stage 0" in (tmp_path / "t.svg").read_text()
    assert "annex" not in (tmp_path / "p.svg").read_text()
