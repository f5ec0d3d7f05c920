"""het_shim all-reduce vs flat gloo, side by side in one run (see docs/shim.md for the results table).

Two measurements:

* ``two-tier`` (needs the emulator: root, network namespaces, tc): two vendor clusters of
  ``--split`` single-rank nodes, each cluster on its own fast fabric (``--fabric-gbps``), joined only
  by Ethernet (``--ethernet-gbps``). Flat gloo runs over Ethernet (the one network every rank shares);
  het_shim reduces inside each vendor over its fabric and crosses Ethernet once per stripe, each
  member over its own NIC. 'no pipelining': one chunk per stripe; 'leaders only': one stripe, so
  only the subgroup leaders cross. Goal:
  shim / flat <= 0.67.
* ``single-vendor`` (loopback, no emulator): a het_shim group whose members all have one vendor vs the
  native gloo group of the same ranks. Goal: shim / native <= 1.05.

    python benchmarks/bench_shim.py                     # both
    python benchmarks/bench_shim.py --only single-vendor
Timings are medians over ``--repeats`` rounds; each round runs the variants back to back (interleaved),
so background load hits them alike. On a shared CPU treat them as rough.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHUNK_ENV = "HET_PLUGIN_SHIM_CHUNK_BYTES"
STRIPES_ENV = "HET_PLUGIN_SHIM_MAX_STRIPES"


# ---- the rank side ------------------------------------------------------------------------------------

def _timed(dist, group, tensor, iters: int) -> float:
    """Seconds for ``iters`` all-reduces, the slowest rank's time (what a training step waits for)."""
    import torch
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor, group=group)
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt.item())


def rank_two_tier(args) -> dict:
    import torch
    import torch.distributed as dist

    import het_plugin.comm as comm
    from het_plugin.core.inputs.cluster import cluster_from_dict
    from het_plugin.runtime.netselect import gloo_network
    from het_plugin.core.ranks.placement import cluster_transport
    cluster = cluster_from_dict(two_tier_cluster(args))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    options = comm.ShimOptions({r: cluster.node_of(r).vendor for r in range(world)},
                               lambda ranks: cluster_transport(cluster, ranks))
    with gloo_network("host-staged"):             # as the adapters create host-staged groups
        flat = dist.new_group(list(range(world)), backend="gloo")
        shim = dist.new_group(list(range(world)), backend=comm.SHIM_BACKEND, pg_options=options)
    n = int(args.mbytes * 2 ** 20) // 4
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    a, b = x.clone(), x.clone()
    dist.all_reduce(a, group=flat)
    dist.all_reduce(b, group=shim)
    ok = bool(torch.allclose(a, b, rtol=1e-4, atol=1e-4))
    variants = {"flat gloo": (flat, {}), "het_shim": (shim, {}),
                "het_shim, no pipelining": (shim, {CHUNK_ENV: str(n * 4)}),
                "het_shim, leaders only": (shim, {STRIPES_ENV: "1"})}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.repeats):
        for name, (group, env) in variants.items():
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            times[name].append(_timed(dist, group, x.clone(), 1))
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k)
                else:
                    os.environ[k] = v
    dist.barrier()
    dist.destroy_process_group()
    return {"ok": ok, "times": times, "subgroups": [list(s) for s in shim.layout.subgroups]}


def rank_single_vendor(args) -> dict:
    import torch
    import torch.distributed as dist

    import het_plugin.comm as comm
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    comm.set_vendor_map(["nvidia"] * world)
    native = dist.new_group(list(range(world)), backend="gloo")
    shim = dist.new_group(list(range(world)), backend=comm.SHIM_BACKEND)
    out = {}
    for kib in args.sizes_kib:
        x = torch.ones(max(1, kib * 1024 // 4))
        iters = max(5, min(100, int(10 * 1024 / max(kib, 1))))
        _timed(dist, native, x, 2)
        _timed(dist, shim, x, 2)
        # Alternate the two calls op by op, swapping which goes first: background load and rank skew hit both
        # alike.
        per_op = {"native gloo": [], "het_shim": []}
        pair = (("native gloo", native), ("het_shim", shim))
        for i in range(args.repeats * iters):
            for name, group in (pair if i % 2 == 0 else pair[::-1]):   # neither always goes first
                t0 = time.perf_counter()
                dist.all_reduce(x, group=group)
                per_op[name].append(time.perf_counter() - t0)
        # the slowest rank's median per-op time, per variant
        med = torch.tensor([statistics.median(per_op["native gloo"]), statistics.median(per_op["het_shim"])],
                           dtype=torch.float64)
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        out[str(kib)] = {"native gloo": [float(med[0])], "het_shim": [float(med[1])], "ops": len(per_op["het_shim"])}
    dist.destroy_process_group()
    return {"times": out}


# ---- the driver side ----------------------------------------------------------------------------------

def two_tier_cluster(args) -> dict:
    counts = split_of(args)

    def vendor_cluster(name, fabric, accel, count):
        return {"name": name, "fabric": {"type": fabric, "gbps": args.fabric_gbps, "latency_us": 3},
                "nodes": [{"count": count, "accelerator": accel, "accelerators_per_node": 1,
                           "nics": [{"type": "ethernet", "gbps": args.ethernet_gbps, "interfaces": ["eth0"]}]}]}
    return {"name": "shim-bench-two-tier",
            "clusters": [vendor_cluster("nv", "ib", "H100", counts[0]),
                         vendor_cluster("amd", "roce", "MI250X", counts[1])],
            "links": [{"between": ["nv", "amd"], "type": "ethernet", "gbps": args.ethernet_gbps, "latency_us": 50}]}


def split_of(args) -> tuple[int, int]:
    counts = tuple(int(x) for x in args.split.split(","))
    if len(counts) != 2 or min(counts) < 1:
        raise SystemExit(f"--split {args.split!r}: two positive node counts, e.g. 2,2 or 3,1")
    return counts


def worker_argv(args, mode: str) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", mode, "--repeats", str(args.repeats),
            "--mbytes", str(args.mbytes), "--split", args.split, "--fabric-gbps",
            str(args.fabric_gbps), "--ethernet-gbps", str(args.ethernet_gbps), "--scale", str(args.scale)]
    return argv + ["--sizes-kib", *map(str, args.sizes_kib)]


def _result(stdout: str) -> dict:
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError("rank 0 reported nothing:\n" + stdout[-2000:])


def run_two_tier(args) -> dict:
    from het_plugin.core.inputs.cluster import cluster_from_dict
    from het_plugin.tools.emulate import Emulation
    cluster = cluster_from_dict(two_tier_cluster(args))
    env = {"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    with Emulation(cluster, scale=args.scale, log=lambda s: None) as emu:
        procs = emu.launch(worker_argv(args, "two-tier"), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
        codes = emu.wait(procs, timeout=args.timeout)
        outs = [p.communicate() for p in procs]
    if any(c != 0 for c in codes):
        raise RuntimeError(f"two-tier ranks failed {codes}:\n" + "\n".join(e[-3000:] for _, e in outs))
    return _result(outs[0][0])


def run_single_vendor(args) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = args.world
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=str(REPO))
        procs.append(subprocess.Popen(worker_argv(args, "single-vendor"), env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True))
    try:
        outs = [p.communicate(timeout=args.timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError("single-vendor ranks failed:\n" + "\n".join(e[-3000:] for _, e in outs))
    return _result(outs[0][0])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["two-tier", "single-vendor"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--mbytes", type=float, default=2.0, help="two-tier: all-reduced tensor size (MiB, fp32)")
    p.add_argument("--split", default="2,2", help="two-tier: single-rank nodes of each vendor, e.g. 2,2 or 3,1")
    p.add_argument("--fabric-gbps", type=float, default=200.0)
    p.add_argument("--ethernet-gbps", type=float, default=25.0)
    p.add_argument("--scale", type=float, default=1000.0, help="emulator: real bits per emulated bit")
    p.add_argument("--world", type=int, default=4, help="single-vendor: ranks on loopback")
    p.add_argument("--sizes-kib", type=int, nargs="+", default=[4, 256, 4096])
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", help="also write the raw numbers here")
    p.add_argument("--worker", choices=["two-tier", "single-vendor"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        result = (rank_two_tier if args.worker == "two-tier" else rank_single_vendor)(args)
        if int(os.environ.get("RANK", "0")) == 0:
            print("RESULT " + json.dumps(result), flush=True)
        return 0

    raw, lines = {}, ["| measurement | variant | median time | ratio | goal |", "|---|---|---|---|---|"]
    if args.only in (None, "two-tier"):
        from het_plugin.tools.emulate import EmulatorUnavailable
        try:
            res = run_two_tier(args)
        except EmulatorUnavailable as exc:
            print(f"two-tier: skipped, the emulator is unavailable here: {exc}", file=sys.stderr)
        else:
            raw["two-tier"] = res
            med = {k: statistics.median(v) for k, v in res["times"].items()}
            base = med["flat gloo"]
            what = (f"two-tier all-reduce {args.mbytes:g} MiB fp32, {'+'.join(args.split.split(','))} ranks, "
                    f"fabric {args.fabric_gbps:g} / Ethernet {args.ethernet_gbps:g} Gbit/s (1/{args.scale:g})")
            for k, v in med.items():
                goal = "<= 0.67" if k == "het_shim" else ""
                lines.append(f"| {what} | {k} | {v * 1000:.0f} ms | {v / base:.2f} | {goal} |")
            if not res["ok"]:
                lines.append("| (het_shim result differed from flat gloo!) | | | | |")
    if args.only in (None, "single-vendor"):
        res = run_single_vendor(args)
        raw["single-vendor"] = res
        for kib, rows in res["times"].items():
            med = {k: statistics.median(v) for k, v in rows.items() if k != "ops"}
            base = med["native gloo"]
            what = f"one vendor, {args.world} ranks, loopback, all-reduce {kib} KiB"
            for k, v in med.items():
                goal = "<= 1.05" if k == "het_shim" else ""
                lines.append(f"| {what} | {k} | {v * 1e6:.0f} us | {v / base:.3f} | {goal} |")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
