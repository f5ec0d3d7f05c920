"""Run one script as N ranks (torchrun-style environment) with a hard timeout.

A rank that hangs is a failure with a stack dump: each rank arms ``faulthandler.dump_traceback_later``
(through ``HET_TEST_TIMEOUT``, see :func:`arm_watchdog`) and the launcher kills whatever is left.
A rank that fails stops the run at once (fail fast): the launcher does not wait out the timeout.
Waiting, draining the ranks' output and killing are ``het_plugin.tools.emulate.procs.collect``, the collector
the emulator's ``Emulation.run_ranks`` uses too. Ranks report results by printing one line ``RESULT <json>``.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

REPO = Path(__file__).resolve().parents[2]


@dataclass
class RankResult:
    rank: int
    returncode: Optional[int]        # None: killed by the launcher (timeout, or another rank failed first)
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


FAIL_FAST_CHECKED = 1.0      # s the other ranks get after one failed, when any failure fails the run (check)
FAIL_FAST_UNCHECKED = 30.0   # ... when the caller looks at how every rank stops (check=False)


def run_ranks(script: str | Path, world_size: int, args: Sequence[str] = (), *, env: Optional[dict] = None,
              rank_env: Optional[Sequence[dict]] = None, timeout: float = 180, ranks_per_node: Optional[int] = None,
              check: bool = True, fail_fast: Optional[float] = None) -> list[RankResult]:
    """Start ``world_size`` processes of ``script``; return their outputs. ``check``: raise on any failure.

    Every rank's output is drained while they run (a rank never blocks on a full pipe). The first rank to
    fail (non-zero exit or a signal) stops the run: the others get ``fail_fast`` seconds to end by
    themselves (default: ``FAIL_FAST_CHECKED`` with ``check``, ``FAIL_FAST_UNCHECKED`` without, where the
    caller inspects how each rank stops), then their process groups are killed (returncode None, and a
    ``[launcher]`` line at the end of their stderr). At ``timeout`` everything left is killed the same way.
    """
    # Imported here: rank scripts import this module (arm_watchdog, report) and must not load het_plugin.
    from het_plugin.tools.emulate.procs import collect, kill_group

    port = free_port()
    procs: list[subprocess.Popen] = []
    base = dict(os.environ)
    base.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size),
                 "HET_TEST_TIMEOUT": str(max(5, timeout - 10)), "PYTHONUNBUFFERED": "1",
                 "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{base.get('PYTHONPATH', '')}"})
    base.setdefault("HET_PLUGIN_USE_ALL_NODES", "1")   # tests not about issue 32's refusal: every node, as before
    base.update(env or {})
    rpn = ranks_per_node or world_size
    try:
        for r in range(world_size):
            e = dict(base, RANK=str(r), LOCAL_RANK=str(r % rpn), LOCAL_WORLD_SIZE=str(rpn), GROUP_RANK=str(r // rpn))
            if rank_env:
                e.update(rank_env[r])
            procs.append(subprocess.Popen([sys.executable, str(script), *args], env=e, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, errors="replace",
                                          start_new_session=True))
    except BaseException:
        for p in procs:
            kill_group(p)
        raise
    if fail_fast is None:
        fail_fast = FAIL_FAST_CHECKED if check else FAIL_FAST_UNCHECKED
    run = collect(procs, timeout, grace=fail_fast, label="launcher")
    outs = [RankResult(o.rank, o.returncode, o.stdout, o.stderr, _results(o.stdout)) for o in run.outputs]
    if check and any(o.returncode != 0 for o in outs):
        raise AssertionError(failure_report(outs, run.first_failed, run.failed_after_s, run.killed, timeout))
    return outs


def failure_report(outs: Sequence[RankResult], first: Optional[int], failed_after_s: Optional[float],
                   killed: Sequence[int], timeout: float) -> str:
    """The failing rank first, with its output tail; then every other rank that did not end with 0."""
    from het_plugin.tools.emulate.procs import describe_code

    if first is not None:
        head = f"rank {first} failed first ({describe_code(outs[first].returncode)})"
        if failed_after_s is not None:
            head += f" after {failed_after_s:.1f}s"
    else:
        head = f"ranks hung: still running after {timeout:g}s"
    if killed:
        head += f"; the launcher killed rank(s) {', '.join(map(str, killed))}"
    order = ([first] if first is not None else []) + [o.rank for o in outs if o.rank != first]
    parts = [head]
    for r in order:
        o = outs[r]
        if o.returncode == 0:
            continue
        tail_out, tail_err = (2000, 4000) if r == first else (1000, 2000)
        parts.append(f"--- rank {r} {describe_code(o.returncode)}{' (failed first)' if r == first else ''}")
        parts += [text.rstrip("\n") for text in (o.stdout[-tail_out:], o.stderr[-tail_err:]) if text.strip()]
    return "\n".join(parts)


def _results(stdout: str) -> list[Any]:
    return [json.loads(line[len("RESULT "):]) for line in stdout.splitlines() if line.startswith("RESULT ")]


# ---- used inside rank scripts -------------------------------------------------------------------

def arm_watchdog() -> None:
    """Dump every thread's stack and exit if this rank outlives HET_TEST_TIMEOUT (a hang)."""
    import faulthandler
    faulthandler.dump_traceback_later(float(os.environ.get("HET_TEST_TIMEOUT", "170")), exit=True)


def report(obj: Any) -> None:
    print("RESULT " + json.dumps(obj), flush=True)
