"""The start-up benchmark's ranks spread over worker processes (``bench_startup.py --processes P``).

With every rank a thread of one interpreter, each rank's local work (37 sysfs reads in discovery, a thread and
a connection in the guard) queues on one GIL: at 1,024 ranks discovery's local scan took 18 ms of CPU per rank
against 1 ms for a rank alone, the difference being GIL hand-offs around each small system call, which a real
job (one rank per process) does not have. Here P processes hold N/P ranks each (threads again, each rank its own
TCPStore client), the server lives in the coordinating process (as torchrun's agent or rank 0's process holds
it), and every phase is released in all processes at once by one cross-process barrier. Time stamps are
``time.perf_counter`` (CLOCK_MONOTONIC on Linux: one clock for every process), so a phase's wall time is from the
release to the last rank's return, as in the threaded path. Each rank runs bench_startup's own phase bodies, so
the counts are the threaded path's: the same calls, the same wrapper.
"""
from __future__ import annotations

import multiprocessing as mp
import threading
import time
from datetime import timedelta
from typing import Any, Optional

TIMEOUT_S = 600.0


class _Rank:
    """One simulated rank in a worker: its het_plugin store client, and the store torch's rendezvous makes for it
    (the reference phases), both counted."""

    def __init__(self, rank: int, store):
        self.rank, self.store, self.torch_store = rank, store, None


class _Worker:
    """A worker's ranks and the phase bodies they run (made once per phase: a body that counts its repeats, such
    as torch's barrier, keeps counting)."""

    def __init__(self, port: int, ranks: list[int], n: int, sysfs: str):
        import torch.distributed as tdist

        from het_plugin.runtime import exchange
        from het_plugin.runtime.store_counts import CountingStore
        exchange.reset_call_counts()
        self.n, self.sysfs = n, sysfs
        self.mine = [_Rank(r, CountingStore(tdist.TCPStore("127.0.0.1", port, None, False, wait_for_workers=False,
                                                            timeout=timedelta(seconds=TIMEOUT_S))))
                     for r in ranks]
        self.bodies: dict[str, Any] = {}
        self.found: dict = {}
        self.plan = self.cluster = None

    def share(self, plan_json: str, cluster_data: dict) -> None:
        import json

        from het_plugin.core.inputs.cluster import cluster_from_dict
        from het_plugin.core.plan import Plan
        self.plan, self.cluster = Plan.from_dict(json.loads(plan_json)), cluster_from_dict(cluster_data)

    def body(self, name: str, payload: Any):
        """(what rank ``m`` runs, the store its requests are counted on)."""
        import bench_startup as B
        if name == B.TORCH[0]:                         # a new rendezvous store per repeat (payload: its port)
            def connect(m: _Rank):
                from het_plugin.runtime.store_counts import CountingStore
                m.torch_store = CountingStore(B.rendezvous_store(payload, self.n, m.rank))
            return connect, (lambda m: m.store)
        if name not in self.bodies:
            self.bodies[name] = {
                "discovery": lambda: B.discovery_body(self.n, self.sysfs, self.found),
                "agreement": lambda: B.agreement_body(self.n, self.plan.hash),
                "pre-flight": lambda: B.preflight_body(self.plan, self.cluster),
                "guard": lambda: B.guard_body(self.n),
                B.TORCH[1]: lambda: B.barrier_and_id_body(self.n),
            }[name]()
        fn = self.bodies[name]
        if name == B.TORCH[1]:
            return (lambda m: fn(m.rank, m.torch_store)), (lambda m: m.torch_store)
        return (lambda m: fn(m.rank, m.store)), (lambda m: m.store)

    def run(self, name: str, payload: Any, gate) -> dict:
        run, counted = self.body(name, payload)
        for m in self.mine:
            if counted(m) is not None:
                counted(m).counts.reset()
        local_gate = threading.Event()
        ends, cpu, errors = {}, {}, {}

        def target(m: _Rank) -> None:
            local_gate.wait()
            c0 = time.thread_time()
            try:
                run(m)
            except BaseException as exc:        # noqa: BLE001 - reported to the coordinator
                errors[m.rank] = repr(exc)
            finally:
                cpu[m.rank] = time.thread_time() - c0
                ends[m.rank] = time.perf_counter()
        threads = [threading.Thread(target=target, args=(m,), daemon=True) for m in self.mine]
        for t in threads:
            t.start()
        gate.wait()
        local_gate.set()
        for t in threads:
            t.join()
        stores = [counted(m) for m in self.mine]
        extra = {"data": self.found["data"]} if name == "discovery" and "data" in self.found else None
        return {"end": max(ends.values()), "cpu": sum(cpu.values()), "errors": errors,
                "requests": {m.rank: s.counts.total_requests for m, s in zip(self.mine, stores)},
                "bytes": sum(s.counts.total_bytes for s in stores), "extra": extra}


def _serve(conn, gate, port: int, ranks: list[int], n: int, sysfs: str) -> None:
    worker = _Worker(port, ranks, n, sysfs)
    conn.send("connected")
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        if msg[0] == "share":
            worker.share(*msg[1:])
            conn.send("shared")
            continue
        conn.send(worker.run(msg[1], msg[2], gate))


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
            proc = ctx.Process(target=_serve, args=(b, self.gate, self.server.port,
                                                    list(range(bounds[i], bounds[i + 1])), n, sysfs), daemon=True)
            proc.start()
            self.conns.append(a)
            self.procs.append(proc)
        self._answers("connected")

    def _answers(self, expected: str) -> None:
        for c in self.conns:
            if c.recv() != expected:
                raise RuntimeError(f"a benchmark worker did not answer {expected!r}")

    def share(self, plan_json: str, cluster_data: dict) -> None:
        """The plan and the cluster every rank holds after planning (each worker decodes them once)."""
        for c in self.conns:
            c.send(("share", plan_json, cluster_data))
        self._answers("shared")

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
        extra: Optional[dict] = next((rep["extra"] for rep in replies if rep["extra"] is not None), None)
        return {"wall": max(rep["end"] for rep in replies) - start, "cpu": sum(rep["cpu"] for rep in replies),
                "requests": [requests[r] for r in range(self.n)], "bytes": sum(rep["bytes"] for rep in replies),
                "extra": extra}

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
