"""Issue 32, real ranks: a plan file that leaves nodes out, started through the Megatron-Core drop-in and through
DeepSpeed's PipelineModule (a config wrapped with the plan) on gloo (integration_tests/ranks/bounded_failures.py).
On the plan's node every rank builds its groups; the same world size on a node the plan leaves out (each rank's
node named by HET_PLUGIN_NODE_NAME, as a hostname would) stops every rank at the plan agreement, before any of the
plan's groups, with the node and the launch to use."""
from __future__ import annotations

from pathlib import Path

import pytest

from het_plugin.core import subsets
from het_plugin.core.inputs.cluster import cluster_from_dict
from integration_tests.support.launch import run_ranks
from integration_tests.support.megatron_tiny import TinyGPT

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "ranks" / "bounded_failures.py"
GLOO = {"HET_PLUGIN_GLOO_IFNAMES": "ib=lo,roce=lo,socket=lo,local=lo"}
V100 = {"name": "V100-32", "vendor": "nvidia", "memory_gib": 32, "peak_tflops": 125, "intra_node_gbps": 2400}
#: one H100 node (fast-0) on IB, two V100 nodes (slow-0, slow-1) behind 1 GbE: the tiny model's best plan keeps
#: fast-0 alone (2 ranks, tp 1, pp 2)
CLUSTER = {"name": "hosts", "clusters": [
    {"name": "main", "fabric": {"type": "ib", "gbps": 3200, "latency_us": 2},
     "nodes": [{"count": 1, "accelerator": "H100", "accelerators_per_node": 2, "hostnames": ["fast-0"]}]},
    {"name": "annex", "fabric": {"type": "ethernet", "gbps": 1, "latency_us": 30},
     "nodes": [{"count": 2, "accelerator": V100, "accelerators_per_node": 2, "hostnames": ["slow-0", "slow-1"]}]}],
    "links": [{"between": ["main", "annex"], "type": "ethernet", "gbps": 1, "latency_us": 100}]}
TIMEOUT = 240


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    plan = subsets.plan_nodes(cluster_from_dict(CLUSTER, "hosts.yaml"), TinyGPT(num_layers=4).model_spec(),
                              tp=1, pp=2, micro_batch_size=2)
    assert [n.name for n in plan.nodes] == ["fast-0"] and plan.left_out["nodes"] == ["slow-0", "slow-1"]
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.save(path)
    return path


def launch(plan_file, host: str, args=None, env=None):
    env = dict(GLOO, HET_PLUGIN_NODE_NAME=host, **(env or {}))
    args = args or ["--framework", "megatron", "--tp", "1", "--pp", "2", "--cluster", str(plan_file),
                    "--timeout-s", "30"]
    return run_ranks(SCRIPT, 2, args, env=env, ranks_per_node=2, timeout=TIMEOUT, check=False, fail_fast=60)


def assert_every_rank_stopped_naming(outs, node: str, kept: str) -> None:
    lines = set()
    for o in outs:
        assert o.returncode not in (0, None), o.stderr[-3000:]      # stopped by itself, not by the launcher
        assert o.result is None                                     # the entry point never returned
        found = [line for line in o.stderr.splitlines() if f"the plan leaves out: {node}" in line]
        assert found, o.stderr[-3000:]
        lines.add(found[-1][found[-1].index("ConfigError:"):])     # torch prefixes "[rankN]: "
        assert f"fix: launch only the plan's 1 nodes, in this order ({kept})" in o.stderr
    assert len(lines) == 1                                          # one verdict on every rank


@pytest.mark.timeout(2 * TIMEOUT + 60)
def test_the_plans_node_starts_and_a_left_out_node_stops_every_rank_before_any_group(plan_file):
    for o in launch(plan_file, "fast-0"):
        assert o.returncode == 0, o.stderr[-3000:]
        assert o.result["groups"] >= 1
    assert_every_rank_stopped_naming(launch(plan_file, "slow-1"), "slow-1", "fast-0")


@pytest.mark.timeout(2 * TIMEOUT + 60)
def test_deepspeed_pipeline_module_on_a_config_wrapped_with_the_plan(tmp_path):
    pytest.importorskip("deepspeed")
    from het_plugin.core.inputs.model import load_model
    from het_plugin.deepspeed import wrap, write_config
    from integration_tests.support.deepspeed_cpu import cpu_environment
    model = load_model(HERE / "data" / "ds_tiny_model.yaml")
    plan = subsets.plan_nodes(cluster_from_dict(CLUSTER, "hosts.yaml"), model, tp=1, pp=2, micro_batch_size=2)
    assert [n.name for n in plan.nodes] == ["fast-0"] and plan.world_size == 2
    plan.save(tmp_path / "plan.json")
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": plan.num_micro_batches,
              "train_batch_size": 2 * plan.num_micro_batches, "steps_per_print": 10 ** 6}
    write_config(wrap(config, tmp_path / "plan.json", pp=2, layer_pattern="Block", timeout_s=30),
                 tmp_path / "ds.json")
    args = ["--framework", "deepspeed", "--pp", "2", "--config", str(tmp_path / "ds.json")]
    for o in launch(None, "fast-0", args, cpu_environment()):
        assert o.returncode == 0, o.stderr[-3000:]
        assert o.result["groups"] >= 1
    assert_every_rank_stopped_naming(launch(None, "slow-0", args, cpu_environment()), "slow-0", "fast-0")
