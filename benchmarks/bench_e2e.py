"""End-to-end benchmark: real Megatron-Core training of a small GPT on an emulated Holmes-shaped cluster.

    sudo .venv/bin/python benchmarks/bench_e2e.py            # full run (~12 min on an idle 2-core machine)
    sudo .venv/bin/python benchmarks/bench_e2e.py --quick    # smoke run (one ratio, one round)
    sudo .venv/bin/python benchmarks/bench_e2e.py --framework both --ratios 10 --rounds 2   # + DeepSpeed
    sudo .venv/bin/python benchmarks/bench_e2e.py --framework interleaved --ratios 10       # + interleaved (vpp)
    sudo .venv/bin/python benchmarks/bench_e2e.py --framework stock --ratios 10             # against today's stock stack

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
from e2e_plans import (ALL_CONFIGS, CONFIGS, DS_CONFIGS, FAST_LINKS, LINKS, STOCK_CONFIGS, VPP_CONFIGS, calibrate_pipeline_overhead,  # noqa: E402
                       predict_configs, setup_ratio, with_pipeline_overhead)
from e2e_drift import DRIFT_MARGIN, drift_verdict, round_to_repeat, run_verdict  # noqa: E402
from e2e_setup import ETH_GBPS, REAL_JOB, TinyShape, derive_scale, mixed_cluster  # noqa: E402
from het_plugin.tools.emulate import Emulation, EmulatorUnavailable, ExtraNetwork  # noqa: E402

CALIBRATION_MBIT = 20_000      # the reference network "unshaped" for the calibration run
# The emulated Ethernet rate. Default: set once, after the start-of-run calibration, so that dp_eth and pp_eth
# are within 10% of the real job's with the compute measured then (e2e_proportions), and held for the run: the
# ratios then mean the same thing on a fast and on a slow machine. --eth-mbit fixes it instead (one operating
# point for comparing code changes on one machine; the proportions follow from the compute and are printed).
CALIBRATE = "calibrate"        # a round's visit to the calibration run (the others are ratios)
GOALS = {"4/3": 0.60, "4/1": 1.15, "4/2": 0.55, "5v/1": 1.05}
PAIRS = {"4/3": ("4-het_plugin", "3-mixed-today"), "4/1": ("4-het_plugin", "1-all-fast"),
         "4/2": ("4-het_plugin", "2-all-eth"), "4p/3": ("4p-placement", "3-mixed-today"),
         "4t/3": ("4t-place+transport", "3-mixed-today"), "4-ds/3-ds": ("4-ds", "3-ds"),
         "3-ds/3": ("3-ds", "3-mixed-today"), "4-ds/4": ("4-ds", "4-het_plugin"),
         # interleaved: het_plugin with vpp against the all-fast reference (the goal), against the all-fast
         # reference with the same interleaving (what the slow hop still costs), and against 1F1B
         "5v/1": ("5-het_plugin+vpp", "1-all-fast"), "5v/1v": ("5-het_plugin+vpp", "1v-all-fast+vpp"),
         "5v/4": ("5-het_plugin+vpp", "4-het_plugin"), "1v/1": ("1v-all-fast+vpp", "1-all-fast"),
         # issue 30: against today's stock stack (multi-network communicators' routing), and what it gains over 3
         "4/3s": ("4-het_plugin", "3s-stock-today"), "4-ds/3s-ds": ("4-ds", "3s-ds-stock-today"),
         "3s/3": ("3s-stock-today", "3-mixed-today")}
FRAMEWORK_CONFIGS = {"megatron": list(CONFIGS), "deepspeed": list(DS_CONFIGS),
                     "both": ["3-mixed-today", "4-het_plugin", "3-ds", "4-ds"],
                     "interleaved": ["1-all-fast", "4-het_plugin", *VPP_CONFIGS],
                     # issue 30: het_plugin against today's stock stack, Megatron and DeepSpeed
                     "stock": ["3-mixed-today", "3s-stock-today", "4-het_plugin", "3-ds", "3s-ds-stock-today", "4-ds"]}


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
        self.rounds_run = args.rounds                 # round numbers handed out so far (repeats add to it)
        self.repeats_left = args.repeat_drifted
        self.repeated: list[dict] = []                # the rounds dropped and run again, and why
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
            # the proportions as the pipeline's compute really is: the rate is set here, once, and held for the run
            # (a fixed rate stays, its proportions follow)
            self.scale = scale_for(self.shape, self.compute, self.args.eth_mbit)
            self.emu.set_rate("eth0", self.scale["eth_mbit"])
            log(f"Ethernet -> {self.scale['eth_mbit']:.1f} Mbit/s, held for the run ({describe_scale(self.scale)})")
            return {}
        if name == "next":
            if not self.visits and not self.repeat_drifted_round():
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

    def repeat_drifted_round(self) -> bool:
        """``--repeat-drifted``: when the rounds so far are not reliable, drop the round that strays furthest
        (e2e_drift.round_to_repeat) and queue a new one (calibration first, every ratio); recorded in
        ``self.repeated`` and the JSON. False when there is nothing (more) to repeat."""
        if self.repeats_left <= 0 or self.args.rounds < 2 or not self.measured:
            return False
        rounds = self._config_rounds()
        cal = ([self.compute["calibration_step_s"]] if "calibration_step_s" in self.compute else []) \
            + self.round_calibrations
        verdict = drift_verdict(cal, rounds, self.args.drift_margin)
        if verdict.reliable:
            return False
        k = round_to_repeat(self.round_calibrations, rounds)
        self.repeated.append({"dropped_round_index": k, "reasons": verdict.reasons,
                              "calibration_s": self.round_calibrations[k] if k < len(self.round_calibrations)
                              else None,
                              "configs_s": {name: v[k] for name, v in rounds.items() if k < len(v)}})
        if k < len(self.round_calibrations):
            del self.round_calibrations[k]
        for per_config in self.measured.values():
            for runs in per_config.values():
                if k < len(runs):
                    del runs[k]
        self.repeats_left -= 1
        rnd, self.rounds_run = self.rounds_run, self.rounds_run + 1
        ratios = self.args.ratios
        self.visits = [(rnd, v) for v in ([CALIBRATE] if not self.args.no_calibration else [])
                       + ratios[rnd % len(ratios):] + ratios[:rnd % len(ratios)]]
        log(f"rounds drifted ({'; '.join(verdict.reasons)}): dropping round #{k + 1} of those kept and running "
            f"round {rnd} instead ({self.repeats_left} repeat(s) left)")
        return True

    def _config_rounds(self) -> dict[str, list[float]]:
        return {f"{ratio:g}:1 {cfg}": [statistics.median(r[self.args.warmup:]) for r in runs]
                for ratio, per_config in self.measured.items() for cfg, runs in per_config.items()}

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
        # the proportions the rounds really ran at: the rate held, the compute as the rounds' calibration found it
        self.scale_rounds = dict(scale_for(self.shape, compute, self.scale["eth_mbit"]), mode="as run")
        log(f"calibration over the rounds: median step {measured * 1e3:.0f} ms (rounds: "
            + ", ".join(f"{t * 1e3:.0f}" for t in self.round_calibrations)
            + f") -> {x * 1e3:+.1f} ms per micro-batch and stage; predictions made again")

    def report_ratio(self, ratio: float) -> None:
        rows = summarize(ratio, self.measured[ratio], self.setups[ratio], self.args.warmup)
        for r in rows["configs"]:
            log(f"  {r['name']:<20} {r['median_s'] * 1e3:8.1f} ms  predicted {r['predicted_s'] * 1e3:8.1f} ms "
                f"({r['error'] * 100:+.0f}%)")
        log("  " + "  ".join(f"{k} {v:.2f}" for k, v in rows["ratios"].items())
            + f"   [fabric {ratio * self.scale['eth_mbit']:.0f} Mbit/s, Ethernet {self.scale['eth_mbit']:.1f} Mbit/s; "
            + describe_scale(self.scale) + "]")


def describe_scale(scale: dict) -> str:
    """The operating point in one line: mode, scale, the tiny job's proportions beside the real job's."""
    s, r = scale["tiny"], scale["real"]
    return (f"{scale.get('mode', 'fixed')}, scale 1/{scale['scale']:.0f}; dp_eth {s['dp_eth']:.2f} (real "
            f"{r['dp_eth']:.2f}, {scale['dp_error']:+.0%}), pp_eth {s['pp_eth']:.3f} (real {r['pp_eth']:.3f}, "
            f"{scale['pp_error']:+.0%}); " + ("within" if scale["matched"] else "NOT within")
            + f" {scale['tolerance']:.0%}; the proportion-matched rate {scale['matched_eth_mbit']:.1f} Mbit/s")


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
        f"until the calibration run ({describe_scale(scale)})")
    cluster = mixed_cluster(args.ratios[0])
    # multinet: the stock-today configurations bind every group to fab0 and cross clusters over Ethernet
    with Emulation(cluster, scale=scale["scale"], extra_networks=[ExtraNetwork("ref0", ETH_GBPS)], multinet=True,
                   log=log) as emu:
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
    if getattr(parent, "scale_rounds", None):
        out["scale_rounds"] = parent.scale_rounds
    out["repeated_rounds"] = parent.repeated
    for ratio in args.ratios:
        st = parent.setups[ratio]
        row = summarize(ratio, parent.measured[ratio], st, args.warmup)
        row["plan"] = st.plan_summary
        row["links"] = st.links
        row["losses"] = parent.losses[ratio]
        out["ratios"].append(row)
    verdict = run_verdict(out, args.drift_margin)
    out["reliability"] = verdict.to_dict()
    log(("RELIABLE" if verdict.reliable else "UNRELIABLE (not a headline)") + f": calibration spread "
        + (f"{verdict.calibration_spread:.0%}" if verdict.calibration_spread is not None else "n/a")
        + (f", widest configuration {verdict.worst_config} {verdict.worst_config_spread:.0%}" if verdict.worst_config
           else ", one round per configuration") + f" (margin {verdict.margin:.0%})" + "".join(f"\n    {r}" for r in verdict.reasons))
    if out.get("scale_rounds"):
        log("proportions over the rounds (the rate held, the rounds' calibration): "
            + describe_scale(out["scale_rounds"]))
    name = "e2e.json" if args.framework == "megatron" else f"e2e-{args.framework}.json"
    (results_dir / name).write_text(json.dumps(out, indent=1))
    return out


def record(out: dict, args) -> str:
    """Where a run's numbers go. Only a full, reliable, proportion-matched Megatron run becomes the recorded run
    (benchmarks/results/, the docs' RESULTS section, the chart, README's headline); a drifted one goes to
    benchmarks/results/unreliable/ and the docs' unreliable-run section, marked; a fixed-rate one to
    benchmarks/results/fixed/<time>/ (for comparing code changes, not a headline). Returns the printed text."""
    from e2e_report import side_by_side, write_chart, write_markdown, write_unreliable
    staging = Path(args.results)
    if any(c in DS_CONFIGS or c in VPP_CONFIGS or c in STOCK_CONFIGS for c in args.configs):
        return side_by_side(out)
    reliable = out["reliability"]["reliable"]
    recorded = reliable and out["scale"].get("mode") == "proportions" and out["scale"]["matched"] and not args.quick
    if args.default_results:       # the staging folder moves to where this kind of run is kept
        final = HERE / "results" if recorded else HERE / "results" / (
            "fixed" if reliable and not args.quick else "unreliable")
        if not recorded and reliable:
            final = final / time.strftime("%Y-%m-%d-%H%M", time.gmtime())
        if final == HERE / "results":
            for f in staging.iterdir():
                os.replace(f, final / f.name)
            staging.rmdir()
        else:
            shutil.rmtree(final, ignore_errors=True)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging, final)
        log(f"raw results: {final}")
    docs = Path(args.docs)
    if not reliable:
        return write_unreliable(out, docs / "benchmark-e2e.md")
    if args.quick or recorded or args.docs_given:
        chart = write_chart(out, docs / "img" / "e2e.png")
        md = write_markdown(out, docs / "benchmark-e2e.md", chart)
        if recorded and docs.resolve() == (REPO / "docs").resolve():
            import e2e_headline
            e2e_headline.write_readme(REPO)
            log("README.md: headline regenerated from benchmarks/results/e2e.json")
        return md
    from e2e_report import results_markdown
    return results_markdown(out, None)


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
    p.add_argument("--eth-mbit", type=float, default=None,
                   help="fix the emulated Ethernet rate (Mbit/s, e.g. 100) to compare code changes on one machine; "
                        "default: set after the start-of-run calibration so that dp_eth and pp_eth are within 10%% "
                        "of the real job's, and held for the run")
    p.add_argument("--drift-margin", type=float, default=DRIFT_MARGIN,
                   help=f"largest spread (max-min over median) of the calibration run's times and of a "
                        f"configuration's rounds for a reliable run (default {DRIFT_MARGIN:g}; e2e_drift.py says why)")
    p.add_argument("--repeat-drifted", type=int, default=0, metavar="N",
                   help="when the rounds drifted past the margin, drop the round that strays furthest and run a new "
                        "one, at most N times (recorded in the JSON; default 0: report the drift, repeat nothing)")
    p.add_argument("--results", help="raw results folder (default: under benchmarks/results/ as the run's verdict "
                                     "says, see record(); quick: a temp folder)")
    p.add_argument("--docs", help="docs folder for the table and chart (default docs/, quick: the results folder)")
    p.add_argument("--timeout", type=float, default=1500)
    args = p.parse_args(argv)
    args.configs = args.configs or FRAMEWORK_CONFIGS[args.framework]
    if args.quick:
        args.ratios, args.rounds, args.warmup, args.steps, args.compute_rounds = [10], 1, 1, 2, 1
        args.calibration_rounds = 1
    quick_dir = Path(tempfile.gettempdir()) / "het_e2e_quick"
    side = any(c in DS_CONFIGS or c in VPP_CONFIGS or c in STOCK_CONFIGS for c in args.configs)
    args.default_results = not args.results and not args.quick
    if args.quick and not args.results:
        args.results = str(quick_dir)
    elif side and not args.results:
        # a DeepSpeed or interleaved run keeps its plans and profiles apart from the recorded Megatron sweep's,
        # one folder per run (e2e_headline picks the latest reliable one)
        args.results = str(HERE / "results" / args.framework / time.strftime("%Y-%m-%d-%H%M", time.gmtime()))
        args.default_results = False
    elif not args.results:       # a full Megatron run: staged, then moved to where its verdict says (record)
        args.results = str(HERE / "results" / f".staging-{os.getpid()}")
    args.docs_given = args.docs is not None
    args.docs = args.docs or (str(quick_dir) if args.quick else str(REPO / "docs"))
    try:
        out = run(args)
    except EmulatorUnavailable as exc:
        print(f"bench_e2e: {exc}", file=sys.stderr)
        return 3
    print(record(out, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
