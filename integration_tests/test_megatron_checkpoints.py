"""Issue 21: a Megatron-LM run saved under plan A resumes under plan B (another layer split) and trains on as if
it had never stopped; a combination that cannot load is refused on every rank before anything loads.

The pretrain_gpt-shaped script of test_megatron_training.py on 4 CPU ranks (PP=2 x DP=2, a 4-layer tiny GPT,
dropout off), through the same test shims (plus integration_tests/support/megatron_checkpoint_cpu.py). Plan A is
what the planner makes for the IB/RoCE cluster (4 layers: [3, 1]); plan B is plan A with the split reversed.

For each supported combination: a continuous run of 2K iterations that saves at K (under plan A; or Megatron's own
run, its even split [2, 2], no het_plugin), and a run under plan B that resumes from iteration K
(``--ckpt-step K``). Iterations K+1..2K must log the continuous run's losses
exactly (tolerance 0): under either split every layer computes the same operations on the same inputs, the
pipeline sends carry the activations bit for bit, and every sum across ranks (data-parallel gradients, the tied
embedding's gradient) adds the same two operands, which IEEE addition does identically in either order; Adam is
elementwise. Any difference is lost or misplaced state (iteration K+1 checks the weights, K+2 the optimizer's
moments and step). Measured on this machine: equal to the last bit (docs/checkpoints.md).
"""
from __future__ import annotations

import dataclasses

import pytest

from het_plugin.core.plan import Plan
from integration_tests.support.launch import run_ranks
from integration_tests.test_megatron_training import (HAVE_TRAINING, IB_ROCE_4, MCORE_PASS, MODEL, NOT_IN_WHEEL, SCRIPT,
                                                      WRAPPER, expected_layers, losses)

pytestmark = pytest.mark.skipif(not MCORE_PASS and not HAVE_TRAINING, reason=NOT_IN_WHEEL)

K = 2
LAYERS = 4
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
DIST_OPT = ["--use-distributed-optimizer"]
FULLY_RESHARDABLE = [*DIST_OPT, "--dist-ckpt-optim-fully-reshardable"]

# Two runs per test at most, each a few iterations of the tiniest model; the bound is a hang guard for a loaded
# machine (every run_ranks call has its own), not a time the test expects.
pytestmark = [pytestmark, pytest.mark.slow, pytest.mark.timeout(1500)]


def train(args, iterations, check=True):
    argv = [str(SCRIPT), "--num-layers", str(LAYERS), "--train-iters", str(iterations), *MODEL, *NO_DROPOUT, *args]
    return run_ranks(WRAPPER, 4, argv, ranks_per_node=1, timeout=600, check=check,
                     env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})


def save(root, flags, iterations, plan=None):
    """Train and save every K iterations: under plan A (planned from the cluster file, or the plan file given;
    plan A and plan B, its split reversed, are written as files), or with ``plan=False`` as Megatron's own run."""
    root.mkdir(parents=True, exist_ok=True)
    het = [] if plan is False else ["--heterogeneous-nic", str(plan or IB_ROCE_4),
                                     "--heterogeneous-plan-out", str(root / "a.json")]
    outs = train([*het, "--save", str(root / "ckpt"), "--save-interval", str(K), *flags], iterations)
    if plan is None:
        a = Plan.load(root / "a.json")
        assert len(set(a.layers_per_stage)) > 1, a.layers_per_stage
        dataclasses.replace(a, layers_per_stage=list(reversed(a.layers_per_stage))).save(root / "b.json")
    return outs


def resume(root, plan_file, flags, check=True):
    return train(["--heterogeneous-nic", str(plan_file), "--load", str(root / "ckpt"), "--ckpt-step", str(K), *flags],
                 2 * K, check=check)


@pytest.fixture(scope="module")
def plan_a(tmp_path_factory):
    """Plan A's continuous run, distributed optimizer saved fully reshardable; plan A and B as files."""
    root = tmp_path_factory.mktemp("plan-a")
    return root, save(root, FULLY_RESHARDABLE, 2 * K)


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory):
    """Megatron's own continuous run (no het_plugin): even split, plain optimizer."""
    root = tmp_path_factory.mktemp("megatron")
    return root, save(root, [], 2 * K, plan=False)


def resumed_like_the_continuous_run(resumed, continuous, b: Plan, saved_under: str) -> None:
    for o in resumed:
        assert o.result["plan_hash"] == b.hash and o.result["layer_numbers"] == expected_layers(b, o.rank)
    note = [line for line in resumed[0].stdout.splitlines() if line.startswith("het_plugin: resuming")]
    assert len(note) == 1 and f"saved under {saved_under}" in note[0] and "weights reshard by global layer" in note[0]
    whole, tail = losses(continuous), losses(resumed)
    assert sorted(tail, key=int) == [str(i) for i in range(K + 1, 2 * K + 1)]
    assert tail == {it: whole[it] for it in tail}, (tail, whole)      # tolerance 0: see the module docstring


def test_distributed_optimizer_state_saved_fully_reshardable_resumes_under_another_split(plan_a):
    root, continuous = plan_a
    a, b = Plan.load(root / "a.json"), Plan.load(root / "b.json")
    # the checkpoint records plan A (Megatron's saved args), its split and its optimizer's format
    from het_plugin.megatron import checkpoints
    saved = checkpoints.read_checkpoint(checkpoints.CheckpointDir(str(root / "ckpt" / f"iter_{K:07d}"), K))
    assert (saved.plan_hash, list(saved.layers), saved.distributed_optimizer, saved.optim_sharding) == (
        a.hash, a.layers_per_stage, True, "fully_reshardable")
    resumed = resume(root, root / "b.json", FULLY_RESHARDABLE)
    resumed_like_the_continuous_run(resumed, continuous, b, f"plan {a.hash}, layers per stage {a.layers_per_stage}")
    assert "optimizer state is fully_reshardable" in resumed[0].stdout


def test_a_plain_optimizer_run_saved_without_het_plugin_resumes_under_a_plan(plan_a, megatron_run):
    """Megatron's own run (even split, plain optimizer: the command line's) resumed under plan B: the weights load by
    global layer and the optimizer stays the command line's (het_plugin used to switch on the distributed optimizer
    here, and the load failed)."""
    root, continuous = megatron_run
    b = Plan.load(plan_a[0] / "b.json")
    resumed = resume(root, plan_a[0] / "b.json", [])
    assert all(o.result["args"]["use_distributed_optimizer"] is False for o in resumed)
    resumed_like_the_continuous_run(resumed, continuous, b, "no het_plugin plan, layers per stage [2, 2]")


def refused_everywhere(outs, *needles):
    """Every rank stopped with het_plugin's ConfigError, raised before Megatron's loader ran."""
    for o in outs:
        assert o.returncode not in (0, None) and "killed after" not in o.stderr, (o.rank, o.stderr[-3000:])
        assert "ConfigError" in o.stderr and all(n in o.stderr for n in needles), o.stderr[-3000:]
        assert "CheckpointingException" not in o.stderr and "_load_base_checkpoint" not in o.stderr
        assert o.result is None


def test_another_optimizer_than_the_checkpoints_is_refused_before_loading(plan_a, megatron_run):
    """A plain-optimizer checkpoint resumed with --use-distributed-optimizer (what het_plugin used to switch on)."""
    outs = resume(megatron_run[0], plan_a[0] / "a.json", DIST_OPT, check=False)
    refused_everywhere(outs, "holds the optimizer state of a plain optimizer", "drop --use-distributed-optimizer")


def test_dp_reshardable_optimizer_state_is_refused_under_another_split_before_loading(plan_a, tmp_path):
    """Megatron's default distributed-optimizer format fails inside its loader under a layer move (Global shape
    mismatch); het_plugin stops every rank first, naming the format and the flag to save with."""
    save(tmp_path, DIST_OPT, K, plan=plan_a[0] / "a.json")
    outs = resume(tmp_path, plan_a[0] / "b.json", DIST_OPT, check=False)
    refused_everywhere(outs, "'dp_reshardable' format", "--dist-ckpt-optim-fully-reshardable and save once")


def test_a_legacy_checkpoint_is_refused_under_another_split_even_without_the_optimizer(plan_a, tmp_path):
    """--ckpt-format torch keys layers within a stage: Megatron would load the wrong layers without a word."""
    save(tmp_path, ["--ckpt-format", "torch"], K, plan=False)
    outs = resume(tmp_path, plan_a[0] / "b.json", ["--ckpt-format", "torch", "--no-load-optim"], check=False)
    refused_everywhere(outs, "'torch' format", "--ckpt-format torch_dist")
