"""Start-up at simulated scale: N ranks as threads, each with its own TCPStore client, against one real
torch.distributed.TCPStore, running het_plugin's real start-up phases (no process group is created), beside
torch's own store rendezvous for the same N in the same run.

    python benchmarks/bench_startup.py                      (N = 64, 256, 1024, 2048)
    python benchmarks/bench_startup.py --ranks 64,256       (a quick run)
    python benchmarks/bench_startup.py --markdown docs/benchmark-startup.md --chart docs/img/startup.png
    python benchmarks/bench_startup.py --processes 16    (the ranks spread over 16 worker processes)

Phases, in the order an adapter runs them (both adapters: the Megatron-LM ``--heterogeneous-nic`` path
discovers the cluster first; a DeepSpeed wrapped config or a cluster file starts at "plan"):

- discovery: :func:`het_plugin.discovery.gather_discovery` on every rank (a fabricated sysfs tree with 4 IB
  HCAs, 8 H100 per node through HET_PLUGIN_ACCELERATOR, 8 ranks a node): every view to rank 0, one cluster back;
- plan: :func:`het_plugin.core.planner.make_plan` once, on the discovered cluster (every rank computes the same plan
  on its own CPU, in parallel: its wall time is one plan's; the threads here share the one result);
- agreement: :func:`het_plugin.runtime.agreement.check_plan_agreement` (every rank's plan hash to rank 0, one verdict);
- pre-flight: :func:`het_plugin.runtime.preflight.exchange_check` (every rank's NCCL settings, one verdict);
- guard: :class:`het_plugin.runtime.guard.GroupGuard` entered and left around no creation (its start keys,
  a heartbeat thread with its own store connection each, the final wait for every rank).

torch's reference for the same N, the store part of ``init_process_group`` (torch 2.13):
- every rank's ``TCPStore(host, port, world_size, is_master=rank == 0)`` as ``rendezvous.py``'s
  ``_create_c10d_store`` makes it: connect, then ``waitForWorkers`` (TCPStore.cpp: each client adds 1 to the
  init key; the server's client polls that key every 10 ms until it reads N);
- ``distributed_c10d._store_based_barrier`` itself (run when ``TORCH_DIST_INIT_BARRIER=1``; off by default
  since 2.1): one add, one read of the count, a wait on the last worker's key;
- NCCL's communicator id (ProcessGroupNCCL.cpp ``broadcastUniqueNCCLID``): rank 0 sets one key, every other
  rank gets it.
Its request count is read from that source (2 requests per rank in the constructor, counted, plus the
server's 10-ms polls, not counted); the barrier and the id exchange go through the counting wrapper.

Times are pessimistic: 2 cores for every rank, and with ``--processes 1`` each rank's local work (parsing,
validating, the sysfs reads) queues on one interpreter's GIL, which a real job (one rank per process) does not
have; ``--processes P`` spreads the ranks over P worker processes (startup_procs.py) with the store server in
this one. Requests and bytes are exact counts; the extrapolation to 16,384 and 131,072 ranks
fits each phase's counts linearly (and says so where a phase grows faster).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch.distributed as tdist  # noqa: E402
from torch.distributed import distributed_c10d  # noqa: E402

from het_plugin.runtime.agreement import check_plan_agreement  # noqa: E402
from het_plugin.discovery import gather_discovery  # noqa: E402
from het_plugin.core.inputs.model import preset_model  # noqa: E402
from het_plugin.core.planner import make_plan  # noqa: E402
from het_plugin.runtime import exchange  # noqa: E402
from het_plugin.runtime.guard import GroupGuard  # noqa: E402
from het_plugin.runtime.preflight import exchange_check  # noqa: E402
from het_plugin.runtime.store_counts import CountingStore  # noqa: E402

RANKS_PER_NODE = 8
TIMEOUT_S = 600.0
PHASES = ("discovery", "plan", "agreement", "pre-flight", "guard")
TORCH = ("torch: connect + wait for workers", "torch: barrier + NCCL id")
TORCH_CONSTRUCTOR_REQUESTS = 2          # TCPStore.cpp: validate on connect, add(initKey) in waitForWorkers


@dataclass
class Phase:
    name: str
    wall_s: float = 0.0
    cpu_s: float = 0.0                  # the threads' CPU time, summed (local work, serialised here)
    requests: int = 0
    bytes: int = 0
    max_rank_requests: int = 0
    root_requests: int = 0
    notes: list[str] = field(default_factory=list)


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def connect(port: int, n: int) -> list:
    """n TCPStore clients, connected in parallel (as ranks do)."""
    def one(_):
        return tdist.TCPStore("127.0.0.1", port, None, False, wait_for_workers=False,
                              timeout=timedelta(seconds=TIMEOUT_S))
    with ThreadPoolExecutor(min(n, 512)) as pool:
        return list(pool.map(one, range(n)))


REPEATS = 3


def run_phase(name: str, stores: list[CountingStore], body: Callable[[int, CountingStore], object]) -> Phase:
    """:func:`run_once` ``REPEATS`` times, the fastest kept: on a loaded machine the slowest runs measure the
    scheduler (one phase measured 0.2 to 6.5 s in a row, with the same requests). Every repeat uses fresh
    keys (the exchanges' per-call counts)."""
    return fastest([run_once(name, stores, body) for _ in range(max(1, REPEATS))])


def released_together(n: int, fn: Callable[[int], object]) -> tuple[float, dict[int, BaseException]]:
    """``fn(rank)`` on n threads released at once: (seconds from the release to the last return, errors)."""
    gate = threading.Event()
    errors: dict[int, BaseException] = {}

    def target(rank: int) -> None:
        gate.wait()
        try:
            fn(rank)
        except BaseException as exc:    # noqa: BLE001 - reported by the caller
            errors[rank] = exc

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    start = time.perf_counter()
    gate.set()
    for t in threads:
        t.join()
    return time.perf_counter() - start, errors


def run_once(name: str, stores: list[CountingStore], body: Callable[[int, CountingStore], object]) -> Phase:
    """``body(rank, store)`` on every rank at once (threads released together); the phase's wall time is
    from the release to the last rank's return."""
    n = len(stores)
    for s in stores:
        s.counts.reset()
    cpu = [0.0] * n

    def timed(rank: int) -> None:
        c0 = time.thread_time()
        try:
            body(rank, stores[rank])
        finally:
            cpu[rank] = time.thread_time() - c0

    wall, errors = released_together(n, timed)
    if errors:
        first = min(errors)
        raise RuntimeError(f"{name}: {len(errors)} rank(s) failed, rank {first}: {errors[first]!r}")
    per_rank = [s.counts.total_requests for s in stores]
    return Phase(name, wall, sum(cpu), sum(per_rank), sum(s.counts.total_bytes for s in stores),
                 max(per_rank[1:] or [0]), per_rank[0])


def fake_sysfs() -> Path:
    """One node's sysfs (4 IB HCAs and an Ethernet port), shared by every simulated node."""
    sys.path.insert(0, str(REPO / "tests"))
    from sysfs_tree import ib_node
    root = Path(tempfile.mkdtemp(prefix="het_bench_sysfs_"))
    ib_node(root)
    return root


def cluster_data(n: int) -> dict:
    """The cluster discovery finds, as a cluster file would give it (the DeepSpeed / cluster-file path)."""
    return {"name": "bench", "clusters": [{"name": "ib", "fabric": {"type": "ib", "gbps": 800},
            "nodes": [{"count": n // RANKS_PER_NODE, "accelerator": "H100", "accelerators_per_node": RANKS_PER_NODE,
                       "nics": [{"type": "ib", "gbps": 200, "devices": ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]}]}]}]}


def file_cluster(n: int):
    from het_plugin.core.inputs.cluster import cluster_from_dict
    return cluster_from_dict(cluster_data(n))


DISCOVERY_ENV = {"HET_PLUGIN_ACCELERATOR": "H100", "HET_PLUGIN_ACCELERATOR_COUNT": str(RANKS_PER_NODE)}
Body = Callable[[int, CountingStore], object]


# ---- what one rank runs in each phase: the same functions for ranks as threads and in worker processes --------

def discovery_body(n: int, sysfs: Path, found: dict) -> Body:
    """Rank 0 leaves the discovered cluster (``cluster``) and its data (``data``) in ``found``."""
    def discover(rank, store):
        d = gather_discovery(store, rank, n, local_rank=rank % RANKS_PER_NODE, sysfs_root=str(sysfs),
                             node_name=f"node{rank // RANKS_PER_NODE:05d}", env=DISCOVERY_ENV, timeout_s=TIMEOUT_S)
        if rank == 0:
            found["cluster"], found["data"] = d.cluster, d.data
    return discover


def agreement_body(n: int, digest: str) -> Body:
    return lambda r, s: check_plan_agreement(digest, rank=r, world_size=n, store=s, timeout_s=TIMEOUT_S)


def preflight_body(plan, cluster) -> Body:
    return lambda r, s: exchange_check(plan, r, store=s, cluster=cluster, env={}, backend="nccl", net_name=None,
                                       timeout_s=TIMEOUT_S)


def guard_body(n: int) -> Body:
    def guard(rank, store):
        with GroupGuard(store, rank=rank, world_size=n, what="the benchmark", timeout=TIMEOUT_S):
            pass
    return guard


def barrier_and_id_body(n: int) -> Body:
    """torch's store barrier and NCCL id exchange over each rank's rendezvous store; a fresh group name each time
    a rank runs it (the repeats)."""
    rounds: dict[int, int] = {}

    def barrier_and_id(rank, store):
        k = rounds[rank] = rounds.get(rank, -1) + 1
        distributed_c10d._store_based_barrier(rank, store, f"bench{k}", n, timedelta(seconds=TIMEOUT_S))
        key = f"bench{k}/ncclUniqueId"          # ProcessGroupNCCL::broadcastUniqueNCCLID: set by 0, get by all
        if rank == 0:
            store.set(key, os.urandom(128))
        else:
            store.get(key)
    return barrier_and_id


def rendezvous_store(port: int, n: int, rank: int):
    """One rank's TCPStore as rendezvous.py's _create_c10d_store makes it for env:// (rank 0 the server)."""
    return tdist.TCPStore("127.0.0.1", port, n, rank == 0, timeout=timedelta(seconds=TIMEOUT_S),
                          wait_for_workers=True)


def free_port() -> int:
    """A port no one listens on (a TCPStore server opened and closed)."""
    probe = tdist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    port = probe.port
    del probe
    return port


def connect_phase(wall_s: float, n: int) -> Phase:
    """torch's connect + wait phase: its requests are read from TCPStore.cpp (the constructor is C++)."""
    return Phase(TORCH[0], wall_s, 0.0, TORCH_CONSTRUCTOR_REQUESTS * n, 0, TORCH_CONSTRUCTOR_REQUESTS,
                 TORCH_CONSTRUCTOR_REQUESTS, ["requests read from TCPStore.cpp, not counted"])


def plan_phase(cluster, model_name: str, n: int):
    """The plan, computed once (every rank computes the same one in parallel), and its phase."""
    model = preset_model(model_name).model_copy(update={"global_batch_size": 4 * n})
    c0, t0 = time.process_time(), time.perf_counter()
    plan = make_plan(cluster, model)
    return plan, Phase("plan", time.perf_counter() - t0, time.process_time() - c0,
                       notes=[f"tp{plan.tp} pp{plan.pp} dp{plan.dp}"])


def het_plugin_phases(n: int, sysfs: Path, model_name: str, discovery: bool = True) -> tuple[list[Phase], dict]:
    exchange.reset_call_counts()
    server = tdist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False, timeout=timedelta(seconds=TIMEOUT_S))
    clients = connect(server.port, n)
    stores = [CountingStore(c) for c in clients]
    found: dict = {}
    if discovery:
        phases = [run_phase("discovery", stores, discovery_body(n, sysfs, found))]
        cluster, cluster_bytes = found["cluster"], len(json.dumps(found["data"]))
    else:
        phases, cluster, cluster_bytes = [], file_cluster(n), 0
    plan, planned = plan_phase(cluster, model_name, n)
    phases.append(planned)
    # each rank hashes its own plan once, in parallel; not N times on one interpreter
    phases.append(run_phase("agreement", stores, agreement_body(n, plan.hash)))
    phases.append(run_phase("pre-flight", stores, preflight_body(plan, cluster)))
    phases.append(run_phase("guard", stores, guard_body(n)))
    plan_bytes = len(json.dumps(plan.to_dict()))
    del clients, stores, server
    return phases, {"cluster_bytes": cluster_bytes, "plan_bytes": plan_bytes}


def fastest(runs: list[Phase]) -> Phase:
    """The fastest of a phase's repeats, the others' wall times noted (on a loaded machine the slowest runs
    measure the scheduler)."""
    best = min(runs, key=lambda p: p.wall_s)
    best.notes.append("wall s of the repeats: " + ", ".join(f"{p.wall_s:.2f}" for p in runs))
    return best


def pooled_phase(pool, name: str, payloads: Optional[list] = None) -> tuple[Phase, Optional[dict]]:
    """One phase run REPEATS times on the worker processes (``--processes``), the fastest kept (as run_phase),
    with rank 0's extra; ``payloads``: one per repeat (torch's connect needs a fresh port each time)."""
    runs, extras = [], []
    for i in range(max(1, REPEATS)):
        res = pool.run(name, payloads[i] if payloads else None)
        req = res["requests"]
        runs.append(Phase(name, res["wall"], res["cpu"], sum(req), res["bytes"], max(req[1:] or [0]), req[0]))
        extras.append(res["extra"])
    best = fastest(runs)
    best.notes.append(f"{pool.processes} processes")
    return best, extras[runs.index(best)]


def pooled_run(n: int, sysfs: Path, model_name: str, discovery: bool, processes: int) -> tuple[list[Phase], dict, list[Phase]]:
    """het_plugin's phases and torch's reference with the ranks in ``processes`` worker processes (the plan and
    the cluster reach them as JSON: each worker decodes them once)."""
    from startup_procs import Pool
    from het_plugin.core.inputs.cluster import cluster_from_dict
    pool = Pool(n, processes, str(sysfs))
    try:
        phases = []
        if discovery:
            ph, extra = pooled_phase(pool, "discovery")
            phases.append(ph)
            data = extra["data"]
        else:
            data = cluster_data(n)
        cluster = cluster_from_dict(data)
        plan, planned = plan_phase(cluster, model_name, n)
        phases.append(planned)
        pool.share(plan.to_json(), data)
        phases += [pooled_phase(pool, name)[0] for name in ("agreement", "pre-flight", "guard")]
        connected = pooled_phase(pool, TORCH[0], payloads=[free_port() for _ in range(max(1, REPEATS))])[0]
        ref = [connect_phase(connected.wall_s, n), pooled_phase(pool, TORCH[1])[0]]
        ref[0].notes[:0] = connected.notes
    finally:
        pool.close()
    cluster_bytes = len(json.dumps(data)) if discovery else 0
    return phases, {"cluster_bytes": cluster_bytes, "plan_bytes": len(json.dumps(plan.to_dict()))}, ref


def torch_reference(n: int) -> list[Phase]:
    """The store traffic of init_process_group (see the module docstring), for n ranks."""
    runs, made = [], []
    for _ in range(max(1, REPEATS)):
        made = []
        runs.append(torch_connect(n, made))
    first = fastest(runs)
    second = run_phase(TORCH[1], [CountingStore(s) for s in made], barrier_and_id_body(n))
    return [first, second]


def torch_connect(n: int, made: list) -> Phase:
    """Every rank's rendezvous store (rank 0 the server), made in parallel."""
    port = free_port()                          # a free port for rank 0's server
    made[:] = [None] * n

    def make(rank: int) -> None:
        made[rank] = rendezvous_store(port, n, rank)

    wall, errors = released_together(n, make)
    if errors:
        raise RuntimeError(f"torch's TCPStore rendezvous failed on {len(errors)} ranks: {next(iter(errors.values()))!r}")
    return connect_phase(wall, n)


def store_service_time() -> tuple[float, float]:
    """One client's sequential requests to a TCPStore: seconds per small request, and per byte of a large value
    read (the store's cost model for the extrapolation: a single server serves every request in turn)."""
    server = tdist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    client = tdist.TCPStore("127.0.0.1", server.port, None, False, wait_for_workers=False)
    k = 5000
    t = time.perf_counter()
    for i in range(k):
        client.set(f"s/{i % 64}", "x")
    per_request = (time.perf_counter() - t) / k
    big = os.urandom(4 << 20)
    client.set("big", big)
    t = time.perf_counter()
    for _ in range(10):
        client.get("big")
    per_byte = max(0.0, (time.perf_counter() - t) / 10 - per_request) / len(big)
    del client, server
    return per_request, per_byte


def slope(points: dict[int, float]) -> float:
    """log-log slope of a count between the two largest N: 1 linear, 2 quadratic (0 for a constant)."""
    ns = sorted(points)
    if len(ns) < 2:
        return 1.0
    a, b = points[ns[-2]], points[ns[-1]]
    if a <= 0 or b <= 0:
        return 1.0
    return math.log(b / a) / math.log(ns[-1] / ns[-2])


def extrapolate(points: dict[int, float], at: int) -> float:
    """A count at ``at`` ranks: the largest measurement scaled by the growth between the two largest (a
    linear phase stays linear, a quadratic one is extrapolated as quadratic), never below linear."""
    ns = sorted(points)
    top = points[ns[-1]]
    return top * (at / ns[-1]) ** max(1.0, slope(points))


GOAL_RATIO, GOAL_WALL_S, GOAL_STORE_S, GOAL_BYTES = 3.0, 30.0, 60.0, 100e6
TARGETS = (16_384, 131_072)


def report(results: dict[int, dict], service: tuple[float, float], md: Optional[Path], chart: Optional[Path]) -> str:
    ns = sorted(results)
    lines = ["| ranks | phase | wall s (best of the repeats) | requests | per rank (max) | rank 0 | bytes | load (1 min) |",
             "|---:|---|---:|---:|---:|---:|---:|---|"]
    for n in ns:
        r = results[n]
        for p in r["phases"] + r["torch"]:
            lines.append(f"| {n:,} | {p.name} | {p.wall_s:.2f} | {p.requests:,} | {p.max_rank_requests} | "
                         f"{p.root_requests} | {p.bytes:,} | {r['load_before'].split()[0]} |")
    table = "\n".join(lines)
    names = [p.name for p in results[ns[-1]]["phases"] if p.name != "plan"] + list(TORCH)
    per_phase = {name: {n: next(p for p in results[n]["phases"] + results[n]["torch"] if p.name == name)
                        for n in ns} for name in names}
    ex = ["| phase | growth of requests (log-log) | growth of bytes | requests at 16,384 | bytes at 16,384 | "
          "requests at 131,072 | bytes at 131,072 |", "|---|---:|---:|---:|---:|---:|---:|"]
    totals = {t: [0.0, 0.0] for t in TARGETS}
    for name in names:
        req = {n: float(p.requests) for n, p in per_phase[name].items()}
        byt = {n: float(p.bytes) for n, p in per_phase[name].items()}
        cells = []
        for t in TARGETS:
            rq, bt = extrapolate(req, t), extrapolate(byt, t) if any(byt.values()) else 0.0
            cells += [f"{rq:,.0f}", f"{bt / 1e6:,.1f} MB"]
            if not name.startswith("torch"):
                totals[t][0] += rq
                totals[t][1] += bt
        ex.append(f"| {name} | {slope(req):.2f} | {slope(byt) if any(byt.values()) else 0:.2f} | " + " | ".join(cells) + " |")
    per_req, per_byte = service
    store_s = {t: totals[t][0] * per_req + totals[t][1] * per_byte for t in TARGETS}
    ex.append("| **het_plugin, all phases** | | | " + " | ".join(
        f"{totals[t][0]:,.0f} | {totals[t][1] / 1e6:,.1f} MB" for t in TARGETS) + " |")
    top = results[ns[-1]]
    het_total = sum(p.wall_s for p in top["phases"])
    torch_total = sum(p.wall_s for p in top["torch"])
    ratio = het_total / torch_total if torch_total else float("inf")
    growths = {name: slope({n: float(p.requests) for n, p in per_phase[name].items()}) for name in names
               if not name.startswith("torch")}
    goals = [
        (f"whole start-up at {ns[-1]:,} ranks <= {GOAL_RATIO:g}x torch's store rendezvous (same run)",
         f"{het_total:.1f} s vs {torch_total:.1f} s: {ratio:.2f}x", ratio <= GOAL_RATIO),
        (f"whole start-up at {ns[-1]:,} ranks under {GOAL_WALL_S:g} s", f"{het_total:.1f} s", het_total < GOAL_WALL_S),
        ("no phase's requests grow faster than N", ", ".join(f"{k} {v:.2f}" for k, v in growths.items()),
         all(v <= 1.15 for v in growths.values())),
        (f"extrapolated to 16,384 ranks: under {GOAL_STORE_S:g} s of store time",
         f"{store_s[16_384]:.1f} s ({totals[16_384][0]:,.0f} requests x {per_req * 1e6:.1f} us + "
         f"{totals[16_384][1] / 1e6:,.1f} MB x {per_byte * 1e9:.2f} ns/B)", store_s[16_384] < GOAL_STORE_S),
        (f"extrapolated to 16,384 ranks: under {GOAL_BYTES / 1e6:g} MB through the store",
         f"{totals[16_384][1] / 1e6:,.1f} MB", totals[16_384][1] < GOAL_BYTES),
    ]
    if ns[-1] < 2048:
        goals = [(g, v, None) if g.startswith("whole") else (g, v, ok) for g, v, ok in goals]
    goal_lines = ["| goal | measured | |", "|---|---|---|"] + [
        f"| {g} | {v} | {'n/a (largest N < 2,048)' if ok is None else ('met' if ok else 'missed')} |"
        for g, v, ok in goals]
    sizes = "; ".join(f"{n:,}: cluster {results[n]['cluster_bytes']:,} B, plan {results[n]['plan_bytes']:,} B"
                      for n in ns)
    text = ("### Per phase\n\n" + table + "\n\n### Extrapolated from the counts\n\n" + "\n".join(ex) +
            f"\n\nStore service time measured in the same run (one client, sequential): {per_req * 1e6:.1f} us per "
            f"small request, {per_byte * 1e9:.2f} ns per byte read. JSON sizes (discovered cluster, plan): {sizes}.\n\n"
            "### Goals\n\n" + "\n".join(goal_lines) + "\n")
    if chart is not None:
        draw(results, per_phase, names, chart)
    if md is not None:
        md.write_text(text)
    return text


def draw(results, per_phase, names, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ns = sorted(results)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in names:
        style = "--" if name.startswith("torch") else "-"
        a.plot(ns, [per_phase[name][n].requests for n in ns], style, marker="o", label=name)
    a.plot(ns, [n * n for n in ns], ":", color="grey", label="N^2 (an all-gather)")
    a.set(xscale="log", yscale="log", xlabel="ranks", ylabel="store requests (all ranks)",
          title="Requests per phase")
    a.legend(fontsize=7)
    het = [sum(p.wall_s for p in results[n]["phases"]) for n in ns]
    ref = [sum(p.wall_s for p in results[n]["torch"]) for n in ns]
    b.plot(ns, het, "-o", label="het_plugin start-up (all phases)")
    b.plot(ns, ref, "--o", label="torch's store rendezvous")
    b.plot(ns, [3 * x for x in ref], ":", color="grey", label="goal: 3x torch")
    b.set(xscale="log", yscale="log", xlabel="ranks", ylabel="wall s (best of the repeats, busy 2-core machine)",
          title="Wall time")
    b.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="64,256,1024,2048")
    ap.add_argument("--model", default="gpt-7.5b")
    ap.add_argument("--json", help="write the measurements here")
    ap.add_argument("--markdown", type=Path, help="write the tables here")
    ap.add_argument("--chart", type=Path, help="draw the chart here (PNG)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each phase, the fastest kept")
    ap.add_argument("--no-discovery", action="store_true",
                    help="start at the plan (a cluster file: the DeepSpeed wrapped-config path)")
    ap.add_argument("--processes", type=int, default=1,
                    help="spread the ranks over this many worker processes (startup_procs.py: each rank's local "
                         "work no longer queues on one interpreter's GIL); 1: every rank a thread of this process")
    args = ap.parse_args(argv)
    global REPEATS
    REPEATS = args.repeats
    sizes = [int(x) for x in args.ranks.split(",")]
    sysfs = fake_sysfs()
    try:
        return _run_sizes(args, sizes, sysfs)
    finally:
        shutil.rmtree(sysfs, ignore_errors=True)


def _run_sizes(args, sizes: list[int], sysfs: Path) -> int:
    service = store_service_time()
    results: dict[int, dict] = {}
    text = ""
    for n in sizes:
        before = load()
        if args.processes > 1:
            het, sizes_info, ref = pooled_run(n, sysfs, args.model, not args.no_discovery, args.processes)
        else:
            het, sizes_info = het_plugin_phases(n, sysfs, args.model, discovery=not args.no_discovery)
            ref = torch_reference(n)
        results[n] = {"load_before": before, "load_after": load(), "phases": het, "torch": ref, **sizes_info}
        print(f"N={n}: het_plugin {sum(p.wall_s for p in het):.2f} s ("
              f"{', '.join(f'{p.name} {p.wall_s:.2f}' for p in het)}); torch {sum(p.wall_s for p in ref):.2f} s; "
              f"load {before} -> {results[n]['load_after']}", flush=True)
        if args.json:
            out = {str(k): {"load_before": r["load_before"], "load_after": r["load_after"],
                            "cluster_bytes": r["cluster_bytes"], "plan_bytes": r["plan_bytes"],
                            "phases": [vars(p) for p in r["phases"]], "torch": [vars(p) for p in r["torch"]]}
                   for k, r in results.items()}
            Path(args.json).write_text(json.dumps({"service": service, "results": out}, indent=1))
        if len(results) >= 2:       # after every size: a run cut short still leaves its tables and chart
            text = report(results, service, args.markdown, args.chart)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
