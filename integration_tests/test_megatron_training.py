"""The no-patch path end to end: Megatron-LM's own megatron.training runs a pretrain_gpt-shaped script, with
``--heterogeneous-nic`` reaching het_plugin only through the pip-installed hook (het_plugin_megatron.pth).

Each rank runs ``integration_tests/ranks/pretrain_gpt.py`` (a plain Megatron-LM script: config container from
``args``, mock data, ``pretrain(...)``) through ``integration_tests/support/megatron_training_cpu.py``, which
installs the test-only CPU shims for megatron.training's CUDA assumptions, runs the script unmodified and
reports this rank's groups (parallel_state), transformer layers and losses. CPU and gloo: 4 ranks, PP=2 x DP=2,
a tiny GPT, 2-3 iterations.

megatron.training ships in the megatron-core wheel from 0.17 on; ``make test`` runs this file in its
megatron-core 0.19.2 pass (HET_TEST_MCORE set), where it must run.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from het_plugin.megatron.pipeline_layout import layout_for_plan
from het_plugin.core.plan import Plan
from integration_tests.support.launch import run_ranks

HERE = Path(__file__).resolve().parent
WRAPPER = HERE / "support" / "megatron_training_cpu.py"
SCRIPT = HERE / "ranks" / "pretrain_gpt.py"
IB_ROCE_4 = HERE / "data" / "megatron-ib-roce-4.yaml"          # ib, roce, ib, roce: one rank per node
HOMOGENEOUS_4 = HERE / "data" / "megatron-homogeneous-4.yaml"  # 2 nodes x 2 ranks

# A tiny GPT on Megatron's mock data. The --no-*-fusion flags and --transformer-impl local are what a machine
# without Transformer Engine and apex needs anyway; --clip-grad 0 because clipping asserts CUDA tensors.
MODEL = ["--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--mock-data", "--transformer-impl", "local",
         "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm",
         "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
         "--lr", "1e-3", "--clip-grad", "0", "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1",
         "--distributed-backend", "gloo", "--pipeline-model-parallel-size", "2"]
ITERATIONS = 3
SUMMARY = re.compile(r"het_plugin: plan [0-9a-f]{16} for ")

NOT_IN_WHEEL = ("megatron.training is not in the megatron-core 0.16.1 wheel; `make test` runs this in its "
                "megatron-core 0.19.2 pass")
MCORE_PASS = os.environ.get("HET_TEST_MCORE")
HAVE_TRAINING = importlib.util.find_spec("megatron") is not None and \
    importlib.util.find_spec("megatron.training") is not None

pytestmark = pytest.mark.skipif(not MCORE_PASS and not HAVE_TRAINING, reason=NOT_IN_WHEEL)


@pytest.fixture(scope="module", autouse=True)
def _megatron_training_and_the_hook():
    """In the megatron-core pass a missing megatron.training is a failure, not a skip; so is a missing hook."""
    if not HAVE_TRAINING:
        pytest.fail(f"HET_TEST_MCORE={MCORE_PASS}, but megatron.training cannot be imported: the megatron-core "
                    f"{MCORE_PASS} pass needs the wheel's megatron/training on PYTHONPATH (make test-mcore-new)")
    code = "import sys; print(any(type(f).__name__ == 'MegatronArgsFinder' for f in sys.meta_path))"
    # The .pth installs the hook only when the flag is on the command line (it costs nothing otherwise).
    fresh = subprocess.run([sys.executable, "-c", code, "--heterogeneous-nic"], capture_output=True, text=True,
                           cwd="/")
    if fresh.stdout.strip() != "True":
        pytest.fail("a fresh interpreter has no het_plugin import hook: het_plugin was installed without "
                    "het_plugin_megatron.pth (before the hook shipped); pip install -e . again")


def train(args, *, layers: int, iterations: int = ITERATIONS, ranks_per_node: int, check: bool = True,
          rank_env=None):
    """Launch the script on 4 ranks; one report per rank (None where a rank stopped before reporting)."""
    argv = [str(SCRIPT), "--num-layers", str(layers), "--train-iters", str(iterations), *MODEL, *args]
    # CUDA_DEVICE_MAX_CONNECTIONS=1: what validate_args demands of TP > 1 before Blackwell (the shims say Hopper).
    return run_ranks(WRAPPER, 4, argv, ranks_per_node=ranks_per_node, rank_env=rank_env, timeout=150, check=check,
                     env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})


def losses(outs) -> dict[str, float]:
    """Per-iteration 'lm loss' (the last stage logs it; every last-stage rank logs the same, DP-reduced)."""
    logged = [o.result["losses"] for o in outs if any(o.result["losses"].values())]
    assert logged and all(lg == logged[0] for lg in logged), logged
    return {it: d["lm loss"] for it, d in logged[0].items()}


def expected_layers(plan: Plan, rank: int) -> list[int]:
    """Global (1-based) layer numbers of the plan's stage for this rank."""
    stage = plan.stage_of(rank)
    first = sum(plan.layers_per_stage[:stage])
    return list(range(first + 1, first + plan.layers_per_stage[stage] + 1))


def check_groups_and_layers(outs, plan: Plan) -> None:
    for o in outs:
        r, rank = o.result, o.rank
        assert r["rank"] == rank and r["plan_hash"] == plan.hash
        for kind in ("tp", "pp", "dp"):
            assert r["groups"][kind] == plan.group_of(kind, rank).ranks, (kind, rank, r["groups"])
        # The embedding group is the script's get_embedding_ranks on this rank's (physical) pipeline group.
        assert sorted(r["groups"]["embedding"]) == sorted(r["callback_embedding"]), (rank, r["groups"])
        assert r["layer_numbers"] == expected_layers(plan, rank), (rank, r["layer_numbers"], plan.layers_per_stage)
        args = r["args"]
        assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"],
                args["data_parallel_size"]) == (plan.tp, plan.pp, plan.dp)
        assert args["overlap_grad_reduce"] == plan.overlap_grad_reduce
        assert args["use_distributed_optimizer"] == plan.distributed_optimizer


@pytest.fixture(scope="module")
def hetero_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("hetero")


@pytest.fixture(scope="module")
def hetero(hetero_dir):
    plan_out = hetero_dir / "plan.json"
    outs = train(["--heterogeneous-nic", str(IB_ROCE_4), "--heterogeneous-plan-out", str(plan_out),
                  "--heterogeneous-profile-out", str(hetero_dir / "measured.yaml"),
                  "--heterogeneous-profile-interval", "1"], layers=5, ranks_per_node=1)
    return outs, Plan.load(plan_out)


def test_megatron_builds_the_plans_groups_and_stages_on_a_heterogeneous_cluster(hetero):
    outs, plan = hetero
    # The launch is one a default placement gets wrong: IB and RoCE ranks interleaved, faster H100s on IB.
    assert (plan.tp, plan.pp, plan.dp) == (1, 2, 2) and not plan.is_identity
    assert len(set(plan.layers_per_stage)) > 1, f"the test needs an uneven split, the plan has {plan.layers_per_stage}"
    check_groups_and_layers(outs, plan)
    for o in outs:
        r = o.result
        assert r["hook_installed"] and r["parse_args_wrapped"]
        assert r["args"]["heterogeneous_nic"] == str(IB_ROCE_4)
        assert r["args"]["pipeline_model_parallel_layout"] == layout_for_plan(plan)
    assert len(losses(outs)) == ITERATIONS, "it trained"
    assert len(SUMMARY.findall(outs[0].stdout)) == 1, "rank 0 prints the plan summary once"
    assert not any(SUMMARY.findall(o.stdout) for o in outs[1:])


def test_the_profile_flag_writes_the_runs_measured_profile(hetero, hetero_dir, capsys):
    """--heterogeneous-profile-out: rank 0 writes each stage's measured times (every iteration here, and at
    exit), and `het-plugin plan --profile` reads them back next to its prediction."""
    from het_plugin.cli import main
    from het_plugin.core.inputs.profile import load_profile
    outs, plan = hetero
    path = hetero_dir / "measured.yaml"
    run = load_profile(path).measured
    assert run.plan_hash == plan.hash and run.framework == "Megatron"
    assert run.iterations == ITERATIONS - 1 and run.layers_per_stage == plan.layers_per_stage
    assert all(st.forward_s > 0 and st.backward_s > 0 and st.ranks == 2 for st in run.stages)
    assert f"het_plugin: measured profile written to {path}" in outs[0].stdout
    model = hetero_dir / "model.yaml"
    model.write_text(__import__("yaml").safe_dump(plan.model))
    assert main(["plan", str(IB_ROCE_4), "--model", str(model), "--pp", "2", "--tp", "1", "--micro-batch-size", "2",
                 "--profile", str(path)]) == 0
    assert f"measured run of plan {plan.hash} (Megatron): {ITERATIONS - 1} iterations" in capsys.readouterr().out


def test_on_a_homogeneous_cluster_the_flag_changes_no_loss():
    baseline = train([], layers=4, ranks_per_node=2)
    for o in baseline:     # without the flag: Megatron's own parser and groups; the .pth installed no hook
        r = o.result
        assert not r["hook_installed"] and not r["parse_args_wrapped"] and not r["flag_in_args"]
        assert r["args"]["pipeline_model_parallel_layout"] is None and r["args"]["overlap_grad_reduce"] is False
        assert set(r["het_plugin_imported"]) <= {"het_plugin", "het_plugin.megatron", "het_plugin.megatron.hook"}
        assert r["plan_hash"] is None
    planned = train(["--heterogeneous-nic", str(HOMOGENEOUS_4)], layers=4, ranks_per_node=2)
    assert all(o.result["plan_hash"] for o in planned), "het_plugin planned this run"
    assert not any(o.result["args"]["overlap_grad_reduce"] for o in planned), "the user's overlap setting is kept"
    assert [o.result["groups"] for o in planned] == [o.result["groups"] for o in baseline]
    assert [o.result["layer_numbers"] for o in planned] == [o.result["layer_numbers"] for o in baseline]
    base, het = losses(baseline), losses(planned)
    assert len(base) == ITERATIONS and het == base


def test_bare_flag_discovers_the_cluster_and_its_split_reaches_the_model(tmp_path):
    """No FILE: the plan is made at initialisation, after the script built its config container from args."""
    from tests.sysfs_tree import ib_node, roce_node
    nodes = [("ib-a", ib_node(tmp_path / "ib-a"), "H100"), ("roce-a", roce_node(tmp_path / "roce-a"), "A100-80"),
             ("ib-b", ib_node(tmp_path / "ib-b"), "H100"), ("roce-b", roce_node(tmp_path / "roce-b"), "A100-80")]
    rank_env = [{"HET_PLUGIN_NODE_NAME": name, "HET_PLUGIN_SYSFS_ROOT": str(root), "HET_PLUGIN_ACCELERATOR": accel,
                 "HET_PLUGIN_ACCELERATOR_COUNT": "1"} for name, root, accel in nodes]
    plan_out = tmp_path / "plan.json"
    # --num-layers 4: with the bare flag Megatron checks num_layers % pp itself, before there is a plan.
    outs = train(["--heterogeneous-nic", "--heterogeneous-plan-out", str(plan_out)], layers=4, iterations=2,
                 ranks_per_node=1, rank_env=rank_env)
    plan = Plan.load(plan_out)
    assert plan.cluster_name == "discovered" and not plan.is_identity
    assert len(set(plan.layers_per_stage)) > 1, f"the test needs an uneven split, the plan has {plan.layers_per_stage}"
    for o in outs:
        r = o.result
        assert r["args"]["heterogeneous_nic"] == "discover"
        assert r["args"]["pipeline_model_parallel_layout"] == layout_for_plan(plan)
        assert r["plan_hash"] == plan.hash
    check_groups_and_layers(outs, plan)
    assert "pretrain's config container set from the plan" in outs[0].stdout
    assert len(losses(outs)) == 2, "it trained"


def test_degrees_that_cannot_be_placed_stop_every_rank_with_the_fix():
    outs = train(["--tensor-model-parallel-size", "2", "--heterogeneous-nic", str(IB_ROCE_4)], layers=4,
                 ranks_per_node=1, check=False)
    for o in outs:
        assert o.returncode not in (0, None) and "killed after" not in o.stderr, (o.rank, o.stderr[-2000:])
        assert "cannot be placed" in o.stderr and "tp=1 pp=2" in o.stderr, o.stderr[-2000:]
        assert o.result is None


@pytest.mark.parametrize("loss_flags", [[], ["--calculate-per-token-loss"]], ids=["mean-loss", "per-token-loss"])
def test_uneven_replicas_read_each_sample_once_and_train_what_the_even_split_trains(hetero, tmp_path, loss_flags):
    """The same plan with replica_micro_batches [3, 1]: Megatron-LM's data loader (the hook's sampler) gives each
    replica its range of every global batch, the schedule runs its count, and the logged loss is the even run's
    (Adam on the reduced gradients: iterations 2 and 3 see equal gradients). With per-token loss Megatron sums over
    dp and divides by the global token count itself: het_plugin leaves its scale alone, and that is right too."""
    _, even = hetero
    uneven = dataclasses.replace(even, replica_micro_batches=[3, 1])
    even_file, plan_file = tmp_path / "even.json", tmp_path / "uneven.json"
    even.save(even_file)
    uneven.save(plan_file)
    # dropout masks follow the micro-batches
    no_dropout = ["--hidden-dropout", "0", "--attention-dropout", "0", *loss_flags]
    even_outs = train(["--heterogeneous-nic", str(even_file), *no_dropout], layers=5, ranks_per_node=1)
    outs = train(["--heterogeneous-nic", str(plan_file), *no_dropout], layers=5, ranks_per_node=1)
    g = uneven.global_batch_size
    for o in outs:
        r, d = o.result, uneven.replica_of(o.rank)
        assert r["plan_hash"] == uneven.hash and r["replica"] == d
        assert r["args"]["calculate_per_token_loss"] == bool(loss_flags)
        assert r["train_sampler"] == "ReplicaPretrainingSampler", r["train_sampler"]
        start, stop = uneven.replica_samples(d)
        # every micro-batch the loop took, iteration by iteration: the replica's range of that global batch
        assert r["train_samples"] == [list(range(i * g + s, i * g + s + 2)) for i in range(ITERATIONS)
                                      for s in range(start, stop, 2)], (o.rank, r["train_samples"])
    for i in range(ITERATIONS):          # over the replicas (first stage): each sample of batch i exactly once
        taken = sorted(x for o in outs if uneven.stage_of(o.rank) == 0
                       for mb in o.result["train_samples"] for x in mb if i * g <= x < (i + 1) * g)
        assert taken == list(range(i * g, (i + 1) * g))
    for o in even_outs:                  # the even run kept Megatron's own sampler
        assert o.result["train_sampler"] == "MegatronPretrainingSampler"
    base, het = losses(even_outs), losses(outs)
    assert het.keys() == base.keys() and het == pytest.approx(base, rel=1e-5, abs=1e-6)


def test_a_launch_batch_other_than_the_uneven_plans_stops_every_rank(hetero, tmp_path):
    _, even = hetero
    plan_file = tmp_path / "uneven.json"
    dataclasses.replace(even, replica_micro_batches=[3, 1]).save(plan_file)
    argv = ["--heterogeneous-nic", str(plan_file)]
    outs = run_ranks(WRAPPER, 4, [str(SCRIPT), "--num-layers", "5", "--train-iters", "1",
                                  *[a if a != "8" else "16" for a in MODEL], *argv],
                     ranks_per_node=1, timeout=150, check=False, env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    for o in outs:
        assert o.returncode not in (0, None) and "killed after" not in o.stderr, (o.rank, o.stderr[-2000:])
        assert "--global-batch-size=16" in o.stderr and "global batch of 8 samples" in o.stderr, o.stderr[-2000:]
        assert o.result is None
