"""Run one script as N ranks (torchrun-style environment) with a hard timeout.

A rank that hangs is a failure with a stack dump: each rank arms ``faulthandler.dump_traceback_later``
(through ``HET_TEST_TIMEOUT``, see :func:`arm_watchdog`) and the launcher kills whatever is left.
Ranks report results by printing one line ``RESULT <json>``.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

REPO = Path(__file__).resolve().parents[2]


@dataclass
class RankResult:
    rank: int
    returncode: Optional[int]
    stdout: str
    stderr: str
    results: list[Any] = field(default_factory=list)

    @property
    def result(self) -> Any:
        return self.results[-1] if self.results else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str | Path, world_size: int, args: Sequence[str] = (), *, env: Optional[dict] = None,
              rank_env: Optional[Sequence[dict]] = None, timeout: float = 180, ranks_per_node: Optional[int] = None,
              check: bool = True) -> list[RankResult]:
    """Start ``world_size`` processes of ``script``; return their outputs. ``check``: raise on any failure."""
    port = free_port()
    procs = []
    base = dict(os.environ)
    base.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size),
                 "HET_TEST_TIMEOUT": str(max(5, timeout - 10)), "PYTHONUNBUFFERED": "1",
                 "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{base.get('PYTHONPATH', '')}"})
    base.update(env or {})
    rpn = ranks_per_node or world_size
    for r in range(world_size):
        e = dict(base, RANK=str(r), LOCAL_RANK=str(r % rpn), LOCAL_WORLD_SIZE=str(rpn), GROUP_RANK=str(r // rpn))
        if rank_env:
            e.update(rank_env[r])
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True))
    deadline = time.monotonic() + timeout
    outs: list[RankResult] = []
    for r, p in enumerate(procs):
        try:
            so, se = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill(p)
            so, se = p.communicate()
            se += f"\n[launcher] rank {r} killed after {timeout}s (hang)"
        outs.append(RankResult(r, p.returncode, so, se, _results(so)))
    for p in procs:
        _kill(p)
    if check:
        bad = [o for o in outs if o.returncode != 0]
        if bad:
            raise AssertionError("ranks failed:\n" + "\n".join(
                f"--- rank {o.rank} rc={o.returncode}\n{o.stdout[-2000:]}\n{o.stderr[-4000:]}" for o in bad))
    return outs


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _results(stdout: str) -> list[Any]:
    return [json.loads(line[len("RESULT "):]) for line in stdout.splitlines() if line.startswith("RESULT ")]


# ---- used inside rank scripts -------------------------------------------------------------------

def arm_watchdog() -> None:
    """Dump every thread's stack and exit if this rank outlives HET_TEST_TIMEOUT (a hang)."""
    import faulthandler
    faulthandler.dump_traceback_later(float(os.environ.get("HET_TEST_TIMEOUT", "170")), exit=True)


def report(obj: Any) -> None:
    print("RESULT " + json.dumps(obj), flush=True)
