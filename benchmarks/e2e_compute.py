"""Compute profile for the end-to-end benchmark: per-layer, embedding and output times of one micro-batch,
measured through the same training code (Megatron-Core schedule, DDP, update) with no communication.

Run as N concurrent single-rank processes (N = the benchmark's ranks, so the CPU is shared as in training):
each trains the tiny GPT with 2 and with 6 layers, each with the benchmark's batch and with twice it, and
also times the embedding and the output layer + loss directly. A least-squares fit of
t(L, m) = per_step + m (per_micro_batch + L per_layer) gives the three; what per_micro_batch holds beyond
the embedding and the output is framework overhead per micro-batch (schedule, hooks), which every pipeline
stage pays: it is added in full to the embedding (first stage) and to the output (last stage) entries (valid for PP=2, where each stage
holds exactly one of them). per_step is the per-step overhead (update, zero-grad, loss all-reduce),
which het_plugin.core.cost does not model on CPU; the benchmark adds it to every prediction and says so.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def small_gpt(shape: dict, num_layers: int):
    """The benchmark's GPT (Megatron-Core's local spec, fp32, CPU) on one rank, with a micro-batch of tokens and
    their positions: (model, tokens, positions)."""
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig
    ps.initialize_model_parallel(1, 1)
    mb, s, h = shape["micro_batch_size"], shape["seq_length"], shape["hidden_size"]
    cfg = TransformerConfig(num_layers=num_layers, hidden_size=h, num_attention_heads=shape["num_attention_heads"],
                            ffn_hidden_size=shape["ffn_hidden_size"], hidden_dropout=0.0, attention_dropout=0.0,
                            use_cpu_initialization=True, pipeline_dtype=torch.float32, params_dtype=torch.float32)
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=shape["vocab_size"], max_sequence_length=s,
                     share_embeddings_and_output_weights=True)
    tokens = torch.randint(0, shape["vocab_size"], (mb, s))
    return model, tokens, torch.arange(s).unsqueeze(0).expand(mb, -1)


def direct_times(shape: dict, reps: int) -> dict:
    import torch
    from megatron.core import parallel_state as ps
    mb, s, h = shape["micro_batch_size"], shape["seq_length"], shape["hidden_size"]
    model, tokens, pos = small_gpt(shape, 1)
    out = {"ef": [], "eb": [], "of": [], "ob": []}

    def head(hidden):
        logits, _ = model.output_layer(model.decoder.final_layernorm(hidden),
                                       weight=model.shared_embedding_or_output_weight())
        return model.compute_language_model_loss(tokens, logits).float().mean()

    for i in range(reps + 2):
        for tag, fwd in (("e", lambda: model.embedding(input_ids=tokens, position_ids=pos).float().sum()),
                         ("o", lambda: head(torch.randn(s, mb, h, requires_grad=True)))):
            t0 = time.perf_counter()
            y = fwd()
            t1 = time.perf_counter()
            y.backward()
            t2 = time.perf_counter()
            model.zero_grad()
            if i >= 2:
                out[tag + "f"].append(t1 - t0)
                out[tag + "b"].append(t2 - t1)
    ps.destroy_model_parallel()
    return {k: statistics.median(v) for k, v in out.items()}


class Barrier:
    """The profile's processes are separate one-rank jobs; a shared TCPStore lines them up before each run,
    so all of them train the same configuration at the same time (the same CPU sharing as in training).
    ``host``: where process 0 serves the store (another address where the processes run in separate network
    namespaces, as bench_hetdp's)."""

    def __init__(self, index: int, count: int, port: int, host: str = "127.0.0.1"):
        from torch.distributed import TCPStore
        self.store = TCPStore(host, port, count, index == 0, wait_for_workers=True)
        self.count, self.n = count, 0

    def wait(self) -> None:
        self.n += 1
        key = f"barrier{self.n}"
        self.store.add(key, 1)
        while int(self.store.add(key, 0)) < self.count:
            time.sleep(0.01)


RUNS = {"t2": (2, 1), "t6": (6, 1), "t2x2": (2, 2), "t6x2": (6, 2)}     # (layers, batch multiple)


def training_runs(shape: dict, rounds: int, steps: int, barrier, runs: dict = RUNS) -> dict:
    """Median step time of single-rank tiny-GPT trainings of each ``runs`` shape (layers, batch multiple), every
    process in step with the others (``barrier``), after a throw-away run."""
    from integration_tests.support import megatron_tiny
    from megatron.core import parallel_state as ps
    times = {k: [] for k in runs}
    # a throw-away run first: the first model of a process pays one-off costs (imports, allocator, buffers)
    megatron_tiny.train(megatron_tiny.TinyGPT(**dict(shape, num_layers=2)), tp=1, pp=1, steps=2, use_plugin=False,
                        overlap_grad_reduce=True)
    ps.destroy_model_parallel()
    megatron_tiny.release_groups()
    for _ in range(rounds):
        for key, (layers, mult) in runs.items():
            barrier.wait()
            cfg = dict(shape, num_layers=layers, global_batch_size=shape["global_batch_size"] * mult)
            res = megatron_tiny.train(megatron_tiny.TinyGPT(**cfg), tp=1, pp=1, steps=steps + 1, use_plugin=False,
                                      overlap_grad_reduce=True)
            times[key] += res.step_times[1:]
            ps.destroy_model_parallel()
            megatron_tiny.release_groups()
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    shape, rounds, steps = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    index, count, port = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    runs = training_runs(shape, rounds, steps, Barrier(index, count, port))
    print("RESULT " + json.dumps({**runs, **direct_times(shape, 10)}), flush=True)


def nonnegative_lstsq(a, b) -> list[float]:
    """Least squares with every coefficient >= 0 (a handful of unknowns: try each set of zeroed ones)."""
    import itertools
    import numpy as np
    n = a.shape[1]
    best, best_res = [0.0] * n, float("inf")
    for k in range(n + 1):
        for free in itertools.combinations(range(n), k):
            x = np.zeros(n)
            if free:
                x[list(free)] = np.linalg.lstsq(a[:, list(free)], b, rcond=None)[0]
            if (x < 0).any():
                continue
            res = float(((a @ x - b) ** 2).sum())
            if res < best_res:
                best, best_res = [float(v) for v in x], res
    return best


def combine(results: list[dict], shape: dict) -> dict:
    """The profile's compute entries from the processes' medians (median over processes).

    Step time t(L, m) = per_step + m * (per_micro_batch + L * per_layer), fitted by least squares to the
    four runs (L = 2, 6; m = M, 2M)."""
    import numpy as np
    med = {k: statistics.median(r[k] for r in results) for k in results[0]}
    m = shape["global_batch_size"] // shape["micro_batch_size"]          # micro-batches per step (DP=1)
    runs = {"t2": (2, m), "t6": (6, m), "t2x2": (2, 2 * m), "t6x2": (6, 2 * m)}
    rows = np.array([[1.0, mm, mm * layers] for layers, mm in runs.values()])
    per_step, per_mb, layer = nonnegative_lstsq(rows, np.array([med[k] for k in runs]))
    bwd_share = 2 / 3                                                    # split fwd:bwd as 1:2
    overhead = max(0.0, float(per_mb) - med["ef"] - med["eb"] - med["of"] - med["ob"])
    return {"layer": [layer * (1 - bwd_share), layer * bwd_share],
            "embedding": [med["ef"] + overhead / 3, med["eb"] + 2 * overhead / 3],
            "output": [med["of"] + overhead / 3, med["ob"] + 2 * overhead / 3],
            "overhead_per_micro_batch": overhead, "overhead_per_step": per_step,
            "steps_s": {k: med[k] for k in runs}, "micro_batches": m,
            "micro_batch_size": shape["micro_batch_size"]}


def measure(shape: dict, procs: int = 4, rounds: int = 2, steps: int = 3, timeout: float = 300) -> dict:
    """Run ``procs`` single-rank processes at once and combine their measurements."""
    import subprocess
    from integration_tests.support.launch import free_port
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", PYTHONPATH=str(repo))
    barrier_port = free_port()
    ps = [subprocess.Popen([sys.executable, __file__, json.dumps(shape), str(rounds), str(steps), str(i), str(procs),
                            str(barrier_port)],
                           env=dict(env, MASTER_PORT=str(free_port())), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True) for i in range(procs)]
    results = []
    for p in ps:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in ps:
                if q.poll() is None:
                    os.killpg(q.pid, 9)
            raise RuntimeError("compute profile timed out")
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"compute profile failed (rc {p.returncode}):\n{err[-3000:]}")
        results.append(json.loads(lines[-1][7:]))
    return combine(results, shape)


if __name__ == "__main__":
    main()
