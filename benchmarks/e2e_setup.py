"""The end-to-end benchmark's fixed inputs: the tiny GPT, the emulated clusters, the real job it stands
for, and the bandwidth scale derived from both (see docs/benchmark-e2e.md).

Scale derivation. The real job (Holmes' main case): GPT-7.5B (36 layers, hidden 4096, seq 2048, global
batch 512, micro-batch 1) on 8 nodes x 8 A100-80 (4 IB + 4 RoCE nodes), TP=8 inside a node, PP=2, DP=4,
200 Gb/s RDMA NICs inside each cluster, 25 GbE per node between clusters. Three proportions matter:

* ``dp_eth``: one iteration's gradient all-reduce through a node's 25 GbE NIC / the iteration's compute;
* ``pp_eth``: one iteration's pipeline activations + activation gradients through 25 GbE / compute;
* ``act_grad``: pipeline bytes / gradient bytes per node and iteration (fixed by the model shapes).

The tiny model is chosen so that ``act_grad`` is close to the real one; the emulated Ethernet rate is
then set so that ``dp_eth`` and ``pp_eth`` are both within 10% of the real job's (e2e_proportions), given the
compute time *measured here*.
The scale factor is real 25 Gbit/s over that emulated rate. The fabric is ``ratio`` x Ethernet.
"""
from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from het_plugin.core.inputs import catalog  # noqa: E402
from het_plugin.core.inputs.cluster import Cluster, cluster_from_dict  # noqa: E402
from het_plugin.core.inputs.model import preset_model  # noqa: E402
from integration_tests.support.megatron_tiny import TinyGPT  # noqa: E402

from e2e_proportions import proportions_at, rate_for_proportions  # noqa: E402

ETH_GBPS = 25.0                 # the real job's Ethernet, per node
NODE_ORDER = ["ib-0", "roce-0", "ib-1", "roce-1"]   # a launch order that mixes the clusters (hostfile order)


PP, DP = 2, 2

# Megatron's default DDP bucket is max(40M, 1M x dp) parameters: the real job's rank (479M parameters of its
# stage) reduces its gradients in ~12 buckets. The tiny stage (0.82M parameters) gets the same count.
BUCKET_PARAMS = 68_000


@dataclass
class TinyShape(TinyGPT):
    """The benchmark's tiny GPT: TinyGPT (integration_tests/support/megatron_tiny.py) with these sizes."""
    num_layers: int = 8
    hidden_size: int = 128
    num_attention_heads: int = 4
    ffn_hidden_size: int = 512
    vocab_size: int = 256
    seq_length: int = 64
    global_batch_size: int = 16
    micro_batch_size: int = 1
    seed: int = 1234
    lr: float = 0.01
    bucket_size: int = BUCKET_PARAMS

    def to_dict(self) -> dict:
        return asdict(self)


# ---- clusters (real units: Gbit/s per node) ---------------------------------------------------------

def mixed_cluster(ratio: float) -> Cluster:
    """Holmes-shaped: 2 IB + 2 RoCE nodes, one rank each; fabric = ratio x 25 GbE; launched interleaved."""
    fast = ETH_GBPS * ratio
    eth = [{"type": "ethernet", "gbps": ETH_GBPS, "interfaces": ["eth0"]}]
    return cluster_from_dict({
        "name": f"emu-holmes-{ratio:g}to1",
        "clusters": [
            {"name": "ib", "fabric": {"type": "ib", "gbps": fast, "latency_us": 2},
             "nodes": [{"count": 2, "accelerator": "A100-80", "accelerators_per_node": 1, "nics": eth}]},
            {"name": "roce", "fabric": {"type": "roce", "gbps": fast, "latency_us": 6},
             "nodes": [{"count": 2, "accelerator": "A100-80", "accelerators_per_node": 1, "nics": eth}]}],
        "links": [{"between": ["ib", "roce"], "type": "ethernet", "gbps": ETH_GBPS, "latency_us": 50}],
        "launch": {"node_order": NODE_ORDER}}, source=f"<bench mixed {ratio:g}:1>")


def fast_cluster(ratio: float) -> Cluster:
    """Reference (1): the same 4 nodes on one RDMA fabric."""
    return cluster_from_dict({
        "name": "emu-all-fast", "clusters": [
            {"name": "ib", "fabric": {"type": "ib", "gbps": ETH_GBPS * ratio, "latency_us": 2},
             "nodes": [{"count": 4, "accelerator": "A100-80", "accelerators_per_node": 1}]}]}, source="<bench fast>")


def slow_cluster() -> Cluster:
    """Reference (2): the same 4 nodes, Ethernet only."""
    return cluster_from_dict({
        "name": "emu-all-ethernet", "clusters": [
            {"name": "eth", "fabric": {"type": "ethernet", "gbps": ETH_GBPS, "latency_us": 30},
             "nodes": [{"count": 4, "accelerator": "A100-80", "accelerators_per_node": 1}]}]}, source="<bench slow>")


# ---- the real job and the tiny one's proportions ----------------------------------------------------

@dataclass
class Proportions:
    compute_s: float          # one iteration's compute on the busiest stage (no bubble)
    dp_bytes: float           # gradient bytes a node pushes through its NIC per iteration (ring)
    pp_bytes: float           # pipeline bytes (activations + their gradients) a node pushes per iteration
    eth_bytes_per_s: float

    @property
    def dp_eth(self) -> float:
        return self.dp_bytes / self.eth_bytes_per_s / self.compute_s

    @property
    def pp_eth(self) -> float:
        return self.pp_bytes / self.eth_bytes_per_s / self.compute_s

    @property
    def act_grad(self) -> float:
        return self.pp_bytes / self.dp_bytes


REAL_JOB = dict(model="gpt-7.5b", accelerator="A100-80", tp=8, pp=2, dp=4, micro_batch=1, gpus_per_node=8)


def real_job() -> Proportions:
    m = preset_model(REAL_JOB["model"])
    acc = catalog.lookup(REAL_JOB["accelerator"])
    tp, pp, dp, mb = REAL_JOB["tp"], REAL_JOB["pp"], REAL_JOB["dp"], REAL_JOB["micro_batch"]
    micro_batches = m.global_batch_size // (dp * mb)
    layers = m.num_layers // pp
    flops_per_mb = 3 * layers * m.layer_flops_fwd(mb) / tp + 3 * m.logits_flops_fwd(mb) / tp
    compute = micro_batches * flops_per_mb / (acc.peak_tflops * 1e12 * acc.efficiency)
    stage_params = layers * m.params_per_layer + m.embedding_params
    dp_bytes = 2 * (dp - 1) / dp * stage_params * 4          # fp32 gradients, all TP shards of the node
    pp_bytes = 2 * micro_batches * m.seq_length * mb * m.hidden_size * m.dtype_bytes
    return Proportions(compute, dp_bytes, pp_bytes, ETH_GBPS * 1e9 / 8)


def tiny_job(shape: TinyShape, stage_s_per_micro_batch: float) -> tuple[float, float]:
    """(dp_bytes, pp_bytes) per node and iteration for the tiny job (fp32, PP x DP, 1 rank per node)."""
    spec = shape.model_spec()
    micro_batches = shape.global_batch_size // (DP * shape.micro_batch_size)
    stage_params = shape.num_layers // PP * spec.params_per_layer + spec.embedding_params
    dp_bytes = 2 * (DP - 1) / DP * stage_params * 4
    pp_bytes = 2 * micro_batches * shape.seq_length * shape.micro_batch_size * shape.hidden_size * 4
    return dp_bytes, pp_bytes


def derive_scale(shape: TinyShape, stage_s_per_micro_batch: float, eth_mbit: float | None = None) -> dict:
    """The emulated Ethernet rate and the tiny job's proportions at it. Default (``eth_mbit`` None, mode
    "proportions"): the rate that puts dp_eth and pp_eth within 10% of the real job's (e2e_proportions); with
    ``eth_mbit`` (mode "fixed": one operating point for comparing code changes on one machine) that rate, and the
    proportions follow from it. ``matched_eth_mbit`` is always the proportion-matched rate for this compute."""
    real = real_job()
    micro_batches = shape.global_batch_size // (DP * shape.micro_batch_size)
    compute = micro_batches * stage_s_per_micro_batch
    dp_bytes, pp_bytes = tiny_job(shape, stage_s_per_micro_batch)
    matched = rate_for_proportions(dp_bytes, pp_bytes, compute, real.dp_eth, real.pp_eth)
    point = matched if eth_mbit is None else proportions_at(eth_mbit * 1e6 / 8, dp_bytes, pp_bytes, compute,
                                                            real.dp_eth, real.pp_eth)
    tiny = Proportions(compute, dp_bytes, pp_bytes, point.eth_bytes_per_s)
    return {"eth_mbit": point.eth_mbit, "scale": ETH_GBPS * 1e3 / point.eth_mbit,
            "mode": "proportions" if eth_mbit is None else "fixed", "fixed": eth_mbit is not None,
            "matched_eth_mbit": matched.eth_mbit, "matched": point.matched, "tolerance": point.tolerance,
            "dp_error": point.dp_error, "pp_error": point.pp_error,
            "real": {"compute_s": real.compute_s, "dp_eth": real.dp_eth, "pp_eth": real.pp_eth,
                     "act_grad": real.act_grad, "dp_bytes": real.dp_bytes, "pp_bytes": real.pp_bytes},
            "tiny": {"compute_s": tiny.compute_s, "dp_eth": tiny.dp_eth, "pp_eth": tiny.pp_eth,
                     "act_grad": tiny.act_grad, "dp_bytes": dp_bytes, "pp_bytes": pp_bytes}}


if __name__ == "__main__":
    r = real_job()
    print(f"real job: compute {r.compute_s:.2f} s/iter, dp_eth {r.dp_eth:.2f}, pp_eth {r.pp_eth:.3f}, "
          f"act:grad {r.act_grad:.3f}")
    print(derive_scale(TinyShape(), 0.03))
