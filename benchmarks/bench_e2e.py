"""End-to-end benchmark: real Megatron-Core training of a small GPT on an emulated Holmes-shaped cluster.

    sudo .venv/bin/python benchmarks/bench_e2e.py            # full run (~12 min on an idle 2-core machine)
    sudo .venv/bin/python benchmarks/bench_e2e.py --quick    # smoke run (one ratio, one round)
    sudo .venv/bin/python benchmarks/bench_e2e.py --framework both --ratios 10 --rounds 2   # + DeepSpeed
    sudo .venv/bin/python benchmarks/bench_e2e.py --framework interleaved --ratios 10       # + interleaved (vpp)

Two clusters (IB, RoCE; two nodes each, one rank per node), each with its own fast fabric, joined only by
Ethernet. Six configurations run side by side in one launch, several rounds interleaved, per fast:slow
ratio; each gets the predictor's estimate from a profile measured here. Writes the table to
docs/benchmark-e2e.md (between the RESULTS markers), the chart to docs/img/e2e.png, and the raw numbers,
profiles and plans to benchmarks/results/. Needs root (network namespaces); see docs/emulator.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
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

import e2e_compute  # noqa: E402
from e2e_plans import (ALL_CONFIGS, CONFIGS, DS_CONFIGS, FAST_LINKS, LINKS, VPP_CONFIGS, calibrate_pipeline_overhead,  # noqa: E402
                       predict_configs, setup_ratio, with_pipeline_overhead)
from e2e_setup import ETH_GBPS, REAL_JOB, TinyShape, derive_scale, mixed_cluster  # noqa: E402
from het_plugin.tools.emulate import Emulation, EmulatorUnavailable, ExtraNetwork  # noqa: E402

CALIBRATION_MBIT = 20_000      # the reference network "unshaped" for the calibration run
# The emulated Ethernet rate, fixed so that runs compare (derived from each run's measured compute it moved
# between 68 and 122 Mbit/s over four runs, and the ratios with it); --derive-eth-rate derives it instead.
# The rate that would give the real job's proportions is printed beside it either way.
FIXED_ETH_MBIT = 100.0
CALIBRATE = "calibrate"        # a round's visit to the calibration run (the others are ratios)
GOALS = {"4/3": 0.60, "4/1": 1.15, "4/2": 0.55, "5v/1": 1.05}
PAIRS = {"4/3": ("4-het_plugin", "3-mixed-today"), "4/1": ("4-het_plugin", "1-all-fast"),
         "4/2": ("4-het_plugin", "2-all-eth"), "4p/3": ("4p-placement", "3-mixed-today"),
         "4t/3": ("4t-place+transport", "3-mixed-today"), "4-ds/3-ds": ("4-ds", "3-ds"),
         "3-ds/3": ("3-ds", "3-mixed-today"), "4-ds/4": ("4-ds", "4-het_plugin"),
         # interleaved: het_plugin with vpp against the all-fast reference (the goal), against the all-fast
         # reference with the same interleaving (what the slow hop still costs), and against 1F1B
         "5v/1": ("5-het_plugin+vpp", "1-all-fast"), "5v/1v": ("5-het_plugin+vpp", "1v-all-fast+vpp"),
         "5v/4": ("5-het_plugin+vpp", "4-het_plugin"), "1v/1": ("1v-all-fast+vpp", "1-all-fast")}
FRAMEWORK_CONFIGS = {"megatron": list(CONFIGS), "deepspeed": list(DS_CONFIGS),
                     "both": ["3-mixed-today", "4-het_plugin", "3-ds", "4-ds"],
                     "interleaved": ["1-all-fast", "4-het_plugin", *VPP_CONFIGS]}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Parent:
    """Answers the rank-0 handshake: rates, plans, configurations; collects results."""

    def __init__(self, emu: Emulation, args, shape: TinyShape, results_dir: Path, compute: dict, scale: dict):
        self.emu, self.args, self.shape, self.results_dir = emu, args, shape, results_dir
        # Rounds outermost, the ratios rotated in each: a drift over the run (load, anything that builds up in
        # the ranks) spreads over every ratio instead of growing with the ratio that happens to run last.
        # The calibration run (see "calibration") comes back in every round too, first: the predictions are made
        # again at the end from its median over the rounds (a steadier fit, in the rounds' own conditions).
        self.visits = [(rnd, visit) for rnd in range(args.rounds)
                       for visit in ([CALIBRATE] if not args.no_calibration else [])
                       + args.ratios[rnd % len(args.ratios):] + args.ratios[:rnd % len(args.ratios)]]
        self.calibration_config = None
        self.ref_link = None
        self.round_calibrations: list[float] = []     # per round: median step after warm-up
        self.round = 0
        self.compute = compute
        self.scale = scale
        self.eth_links = None
        self.current = None
        self.setups = {}
        self.measured = {}
        self.losses = {}

    def handle(self, name: str, payload):
        if name == "calibrate":
            if self.args.no_calibration:
                return {}
            self.emu.set_rate("ref0", CALIBRATION_MBIT)
            log(f"calibration: PP{2}xDP{2} on an unshaped reference network ({CALIBRATION_MBIT} Mbit/s) ...")
            config = dict(pp=2, overlap=True, micro_batch_size=self.shape.micro_batch_size, layers=None, plan=None,
                          ifname="ref0", ifnames=None, name="calibration")
            self.calibration_config = config
            return {"config": config, "rounds": self.args.calibration_rounds}
        if name == "calibration" and "round" in payload:
            self.round_calibrations.append(statistics.median(payload["step_times"][0][self.args.warmup:]))
            log(f"round {payload['round']}: calibration step {self.round_calibrations[-1] * 1e3:.0f} ms")
            return {}
        if name == "calibration":
            self.ref_link = payload["link"]
            steps = [t for r in payload["step_times"] for t in r[self.args.warmup:]]
            measured = statistics.median(steps)
            x = calibrate_pipeline_overhead(self.shape, self.compute, payload["link"], measured)
            self.compute_base = self.compute
            self.compute = with_pipeline_overhead(self.compute, x)
            self.compute["calibration_step_s"] = measured
            log(f"calibration step {measured * 1e3:.0f} ms -> pipelined code path costs {x * 1e3:+.1f} ms per "
                "micro-batch and stage beyond the single-rank profile")
            # the proportions as the pipeline's compute really is (a fixed rate stays, its proportions follow)
            self.scale = scale_for(self.shape, self.compute, self.args.eth_mbit)
            self.emu.set_rate("eth0", self.scale["eth_mbit"])
            log(f"Ethernet -> {self.scale['eth_mbit']:.1f} Mbit/s (scale 1/{self.scale['scale']:.0f}; the real job's "
                f"proportions would need {self.scale['derived_eth_mbit']:.1f})")
            return {}
        if name == "next":
            if not self.visits:
                return {"done": True}
            self.round, visit = self.visits.pop(0)
            if visit == CALIBRATE:
                self.emu.set_rate("ref0", CALIBRATION_MBIT)
                return {"calibrate": self.calibration_config, "round": self.round}
            self.current = visit
            fast = self.current * self.scale["eth_mbit"]
            self.emu.set_rate("fab0", fast)
            self.emu.set_rate("ref0", fast)
            log(f"round {self.round}, ratio {self.current:g}:1: fabric {fast:.0f} Mbit/s, Ethernet "
                f"{self.scale['eth_mbit']:.0f} Mbit/s")
            if self.current in self.setups:          # set up on its first visit: links measured, plans made
                return {"measure": [], "round": self.round}
            measure = FAST_LINKS + ([] if self.eth_links else ["eth", "inter"])
            return {"measure": measure, "round": self.round}
        if name == "links":
            if self.current in self.setups:
                return {"configs": [c for c in self.setups[self.current].configs if c["name"] in self.args.configs]}
            if "eth" in payload:
                self.eth_links = {k: payload[k] for k in ("eth", "inter")}
            links = dict(payload, **self.eth_links)
            log("links (largest message; latency): " + ", ".join(
                f"{k} {v['bandwidth'][-1][1] * 1e3:.0f} Mbit/s, {v['latency_us']:.0f} us" for k, v in links.items()))
            st = setup_ratio(self.current, self.shape, self.compute, links, self.results_dir)
            st.links = links
            self.setups[self.current] = st
            log(f"plan: layers {st.plan_summary['layers_per_stage']}, ranks {st.plan_summary['rank_of_logical']}, "
                f"transports {st.plan_summary['transports']}")
            configs = [c for c in st.configs if c["name"] in self.args.configs]
            return {"configs": configs}
        if name == "results":
            measured = self.measured.setdefault(self.current, {})
            for cfg, rounds in payload["step_times"].items():
                measured.setdefault(cfg, []).extend(rounds)
            self.losses[self.current] = payload["losses"]
            if len(next(iter(measured.values()))) == self.args.rounds:
                self.report_ratio(self.current)
            return {}
        raise RuntimeError(f"unknown request {name}")

    def repredict(self) -> None:
        """Every prediction again, with the pipelined code path's cost fitted to the median of the rounds'
        calibration runs instead of the one at the start (kept as ``predictions_start``): the same plans, the
        links measured at each ratio."""
        if not self.round_calibrations or self.ref_link is None:
            return
        measured = statistics.median(self.round_calibrations)
        x = calibrate_pipeline_overhead(self.shape, self.compute_base, self.ref_link, measured)
        compute = with_pipeline_overhead(self.compute_base, x)
        for ratio, st in self.setups.items():
            st.predictions_start = dict(st.predictions)
            st.predictions, st.compute_share = predict_configs(ratio, self.shape, compute, st.links, st.plan,
                                                               st.plan_vpp)
        self.compute["rounds_calibration_step_s"] = self.round_calibrations
        self.compute["rounds_pipeline_overhead_per_micro_batch"] = x
        log(f"calibration over the rounds: median step {measured * 1e3:.0f} ms (rounds: "
            + ", ".join(f"{t * 1e3:.0f}" for t in self.round_calibrations)
            + f") -> {x * 1e3:+.1f} ms per micro-batch and stage; predictions made again")

    def report_ratio(self, ratio: float) -> None:
        rows = summarize(ratio, self.measured[ratio], self.setups[ratio], self.args.warmup)
        for r in rows["configs"]:
            log(f"  {r['name']:<20} {r['median_s'] * 1e3:8.1f} ms  predicted {r['predicted_s'] * 1e3:8.1f} ms "
                f"({r['error'] * 100:+.0f}%)")
        log("  " + "  ".join(f"{k} {v:.2f}" for k, v in rows["ratios"].items()))


def summarize(ratio: float, measured: dict, setup, warmup: int) -> dict:
    """Median step time per config (all rounds, after warm-up); ratios per round, then their median."""
    per_round = {name: [statistics.median(r[warmup:]) for r in rounds] for name, rounds in measured.items()}
    configs = []
    for name, rounds in measured.items():
        steps = [t for r in rounds for t in r[warmup:]]
        med = statistics.median(steps)
        pred = setup.predictions[name]
        configs.append({"name": name, "median_s": med, "rounds_s": per_round[name], "predicted_s": pred,
                        "error": (pred - med) / med, "compute_share": setup.compute_share[name],
                        "predicted_start_s": setup.predictions_start.get(name)})
    ratios, spread = {}, {}
    for key, (a, b) in PAIRS.items():
        if a in per_round and b in per_round:
            each = [x / y for x, y in zip(per_round[a], per_round[b])]
            ratios[key] = statistics.median(each)
            spread[key] = [min(each), max(each)]
    return {"ratio": ratio, "configs": configs, "ratios": ratios, "ratio_spread": spread}


def scale_for(shape: TinyShape, compute: dict, eth_mbit: float | None = None) -> dict:
    """The emulated Ethernet rate: ``eth_mbit``, or (None) the one that gives the tiny job the real job's dp_eth
    (see e2e_setup); the proportions at that rate, and the derived rate beside it."""
    stage_mb = (shape.num_layers // 2) * sum(compute["layer"]) + \
        max(sum(compute["embedding"]), sum(compute["output"]))
    return derive_scale(shape, stage_mb, eth_mbit)


def run(args) -> dict:
    shape = TinyShape()
    results_dir = Path(args.results)
    results_dir.mkdir(parents=True, exist_ok=True)
    handshake = Path(tempfile.mkdtemp(prefix="het_e2e_"))
    job = {"handshake": str(handshake), "shape": shape.to_dict(),
           "links": LINKS, "link_sizes": [65536, 1 << 20, 4 << 20], "link_reps": 3,
           "rounds": args.rounds, "warmup": args.warmup, "steps": args.steps}
    job_path = handshake / "job.json"
    job_path.write_text(json.dumps(job))
    env = {"PYTHONPATH": f"{REPO}{os.pathsep}{HERE}", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONWARNINGS": "ignore"}
    t0 = time.monotonic()
    load_start = os.getloadavg()[0]
    # Runnable tasks right now, less this process: unlike the load average, not an echo of earlier work.
    others_runnable_start = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]) - 1
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    log("compute profile: 4 single-rank trainings at once (no communication) ...")
    compute = e2e_compute.measure(shape.to_dict(), procs=4, rounds=args.compute_rounds, steps=3)
    scale = scale_for(shape, compute, args.eth_mbit)
    log(f"compute: {sum(compute['layer']) * 1e3:.1f} ms per layer fwd+bwd, framework overhead "
        f"{compute['overhead_per_micro_batch'] * 1e3:.1f} ms per micro-batch and "
        f"{compute['overhead_per_step'] * 1e3:.0f} ms per step; Ethernet -> {scale['eth_mbit']:.1f} Mbit/s "
        f"(scale 1/{scale['scale']:.0f})")
    cluster = mixed_cluster(args.ratios[0])
    with Emulation(cluster, scale=scale["scale"], extra_networks=[ExtraNetwork("ref0", ETH_GBPS)], log=log) as emu:
        log(emu.layout.describe())
        parent = Parent(emu, args, shape, results_dir, compute, scale)
        logs = [open(handshake / f"rank{r}.log", "w") for r in range(emu.layout.world_size)]
        procs = [emu.popen_in(emu.layout.node_of_rank(r).index, [sys.executable, str(HERE / "e2e_worker.py"),
                                                                   str(job_path)],
                              env=dict(env, **emu.rank_env(r)), stdout=logs[r], stderr=subprocess.STDOUT)
                 for r in range(emu.layout.world_size)]
        done = set()
        deadline = time.monotonic() + args.timeout
        try:
            while True:
                reqs = sorted(p for p in handshake.glob("*.req.json") if p.name not in done)
                for req in reqs:
                    name = req.name.split("-", 1)[1].rsplit(".req.json", 1)[0]
                    answer = parent.handle(name, json.loads(req.read_text()))
                    tmp = handshake / (req.name.replace(".req.json", ".resp.tmp"))
                    tmp.write_text(json.dumps(answer))
                    tmp.rename(handshake / req.name.replace(".req.json", ".resp.json"))
                    done.add(req.name)
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes):
                    break
                if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
                    emu.wait(procs, timeout=5)
                    break
                time.sleep(0.05)
        finally:
            for f in logs:
                f.close()
        codes = [p.poll() for p in procs]
    if codes != [0] * len(codes):
        for r in range(len(codes)):
            text = (handshake / f"rank{r}.log").read_text()
            print(f"--- rank {r} rc={codes[r]}\n{text[-4000:]}", file=sys.stderr)
        raise SystemExit(f"bench_e2e: ranks failed: {codes}")
    shutil.rmtree(handshake, ignore_errors=True)
    out = {"shape": shape.to_dict(), "real_job": REAL_JOB, "scale": parent.scale, "compute": parent.compute,
           "wall_s": time.monotonic() - t0, "load_average": [load_start, os.getloadavg()[0]],
           "others_runnable_start": others_runnable_start,
           "started_utc": started,
           "cores": os.cpu_count(), "quick": args.quick, "rounds": args.rounds, "warmup": args.warmup, "steps": args.steps,
           "configs": {k: v for k, v in ALL_CONFIGS.items() if k in args.configs}, "goals": GOALS,
           "framework": args.framework,
           "latency": "not emulated (no netem in this kernel); bandwidth only",
           "ratios": []}
    parent.repredict()
    for ratio in args.ratios:
        st = parent.setups[ratio]
        row = summarize(ratio, parent.measured[ratio], st, args.warmup)
        row["plan"] = st.plan_summary
        row["links"] = st.links
        row["losses"] = parent.losses[ratio]
        out["ratios"].append(row)
    name = "e2e.json" if args.framework == "megatron" else f"e2e-{args.framework}.json"
    (results_dir / name).write_text(json.dumps(out, indent=1))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: ratio 10:1, one round, short steps")
    p.add_argument("--ratios", type=float, nargs="+", default=[2, 5, 10, 20])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="measured steps per configuration and round")
    p.add_argument("--compute-rounds", type=int, default=2, help="rounds of the compute profile")
    p.add_argument("--framework", choices=list(FRAMEWORK_CONFIGS), default="megatron",
                   help="megatron: configurations 1-4 (default); deepspeed: 3-ds and 4-ds; both: 3, 4, 3-ds, 4-ds "
                        "interleaved; interleaved: 1, 4 and their interleaved versions 1v, 5 (Megatron's interleaved "
                        "schedule, vpp=2). The DeepSpeed and interleaved runs print a side-by-side table and leave "
                        "the docs alone")
    p.add_argument("--configs", nargs="+", choices=list(ALL_CONFIGS),
                   help="default: the --framework's configurations")
    p.add_argument("--calibration-rounds", type=int, default=2)
    p.add_argument("--no-calibration", action="store_true",
                   help="predict from the single-rank compute profile alone (no calibration run)")
    p.add_argument("--eth-mbit", type=float, default=FIXED_ETH_MBIT,
                   help=f"emulated Ethernet rate in Mbit/s (default {FIXED_ETH_MBIT:g}, fixed so that runs compare)")
    p.add_argument("--derive-eth-rate", action="store_true",
                   help="derive the Ethernet rate from the compute measured at the start (the real job's proportions; "
                        "it moves with the machine's speed between runs)")
    p.add_argument("--results", help="raw results folder (default benchmarks/results, quick: a temp folder)")
    p.add_argument("--docs", help="docs folder for the table and chart (default docs/, quick: the results folder)")
    p.add_argument("--timeout", type=float, default=1500)
    args = p.parse_args(argv)
    args.configs = args.configs or FRAMEWORK_CONFIGS[args.framework]
    if args.derive_eth_rate:
        args.eth_mbit = None
    if args.quick:
        args.ratios, args.rounds, args.warmup, args.steps, args.compute_rounds = [10], 1, 1, 2, 1
        args.calibration_rounds = 1
    quick_dir = Path(tempfile.gettempdir()) / "het_e2e_quick"
    # a DeepSpeed run keeps its plans and profiles apart from the recorded Megatron sweep's
    full_dir = HERE / "results" if args.framework == "megatron" else HERE / "results" / args.framework
    args.results = args.results or str(quick_dir if args.quick else full_dir)
    args.docs = args.docs or (str(quick_dir) if args.quick else str(REPO / "docs"))
    try:
        out = run(args)
    except EmulatorUnavailable as exc:
        print(f"bench_e2e: {exc}", file=sys.stderr)
        return 3
    if any(c in DS_CONFIGS or c in VPP_CONFIGS for c in args.configs):
        from e2e_report import side_by_side
        print(side_by_side(out))
        return 0
    from e2e_report import write_chart, write_markdown
    chart = write_chart(out, Path(args.docs) / "img" / "e2e.png")
    md = write_markdown(out, Path(args.docs) / "benchmark-e2e.md", chart)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
