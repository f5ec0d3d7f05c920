"""Issue 21: a Megatron-LM run saved under plan A resumes under plan B (another layer split) and trains on as if
it had never stopped; a combination that cannot load is refused on every rank before anything loads.

The pretrain_gpt-shaped script of test_megatron_training.py on 4 CPU ranks (PP=2 x DP=2, a 5-layer tiny GPT,
dropout off), through the same test shims (plus integration_tests/support/megatron_checkpoint_cpu.py). Plan A is
what the planner makes for the IB/RoCE cluster ([4, 1] layers); plan B is plan A with the split reversed.

For each supported combination: a continuous run of 2K iterations under A that saves at K and 2K, and a run under
B that resumes from iteration K (``--ckpt-step K``). Iterations K+1..2K must log the continuous run's losses
exactly (tolerance 0): under either split every layer computes the same operations on the same inputs, the
pipeline sends carry the activations bit for bit, and every sum across ranks (data-parallel gradients, the tied
embedding's gradient) adds the same two operands, which IEEE addition does identically in either order; Adam is
elementwise. Any difference is lost or misplaced state (iteration K+1 checks the weights, K+2 the optimizer's
moments and step). Measured on this machine: equal to the last bit (docs/checkpoints.md).
"""
from __future__ import annotations

import dataclasses
import shutil

import pytest

from het_plugin.plan import Plan
from integration_tests.support.launch import run_ranks
from integration_tests.test_megatron_training import (HAVE_TRAINING, IB_ROCE_4, MCORE_PASS, MODEL, NOT_IN_WHEEL, SCRIPT,
                                                      WRAPPER, expected_layers, losses)

pytestmark = pytest.mark.skipif(not MCORE_PASS and not HAVE_TRAINING, reason=NOT_IN_WHEEL)

K = 2
LAYERS = 5
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
DIST_OPT = ["--use-distributed-optimizer"]
FULLY_RESHARDABLE = [*DIST_OPT, "--dist-ckpt-optim-fully-reshardable"]


def train(args, iterations, check=True):
    argv = [str(SCRIPT), "--num-layers", str(LAYERS), "--train-iters", str(iterations), *MODEL, *NO_DROPOUT, *args]
    return run_ranks(WRAPPER, 4, argv, ranks_per_node=1, timeout=400, check=check,
                     env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})


def save_under_a(root, flags, iterations):
    """Train under plan A (planned from the cluster file), saving every K iterations; plan A and plan B (the split
    reversed) as files."""
    root.mkdir(parents=True, exist_ok=True)
    outs = train(["--heterogeneous-nic", str(IB_ROCE_4), "--heterogeneous-plan-out", str(root / "a.json"),
                  "--save", str(root / "ckpt"), "--save-interval", str(K), *flags], iterations)
    a = Plan.load(root / "a.json")
    assert len(set(a.layers_per_stage)) > 1, a.layers_per_stage
    b = dataclasses.replace(a, layers_per_stage=list(reversed(a.layers_per_stage)))
    b.save(root / "b.json")
    return outs, a, b


def resume(root, plan_file, flags, check=True):
    return train(["--heterogeneous-nic", str(plan_file), "--load", str(root / "ckpt"), "--ckpt-step", str(K), *flags],
                 2 * K, check=check)


def refused_everywhere(outs, *needles):
    """Every rank stopped with het_plugin's ConfigError, raised before Megatron's loader ran."""
    for o in outs:
        assert o.returncode not in (0, None) and "killed after" not in o.stderr, (o.rank, o.stderr[-3000:])
        assert "ConfigError" in o.stderr and all(n in o.stderr for n in needles), o.stderr[-3000:]
        assert "CheckpointingException" not in o.stderr and "_load_base_checkpoint" not in o.stderr
        assert o.result is None


@pytest.mark.parametrize("flags", [FULLY_RESHARDABLE, []], ids=["distributed-optimizer-fully-reshardable",
                                                                "plain-optimizer"])
def test_a_run_saved_under_plan_a_resumes_under_plan_b_and_trains_as_the_continuous_run(tmp_path, flags):
    continuous, a, b = save_under_a(tmp_path, flags, 2 * K)
    # the checkpoint records plan A (Megatron's saved args), its split and its optimizer
    from het_plugin.megatron import checkpoints
    saved = checkpoints.read_checkpoint(checkpoints.CheckpointDir(str(tmp_path / "ckpt" / f"iter_{K:07d}"), K))
    assert (saved.plan_hash, list(saved.layers), saved.distributed_optimizer) == (a.hash, a.layers_per_stage,
                                                                                   bool(flags))
    assert saved.optim_sharding == ("fully_reshardable" if flags else None)
    resumed = resume(tmp_path, tmp_path / "b.json", flags)
    for o in resumed:
        assert o.result["plan_hash"] == b.hash and o.result["layer_numbers"] == expected_layers(b, o.rank)
    note = [line for line in resumed[0].stdout.splitlines() if line.startswith("het_plugin: resuming")]
    assert len(note) == 1 and f"saved under plan {a.hash}" in note[0] and "weights reshard by global layer" in note[0]
    whole, tail = losses(continuous), losses(resumed)
    assert sorted(tail, key=int) == [str(i) for i in range(K + 1, 2 * K + 1)]
    assert tail == {it: whole[it] for it in tail}, (tail, whole)      # tolerance 0: see the module docstring


def test_dp_reshardable_optimizer_state_is_refused_under_another_split_before_loading(tmp_path):
    """Megatron's default distributed-optimizer format fails inside its loader under a layer move (Global shape
    mismatch); het_plugin stops every rank first, naming the format and the flag to save with."""
    save_under_a(tmp_path, DIST_OPT, K)
    outs = resume(tmp_path, tmp_path / "b.json", DIST_OPT, check=False)
    refused_everywhere(outs, "'dp_reshardable' format", "--dist-ckpt-optim-fully-reshardable and save once")


def test_another_optimizer_than_the_checkpoints_is_refused_before_loading(tmp_path):
    """A plain-optimizer checkpoint, resumed with --use-distributed-optimizer (what het_plugin used to switch on)."""
    save_under_a(tmp_path, [], K)
    outs = resume(tmp_path, tmp_path / "a.json", DIST_OPT, check=False)
    refused_everywhere(outs, "holds the optimizer state of a plain optimizer", "drop --use-distributed-optimizer")


def test_a_legacy_checkpoint_is_refused_under_another_split_even_without_the_optimizer(tmp_path):
    """--ckpt-format torch keys layers within a stage: Megatron would load the wrong layers without a word."""
    save_under_a(tmp_path, ["--ckpt-format", "torch"], K)
    outs = resume(tmp_path, tmp_path / "b.json", ["--ckpt-format", "torch", "--no-load-optim"], check=False)
    refused_everywhere(outs, "'torch' format", "--ckpt-format torch_dist")
    shutil.rmtree(tmp_path / "ckpt")
