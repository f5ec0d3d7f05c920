"""The no-patch path: a Megatron-LM-shaped launch with --heterogeneous-nic, handled by the pip-installed hook.

Megatron-LM's own initialize_megatron needs CUDA, so the rank script runs a cut-down Megatron-LM tree
(integration_tests/ranks/megatron_lm_stub: strict argparse parse_args with extra_args_provider,
validate_args' pipeline-split checks, _initialize_distributed calling mpu.initialize_model_parallel)
on top of the real megatron-core; het_plugin is reached only through het_plugin_megatron.pth.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from het_plugin.megatron.pipeline_layout import layout_string
from het_plugin.plan import Plan
from integration_tests.support.launch import run_ranks

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "ranks" / "megatron_lm_pretrain.py"
CLUSTER_2 = HERE / "data" / "megatron-ib-roce-2.yaml"
MODEL_ARGS = ["--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
              "--micro-batch-size", "2", "--global-batch-size", "8", "--vocab-size", "128",
              "--distributed-backend", "gloo", "--my-script-flag", "7"]


def _hook_installed() -> bool:
    """Does a fresh interpreter of this environment start with the hook's finder registered?"""
    code = "import sys; print(any(type(f).__name__ == 'MegatronArgsFinder' for f in sys.meta_path))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    return out.stdout.strip() == "True"


pytestmark = pytest.mark.skipif(not _hook_installed(), reason="het_plugin was installed without "
                                "het_plugin_megatron.pth (installed before the hook shipped): pip install -e . again")


def test_flag_on_an_unmodified_launch_applies_the_plan(tmp_path):
    plan_out = tmp_path / "plan.json"
    outs = run_ranks(SCRIPT, 2, MODEL_ARGS + ["--pipeline-model-parallel-size", "2", "--heterogeneous-nic",
                                              str(CLUSTER_2), "--heterogeneous-plan-out", str(plan_out)],
                     ranks_per_node=1, timeout=180)
    saved = Plan.load(plan_out)
    for o in outs:
        r = o.result
        assert r["hook_installed"]
        args = r["args"]
        assert args["my_script_flag"] == 7, "the script's own extra_args_provider still works"
        plan = Plan.from_dict(r["plan"])
        assert plan.hash == saved.hash
        degrees = (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"])
        assert degrees == (plan.tp, plan.pp) == (1, 2)
        assert args["pipeline_model_parallel_layout"] == layout_string(plan.layers_per_stage)
        assert args["virtual_pipeline_model_parallel_size"] is None
        assert args["overlap_grad_reduce"] == plan.overlap_grad_reduce
        assert r["groups"]["pp"] == plan.group_of("pp", r["rank"]).ranks
        assert r["groups"]["embedding"] == plan.group_of("embedding", r["rank"]).ranks
    summary = re.compile(r"het_plugin: plan [0-9a-f]{16} for ")
    assert len(summary.findall(outs[0].stdout)) == 1, "rank 0 prints the summary once"
    assert not summary.findall(outs[1].stdout)


def test_without_the_flag_the_hook_changes_nothing():
    outs = run_ranks(SCRIPT, 1, MODEL_ARGS, env={"HET_TEST_PARSE_ONLY": "1"}, timeout=120)
    r = outs[0].result
    assert r["hook_installed"]
    assert "heterogeneous_nic" not in r["args"], "Megatron's parser is exactly its own"
    assert r["args"]["pipeline_model_parallel_layout"] is None and r["args"]["overlap_grad_reduce"] is False
    assert r["args"]["my_script_flag"] == 7
    # the hook itself is all that was loaded of het_plugin
    assert set(r["het_plugin_imported"]) <= {"het_plugin", "het_plugin.megatron", "het_plugin.megatron.hook"}
    # and with the flag, the same parse gets it (strict parsing would reject it otherwise)
    outs = run_ranks(SCRIPT, 1, MODEL_ARGS + ["--pipeline-model-parallel-size", "2",
                                              "--heterogeneous-nic", str(CLUSTER_2)],
                     env={"HET_TEST_PARSE_ONLY": "1", "WORLD_SIZE": "2"}, timeout=120)
    args = outs[0].result["args"]
    assert args["heterogeneous_nic"] == str(CLUSTER_2) and args["pipeline_model_parallel_layout"]


def test_degrees_that_cannot_be_placed_stop_every_rank_with_the_fix():
    outs = run_ranks(SCRIPT, 2, MODEL_ARGS + ["--tensor-model-parallel-size", "2", "--heterogeneous-nic",
                                              str(CLUSTER_2)], ranks_per_node=1, timeout=120, check=False)
    for o in outs:
        assert o.returncode not in (0, None) and "killed after" not in o.stderr
        assert "cannot be placed" in o.stderr and "tp=1 pp=2" in o.stderr, o.stderr[-2000:]


def test_bare_flag_discovers_the_cluster_at_initialisation():
    """No FILE: the cluster is gathered over the store after init_process_group; the split still reaches args."""
    from het_plugin.megatron.pipeline_layout import layout_for_plan
    model = [a if a != "3" else "4" for a in MODEL_ARGS]          # --num-layers 4: Megatron checks 4 % pp itself
    outs = run_ranks(SCRIPT, 2, model + ["--pipeline-model-parallel-size", "2", "--heterogeneous-nic"],
                     env={"HET_PLUGIN_ACCELERATOR": "H100", "HET_PLUGIN_ACCELERATOR_COUNT": "2"}, timeout=180)
    plans = [Plan.from_dict(o.result["plan"]) for o in outs]
    assert plans[0].hash == plans[1].hash and plans[0].cluster_name == "discovered"
    for o, plan in zip(outs, plans):
        args = o.result["args"]
        assert args["heterogeneous_nic"] == "discover"
        assert args["pipeline_model_parallel_layout"] == layout_for_plan(plan)
        assert o.result["groups"]["pp"] == plan.group_of("pp", o.result["rank"]).ranks == [0, 1]
