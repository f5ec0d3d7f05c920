"""``het-plugin emulate CLUSTER -- COMMAND...``: run COMMAND as every rank of CLUSTER on an emulated network.

Each node is a network namespace; its ranks get RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT like
torchrun, GLOO_SOCKET_IFNAME=eth0 for the default group and HET_PLUGIN_GLOO_IFNAMES so het_plugin's
adapters put each group on the interface its plan transport names. With ``--speed``, each node's processes
run in a cpu cgroup whose quota follows its accelerator's relative speed. Needs root.
"""
from __future__ import annotations

import argparse
import math
import subprocess
import sys

from ..core.errors import ConfigError

_PARSER: argparse.ArgumentParser | None = None


def register(sub) -> None:
    p = sub.add_parser("emulate", help="run a command as every rank of a cluster on an emulated network (root)",
                       description=__doc__)
    p.add_argument("cluster", nargs="?", help="cluster file (one namespace per node; one process per accelerator)")
    p.add_argument("--scale", type=float, default=1000.0,
                   help="real bits per emulated bit (default 1000: 200 Gbit/s becomes 200 Mbit/s)")
    p.add_argument("--port", type=int, default=29500, help="MASTER_PORT (rank 0's namespace; default 29500)")
    p.add_argument("--timeout", type=float, default=0, help="kill the ranks after this many seconds (0: never)")
    p.add_argument("--speed", action="append", metavar="catalog|NAME=X",
                   help="emulate compute speed per node with a cpu cgroup quota: 'catalog' (from the accelerators' "
                        "sustained TFLOPS) or NAME=X per node or cluster name, repeated (e.g. --speed ib=2 "
                        "--speed roce=1; only ratios count). Needs the cgroup-v1 cpu controller")
    p.add_argument("--cpu-per-rank", type=float, default=None,
                   help="with --speed: the fastest node's share of a core per rank (default: all quotas together "
                        "use 75%% of the machine's cores, at most 1 core per rank)")
    p.add_argument("--show", action="store_true", help="print the emulated network and exit without building it")
    p.add_argument("--cleanup", action="store_true",
                   help="only remove leftovers of crashed runs (namespaces, veths, bridges) and exit")
    # dest "argv", not "command": the top-level parser keeps the subcommand's name in args.command
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="COMMAND", help="after --: the command each rank runs")
    p.set_defaults(func=run)
    global _PARSER
    _PARSER = p


def split_command(args) -> argparse.Namespace:
    """argparse hands options written after CLUSTER to the command; parse those, keep what follows ``--``."""
    words = list(args.argv or [])
    if "--" in words:
        i = words.index("--")
        options, words = words[:i], words[i + 1:]
    elif words and words[0].startswith("-"):
        options, words = words, []          # only options after CLUSTER, no command
    else:
        options = []
    if options and _PARSER is not None:
        args = _PARSER.parse_args([*options, *([args.cluster] if args.cluster else [])])
    args.argv = words
    return args


def check_numbers(args) -> None:

    if not (math.isfinite(args.scale) and 1e-3 <= args.scale <= 1e9):
        raise ConfigError(f"{args.scale} is not a scale the emulator takes (0.001 .. 1e9)", field="--scale",
                          fix="pass real bits per emulated bit, e.g. --scale 1000 (200 Gbit/s -> 200 Mbit/s)")
    if not 1 <= args.port <= 65535:
        raise ConfigError(f"{args.port} is not a TCP port", field="--port", fix="pass a port from 1 to 65535, e.g. 29500")
    if args.cpu_per_rank is not None:
        from ..tools.emulate.speed import MAX_CPU_PER_RANK
        if not (math.isfinite(args.cpu_per_rank) and 0 < args.cpu_per_rank <= MAX_CPU_PER_RANK):
            raise ConfigError(f"{args.cpu_per_rank} is not a share of a core the emulator takes (0 < x <= "
                              f"{MAX_CPU_PER_RANK:g})", field="--cpu-per-rank",
                              fix="give the fastest rank's share of one core, e.g. 0.5")
        if not args.speed:
            raise ConfigError("--cpu-per-rank without --speed", field="--cpu-per-rank",
                              fix="add --speed catalog (or NAME=X per node or cluster), or drop --cpu-per-rank")
    if not (math.isfinite(args.timeout) and args.timeout >= 0):
        raise ConfigError(f"{args.timeout} is not a number of seconds >= 0", field="--timeout",
                          fix="pass the seconds after which the ranks are killed, or 0 for never")


def parse_speeds(words):
    """``--speed`` values: None (unshaped), "catalog", or {name: speed}; a malformed one names the flag."""
    if not words:
        return None
    if "catalog" in words:
        if len(words) > 1:
            raise ConfigError(f"'catalog' cannot be combined with other speeds ({words})", field="--speed",
                              fix="pass either --speed catalog, or NAME=X for every node or cluster")
        return "catalog"
    speeds = {}
    for w in words:
        name, eq, value = w.partition("=")
        try:
            speeds[name.strip()] = float(value)
        except ValueError:
            speeds[name.strip()] = None
        if not eq or not name.strip() or speeds[name.strip()] is None:
            raise ConfigError(f"{w!r} is not NAME=X", field="--speed",
                              fix="pass --speed catalog, or --speed NAME=X per node or cluster (e.g. --speed ib=2 "
                                  "--speed roce=1)")
    return speeds


def run(args) -> int:
    from ..core.inputs.cluster import load_cluster
    from ..tools.emulate import Emulation, EmulatorUnavailable, make_layout, stream_prefixed, terminate_on_signals
    from ..tools.emulate.system import check_preconditions, clean_leftovers

    args = split_command(args)
    check_numbers(args)
    speeds = parse_speeds(args.speed)
    if args.cleanup:
        try:
            check_preconditions()
        except EmulatorUnavailable as exc:
            print(f"het-plugin emulate: {exc}", file=sys.stderr)
            return 3
        kept: list[str] = []
        removed = clean_leftovers(kept)
        print("removed: " + (", ".join(removed) if removed else "nothing (no leftovers)"))
        for note in kept:
            print(f"kept: {note}")
        return 0
    if not args.cluster:
        raise ConfigError("no cluster file given", field="CLUSTER",
                          fix="het-plugin emulate examples/clusters/holmes-ib-roce.yaml -- python train.py")
    from .plan import named_by
    with named_by("CLUSTER"):
        cluster = load_cluster(args.cluster)
    if args.show:
        print(make_layout(cluster, "000000", args.scale, (), speeds, args.cpu_per_rank).describe())
        return 0
    if not args.argv:
        raise ConfigError("no command to run", field="COMMAND",
                          fix=f"het-plugin emulate {args.cluster} -- python train.py")
    terminate_on_signals()
    try:
        with Emulation(cluster, scale=args.scale, speeds=speeds, cpu_per_rank=args.cpu_per_rank) as emu:
            print(emu.layout.describe(), file=sys.stderr, flush=True)
            procs = emu.launch(args.argv, master_port=args.port, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, bufsize=1)
            pumps = [stream_prefixed(p.stdout, f"[rank {r}] ", sys.stdout) for r, p in enumerate(procs)]
            codes = emu.wait(procs, timeout=args.timeout or 10 ** 9)
            for t in pumps:
                t.join(timeout=2)
    except EmulatorUnavailable as exc:
        print(f"het-plugin emulate: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("het-plugin emulate: interrupted; network torn down", file=sys.stderr)
        return 130
    bad = [(r, c) for r, c in enumerate(codes) if c != 0]
    if bad:
        print("het-plugin emulate: ranks failed: " + ", ".join(
            f"rank {r} {'killed (timeout or a peer failed)' if c is None else f'rc {c}'}" for r, c in bad),
            file=sys.stderr)
        return 1
    return 0
