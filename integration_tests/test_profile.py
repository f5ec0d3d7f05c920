"""``het-plugin profile`` on CPU (gloo): 4 ranks on 2 nodes with a cluster file, 2 ranks with discovery; the
profile loads, holds what the cluster has, and ``het-plugin plan --profile`` takes it. A size that does not fit
is refused before anything runs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from het_plugin.core.inputs.profile import load_profile
from integration_tests.support.launch import free_port, run_ranks
from tests.sysfs_tree import ib_node

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "ranks" / "profile_cli.py"
CLUSTER = HERE / "data" / "profile_cpu_4.yaml"
MODEL = HERE / "data" / "profile_tiny_model.yaml"
LAYER_MODEL = HERE / "data" / "profile_speed_model.yaml"      # layers of milliseconds: their growth shows
CLI = [sys.executable, "-c", "import sys; from het_plugin.cli import main; sys.exit(main())"]


def test_four_ranks_write_a_profile_that_plan_takes(tmp_path):
    out = tmp_path / "profile.yaml"
    ranks = run_ranks(SCRIPT, 4, [str(CLUSTER), "--model", str(LAYER_MODEL), "--quick", "--micro-batch-sizes",
                                  "1,4", "--window", "0.2", "--message-sizes", "64K,1M", "-o", str(out)],
                      ranks_per_node=2, timeout=120)
    assert "profile written to" in ranks[0].stderr and "compute 1/12" in ranks[0].stderr
    prof = load_profile(out)
    assert prof.format_version == 2 and "plain torch blocks" in prof.description
    curves = {(c.kind, c.tp, c.micro_batch_size) for c in prof.compute}
    assert curves == {(k, tp, mb) for k in ("layer", "embedding", "output") for tp in (1, 2) for mb in (1, 4)}
    assert {c.device for c in prof.compute} == {"A100-80"}
    # 4 samples take longer than 1 (real work). Only at TP 1: at TP 2 the all-reduces' gloo latency on a loaded
    # 2-core machine can outweigh the layer's work (the emulated speed test checks times against known speeds).
    one, four = prof.compute_time("A100-80", "layer", 1, 1), prof.compute_time("A100-80", "layer", 4, 1)
    assert four.forward_s + four.backward_s > 1.3 * (one.forward_s + one.backward_s), (one, four)
    assert all(c.forward_s > 0 and c.backward_s > 0 for c in prof.compute)
    assert prof.optimizer_s_per_param("A100-80", 1) > 0 and prof.iteration_overhead_s("A100-80") > 0
    assert 0 < prof.pipeline_slot_s("A100-80") < four.forward_s + four.backward_s    # measured, not a layer's work
    links = {(link.tier, link.cluster): link for link in prof.links}
    assert set(links) == {("local", "ib"), ("ib", "ib"), ("socket", "ib")}
    ib = links[("ib", "ib")]
    assert [b for b, _ in ib.bandwidth] == [65536, 1 << 20] and ib.latency_us > 0
    assert [k for k, _ in ib.concurrency] == [2] and [b for b, _ in ib.allreduce] == [65536, 1 << 20]
    assert all(g > 0 for _, g in ib.bandwidth + ib.allreduce)
    planned = subprocess.run([*CLI, "plan", str(CLUSTER), "--model", str(LAYER_MODEL), "--profile", str(out)],
                             capture_output=True, text=True, timeout=120)
    assert planned.returncode == 0, planned.stderr
    assert "iteration" in planned.stdout


def test_discovered_nodes_are_profiled(tmp_path):
    out = tmp_path / "profile.json"
    env = [{"HET_PLUGIN_SYSFS_ROOT": str(ib_node(tmp_path / name)), "HET_PLUGIN_NODE_NAME": name,
            "HET_PLUGIN_ACCELERATOR": "H100"} for name in ("n0", "n1")]
    ranks = run_ranks(SCRIPT, 2, ["discover", "--model", str(MODEL), "--quick", "--window", "0.03",
                                  "--message-sizes", "64K", "-o", str(out)], rank_env=env, ranks_per_node=1,
                      timeout=120)
    assert "profile written to" in ranks[0].stderr
    prof = load_profile(out)
    assert {c.device for c in prof.compute} == {"H100"}
    assert [(link.tier, link.cluster is not None) for link in prof.links] == [("ib", True), ("socket", True)]


def test_a_size_that_does_not_fit_is_refused_before_anything_runs(tmp_path):
    out = tmp_path / "profile.yaml"
    cluster = tmp_path / "one.yaml"
    cluster.write_text("clusters: [{name: c, fabric: {type: ib, gbps: 100}, nodes: [{count: 1, accelerator: A100-80, "
                       "accelerators_per_node: 1}]}]\n")
    p = subprocess.run([*CLI, "profile", str(cluster), "--model", "gpt-7.5b", "--micro-batch-sizes", "1,64",
                        "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "--micro-batch-sizes" in p.stderr and "micro-batch 64 with tp=1" in p.stderr and "fix:" in p.stderr
    assert not out.exists()


def test_megatron_cores_own_layers_are_timed(tmp_path):
    """--layers megatron: Megatron-Core's one-layer GPTModel pieces at TP 1 and 2 (on CPU through the test-only
    shims the rank script installs; `auto` would take the plain blocks here, as the first test shows)."""
    out = tmp_path / "profile.yaml"
    ranks = run_ranks(SCRIPT, 4, ["--megatron-cpu-shims", str(CLUSTER), "--model", str(LAYER_MODEL), "--quick",
                                  "--layers", "megatron", "--no-links", "--window", "0.1", "-o", str(out)],
                      ranks_per_node=2, timeout=150)
    assert "(Megatron-Core layers)" in ranks[0].stderr
    prof = load_profile(out)
    assert "layers: Megatron-Core 0." in prof.description and "local spec" in prof.description
    assert {(c.kind, c.tp, c.micro_batch_size) for c in prof.compute} == {
        (k, tp, mb) for k in ("layer", "embedding", "output") for tp in (1, 2) for mb in (1, 2)}
    assert all(c.forward_s > 0 and c.backward_s > 0 for c in prof.compute)
    assert prof.links == [] and prof.optimizer_s_per_param("A100-80", 1) > 0


def _one_rank_moe(tmp_path) -> tuple[Path, Path]:
    cluster, model = tmp_path / "one.yaml", tmp_path / "moe.yaml"
    cluster.write_text("clusters: [{name: c, fabric: {type: ib, gbps: 100}, nodes: [{count: 1, accelerator: H100, "
                       "accelerators_per_node: 1}]}]\n")
    model.write_text("{name: moe-tiny, num_layers: 4, hidden_size: 64, num_attention_heads: 4, vocab_size: 256, "
                     "seq_length: 32, global_batch_size: 8, dtype: fp32, activation: swiglu, num_moe_experts: 4, "
                     "moe_router_topk: 2, moe_layer_freq: 2, moe_shared_expert_intermediate_size: 64}\n")
    return cluster, model


def test_megatron_moe_layer_is_timed(tmp_path):
    (cluster, model), out = _one_rank_moe(tmp_path), tmp_path / "profile.yaml"
    run_ranks(SCRIPT, 1, ["--megatron-cpu-shims", str(cluster), "--model", str(model), "--layers", "megatron",
                          "--micro-batch-sizes", "2", "--window", "0.05", "-o", str(out)], timeout=120)
    prof = load_profile(out)
    assert "Megatron-Core" in prof.description
    assert {c.kind for c in prof.compute} == {"layer", "moe_layer", "embedding", "output"}


def test_one_process_without_a_launcher_times_an_moe_model(tmp_path):
    (cluster, model), out = _one_rank_moe(tmp_path), tmp_path / "profile.yaml"
    p = subprocess.run([*CLI, "profile", str(cluster), "--model", str(model), "--quick", "--window", "0.03",
                        "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    prof = load_profile(out)
    assert {(c.kind, c.micro_batch_size) for c in prof.compute} == {
        (k, mb) for k in ("layer", "moe_layer", "embedding", "output") for mb in (1, 2)}
    assert prof.links == []                      # one rank: nothing to send to
    # the average layer of a half-MoE model mixes the two measured curves
    dense, moe = prof.compute_time("H100", "layer", 2, 1), prof.compute_time("H100", "moe_layer", 2, 1)
    mixed = prof.compute_time("H100", "layer", 2, 1, moe_fraction=0.5)
    assert abs(mixed.forward_s - (dense.forward_s + moe.forward_s) / 2) < 1e-12


def _console(name: str) -> Path:
    found = Path(sys.executable).parent / name
    if not found.exists():
        pytest.skip(f"{name} is not installed next to this python")
    return found


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_under_the_real_launchers(tmp_path, launcher):
    """`torchrun --no-python het-plugin profile` and `deepspeed --no_python --no_local_rank het-plugin profile`
    (the deepspeed launcher would otherwise put --local_rank=N before the subcommand)."""
    out, cluster = tmp_path / "profile.yaml", tmp_path / "two.yaml"
    cluster.write_text("clusters: [{name: c, fabric: {type: ib, gbps: 100}, nodes: [{count: 1, accelerator: A100-80, "
                       "accelerators_per_node: 2}]}]\n")
    port = str(free_port())
    head = ([str(_console("torchrun")), "--nproc-per-node", "2", "--master-port", port, "--no-python"]
            if launcher == "torchrun" else
            [str(_console("deepspeed")), "--num_gpus", "2", "--master_port", port, "--no_python", "--no_local_rank"])
    p = subprocess.run([*head, str(_console("het-plugin")), "profile", str(cluster), "--model", str(MODEL), "--quick",
                        "--window", "0.03", "--message-sizes", "64K", "-o", str(out)],
                       capture_output=True, text=True, timeout=150, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    prof = load_profile(out)
    assert {c.tp for c in prof.compute} == {1, 2}
    assert [(link.tier, link.cluster) for link in prof.links] == [("local", "c")]
