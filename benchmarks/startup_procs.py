"""The start-up benchmark's ranks spread over worker processes (``bench_startup.py --processes P``).

With every rank a thread of one interpreter, each rank's local work (37 sysfs reads in discovery, a thread and
a connection in the guard) queues on one GIL: at 1,024 ranks discovery's local scan took 18 ms of CPU per rank
against 1 ms for a rank alone, the difference being GIL hand-offs around each small system call, which a real
job (one rank per process) does not have. Here P processes hold N/P ranks each (threads again, each rank its own
TCPStore client), the server lives in the coordinating process (as torchrun's agent or rank 0's process holds
it), and every phase is released in all processes at once by one cross-process barrier. Time stamps are
``time.perf_counter`` (CLOCK_MONOTONIC on Linux: one clock for every process), so a phase's wall time is from the
release to the last rank's return, as in the threaded path. The counts do not change: the same calls, the same
wrapper.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
import time
from datetime import timedelta
from typing import Any, Optional

TIMEOUT_S = 600.0
RANKS_PER_NODE = 8


class _Rank:
    """What one simulated rank holds in a worker: its het_plugin store client, and the store torch's
    rendezvous makes for it (the reference phases)."""

    def __init__(self, rank: int, store):
        self.rank, self.store, self.torch_store = rank, store, None


def _body(name: str, payload: Any, n: int, sysfs: str, state: dict):
    """The function one rank runs in phase ``name`` (the same calls as bench_startup's threaded path)."""
    import torch.distributed as tdist
    from torch.distributed import distributed_c10d

    from het_plugin.discovery import gather_discovery
    from het_plugin.runtime.agreement import check_plan_agreement
    from het_plugin.runtime.guard import GroupGuard
    from het_plugin.runtime.preflight import exchange_check

    if name == "discovery":
        env = {"HET_PLUGIN_ACCELERATOR": "H100", "HET_PLUGIN_ACCELERATOR_COUNT": str(RANKS_PER_NODE)}

        def run(r: _Rank):
            d = gather_discovery(r.store, r.rank, n, local_rank=r.rank % RANKS_PER_NODE, sysfs_root=sysfs,
                                 node_name=f"node{r.rank // RANKS_PER_NODE:05d}", env=env, timeout_s=TIMEOUT_S)
            if r.rank == 0:
                state["extra"] = {"data": d.data}
        return run
    if name == "agreement":
        return lambda r: check_plan_agreement(payload, rank=r.rank, world_size=n, store=r.store, timeout_s=TIMEOUT_S)
    if name == "pre-flight":
        from het_plugin.core.inputs.cluster import cluster_from_dict
        from het_plugin.core.plan import Plan
        plan, cluster = Plan.from_dict(json.loads(payload[0])), cluster_from_dict(payload[1])
        return lambda r: exchange_check(plan, r.rank, store=r.store, cluster=cluster, env={}, backend="nccl",
                                        net_name=None, timeout_s=TIMEOUT_S)
    if name == "guard":
        def run(r: _Rank):
            with GroupGuard(r.store, rank=r.rank, world_size=n, what="the benchmark", timeout=TIMEOUT_S):
                pass
        return run
    if name.startswith("torch: connect"):
        def run(r: _Rank):
            r.torch_store = tdist.TCPStore("127.0.0.1", payload, n, r.rank == 0,
                                           timeout=timedelta(seconds=TIMEOUT_S), wait_for_workers=True)
        return run
    if name.startswith("torch: barrier"):
        from het_plugin.runtime.store_counts import CountingStore

        def run(r: _Rank):
            store = CountingStore(r.torch_store)
            state.setdefault("torch_counting", {})[r.rank] = store
            distributed_c10d._store_based_barrier(r.rank, store, f"bench{payload}", n, timedelta(seconds=TIMEOUT_S))
            key = f"bench{payload}/ncclUniqueId"
            if r.rank == 0:
                store.set(key, os.urandom(128))
            else:
                store.get(key)
        return run
    raise ValueError(f"unknown phase {name!r}")


def _worker(conn, gate, port: int, ranks: list[int], n: int, sysfs: str) -> None:
    import torch.distributed as tdist

    from het_plugin.runtime import exchange
    from het_plugin.runtime.store_counts import CountingStore
    exchange.reset_call_counts()
    mine = []
    for r in ranks:
        client = tdist.TCPStore("127.0.0.1", port, None, False, wait_for_workers=False,
                                timeout=timedelta(seconds=TIMEOUT_S))
        mine.append(_Rank(r, CountingStore(client)))
    conn.send("connected")
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        _, name, payload = msg
        state: dict = {}
        body = _body(name, payload, n, sysfs, state)
        for m in mine:
            m.store.counts.reset()
        local_gate = threading.Event()
        ends, cpu, errors = {}, {}, {}

        def target(m: _Rank) -> None:
            local_gate.wait()
            c0 = time.thread_time()
            try:
                body(m)
            except BaseException as exc:        # noqa: BLE001 - reported to the coordinator
                errors[m.rank] = repr(exc)
            finally:
                cpu[m.rank] = time.thread_time() - c0
                ends[m.rank] = time.perf_counter()
        threads = [threading.Thread(target=target, args=(m,), daemon=True) for m in mine]
        for t in threads:
            t.start()
        gate.wait()
        local_gate.set()
        for t in threads:
            t.join()
        counting = state.pop("torch_counting", None)
        stores = [counting[m.rank] for m in mine] if counting else [m.store for m in mine]
        conn.send({"end": max(ends.values()), "cpu": sum(cpu.values()), "errors": errors,
                   "requests": {m.rank: s.counts.total_requests for m, s in zip(mine, stores)},
                   "bytes": sum(s.counts.total_bytes for s in stores), "extra": state.get("extra")})


class Pool:
    """P worker processes holding ranks 0..N-1 in contiguous slices (a node's ranks in one process), connected
    to the coordinator's TCPStore server."""

    def __init__(self, n: int, processes: int, sysfs: str):
        import torch.distributed as tdist
        self.n = n
        self.server = tdist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                                     timeout=timedelta(seconds=TIMEOUT_S))
        ctx = mp.get_context("spawn")
        p = self.processes = max(1, min(processes, n))
        self.gate = ctx.Barrier(p + 1)
        bounds = [round(i * n / p) for i in range(p + 1)]
        self.conns, self.procs = [], []
        for i in range(p):
            a, b = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(b, self.gate, self.server.port, list(range(bounds[i], bounds[i + 1])),
                                                      n, sysfs), daemon=True)
            proc.start()
            self.conns.append(a)
            self.procs.append(proc)
        for c in self.conns:
            if c.recv() != "connected":
                raise RuntimeError("a benchmark worker did not connect")

    def run(self, name: str, payload: Any = None) -> dict:
        """One phase on every rank, released together: wall time, CPU, per-rank requests, bytes, rank 0's extra."""
        for c in self.conns:
            c.send(("run", name, payload))
        self.gate.wait()
        start = time.perf_counter()
        replies = [c.recv() for c in self.conns]
        errors = {r: e for rep in replies for r, e in rep["errors"].items()}
        if errors:
            first = min(errors)
            raise RuntimeError(f"{name}: {len(errors)} rank(s) failed, rank {first}: {errors[first]}")
        requests: dict[int, int] = {}
        for rep in replies:
            requests.update(rep["requests"])
        return {"wall": max(rep["end"] for rep in replies) - start, "cpu": sum(rep["cpu"] for rep in replies),
                "requests": [requests[r] for r in range(self.n)], "bytes": sum(rep["bytes"] for rep in replies),
                "extra": next((rep["extra"] for rep in replies if rep["extra"] is not None), None)}

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        self.server = None



def free_port() -> int:
    """A port no one listens on (a TCPStore server opened and closed)."""
    import torch.distributed as tdist
    probe = tdist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    port = probe.port
    del probe
    return port
