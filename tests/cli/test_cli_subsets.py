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


def test_the_launch_files_are_what_deepspeeds_launcher_reads(capsys, tmp_path):
    """The hostfile, --include and --exclude the plan prints, read by DeepSpeed's own launcher functions: the kept
    nodes with their slots, in the plan's node order (DeepSpeed numbers nodes in the hostfile's order)."""
    runner = pytest.importorskip("deepspeed.launcher.runner")
    hostfile, nodes = tmp_path / "hostfile", tmp_path / "nodes.txt"
    rc, text, err = run(capsys, EXAMPLE, "--hostfile-out", hostfile, "--nodes-out", nodes, "-o", tmp_path / "p.json")
    assert rc == 0, err
    plan = Plan.load(tmp_path / "p.json")
    kept = [(n.name, n.num_ranks) for n in sorted(plan.nodes, key=lambda n: n.first_rank)]
    pool = runner._parse_hostfile(hostfile.read_text().splitlines())
    assert list(pool.items()) == kept
    assert nodes.read_text().splitlines() == [name for name, _ in kept]
    # --include / --exclude as printed, over a hostfile of every node of the cluster
    every = runner._parse_hostfile([f"{n} slots=8" for n, _ in kept] + ["annex-0 slots=8", "annex-1 slots=8"])
    line = next(x for x in text.splitlines() if "deepspeed: --hostfile" in x)
    include = line.split("--include ")[1].split()[0]
    exclude = line.split("--exclude ")[1].split()[0]
    for active in (runner.parse_inclusion_exclusion(every, include, ""),
                   runner.parse_inclusion_exclusion(every, "", exclude)):
        assert [(h, len(slots)) for h, slots in active.items()] == kept


def wrap_cli(capsys, *argv):
    rc = main(["wrap-config", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.err


def test_wrap_config_says_it_plans_every_node_and_how_to_run_without_the_slow_ones(capsys, tmp_path):
    """DeepSpeed's wrap with a cluster file plans every node (the config's batch fixes dp over the launch) and
    says so; where leaving nodes out is faster it prints the commands, and they work: the plan file wrapped runs
    on the kept nodes, and its hostfile lists them."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 640, "train_micro_batch_size_per_gpu": 1}))
    rc, err = wrap_cli(capsys, ds, "--cluster", EXAMPLE, "--model", "gpt-7.5b", "--pp", 4, "-o", tmp_path / "w.json")
    assert rc == 0, err
    assert "the plan uses every node" in err and "(80 ranks on 10 nodes)" in err
    assert "leaving out annex-0 annex-1 is predicted" in err and "at dp 16 on 8 nodes" in err
    wrapped = json.loads((tmp_path / "w.json").read_text())["heterogeneous"]
    assert wrapped["dp"] == 20 and Plan.from_dict(wrapped["plan"]).world_size == 80
    command = next(x for x in err.splitlines() if x.strip().startswith("het-plugin plan")).split()[2:]
    files = {"plan.json": str(tmp_path / "plan.json"), "hostfile": str(tmp_path / "hosts")}
    command = [files.get(a, a) for a in command]
    assert main(["plan", *command]) == 0, capsys.readouterr().err
    capsys.readouterr()
    rc, err = wrap_cli(capsys, ds, "--cluster", tmp_path / "plan.json", "-o", tmp_path / "w2.json")
    assert rc == 0, err
    assert "runs on its 8 kept nodes only" in err and "annex-0 annex-1" in err
    section = json.loads((tmp_path / "w2.json").read_text())["heterogeneous"]
    assert section["dp"] == 16 and Plan.from_dict(section["plan"]).left_out["nodes"] == ["annex-0", "annex-1"]
    assert (tmp_path / "hosts").read_text().split("\n")[0] == "main-0 slots=8"
    # asked for every node: nothing to say
    rc, err = wrap_cli(capsys, ds, "--cluster", EXAMPLE, "--model", "gpt-7.5b", "--pp", 4, "--use-all-nodes",
                       "-o", tmp_path / "w3.json")
    assert rc == 0 and "leaving out" not in err and "every node of" not in err
