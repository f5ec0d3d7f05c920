"""A DeepSpeed pipeline across two emulated clusters sends its activations over the plan's pipeline groups.

DeepSpeed's own ``p2p.send/recv`` use the world group (here gloo on ``eth0``, the shared Ethernet).
The plan below keeps each pipeline inside one cluster -- pipeline groups on the cluster fabric (``fab0``)
-- while each stage sits in both clusters, its data-parallel group crossing on Ethernet. The interface
byte counters show activations and their gradients on ``fab0`` and the gradient all-reduce on ``eth0``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from het_plugin.core.inputs.cluster import load_cluster  # noqa: E402
from het_plugin.deepspeed import wrap, write_config  # noqa: E402
from het_plugin.core.inputs.model import ModelSpec  # noqa: E402
from het_plugin.core.ranks.placement import Placement  # noqa: E402
from het_plugin.core.planner import assemble_plan  # noqa: E402
from het_plugin.core.ranks.dims import ParallelDims  # noqa: E402
from het_plugin.tools.emulate import Emulation  # noqa: E402
from integration_tests.support.deepspeed_cpu import cpu_environment  # noqa: E402

from .test_emulate import CLUSTER, ENV, emulator_ok  # noqa: F401,E402  (fixture)

HERE = Path(__file__).resolve().parent
PIPE = HERE / "ranks" / "deepspeed_pipe.py"
HIDDEN, MICRO, ACCUM, STEPS, BLOCKS = 256, 16, 4, 3, 8


def pipelines_inside_clusters():
    """pp=2 x dp=2 on emu_two_clusters (ib-0, ib-1, roce-0, roce-1): pipeline groups [0, 1] (ib) and [2, 3]
    (roce), data-parallel groups [0, 2] and [1, 3] across the clusters."""
    cluster = load_cluster(CLUSTER)
    model = ModelSpec(name="ds-emu", num_layers=BLOCKS, hidden_size=HIDDEN, num_attention_heads=1, vocab_size=16,
                      seq_length=1, global_batch_size=MICRO * ACCUM * 2, micro_batch_size=MICRO)
    placement = Placement(ParallelDims(pp=2, dp=2), (0, 2, 1, 3), tuple(cluster.domains))
    return cluster, assemble_plan(cluster, model, placement, [BLOCKS // 2] * 2, MICRO)


def test_pipeline_hops_use_the_pipeline_groups_interface(emulator_ok, tmp_path):  # noqa: F811
    cluster, plan = pipelines_inside_clusters()
    assert [g.ranks for g in plan.groups["pp"]] == [[0, 1], [2, 3]]
    assert {g.transport for g in plan.groups["pp"]} == {"ib", "roce"}
    assert {g.transport for g in plan.groups["dp"]} == {"socket"}
    cfg = wrap({"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM,
                "train_batch_size": MICRO * ACCUM * 2, "steps_per_print": 10 ** 6}, plan, pp=2, layer_pattern="Block")
    write_config(cfg, tmp_path / "cfg.json")
    env = dict(ENV, **cpu_environment(), HET_TEST_TIMEOUT="170", PYTHONWARNINGS="ignore")
    args = ["--config", str(tmp_path / "cfg.json"), "--pp", "2", "--mp", "1", "--steps", str(STEPS),
            "--hidden", str(HIDDEN), "--micro", str(MICRO)]
    with Emulation(cluster, scale=100, log=lambda s: None) as emu:       # fabric 2 Gbit/s, Ethernet 200-400 Mbit/s
        outs = emu.run_ranks([sys.executable, str(PIPE), *args], env=env, timeout=200)
    assert [o.returncode for o in outs] == [0, 0, 0, 0], \
        "\n".join(f"--- rank {o.rank} rc={o.returncode}\n{o.stderr[-3000:]}" for o in outs)
    res = sorted((json.loads(l[7:]) for o in outs for l in o.stdout.splitlines() if l.startswith("RESULT ")),
                 key=lambda r: r["rank"])
    assert len(res) == 4
    # one hop per micro-batch: activations forward (stage 0), their gradients backward (stage 1)
    hop_bytes = STEPS * ACCUM * MICRO * HIDDEN * 4
    # each rank's share of a 2-rank all-reduce of its stage's gradients (4 blocks, plus InProj or Head)
    grad_bytes = STEPS * 4 * (BLOCKS // 2 + 1) * (HIDDEN * HIDDEN + HIDDEN)
    for r in res:
        assert r["pp_group"] == plan.group_of("pp", r["rank"]).ranks
        assert r["losses"] == res[0]["losses"] and len(set(r["losses"])) > 1          # trained, every rank agrees
        # the pipeline's traffic rides the fabric: the hops, a loss broadcast, TCP overhead
        assert 0.9 * hop_bytes <= r["tx"]["fab0"] <= 1.5 * hop_bytes + 50_000, (r["rank"], r["tx"], hop_bytes)
        # Ethernet: the data-parallel gradient all-reduce (not the hops)
        assert r["tx"]["eth0"] >= 0.8 * grad_bytes, (r["rank"], r["tx"], grad_bytes)
