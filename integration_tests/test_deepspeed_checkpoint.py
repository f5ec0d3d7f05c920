"""DeepSpeed pipeline checkpoints across plans (issue 21, item 2), 4 CPU ranks on gloo.

Equal training: 2k iterations under plan A with a checkpoint after iteration k, resumed under plan B for k more;
the losses of iterations k+1..2k must equal the continuous run's. Tolerance: rel 1e-6 -- the same fp32 operations
run in the same order on the same values (a stage boundary moves where a layer runs, not what it computes; the
data-parallel all-reduce sums the same two gradients), so the losses agree bit for bit here; 1e-6 leaves room for
a gloo reduction order that differs between placements. A refused combination is refused before DeepSpeed reads a
tensor, on every rank, with the documented message (docs/deepspeed.md, "Checkpoints across plans")."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from het_plugin.core.inputs.cluster import load_cluster  # noqa: E402
from het_plugin.deepspeed import wrap, write_config  # noqa: E402
from het_plugin.core.inputs.model import load_model  # noqa: E402
from het_plugin.core.ranks.placement import Placement, place  # noqa: E402
from het_plugin.core.planner import assemble_plan  # noqa: E402
from het_plugin.core.ranks.dims import ParallelDims  # noqa: E402
from integration_tests.support.deepspeed_cpu import cpu_environment  # noqa: E402
from integration_tests.support.launch import run_ranks  # noqa: E402

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
SCRIPT = HERE / "ranks" / "deepspeed_ckpt.py"
CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "train_batch_size": 8,
          "steps_per_print": 10 ** 6}
ENV = dict(cpu_environment(), HET_PLUGIN_GLOO_IFNAMES="local=lo,ib=lo,roce=lo,socket=lo")
K = 2
TOL = dict(rel=1e-6, abs=0.0)
TIMEOUT = 420          # a hang bound (each launch takes 1-2 min on a loaded 2-core machine), not a timing check


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """Plan A: 5/3 blocks, stage 0 on the H100s (ranks 0, 2); B: 3/5 with stage 0 on the A100s (ranks 1, 3), so
    both the partition and the placement change; A2: A's split on B's placement (stage 1 now on the lower launch
    rank of each pipeline); A3: A's split with the two replicas swapped (stage 0 on ranks 2, 0: each pipeline's
    stages still on ascending ranks)."""
    work = tmp_path_factory.mktemp("ds_ckpt")
    cluster = load_cluster(DATA / "ds_hetero_4.yaml")
    model = load_model(DATA / "ds_tiny_model.yaml")
    dims = ParallelDims(pp=2, dp=2)
    flipped = tuple(reversed(cluster.domains))
    plans = {"A": assemble_plan(cluster, model, place(cluster, dims), [5, 3], 2),
             "B": assemble_plan(cluster, model, place(cluster, dims, flipped), [3, 5], 2),
             "A2": assemble_plan(cluster, model, place(cluster, dims, flipped), [5, 3], 2),
             "A3": assemble_plan(cluster, model, Placement(dims, (2, 0, 3, 1), tuple(cluster.domains)), [5, 3], 2)}
    out = {}
    for name, plan in plans.items():
        plan.save(work / f"plan{name}.json")
        write_config(wrap(CONFIG, work / f"plan{name}.json", layer_pattern="Block", pp=2), work / f"cfg{name}.json")
        out[name] = (plan, work / f"cfg{name}.json")
    assert plans["A"].stage_ranks(0) != plans["B"].stage_ranks(0) == plans["A2"].stage_ranks(0)
    assert plans["A3"].hash != plans["A"].hash and sorted(plans["A3"].stage_ranks(0)) == [0, 2]
    return work, out


def launch(cfg, *args):
    outs = run_ranks(SCRIPT, 4, ["--config", str(cfg), "--pp", "2", *map(str, args)], env=ENV, timeout=TIMEOUT)
    return sorted((o.result for o in outs), key=lambda r: r["rank"])


def continuous(configs, momentum, ckpt):
    work, cfgs = configs
    res = launch(cfgs["A"][1], "--steps", 2 * K, "--momentum", momentum, "--save-dir", work / ckpt, "--save-at", K)
    losses = res[0]["losses"]
    assert all(r["losses"] == losses for r in res) and len(set(losses)) > 1      # it trained
    return losses


def test_weights_follow_a_changed_partition_and_placement(configs):
    """Plain SGD (no optimizer state to carry): A saves at k, B (other split, other stages' ranks) resumes the
    weights (per-layer files, by global index) and trains on exactly as the continuous run."""
    work, cfgs = configs
    expected = continuous(configs, 0.0, "ckpt_sgd")
    res = launch(cfgs["B"][1], "--steps", K, "--load-dir", work / "ckpt_sgd", "--no-load-optim")
    assert all(r["plan_hash"] == cfgs["B"][0].hash and r["resumed_at"] == K for r in res)
    for r in res:
        assert r["losses"] == pytest.approx(expected[K:], **TOL)


def test_optimizer_state_is_refused_where_it_cannot_follow_and_follows_a_replica_swap(configs):
    """SGD with momentum: its state is in DeepSpeed's per-stage engine files. Under B (5/3 -> 3/5) the load is
    refused before anything is read, on every rank, naming the fix. Under A2 (the same split, stage 1 on the lower
    launch rank of each pipeline) too: DeepSpeed names those files by each pipeline's sorted launch ranks, so stage 1
    would read stage 0's file (without the check: torch's "loaded state dict contains a parameter group that doesn't
    match the size of optimizer's group", seen here). Under A3 (replicas swapped, stages on other ranks in the
    same order) the state follows and training continues exactly."""
    work, cfgs = configs
    expected = continuous(configs, 0.9, "ckpt_momentum")
    for name, words in (("B", "layer split [5, 3] -> [3, 5]"), ("A2", "sorted launch ranks")):
        refused = launch(cfgs[name][1], "--steps", K, "--momentum", 0.9, "--load-dir", work / "ckpt_momentum")
        assert all("refused" in r for r in refused), name
        first = refused[0]["refused"]
        assert all(r["refused"] == first for r in refused)
        assert first["field"] == "checkpoint.load_universal"
        assert words in first["problem"] and "resume under the plan it was saved with" in first["fix"], first
    res = launch(cfgs["A3"][1], "--steps", K, "--momentum", 0.9, "--load-dir", work / "ckpt_momentum")
    for r in res:
        assert r["plan_hash"] == cfgs["A3"][0].hash and r["losses"] == pytest.approx(expected[K:], **TOL)


def test_zero_state_follows_another_partition_and_placement_through_a_universal_checkpoint(configs):
    """ZeRO stage 1 with Adam (its state partitioned over the data-parallel ranks, per pipeline stage) saved under A
    at k. Under B (5/3 on the H100s -> 3/5 on the A100s) the plain load is refused before anything is read, naming
    the conversion; the conversion the message names, run as it says (DeepSpeed's own ds_to_universal), and the
    config's ``"checkpoint": {"load_universal": true}`` then resume B, and iterations k+1..2k equal the continuous
    run's under A: weights by global layer index, Adam's moments and step by parameter name."""
    work, cfgs = configs
    ckpt = work / "ckpt_zero1"
    zero = ("--adam", "--zero", 1)
    res = launch(cfgs["A"][1], "--steps", 2 * K, *zero, "--save-dir", ckpt, "--save-at", K)
    expected = res[0]["losses"]
    assert all(r["losses"] == expected for r in res) and len(set(expected)) > 1
    refused = launch(cfgs["B"][1], "--steps", K, *zero, "--load-dir", ckpt)
    assert all("refused" in r for r in refused)
    fix = refused[0]["refused"]["fix"]
    command = fix[fix.index("python -m deepspeed.checkpoint.ds_to_universal"):].split(",")[0].split()
    assert command[:3] == ["python", "-m", "deepspeed.checkpoint.ds_to_universal"], fix
    done = subprocess.run([sys.executable, *command[1:]], env={**os.environ, **ENV}, capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (ckpt / "latest_universal").is_file()
    res = launch(cfgs["B"][1], "--steps", K, *zero, "--universal", "--load-dir", ckpt)
    for r in res:
        assert "refused" not in r, r
        assert r["plan_hash"] == cfgs["B"][0].hash and r["resumed_at"] == K
        assert r["losses"] == pytest.approx(expected[K:], **TOL)
    # the state mattered: the weights alone (Adam afresh: the per-rank files without their optimizer state; a
    # universal load reads the optimizer state even with load_optimizer_states=False, DeepSpeed 0.19.8
    # runtime/zero/stage_1_and_2.py _load_universal_checkpoint) train on differently
    fresh = launch(cfgs["B"][1], "--steps", K, *zero, "--no-load-optim", "--load-dir", ckpt)
    assert fresh[0]["losses"][1] != pytest.approx(expected[K + 1], **TOL)
