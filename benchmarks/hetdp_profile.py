"""The heterogeneous data-parallel benchmark's measured profile: compute measured in the emulated nodes themselves
(each under its cpu cgroup quota, all nodes at once, through the training code of each framework) and links
measured between them with gloo, written as a het_plugin profile (format 2) with one device type per node kind.

Compute, per node (``python hetdp_profile.py ...`` started in every node at once by bench_hetdp): single-rank
trainings of the benchmark's tiny GPT with 2 and 6 layers, each at PROFILE_MICRO_BATCHES micro-batches per step
and twice that (the four runs lined up across the nodes by a TCPStore barrier on the master node, so every node
computes while the others do, as in training); the embedding and the output layer + loss timed directly; the
SGD update timed directly (seconds per parameter). Direct timings run in blocks of many calls (:func:`_block_times`):
under a cpu quota a single short call mostly runs unthrottled, faster than the node's average rate. Per device type (the median of its nodes' numbers) a
least-squares fit of t(L, m) = per_step + m (per_micro_batch + L per_layer) to the four step times, less the
update (seconds per parameter x the run's parameters), gives the profile's entries:

* ``layer``: per_layer, split 1:2 forward:backward (the fit sees only the sum);
* ``embedding`` and ``output``: their direct times, plus half each of what per_micro_batch holds beyond them
  (framework overhead per micro-batch: schedule, hooks), so a single-stage plan pays it once, as measured;
  a pipeline stage pays half of it (the profile has no per-stage entry: see docs/benchmark-hetdp.md);
* ``optimizer``: the update's seconds per parameter; ``iteration_overhead``: per_step (zero-grad, loss
  reduction, the engine's step bookkeeping).

Links (:func:`link_pairs`, measured by hetdp_worker.py in a 4-rank launch): each cluster's fabric and its
Ethernet between its two nodes, and the Ethernet between the clusters in both directions.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

PROFILE_MICRO_BATCHES = 12           # micro-batches per step of the profile's runs (and twice it)
from e2e_compute import RUNS  # noqa: E402  (layers, multiple of the micro-batches): the end-to-end profile's runs
BWD_SHARE = 2 / 3                    # a layer's fit split forward:backward as 1:2
LINK_SIZES = [16384, 65536, 262144, 1 << 20, 4 << 20]
LINK_REPS = 3


# ---- pure: from measurements to the profile -------------------------------------------------------------

@dataclass
class DeviceCompute:
    """One device type's fitted compute (seconds; one micro-batch of the profile's size)."""
    layer: tuple[float, float]
    embedding: tuple[float, float]
    output: tuple[float, float]
    overhead_per_micro_batch: float
    overhead_per_step: float
    optimizer_s_per_param: float
    steps_s: dict
    nodes: int

    def to_dict(self) -> dict:
        return asdict(self)


def run_params(spec, layers: int) -> float:
    """Parameters the predictor counts for a one-stage model of ``layers`` layers (what the update touches)."""
    extra = 0 if spec.tie_embeddings else spec.embedding_params
    return spec.embedding_params + extra + layers * spec.params_per_layer


def fit_device(results: list[dict], spec, micro_batches: int) -> DeviceCompute:
    """The profile entries of one device type from its nodes' measurements (median over the nodes).

    ``results``: per node, the median step time of each run in RUNS, the direct embedding/output times
    (``ef``, ``eb``, ``of``, ``ob``) and ``optimizer_s_per_param``; ``micro_batches``: the runs' base count."""
    import numpy as np
    from e2e_compute import nonnegative_lstsq
    if not results:
        raise ValueError("no node measured this device type")
    med = {k: statistics.median(r[k] for r in results) for k in results[0] if k != "node"}
    opt = med["optimizer_s_per_param"]
    rows, times = [], []
    for key, (layers, mult) in RUNS.items():
        m = micro_batches * mult
        rows.append([1.0, m, m * layers])
        times.append(med[key] - opt * run_params(spec, layers))
    per_step, per_mb, per_layer = nonnegative_lstsq(np.array(rows), np.array(times))
    overhead = max(0.0, per_mb - med["ef"] - med["eb"] - med["of"] - med["ob"])
    half = overhead / 2
    return DeviceCompute(
        layer=(per_layer * (1 - BWD_SHARE), per_layer * BWD_SHARE),
        embedding=(med["ef"] + half * (1 - BWD_SHARE), med["eb"] + half * BWD_SHARE),
        output=(med["of"] + half * (1 - BWD_SHARE), med["ob"] + half * BWD_SHARE),
        overhead_per_micro_batch=overhead, overhead_per_step=per_step, optimizer_s_per_param=opt,
        steps_s={k: med[k] for k in RUNS}, nodes=len(results))


def by_device(cluster, per_node: list[dict]) -> dict[str, list[dict]]:
    """Group per-node results (each with its ``node`` index) by the node's accelerator name."""
    out: dict[str, list[dict]] = {}
    for r in per_node:
        out.setdefault(cluster.nodes[r["node"]].accelerator.name, []).append(r)
    return out


def link_pairs(cluster) -> list[tuple[str, list[int], str]]:
    """What to measure, as (key, [sender rank, receiver rank], interface): inside each cluster its fabric
    (``fabric:<cluster>``, fab0) and its Ethernet (``eth:<cluster>``, eth0) between its first two nodes; between
    two clusters their first nodes' Ethernet, each direction (``<a>-><b>``). One rank per node."""
    first: dict[str, list[int]] = {}
    for node in cluster.nodes:
        first.setdefault(node.cluster, []).append(cluster.node_first_rank[node.index])
    pairs = []
    for name, ranks in first.items():
        if len(ranks) > 1:
            pairs += [(f"fabric:{name}", ranks[:2], "fab0"), (f"eth:{name}", ranks[:2], "eth0")]
    names = list(first)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            pairs += [(f"{a}->{b}", [first[a][0], first[b][0]], "eth0"),
                      (f"{b}->{a}", [first[b][0], first[a][0]], "eth0")]
    return pairs


def build_profile(cluster, compute: dict[str, DeviceCompute], links: dict[str, dict], micro_batch_size: int,
                  description: str):
    """A format-2 Profile: compute, optimizer and overhead per device type; each cluster's fabric (its own tier
    kind) and Ethernet (``socket`` and ``ethernet``) inside that cluster; the named link between clusters per
    direction. ``links``: key of :func:`link_pairs` -> {"latency_us", "bandwidth": [[bytes, Gbit/s], ...]}."""
    from het_plugin.core.inputs.profile import Profile
    prof = Profile(description=description)
    for device, c in sorted(compute.items()):
        for kind in ("layer", "embedding", "output"):
            f, b = getattr(c, kind)
            prof.add_compute(device, kind, micro_batch_size, 1, max(f, 0.0), max(b, 0.0))
        prof.add_optimizer(device, 1, c.optimizer_s_per_param)
        prof.add_overhead(device, c.overhead_per_step)
        # measured: the per-micro-batch framework work is in embedding + output above (not the default slot)
        prof.add_pipeline_slot(device, 0.0)
    fabric = {n.cluster: n.fabric.type for n in cluster.nodes}
    for key, link in links.items():
        curve = [(int(b), float(g)) for b, g in link["bandwidth"]]
        if key.startswith("fabric:"):
            name = key.split(":", 1)[1]
            prof.add_link(fabric[name], curve, latency_us=link["latency_us"], cluster=name)
        elif key.startswith("eth:"):
            name = key.split(":", 1)[1]
            for tier in ("socket", "ethernet"):
                prof.add_link(tier, curve, latency_us=link["latency_us"], cluster=name)
        else:
            prof.add_link(key, curve, latency_us=link["latency_us"])
    return prof


# ---- in each node -------------------------------------------------------------------------------------------

BLOCK = 30          # direct timings: operations per timed block (see _block_times)


def _block_times(step, reps: int = 3, block: int = BLOCK) -> tuple[float, float]:
    """(forward, backward) seconds of one call of ``step`` (which returns a scalar to differentiate), timed as
    blocks of ``block`` calls (all forwards, then all backwards), the median block over ``reps``. Not one call at
    a time: under a cpu quota (the emulated nodes' cgroups) a short operation often runs unthrottled at the
    core's full speed, and its median would miss the throttled periods that training, running long, goes
    through; a block of a few quota periods gets the node's average rate, as training does."""
    fwd, bwd = [], []
    for r in range(reps + 1):
        t0 = time.perf_counter()
        outs = [step() for _ in range(block)]
        t1 = time.perf_counter()
        for y in outs:
            y.backward()
        t2 = time.perf_counter()
        if r:                                  # the first block warms up
            fwd.append((t1 - t0) / block)
            bwd.append((t2 - t1) / block)
    return statistics.median(fwd), statistics.median(bwd)


def _timed_update(params, lr: float, reps: int = 3, block: int = 100) -> float:
    """Seconds per parameter of the benchmark's plain SGD update (as megatron_tiny applies it; DeepSpeed's runs
    step a torch SGD optimizer, whose loop is the same add per tensor), in blocks as :func:`_block_times`."""
    import torch
    grads = [torch.randn_like(p) for p in params]
    times = []
    with torch.no_grad():
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            for _ in range(block):
                for p, g in zip(params, grads):
                    p.add_(g, alpha=-lr)
            times.append((time.perf_counter() - t0) / block)
    return statistics.median(times[1:]) / sum(p.numel() for p in params)


def _megatron_runs(shape: dict, rounds: int, steps: int, barrier) -> dict:
    from e2e_compute import training_runs
    out = training_runs(shape, rounds, steps, barrier, RUNS)
    out.update(_megatron_direct(shape))
    return out


def _megatron_direct(shape: dict) -> dict:
    """Megatron's embedding and output layer + loss timed directly (as e2e_compute.direct_times, in blocks), and
    the update of a 6-layer model."""
    import torch
    from e2e_compute import small_gpt
    from megatron.core import parallel_state as ps
    mb, s, h = shape["micro_batch_size"], shape["seq_length"], shape["hidden_size"]
    model, tokens, pos = small_gpt(shape, 6)

    def head():
        hidden = torch.randn(s, mb, h, requires_grad=True)
        logits, _ = model.output_layer(model.decoder.final_layernorm(hidden),
                                       weight=model.shared_embedding_or_output_weight())
        return model.compute_language_model_loss(tokens, logits).float().mean()

    try:
        ef, eb = _block_times(lambda: model.embedding(input_ids=tokens, position_ids=pos).float().sum())
        of, ob = _block_times(head)
        return {"ef": ef, "eb": eb, "of": of, "ob": ob,
                "optimizer_s_per_param": _timed_update(list(model.parameters()), shape["lr"])}
    finally:
        ps.destroy_model_parallel()


def _deepspeed_runs(shape: dict, rounds: int, steps: int, barrier) -> dict:
    import e2e_deepspeed
    cfg = {"pp": 1, "plan": None, "micro_batch_size": shape["micro_batch_size"]}
    times = {k: [] for k in RUNS}
    e2e_deepspeed.train(dict(shape, num_layers=2), cfg, 2)         # throw-away, as above
    for _ in range(rounds):
        for key, (layers, mult) in RUNS.items():
            barrier.wait()
            run = dict(shape, num_layers=layers, global_batch_size=shape["global_batch_size"] * mult)
            times[key] += e2e_deepspeed.train(run, cfg, steps + 1)[0][1:]
    out = {k: statistics.median(v) for k, v in times.items()}
    out.update(_deepspeed_direct(shape))
    return out


def _deepspeed_direct(shape: dict) -> dict:
    """The DeepSpeed model's embedding and output layer + loss timed directly (in blocks), and its SGD update."""
    import torch
    import e2e_deepspeed
    specs, loss_fn = e2e_deepspeed._layers(shape)
    emb, out_layer = specs[0].build(), specs[-1].build()
    mb, s, h = shape["micro_batch_size"], shape["seq_length"], shape["hidden_size"]
    tokens = torch.randint(0, shape["vocab_size"], (mb, s))
    labels = torch.randint(0, shape["vocab_size"], (mb, s))
    out = dict(zip(("ef", "eb"), _block_times(lambda: emb(tokens).sum())))
    out.update(zip(("of", "ob"), _block_times(
        lambda: loss_fn(out_layer(torch.randn(mb, s, h, requires_grad=True)), labels))))
    full = torch.nn.Sequential(*(spec.build() for spec in e2e_deepspeed._layers(dict(shape, num_layers=6))[0]))
    out["optimizer_s_per_param"] = _timed_update(list(full.parameters()), shape["lr"])
    return out


def main() -> None:
    """In one node: ``hetdp_profile.py FRAMEWORKS SHAPE_JSON ROUNDS STEPS INDEX COUNT HOST PORT``."""
    frameworks, shape = sys.argv[1].split(","), json.loads(sys.argv[2])
    rounds, steps, index, count, host, port = (int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]),
                                               int(sys.argv[6]), sys.argv[7], int(sys.argv[8]))
    from e2e_compute import Barrier
    barrier = Barrier(index, count, port, host)
    out = {}
    for fw in frameworks:
        out[fw] = (_megatron_runs if fw == "megatron" else _deepspeed_runs)(shape, rounds, steps, barrier)
    print("RESULT " + json.dumps(out), flush=True)
    barrier.wait()                    # every node has finished; the store's host (index 0) leaves last
    if index == 0:
        time.sleep(2.0)


def measure_compute(emu, frameworks: list[str], shape: dict, rounds: int, steps: int, port: int = 29611,
                    timeout: float = 900) -> dict[str, list[dict]]:
    """Run the profile in every node of the emulation at once; per framework, per node, its measurements."""
    import subprocess
    env = {"PYTHONPATH": f"{HERE.parent}{os.pathsep}{HERE}", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port + 1), "DS_ACCELERATOR": "cpu", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    nodes = emu.layout.nodes
    procs = [emu.popen_in(n.index, [sys.executable, str(Path(__file__).resolve()), ",".join(frameworks),
                                    json.dumps(shape), str(rounds), str(steps), str(i), str(len(nodes)),
                                    emu.layout.master_addr, str(port)],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, n in enumerate(nodes)]
    from het_plugin.tools.emulate.procs import collect
    outs = collect(procs, timeout, grace=5.0, label="hetdp profile").outputs
    per_fw: dict[str, list[dict]] = {fw: [] for fw in frameworks}
    for i, o in enumerate(outs):
        lines = [line for line in (o.stdout or "").splitlines() if line.startswith("RESULT ")]
        if o.returncode != 0 or not lines:
            raise RuntimeError(f"compute profile in node {nodes[i].name} failed (rc {o.returncode}):\n"
                               f"{(o.stderr or '')[-3000:]}")
        for fw, r in json.loads(lines[-1][7:]).items():
            per_fw[fw].append(dict(r, node=nodes[i].index))
    return per_fw


if __name__ == "__main__":
    main()
