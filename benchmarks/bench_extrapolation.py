"""Compute extrapolation on this machine's CPU (issue 23, item 4): does a profile measured at micro-batch 1
predict a layer at micro-batch 1-32 and TP 1-2?

    python benchmarks/bench_extrapolation.py             (a few minutes on 2 busy cores)
    python benchmarks/bench_extrapolation.py --quick     (fewer repeats: a smoke run)

What it does, side by side in one process tree:

1. The CPU's "peak": a single-thread fp32 1024^3 GEMM's FLOP rate (median of repeats), written as a cluster
   file's accelerator ``{peak_tflops: that, efficiency: 0.5}`` (0.5: the project's default for a part the
   catalog lacks; the table also shows 0.8 as a sensitivity line, not a tuned value).
2. One decoder layer (het_plugin.tools.profiler.layers.Block, the layer ``het-plugin profile`` times on a CPU) at
   micro-batch 1, 2, 4, 8, 16, 32, TP 1 (one process, one thread) and TP 2 (two processes on loopback gloo, one
   thread each), forward and backward, in two independent passes: the *profile* pass and the *measured* pass
   the predictions are held against, their rounds alternating (no sample shared). Each point is the median of
   a pass's rounds; a round visits every size (so load changes spread over all of them); the load average is
   recorded before, between TP 1 and TP 2, and after.
3. Predictions of the measured pass through the cost model's own path (``core.cost.stage._compute_s``), from
   * a micro-batch-1 profile (TP 1 only, plus the loopback link a profile measures): *before* = the old rule
     (linear through the origin; TP 2 analytic), *after* = het_plugin.core.inputs.compute_curve (fixed + per-sample
     bounded by the roofline; TP 2 scaled from TP 1);
   * a full TP-1 profile (every size; TP 2 extrapolated) and a full TP-1+2 profile (every point measured:
     the error here is the machine's run-to-run noise).

The machine is shared (8 agents on 2 cores, load averages of 30+ seen): times are the process's CPU seconds
(``time.process_time``), not wall time; numbers still move between runs (caches, clock); medians and the load
are reported.
Results: benchmarks/results/extrapolation.json, the table in docs/planner.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch                                   # noqa: E402
import torch.distributed as dist               # noqa: E402
import torch.multiprocessing as mp             # noqa: E402

from het_plugin.core import cost                                     # noqa: E402
from het_plugin.core.cost.stage import _compute_s                     # noqa: E402
from het_plugin.core.inputs.cluster import cluster_from_dict          # noqa: E402
from het_plugin.core.inputs.compute_curve import Analytic, curve_at   # noqa: E402
from het_plugin.core.inputs.model import ModelSpec                    # noqa: E402
from het_plugin.core.inputs.profile import Profile                    # noqa: E402
from het_plugin.core.ranks.dims import ParallelDims                   # noqa: E402
from het_plugin.core.ranks.placement import place                     # noqa: E402
from het_plugin.tools.profiler import layers                          # noqa: E402

SIZES = (1, 2, 4, 8, 16, 32)
MODEL = ModelSpec(name="cpu-small", num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=1024,
                  seq_length=32, global_batch_size=64, dtype="fp32")
LINK_BYTES = (4096, 16384, 65536, 262144, 1048576)   # each TP rank's all-reduce share (act / tp) spans these
RESULTS = ROOT / "benchmarks" / "results" / "extrapolation.json"
# CPU seconds of this process (every thread: torch's one compute thread and gloo's), not wall time: at a load
# average of 30 on 2 cores wall time measures the scheduler; CPU time is what the layer costs an idle core.
# A rank waiting for its peer in an all-reduce does not count (gloo's own copying and syscalls do).
clock = time.process_time


def gemm_tflops(repeats: int) -> float:
    torch.set_num_threads(1)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    rates = []
    for _ in range(repeats):
        t0 = clock()
        a @ b
        rates.append(2 * 1024 ** 3 / (clock() - t0))
    return statistics.median(rates) / 1e12


def reps_for(mb: int, quick: bool) -> int:
    return max(2, (24 if quick else 48) // mb)


def time_layer(block, mb: int, reps: int, group) -> tuple[float, float]:
    """Mean forward and backward of ``reps`` repetitions after one warm-up (TP ranks in step: same counts)."""
    x = torch.randn(mb, MODEL.seq_length, MODEL.hidden_size, requires_grad=True)
    grad = torch.randn(mb, MODEL.seq_length, MODEL.hidden_size)
    block(x).backward(grad)
    fwd = bwd = 0.0
    for _ in range(reps):
        if group is not None:
            dist.barrier(group)
        t0 = clock()
        out = block(x)
        t1 = clock()
        out.backward(grad)
        t2 = clock()
        fwd, bwd = fwd + t1 - t0, bwd + t2 - t1
    block.zero_grad(set_to_none=True)
    return fwd / reps, bwd / reps


def two_passes(block, rounds: int, quick: bool, group) -> tuple[dict, dict]:
    """The profile pass and the measured pass: each size's median (forward, backward) over the even rounds and
    over the odd ones. A round visits every size; alternating the rounds keeps the machine's load drift (it
    changed 45 -> 65 over one run) out of the comparison without sharing a sample between the two."""
    seen: dict[int, list] = {mb: [] for mb in SIZES}
    for _ in range(2 * rounds):
        for mb in SIZES:
            seen[mb].append(time_layer(block, mb, reps_for(mb, quick), group))

    def median(v):
        return statistics.median(f for f, _ in v), statistics.median(b for _, b in v)
    return ({mb: median(v[0::2]) for mb, v in seen.items()}, {mb: median(v[1::2]) for mb, v in seen.items()})


def allreduce_link(group, repeats: int) -> list[tuple[int, float]]:
    """The loopback 'local' link as a profile holds it: (message bytes, Gbit/s) of one ring step, from the
    two-rank all-reduce of twice that many bytes (2 steps of bytes/2 each: T = 2 x step)."""
    out = []
    for nbytes in LINK_BYTES:
        t = torch.zeros(2 * nbytes // 4)
        dist.all_reduce(t, group=group)
        times = []
        for _ in range(repeats):
            dist.barrier(group)
            t0 = clock()
            dist.all_reduce(t, group=group)
            times.append(clock() - t0)
        step = statistics.median(times) / 2
        out.append((nbytes, nbytes * 8 / step / 1e9))
    return out


def tp2_worker(rank: int, port: int, rounds: int, quick: bool, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        block = layers.build("layer", MODEL, 2, rank, dist.group.WORLD)
        link = allreduce_link(dist.group.WORLD, 5 if quick else 11)
        first, second = two_passes(block, rounds, quick, dist.group.WORLD)
        queue.put((rank, {"link": link, "profile": first, "measured": second}))
    finally:
        dist.destroy_process_group()


def measure(rounds: int, quick: bool) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    load = {"before": os.getloadavg()[0]}
    peak = gemm_tflops(5 if quick else 11)
    block = layers.build("layer", MODEL, 1, 0, None)
    tp1_profile, tp1_measured = two_passes(block, rounds, quick, None)
    load["middle"] = os.getloadavg()[0]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 2000
    procs = [ctx.Process(target=tp2_worker, args=(r, port, rounds, quick, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    load["after"] = os.getloadavg()[0]
    r0, r1 = got[0], got[1]
    worst = lambda a, b: {mb: (max(a[mb][0], b[mb][0]), max(a[mb][1], b[mb][1])) for mb in SIZES}   # noqa: E731
    return {"peak_tflops": peak, "load_avg_1min": load,
            "rounds": rounds, "cpus": os.cpu_count(),
            "link": r0["link"],
            "profile": {1: tp1_profile, 2: worst(r0["profile"], r1["profile"])},
            "measured": {1: tp1_measured, 2: worst(r0["measured"], r1["measured"])}}


# ---- predictions -------------------------------------------------------------------------------------------


def cluster_and_tier(peak_tflops: float, efficiency: float):
    cluster = cluster_from_dict({"name": "cpu", "clusters": [{
        "name": "cpu", "fabric": {"type": "ethernet", "gbps": 10, "latency_us": 50},
        "nodes": [{"count": 1, "accelerators_per_node": 2,
                   "accelerator": {"name": "cpu", "vendor": "other", "memory_gib": 64, "peak_tflops": peak_tflops,
                                   "efficiency": efficiency}}]}]})
    analysis = cost.analyze(cluster, place(cluster, ParallelDims(tp=2, pp=1, dp=1)))
    return analysis.stages[0].accelerators[0], analysis.stages[0].tp_tier


def make_profile(points: dict, sizes_by_tp: dict, link) -> Profile:
    prof = Profile(description="bench_extrapolation")
    for tp, sizes in sizes_by_tp.items():
        for mb in sizes:
            f, b = points[tp][mb]
            prof.add_compute("cpu", "layer", mb, tp, f, b)
    prof.add_link("local", [(b, g) for b, g in link])
    return prof


def predict(acc, tier, prof: Profile, mb: int, tp: int) -> float:
    f, b = _compute_s(acc, "layer", MODEL, mb, tp, 1, tier, prof)
    return f + b


def predict_before(acc, tier, prof: Profile, mb: int, tp: int) -> float:
    """The rule before issue 23: a curve's points linear through the origin when one point (the fixed +
    per-sample fit, unbounded, with several); a TP degree without a curve analytic."""
    curve = prof.curve("cpu", "layer", tp)
    if curve:
        sizes = [c.micro_batch_size for c in curve]
        return (curve_at(sizes, [c.forward_s for c in curve], mb) + curve_at(sizes, [c.backward_s for c in curve], mb))
    a = Analytic(*_compute_s(acc, "layer", MODEL, mb, tp, 1, tier, prof, apart=True))
    return 3 * a.compute_fwd_s + 2 * a.comm_s


def errors(data: dict, efficiency: float) -> dict:
    acc, tier = cluster_and_tier(data["peak_tflops"], efficiency)
    meas = {tp: {mb: sum(data["measured"][tp][mb]) for mb in SIZES} for tp in (1, 2)}
    profiles = {"mb1": make_profile(data["profile"], {1: (1,)}, data["link"]),
                "full_tp1": make_profile(data["profile"], {1: SIZES}, data["link"]),
                "full": make_profile(data["profile"], {1: SIZES, 2: SIZES}, data["link"])}
    out = {}
    for name, prof in profiles.items():
        for rule, fn in (("before", predict_before), ("after", predict)):
            rows = {}
            for tp in (1, 2):
                for mb in SIZES:
                    p = fn(acc, tier, prof, mb, tp)
                    rows[f"tp{tp} mb{mb}"] = {"predicted_s": p, "measured_s": meas[tp][mb],
                                              "error": (p - meas[tp][mb]) / meas[tp][mb]}
            out[f"{name} {rule}"] = rows
    return out


def mean_abs(rows: dict, tp=None) -> float:
    vals = [abs(r["error"]) for k, r in rows.items() if tp is None or k.startswith(f"tp{tp} ")]
    return sum(vals) / len(vals)


GLOBAL_BATCH = 32      # samples per iteration over the machine's 2 devices, for the choice below


def plan_times(rows: dict, key: str) -> dict[str, float]:
    """The plans these points make for a global batch of GLOBAL_BATCH on 2 devices: TP 1 (2 replicas, 16 samples
    each) or TP 2 (one replica), each at every micro-batch size; compute seconds per iteration (the data-parallel
    all-reduce, equal for the TP-1 plans, left out). ``key``: predicted_s or measured_s."""
    out = {}
    for name, r in rows.items():
        tp, mb = (int(x[2:]) for x in name.split(" "))
        out[name] = (GLOBAL_BATCH // (2 // tp)) / mb * r[key]
    return out


def pick_loss(rows: dict) -> tuple[str, str, float]:
    """(the plan the predictions pick, the best measured plan, how much slower the pick measured than the best)."""
    predicted, measured = plan_times(rows, "predicted_s"), plan_times(rows, "measured_s")
    pick, best = min(predicted, key=predicted.get), min(measured, key=measured.get)
    return pick, best, measured[pick] / measured[best] - 1


def table(data: dict, results: dict) -> str:
    lines = [f"peak (1-thread fp32 GEMM) {data['peak_tflops'] * 1e3:.1f} GFLOPS; load average (1 min) "
             + ", ".join(f"{k} {v:.1f}" for k, v in data["load_avg_1min"].items()) + f" on {data['cpus']} CPUs; "
             f"median of {data['rounds']} rounds per pass (passes: {data.get('protocol', 'alternating')}); CPU seconds "
             "(process_time)",
             "", "| profile | rule | efficiency | TP 1 mean abs | TP 2 mean abs | all | worst point | pick (best measured): "
                 "slower by |",
             "|---|---|---|---|---|---|---|---|"]
    for (eff, res) in results.items():
        for key, rows in res.items():
            name, rule = key.split(" ")
            worst_k = max(rows, key=lambda k: abs(rows[k]["error"]))
            pick, best, loss = pick_loss(rows)
            lines.append(f"| {name} | {rule} | {eff} | {mean_abs(rows, 1):.1%} | {mean_abs(rows, 2):.1%} | "
                         f"{mean_abs(rows):.1%} | {worst_k}: {rows[worst_k]['error']:+.0%} | {pick} ({best}): "
                         f"{loss:.1%} |")
    lines += ["", f"pick: the plan (TP degree, micro-batch size) with the least predicted compute per iteration for "
              f"{GLOBAL_BATCH} samples on 2 devices (TP 1: two replicas of 16; TP 2: one of 32), measured against the "
              "best measured plan of the same 12"]
    meas = data["measured"]
    lines += ["", "measured fwd+bwd per layer (ms), per sample (ms): "
              + "; ".join(f"tp{tp} mb{mb} {sum(meas[tp][mb]) * 1e3:.2f} ({sum(meas[tp][mb]) * 1e3 / mb:.2f})"
                          for tp in (1, 2) for mb in SIZES)]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--from-json", help="recompute the table from a saved run")
    ap.add_argument("--out", default=str(RESULTS), help=f"where the run is written (default {RESULTS})")
    args = ap.parse_args()
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())["data"]
        for part in ("profile", "measured"):
            data[part] = {int(tp): {int(mb): tuple(v) for mb, v in pts.items()} for tp, pts in data[part].items()}
    else:
        data = measure(args.rounds or (2 if args.quick else 6), args.quick)
    results = {eff: errors(data, eff) for eff in (0.5, 0.8)}
    print(table(data, results))
    if not args.quick and not args.from_json:
        Path(args.out).write_text(json.dumps({"data": data, "results": {str(k): v for k, v in results.items()}},
                                             indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
