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
  (ii)  ``ii-proportional-dp``  DP=4 as (i), through het_plugin with a plan whose replica_micro_batches are
                              proportional to the replicas' speeds (fast replicas 2x the slow ones' micro-batches).
  (iii) ``iii-pipeline``      PP=2 across the clusters x DP=2 inside each: het_plugin's placement and
                              per-group transports (DP on each cluster's fabric, the pipeline on Ethernet), the
                              layers split by the stages' speeds (``--layers`` to override).
  (iv)  ``iv-planner``        whatever het_plugin.planner.make_plan picks for this cluster and model, run as is
                              (placement, layers, and replica_micro_batches when the planner sets them).

Every configuration trains the same global batch (GLOBAL_BATCH, which splits 2:1 over the replicas), so
step times compare and the losses must match (i)'s. Prints per configuration the median step time (all
rounds, after warm-up), per-round medians and the predictor's estimate; the ratios within each round
((ii)/(i), (iii)/(i), (iv)/(i), (iv)/best measured, predicted/measured) and their median, against the
issue's goals; writes the raw numbers to benchmarks/results/hetdp.json
(quick: a temporary folder). It writes nothing into docs/. Needs root and the cgroup-v1 cpu controller.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
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
from het_plugin.cost import predict  # noqa: E402
from het_plugin.placement import Placement  # noqa: E402
from het_plugin.plan import Plan  # noqa: E402
from het_plugin.planner import assemble_plan, make_plan  # noqa: E402
from het_plugin.topology import ParallelDims  # noqa: E402

ETH_GBPS = 25.0
FABRIC_GBPS = 200.0
FAST_PART = "A100-80"
SLOW_PART = {"name": "A100-half", "vendor": "nvidia", "memory_gib": 80, "peak_tflops": 156}   # half of 312
DEFAULT_SCALE = 25.0       # 25 GbE -> 1000 Mbit/s, fabric -> 8000 Mbit/s: the tiny job stays mostly compute-bound

# One global batch for every configuration (step times compare, losses match): 48 samples of micro-batch 1 split
# 2:1 over two fast and two slow replicas as 16, 16, 8, 8 micro-batches ((i): 12 each; (iii): 24 per pipeline).
# A multiple of 12 (4 replicas, 2:1). Not smaller: at 12 samples the per-step costs that do not shrink with a
# replica's micro-batches (update, the gradient all-reduce through the slow nodes' throttled cpu quota) hid the
# split ((ii)/(i) 0.97 at 12 against 0.71 at 48 in one quick run each, speed check held); a real job runs many
# micro-batches per replica.
GLOBAL_BATCH = 48

CONFIGS = {
    "i-even-dp": "(i) DP=4 across both clusters, even split (global_batch/4 per replica); gradients over Ethernet",
    "ii-proportional-dp": "(ii) DP=4 across both clusters, het_plugin's split: micro-batches per replica "
                          "proportional to speed",
    "iii-pipeline": "(iii) PP=2 across the clusters x DP=2 inside each, het_plugin's placement and transports, "
                    "layers split by stage speed",
    "iv-planner": "(iv) the planner's pick (make_plan as is)",
}
PAIRS = {"ii/i": ("ii-proportional-dp", "i-even-dp"), "iii/i": ("iii-pipeline", "i-even-dp"),
         "iv/i": ("iv-planner", "i-even-dp")}
# The goals: (ii)/(i) at most 0.75 (ideal 0.67); the planner's pick within 5% of the best measured
# configuration; the predictor within 10% of each measured step.
GOALS = {"ii/i": 0.75, "iv/best": 1.05, "predictor": 0.10}
LOSS_TOLERANCE = 1e-4       # relative: the same global batch and model give (i)'s losses up to float reordering


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


def replica_speeds(cluster: Cluster, plan: Plan) -> list[float]:
    """Each data-parallel replica's speed: its slowest rank's sustained FLOP/s (a replica spans all stages)."""
    slowest = [float("inf")] * plan.dp
    for rank in range(plan.world_size):
        d = plan.replica_of(rank)
        slowest[d] = min(slowest[d], cluster.node_of(rank).accelerator.sustained_flops)
    return slowest


def proportional_counts(cluster: Cluster, plan: Plan) -> list[int]:
    """(ii)'s micro-batches per replica: the global batch's micro-batches proportional to the replicas' speeds."""
    return split_by_speed(plan.dp * plan.num_micro_batches, replica_speeds(cluster, plan))


def proportional_plan(cluster: Cluster, shape: TinyShape, out_dir: Path) -> tuple[Path, dict]:
    """(ii): the planner's DP=4 placement (the even split), with ``replica_micro_batches`` proportional to speed.
    Where make_plan takes the counts (``replica_split=[...]``) it plans them, and its prediction covers them;
    otherwise the counts go into the even plan (``dataclasses.replace``) and the even split's prediction is
    dropped, not kept as if it were (ii)'s."""
    spec = shape.model_spec()
    even = make_plan(cluster, spec, tp=1, pp=1, dp=4, micro_batch_size=shape.micro_batch_size)
    counts = proportional_counts(cluster, even)
    if "replica_split" in inspect.signature(make_plan).parameters:
        plan = make_plan(cluster, spec, tp=1, pp=1, dp=4, micro_batch_size=shape.micro_batch_size,
                         replica_split=counts)
    else:
        plan = dataclasses.replace(even, replica_micro_batches=counts, prediction=None)
    path = out_dir / "plan-hetdp-proportional.json"
    plan.save(path)
    return path, plan_summary(cluster, plan)


def planner_plan(cluster: Cluster, shape: TinyShape, out_dir: Path) -> tuple[Path, dict]:
    """(iv): make_plan's pick for this cluster and model, nothing fixed but the micro-batch size, used as is."""
    plan = make_plan(cluster, shape.model_spec(), micro_batch_size=shape.micro_batch_size)
    path = out_dir / "plan-hetdp-planner.json"
    plan.save(path)
    return path, plan_summary(cluster, plan)


def plan_summary(cluster: Cluster, plan: Plan) -> dict:
    return {"tp": plan.tp, "pp": plan.pp, "dp": plan.dp, "layers_per_stage": plan.layers_per_stage,
            "stages": ["+".join(sorted({cluster.node_of(r).cluster for r in plan.stage_ranks(s)})) for s in range(plan.pp)],
            "replica_micro_batches": plan.replica_counts, "rank_of_logical": plan.rank_of_logical,
            "transports": {k: sorted({g.transport for g in plan.groups[k]}) for k in ("dp", "pp") if plan.groups.get(k)},
            "hash": plan.hash}


def predicted_step(cluster: Cluster, shape: TinyShape, plan: Plan) -> float | None:
    """het_plugin.cost's iteration time for ``plan`` (catalog numbers, no measured profile). An even plan is
    predicted here; an uneven one only by a planner that modelled its counts (the plan's own prediction),
    else None: no prediction is better than the even split's passed off as the uneven one's."""
    if plan.uneven_replicas:
        return plan.prediction.iteration_s if plan.prediction is not None else None
    dims = ParallelDims(tp=plan.tp, cp=plan.cp, pp=plan.pp, dp=plan.dp)
    placed = Placement(dims, tuple(plan.rank_of_logical), tuple(cluster.domains))
    # as the runs train: Megatron's plain optimizer (megatron_tiny), not the distributed one the planner assumes
    return predict(cluster, shape.model_spec(), placed, plan.layers_per_stage, plan.micro_batch_size,
                   overlap_grad_reduce=plan.overlap_grad_reduce, distributed_optimizer=False).iteration_s


def even_dp_plan(cluster: Cluster, shape: TinyShape) -> Plan:
    """(i)'s shape as a plan (DP=4, even, gradients over Ethernet): what the predictor reads for (i), which
    itself runs on Megatron-Core's own groups."""
    return make_plan(cluster, shape.model_spec(), tp=1, pp=1, dp=4, micro_batch_size=shape.micro_batch_size)


def configurations(shape: TinyShape, plan_paths: dict[str, Path]) -> list[dict]:
    """What the ranks run: (i) without het_plugin, the others from their plan files (``plan_paths``)."""
    base = dict(overlap=True, micro_batch_size=shape.micro_batch_size, layers=None, plan=None, ifname="eth0",
                ifnames=None)
    out = [dict(base, name="i-even-dp", pp=1)]
    for name in ("ii-proportional-dp", "iii-pipeline", "iv-planner"):
        if name in plan_paths:
            path = plan_paths[name]
            out.append(dict(base, name=name, pp=Plan.load(path).pp, plan=str(path)))
    return out


def loss_check(losses: dict) -> dict[str, float]:
    """Largest relative difference of each configuration's losses from (i)'s (the same math: one global batch)."""
    ref = losses.get("i-even-dp")
    if not ref:
        return {}
    return {name: max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, ref))
            for name, got in losses.items() if name != "i-even-dp" and got}


def summarize(measured: dict, warmup: int, predicted: dict | None = None) -> dict:
    """Medians, per-round medians, the ratios within each round and their median: PAIRS, the planner's pick
    against the best measured configuration of the same round, and predicted / measured per configuration."""
    predicted = predicted or {}
    per_round = {name: [statistics.median(r[warmup:]) for r in rounds] for name, rounds in measured.items()}
    rows = {name: {"median_s": statistics.median(t for r in rounds for t in r[warmup:]), "rounds_s": per_round[name],
                   "predicted_s": predicted.get(name)}
            for name, rounds in measured.items()}
    ratios = {}

    def add(key: str, each: list[float]) -> None:
        ratios[key] = {"median": statistics.median(each), "rounds": each}

    for key, (a, b) in PAIRS.items():
        if a in per_round and b in per_round:
            add(key, [x / y for x, y in zip(per_round[a], per_round[b])])
    if "iv-planner" in per_round and len(per_round) > 1:
        rounds = range(len(per_round["iv-planner"]))
        add("iv/best", [per_round["iv-planner"][i] / min(r[i] for r in per_round.values()) for i in rounds])
    for name, times in per_round.items():
        if predicted.get(name):
            add(f"predicted/{name}", [predicted[name] / t for t in times])
    return {"configs": rows, "ratios": ratios}


def goal_marks(ratios: dict) -> list[str]:
    """The issue's goals, each met or missed by the run's median ratio (or not assessed)."""
    out = []
    for key, label in (("ii/i", "(ii)/(i) <= 0.75 (ideal 0.67)"),
                       ("iv/best", "the planner's pick within 5% of the best measured")):
        r = ratios.get(key)
        out.append(f"goal {label}: " + ("not assessed (not run)" if r is None else
                                        f"{'met' if r['median'] <= GOALS[key] else 'missed'} ({r['median']:.2f})"))
    pred = {k.split("/", 1)[1]: r["median"] for k, r in ratios.items() if k.startswith("predicted/")}
    if pred:
        off = {name: abs(r - 1) for name, r in pred.items()}
        out.append(f"goal the predictor within 10% of each measured step: "
                   f"{'met' if max(off.values()) <= GOALS['predictor'] else 'missed'} ("
                   + ", ".join(f"{name} {r:.3g}" for name, r in pred.items()) + ")")
    else:
        out.append("goal the predictor within 10% of each measured step: not assessed (no prediction)")
    return out


def speed_line(cluster: Cluster, rates: list[float]) -> str:
    top = max(rates)
    return ", ".join(f"{n.name} {r / top:.2f}" for n, r in zip(cluster.nodes, rates))


def build_plans(cluster: Cluster, shape: TinyShape, layers_arg, out_dir: Path) -> tuple[dict, dict, dict]:
    """Every configuration's plan file (except (i), which runs without het_plugin), a summary of each plan and
    the predictor's step time for each configuration (None where the predictor does not model the plan)."""
    paths, summaries = {}, {}
    paths["iii-pipeline"], summaries["iii-pipeline"] = pipeline_plan(cluster, shape, layers_arg, out_dir)
    paths["ii-proportional-dp"], summaries["ii-proportional-dp"] = proportional_plan(cluster, shape, out_dir)
    paths["iv-planner"], summaries["iv-planner"] = planner_plan(cluster, shape, out_dir)
    predicted = {"i-even-dp": predicted_step(cluster, shape, even_dp_plan(cluster, shape))}
    for name, path in paths.items():
        predicted[name] = predicted_step(cluster, shape, Plan.load(path))
    return paths, summaries, predicted


def run(args) -> dict:
    shape = TinyShape(global_batch_size=args.global_batch)
    cluster = hetdp_cluster()
    results_dir = Path(args.results)
    results_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="het_hetdp_"))
    plan_paths, plans, predicted = build_plans(cluster, shape, args.layers, results_dir)
    pipe = plans["iii-pipeline"]
    log(f"(iii) plan: stages on {pipe['stages']}, layers {pipe['layers_per_stage']} (the planner "
        f"alone, without a measured profile: {pipe['planner_layers_per_stage']}), ranks "
        f"{pipe['rank_of_logical']}, transports {pipe['transports']}")
    for name in ("ii-proportional-dp", "iv-planner"):
        pl = plans[name]
        log(f"{name} plan: tp {pl['tp']} pp {pl['pp']} dp {pl['dp']}, stages on {pl['stages']}, layers "
            f"{pl['layers_per_stage']}, micro-batches per replica {pl['replica_micro_batches']}, ranks "
            f"{pl['rank_of_logical']}, transports {pl['transports']}")
    configs = [c for c in configurations(shape, plan_paths) if c["name"] in args.configs]
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
           "plans": plans, "predicted_s": predicted, "configs": {c["name"]: CONFIGS[c["name"]] for c in configs},
           "measured": raw["step_times"], "losses": raw["losses"], "loss_vs_i": loss_check(raw["losses"]),
           **summarize(raw["step_times"], args.warmup, predicted)}
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
             speed_check(out), f"global batch {out['shape']['global_batch_size']} for every configuration; "
             "predictions: het_plugin.cost with the catalog's numbers (no profile measured in the emulator)", "",
             "| configuration | median step (ms) | per round (ms) | predicted (ms) | losses vs (i) |",
             "|---|---:|---|---:|---|"]
    for name, row in out["configs"].items():
        pred = row.get("predicted_s")
        diff = out.get("loss_vs_i", {}).get(name)
        same = ("reference" if name == "i-even-dp" else "not compared" if diff is None else
                f"{'match' if diff <= LOSS_TOLERANCE else 'DIFFER'} (max rel. diff {diff:.1e})")
        lines.append(f"| {CONFIGS[name]} | {row['median_s'] * 1e3:.0f} | "
                     + ", ".join(f"{t * 1e3:.0f}" for t in row["rounds_s"])
                     + f" | {'not modelled' if pred is None else f'{pred * 1e3:.3g}'} | {same} |")
    lines.append("")
    for key, r in out["ratios"].items():
        lines.append(f"ratio {key}: median {r['median']:.3g} (per round: "
                     + ", ".join(f"{x:.3g}" for x in r["rounds"]) + ")")
    lines.extend(goal_marks(out["ratios"]))
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
    p.add_argument("--global-batch", type=int, default=GLOBAL_BATCH,
                   help=f"samples per step for every configuration (default {GLOBAL_BATCH}); a multiple of 12, so "
                        "that four replicas split it evenly and two fast and two slow ones 2:1")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--results", help="raw results folder (default benchmarks/results; quick: a temporary folder)")
    p.add_argument("--timeout", type=float, default=1500)
    args = p.parse_args(argv)
    if args.global_batch < 12 or args.global_batch % 12:
        p.error(f"--global-batch {args.global_batch}: needs a positive multiple of 12 (4 replicas, split 2:1 as "
                "2n, 2n, n, n micro-batches of 1 sample)")
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
