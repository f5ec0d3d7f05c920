"""Heterogeneous data parallelism (issue 12): the benchmark harness, on two emulated clusters whose
accelerators differ in speed 2:1.

    sudo .venv/bin/python benchmarks/bench_hetdp.py              # 3 rounds
    sudo .venv/bin/python benchmarks/bench_hetdp.py --quick      # smoke run: 1 round, short steps

The cluster: "fast" (2 nodes x 1 rank, IB fabric) and "slow" (2 nodes x 1 rank of a part with half the
sustained TFLOPS, RoCE fabric), 25 GbE per node and between the clusters. The emulator shapes the
bandwidths (``--scale``) and the compute: each node's ranks run in a cpu cgroup whose quota and weight
follow the accelerators' sustained FLOP/s (``Emulation(speeds="catalog")``, docs/emulator.md "Compute
speed"), so the slow cluster's ranks compute at about half the rate; the harness measures and prints the
rate each node really got, before and after training.

Configurations, trained side by side in one launch, several rounds, order rotated each round (the tiny
Megatron-Core GPT of the end-to-end benchmark, benchmarks/e2e_setup.py TinyShape, through e2e_worker):

  (i)   ``i-even-dp``         DP=4 across both clusters, every replica global_batch/4 samples: Megatron-Core's
                              own groups, gradients over Ethernet (the even split, as run today).
  (ii)  ``ii-proportional-dp``  SLOT, not run: het_plugin's speed-proportional split (fast replicas more
                              micro-batches). Needs the per-replica micro-batch runtime of issue 12 items 3-5
                              (Plan.replica_micro_batches, per-rank num_microbatches and gradient weights).
  (iii) ``iii-pipeline``      PP=2 across the clusters x DP=2 inside each: het_plugin's placement and
                              per-group transports (DP on each cluster's fabric, the pipeline on Ethernet), the
                              layers split by the stages' speeds (``--layers`` to override).
  (iv)  ``iv-planner``        SLOT, not run: whatever the planner picks once it searches (ii) and mixes; needs
                              the same runtime.

Prints per configuration the median step time (all rounds, after warm-up) and per-round medians, and the
ratios within each round ((iii)/(i)), their median; writes the raw numbers to benchmarks/results/hetdp.json
(quick: a temporary folder). It writes nothing into docs/. Needs root and the cgroup-v1 cpu controller.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from e2e_setup import TinyShape  # noqa: E402
from het_plugin.cluster import Cluster, cluster_from_dict  # noqa: E402
from het_plugin.emulate import Emulation, EmulatorUnavailable  # noqa: E402
from het_plugin.placement import Placement  # noqa: E402
from het_plugin.planner import assemble_plan, make_plan  # noqa: E402
from het_plugin.topology import ParallelDims  # noqa: E402

ETH_GBPS = 25.0
FABRIC_GBPS = 200.0
FAST_PART = "A100-80"
SLOW_PART = {"name": "A100-half", "vendor": "nvidia", "memory_gib": 80, "peak_tflops": 156}   # half of 312
DEFAULT_SCALE = 25.0       # 25 GbE -> 1000 Mbit/s, fabric -> 8000 Mbit/s: the tiny job stays mostly compute-bound

CONFIGS = {
    "i-even-dp": "(i) DP=4 across both clusters, even split (global_batch/4 per replica); gradients over Ethernet",
    "iii-pipeline": "(iii) PP=2 across the clusters x DP=2 inside each, het_plugin's placement and transports, "
                    "layers split by stage speed",
}
# Slots for the configurations that need the per-replica micro-batch runtime (issue 12 items 3-5). They are
# listed, not run: add them to CONFIGS and to configurations() when Plan.replica_micro_batches reaches
# Megatron-Core's schedule (per-rank num_microbatches) and the gradient weights.
SLOTS = {
    "ii-proportional-dp": "(ii) DP=4, micro-batches per replica proportional to speed (het_plugin's split): needs "
                          "Plan.replica_micro_batches in the Megatron runtime (per-rank num_microbatches, gradient "
                          "weights)",
    "iv-planner": "(iv) the planner's pick among (i)-(iii) and mixes: needs the same runtime and the planner's search",
}
PAIRS = {"iii/i": ("iii-pipeline", "i-even-dp")}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def hetdp_cluster() -> Cluster:
    """Two clusters of two one-rank nodes; the slow cluster's part has half the sustained TFLOPS."""
    eth = [{"type": "ethernet", "gbps": ETH_GBPS, "interfaces": ["eth0"]}]
    return cluster_from_dict({
        "name": "hetdp-2to1",
        "clusters": [
            {"name": "fast", "fabric": {"type": "ib", "gbps": FABRIC_GBPS, "latency_us": 2},
             "nodes": [{"count": 2, "accelerator": FAST_PART, "accelerators_per_node": 1, "nics": eth}]},
            {"name": "slow", "fabric": {"type": "roce", "gbps": FABRIC_GBPS, "latency_us": 6},
             "nodes": [{"count": 2, "accelerator": SLOW_PART, "accelerators_per_node": 1, "nics": eth}]}],
        "links": [{"between": ["fast", "slow"], "type": "ethernet", "gbps": ETH_GBPS, "latency_us": 50}]},
        source="<bench hetdp>")


def split_by_speed(num_layers: int, speeds: list[float]) -> list[int]:
    """Layers per stage proportional to the stages' speeds (largest remainder, at least one each)."""
    exact = [num_layers * s / sum(speeds) for s in speeds]
    layers = [max(1, int(x)) for x in exact]
    by_remainder = sorted(range(len(speeds)), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    i = 0
    while sum(layers) < num_layers:
        layers[by_remainder[i % len(speeds)]] += 1
        i += 1
    while sum(layers) > num_layers:
        j = max(range(len(layers)), key=lambda k: layers[k] - exact[k])
        layers[j] -= 1
    return layers


def pipeline_plan(cluster: Cluster, shape: TinyShape, layers_arg, out_dir: Path) -> tuple[Path, dict]:
    """(iii): the planner's PP=2 x DP=2 placement and transports; layers by the stages' speeds (or given)."""
    spec = shape.model_spec()
    planned = make_plan(cluster, spec, tp=1, pp=2, dp=2, micro_batch_size=shape.micro_batch_size)
    dims = ParallelDims(tp=1, cp=1, pp=2, dp=2)
    stage_node = [cluster.node_of(planned.rank_of_logical[s * dims.dp]) for s in range(dims.pp)]
    speeds = [n.accelerator.sustained_flops for n in stage_node]
    layers = list(layers_arg) if layers_arg else split_by_speed(spec.num_layers, speeds)
    placed = Placement(dims, tuple(planned.rank_of_logical), tuple(cluster.domains))
    plan = assemble_plan(cluster, spec, placed, layers, shape.micro_batch_size, overlap_grad_reduce=True)
    path = out_dir / "plan-hetdp-pipeline.json"
    plan.save(path)
    summary = {"stages": [n.cluster for n in stage_node], "layers_per_stage": plan.layers_per_stage,
               "planner_layers_per_stage": planned.layers_per_stage, "rank_of_logical": plan.rank_of_logical,
               "transports": {k: sorted({g.transport for g in v}) for k, v in plan.groups.items() if v},
               "hash": plan.hash}
    return path, summary


def configurations(shape: TinyShape, plan_path: Path) -> list[dict]:
    base = dict(overlap=True, micro_batch_size=shape.micro_batch_size, layers=None, plan=None, ifname="eth0",
                ifnames=None)
    return [dict(base, name="i-even-dp", pp=1),
            dict(base, name="iii-pipeline", pp=2, plan=str(plan_path))]


def summarize(measured: dict, warmup: int) -> dict:
    per_round = {name: [statistics.median(r[warmup:]) for r in rounds] for name, rounds in measured.items()}
    rows = {name: {"median_s": statistics.median(t for r in rounds for t in r[warmup:]), "rounds_s": per_round[name]}
            for name, rounds in measured.items()}
    ratios = {}
    for key, (a, b) in PAIRS.items():
        if a in per_round and b in per_round:
            each = [x / y for x, y in zip(per_round[a], per_round[b])]
            ratios[key] = {"median": statistics.median(each), "rounds": each}
    return {"configs": rows, "ratios": ratios}


def speed_line(cluster: Cluster, rates: list[float]) -> str:
    top = max(rates)
    return ", ".join(f"{n.name} {r / top:.2f}" for n, r in zip(cluster.nodes, rates))


def run(args) -> dict:
    shape = TinyShape()
    cluster = hetdp_cluster()
    results_dir = Path(args.results)
    results_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="het_hetdp_"))
    plan_path, plan_summary = pipeline_plan(cluster, shape, args.layers, results_dir)
    log(f"(iii) plan: stages on {plan_summary['stages']}, layers {plan_summary['layers_per_stage']} (the planner "
        f"alone, without a measured profile: {plan_summary['planner_layers_per_stage']}), ranks "
        f"{plan_summary['rank_of_logical']}, transports {plan_summary['transports']}")
    configs = [c for c in configurations(shape, plan_path) if c["name"] in args.configs]
    job = {"shape": shape.to_dict(), "configs": configs, "rounds": args.rounds, "warmup": args.warmup,
           "steps": args.steps, "results": str(work / "results.json")}
    job_path = work / "job.json"
    job_path.write_text(json.dumps(job))
    env = {"PYTHONPATH": f"{REPO}{os.pathsep}{HERE}", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONWARNINGS": "ignore"}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_start = os.getloadavg()[0]
    t0 = time.monotonic()
    with Emulation(cluster, scale=args.scale, speeds="catalog", cpu_per_rank=args.cpu_per_rank, log=log) as emu:
        log(emu.layout.describe())
        before = emu.compute_rates(1.0)
        log(f"compute rate per node (busy loop, all at once; fastest = 1): {speed_line(cluster, before)}")
        logs = [open(work / f"rank{r}.log", "w") for r in range(emu.layout.world_size)]
        try:
            procs = [
                emu.popen_in(emu.layout.node_of_rank(r).index, [sys.executable, str(HERE / "hetdp_worker.py"),
                                                               str(job_path)],
                             env=dict(env, **emu.rank_env(r)), stdout=logs[r], stderr=subprocess.STDOUT)
                for r in range(emu.layout.world_size)]
            codes = emu.wait(procs, timeout=args.timeout)
        finally:
            for f in logs:
                f.close()
        after = emu.compute_rates(1.0)
        log(f"compute rate per node after training: {speed_line(cluster, after)}")
    if codes != [0] * len(codes):
        for r, code in enumerate(codes):
            print(f"--- rank {r} rc={code}\n{(work / f'rank{r}.log').read_text()[-4000:]}", file=sys.stderr)
        raise SystemExit(f"bench_hetdp: ranks failed: {codes}")
    raw = json.loads((work / "results.json").read_text())
    print((work / "rank0.log").read_text(), file=sys.stderr)
    out = {"started_utc": started, "wall_s": time.monotonic() - t0, "load_average": [load_start, os.getloadavg()[0]],
           "cores": os.cpu_count(), "scale": args.scale, "shape": shape.to_dict(), "quick": args.quick,
           "rounds": args.rounds, "warmup": args.warmup, "steps": args.steps,
           "cpu": [{"node": n.name, "speed": n.cpu.speed, "quota_us": n.cpu.quota_us, "period_us": n.cpu.period_us,
                    "shares": n.cpu.shares} for n in emu.layout.nodes],
           "compute_rates": {"before": before, "after": after},
           "plan": plan_summary, "configs": {c["name"]: CONFIGS[c["name"]] for c in configs}, "slots": SLOTS,
           "measured": raw["step_times"], "losses": raw["losses"], **summarize(raw["step_times"], args.warmup)}
    (results_dir / "hetdp.json").write_text(json.dumps(out, indent=1))
    return out


SPEED_TOLERANCE = 0.25      # every node's measured rate within 25% of its configured speed: the emulation held


def speed_check(out: dict) -> str:
    """Did every node compute at its configured speed relative to the fastest? (a busy machine can break it:
    docs/emulator.md "Compute speed")"""
    want = [c["speed"] for c in out["cpu"]]
    off = []
    for when, rates in out["compute_rates"].items():
        for c, w, r in zip(out["cpu"], want, rates):
            if abs(r / max(rates) - w) > SPEED_TOLERANCE * w:
                off.append(f"{c['node']} {r / max(rates):.2f} {when}")
    configured = ", ".join(f"{c['node']} {c['speed']:.2f}" for c in out["cpu"])
    if not off:
        return f"compute speed check: held (every node within {SPEED_TOLERANCE:.0%} of {configured})"
    return (f"compute speed check: NOT HELD ({'; '.join(off)}; configured {configured}): the machine was too busy "
            "to give the nodes their quotas, so these step times do not show a clean 2:1 speed difference; rerun "
            "on an idle machine")


def table(out: dict) -> str:
    lines = [f"hetdp: 2 clusters x 2 ranks, compute 2:1 (cpu cgroups), scale 1/{out['scale']:g}, {out['rounds']} "
             f"round(s) x {out['steps']} steps after {out['warmup']} warm-up, started {out['started_utc']}, "
             f"load {out['load_average'][0]:.1f} -> {out['load_average'][1]:.1f} on {out['cores']} cores",
             "compute rate per node (fastest = 1): before "
             + ", ".join(f"{r / max(out['compute_rates']['before']):.2f}" for r in out["compute_rates"]["before"])
             + "; after "
             + ", ".join(f"{r / max(out['compute_rates']['after']):.2f}" for r in out["compute_rates"]["after"]),
             speed_check(out), "", f"| configuration | median step (ms) | per round (ms) |", "|---|---:|---|"]
    for name, row in out["configs"].items():
        lines.append(f"| {CONFIGS[name]} | {row['median_s'] * 1e3:.0f} | "
                     + ", ".join(f"{t * 1e3:.0f}" for t in row["rounds_s"]) + " |")
    for name, why in SLOTS.items():
        lines.append(f"| {why} | not run | |")
    lines.append("")
    for key, r in out["ratios"].items():
        lines.append(f"ratio {key}: median {r['median']:.2f} (per round: "
                     + ", ".join(f"{x:.2f}" for x in r["rounds"]) + ")")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: one round, one warm-up step, two steps")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="measured steps per configuration and round")
    p.add_argument("--scale", type=float, default=DEFAULT_SCALE,
                   help=f"real bits per emulated bit (default {DEFAULT_SCALE:g}: 25 GbE -> "
                        f"{ETH_GBPS * 1e3 / DEFAULT_SCALE:g} Mbit/s)")
    p.add_argument("--cpu-per-rank", type=float, default=None,
                   help="the fast cluster's share of a core per rank (default: the emulator's, 75%% of the cores "
                        "for all quotas together)")
    p.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")],
                   help="(iii)'s layers per stage, e.g. 5,3 (default: split by the stages' speeds)")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--results", help="raw results folder (default benchmarks/results; quick: a temporary folder)")
    p.add_argument("--timeout", type=float, default=1500)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup, args.steps = 1, 1, 2
    args.results = args.results or str(Path(tempfile.gettempdir()) / "het_hetdp_quick" if args.quick
                                       else HERE / "results")
    try:
        out = run(args)
    except EmulatorUnavailable as exc:
        print(f"bench_hetdp: {exc}", file=sys.stderr)
        return 3
    print(table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
