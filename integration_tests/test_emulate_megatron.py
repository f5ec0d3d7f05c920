"""A 4-rank Megatron-Core training across two emulated clusters, through het_plugin's Megatron adapter.

The emulated IB and RoCE clusters reach each other only over Ethernet. The plan keeps each data-parallel
group inside one cluster (its fabric) and lets only the pipeline cross; the interface byte counters show
the gradient traffic on the fabric and the pipeline traffic on Ethernet.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from het_plugin.core.inputs.cluster import load_cluster
from het_plugin.tools.emulate import Emulation
from integration_tests.support.megatron_tiny import TinyGPT

from .test_emulate import CLUSTER, ENV, emulator_ok  # noqa: F401  (fixture)

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "ranks" / "emulate_megatron.py"
TINY = dict(num_layers=4, hidden_size=64, ffn_hidden_size=128, seq_length=32, global_batch_size=8, micro_batch_size=1)


def test_megatron_trains_across_two_emulated_clusters(emulator_ok):  # noqa: F811
    cluster = load_cluster(CLUSTER)
    env = dict(ENV, HET_TEST_TIMEOUT="170", PYTHONWARNINGS="ignore")
    with Emulation(cluster, scale=100, log=lambda s: None) as emu:       # fabric 2 Gbit/s, Ethernet 200-400 Mbit/s
        outs = emu.run_ranks([sys.executable, str(SCRIPT), str(CLUSTER), "2", "3", json.dumps(TINY)], env=env,
                             timeout=200)
    assert [o.returncode for o in outs] == [0, 0, 0, 0], \
        "\n".join(f"--- rank {o.rank} rc={o.returncode}\n{o.stderr[-3000:]}" for o in outs)
    res = [json.loads(l[7:]) for o in outs for l in o.stdout.splitlines() if l.startswith("RESULT ")]
    assert len(res) == 4
    by_rank = {r["rank"]: r for r in res}
    node_cluster = {r: cluster.node_of(r).cluster for r in range(4)}
    losses = by_rank[0]["losses"]
    assert len(losses) == 3 and all(l == l and 0 < l < 20 for l in losses)     # finite, plausible
    assert all(r["losses"] == losses for r in res)                               # every rank agrees
    assert all(r["plan_hash"] == by_rank[0]["plan_hash"] for r in res)
    spec = TinyGPT(**TINY).model_spec()
    steps = 3
    micro_batches = spec.global_batch_size // (2 * spec.micro_batch_size)
    act_bytes = steps * micro_batches * spec.seq_length * spec.micro_batch_size * spec.hidden_size * 4
    for r in res:
        dp, pp = r["groups"]["dp"], r["groups"]["pp"]
        # a 2-rank ring all-reduce sends each gradient byte once (half in reduce-scatter, half in all-gather)
        grad_bytes = steps * 4 * (len(r["layer_numbers"]) * spec.params_per_layer + spec.embedding_params)
        assert len({node_cluster[x] for x in dp}) == 1, f"dp group {dp} crosses clusters"
        assert len({node_cluster[x] for x in pp}) == 2, f"pp group {pp} should join the clusters"
        # gradients ride the fabric; only activations (and the tied-embedding sync) cross on Ethernet
        assert r["tx"]["fab0"] >= 0.8 * grad_bytes, (r["tx"], grad_bytes)
        # Ethernet: activations, the tied-embedding all-reduce, TCP headers/ACKs; never the gradients
        emb_bytes = steps * 4 * spec.embedding_params
        assert 0.8 * act_bytes <= r["tx"]["eth0"] <= 1.5 * (act_bytes + emb_bytes) + 50_000, \
            (r["tx"], act_bytes, emb_bytes, grad_bytes)
