"""Wait for the processes of one job together: drain their pipes concurrently, stop all of them when one
fails, kill what is left at a hard timeout.

The one collector behind ``Emulation.run_ranks`` / ``Emulation.wait`` and the integration tests' local
launcher (``integration_tests/support/launch.py``). Pure standard library; the processes are started by the
caller, each ideally in its own session (``start_new_session=True``) so that killing its process group
also ends whatever it started.

A rank that fails (non-zero exit, or killed by a signal) stops the job: the others get ``grace`` seconds
to end on their own (enough to print their side of an error, e.g. a plan mismatch every rank reports),
then their process groups are killed. A rank that writes a lot never blocks on a full pipe, whichever
rank the job is waiting for.
"""
from __future__ import annotations

import io
import os
import queue
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

DRAIN_JOIN_S = 5.0      # after the processes ended: how long to wait for their last output (all pipes together)


@dataclass
class RankOutput:
    rank: int
    returncode: Optional[int]        # None: killed by the collector (timeout, or a peer failed)
    stdout: str
    stderr: str


@dataclass
class Waited:
    """How a set of processes ended."""
    codes: list[Optional[int]]                 # exit status per process; None: killed by us
    first_failed: Optional[int] = None         # index of the process that failed first (None: none failed)
    timed_out: bool = False                    # the hard timeout was reached with processes still running
    killed: list[int] = field(default_factory=list)   # indices we killed (still running at the stop)
    elapsed_s: float = 0.0                     # from the call until every process ended
    failed_after_s: Optional[float] = None     # from the call until the first failure


@dataclass
class Collected(Waited):
    outputs: list[RankOutput] = field(default_factory=list)


def failed(code: Optional[int]) -> bool:
    """A non-zero exit status, a signal (negative), or killed by us (None)."""
    return code != 0


def describe_code(code: Optional[int]) -> str:
    if code is None:
        return "killed by the launcher"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"rc={code}"


def kill_group(p: subprocess.Popen) -> None:
    """SIGKILL ``p``'s process group (it and everything it started in its session); ``p`` alone if it has
    no group of its own. On a process that already ended, whatever is left of its group goes (a group's id
    is not handed to a new process while the group has members)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
        return
    except (ProcessLookupError, PermissionError):
        pass
    if p.poll() is None:
        try:
            p.kill()
        except ProcessLookupError:
            pass


def wait_all(procs: Sequence[subprocess.Popen], timeout: float, *, grace: float = 0.0) -> Waited:
    """Wait for every process. Once one fails, the others get ``grace`` seconds, then every process group
    still running is killed; likewise at ``timeout`` seconds from the call. Killed processes report None.

    Each process is reaped by its own thread, so the first failure is seen when it happens (not after the
    processes before it in the list ended) and the order of failures is the order they happened in.
    """
    start = time.monotonic()
    deadline = start + timeout
    ended: "queue.SimpleQueue[int]" = queue.SimpleQueue()

    def reap(i: int, p: subprocess.Popen) -> None:
        try:
            p.wait()
        finally:
            ended.put(i)

    for i, p in enumerate(procs):
        threading.Thread(target=reap, args=(i, p), name=f"reap-{p.pid}", daemon=True).start()
    done: set[int] = set()
    stop_at = deadline
    first: Optional[int] = None
    failed_after = None
    while len(done) < len(procs):
        try:
            i = ended.get(timeout=min(threading.TIMEOUT_MAX, max(0.0, stop_at - time.monotonic())))
        except queue.Empty:
            break
        done.add(i)
        if first is None and failed(procs[i].returncode):
            first, failed_after = i, time.monotonic() - start
            stop_at = min(deadline, time.monotonic() + max(0.0, grace))
    running = [i for i in range(len(procs)) if i not in done]
    timed_out = bool(running) and stop_at >= deadline       # (else a failure stopped them, before the deadline)
    for i in running:
        kill_group(procs[i])
    killed = []
    for i in running:
        try:
            procs[i].wait(timeout=10)
        except subprocess.TimeoutExpired:          # unkillable (uninterruptible sleep): report it as killed
            pass
        if procs[i].returncode in (None, -signal.SIGKILL):
            killed.append(i)                       # (else it ended by itself as we killed it: keep its code)
    for p in procs:
        kill_group(p)                              # leftovers of finished ranks (they would hold our pipes)
    codes = [None if i in killed else p.returncode for i, p in enumerate(procs)]
    if first is None:                              # one that ended by itself, with a failure, as we killed
        first = next((i for i in running if i not in killed and failed(codes[i])), None)
    return Waited(codes, first, timed_out, killed, time.monotonic() - start, failed_after)


class _Drain:
    """One thread per pipe copies it into memory until EOF."""

    def __init__(self, procs: Sequence[subprocess.Popen]):
        self.parts: list[tuple[list, list]] = [([], []) for _ in procs]
        self.text = [True] * len(procs)
        self.pipes: list[tuple[Any, threading.Thread]] = []
        for i, p in enumerate(procs):
            for stream, sink in ((p.stdout, self.parts[i][0]), (p.stderr, self.parts[i][1])):
                if stream is None:
                    continue
                self.text[i] = isinstance(stream, io.TextIOBase)
                t = threading.Thread(target=self._pump, args=(stream, sink), name=f"drain-{p.pid}", daemon=True)
                t.start()
                self.pipes.append((stream, t))

    @staticmethod
    def _pump(stream: Any, sink: list) -> None:
        read = stream.read1 if hasattr(stream, "read1") else stream.readline     # bytes: what is there; text: lines
        try:
            while True:
                chunk = read(1 << 16)
                if not chunk:
                    return
                sink.append(chunk)
        except (ValueError, OSError):              # closed under us
            return
        except UnicodeDecodeError as exc:          # keep draining (a full pipe would block the rank), undecoded
            sink.append(f"\n[collect] output not decodable from here on ({exc}); dropped\n")
            raw = getattr(stream, "buffer", None)
            try:
                while raw is not None and raw.read1(1 << 16):
                    pass
            except (ValueError, OSError):
                return

    def finish(self, budget: float = DRAIN_JOIN_S) -> None:
        """Wait (``budget`` s for all pipes together) for the last output; close the pipes that reached EOF.
        A pipe still open (a process outside the killed groups holds it) is left to its daemon thread."""
        end = time.monotonic() + budget
        for stream, t in self.pipes:
            t.join(max(0.0, end - time.monotonic()))
            if not t.is_alive():
                try:
                    stream.close()
                except OSError:
                    pass

    def output(self, i: int) -> tuple[Any, Any]:
        empty = "" if self.text[i] else b""
        out, err = (empty.join(list(part)) for part in self.parts[i])
        return out, err


def collect(procs: Sequence[subprocess.Popen], timeout: float, *, grace: float = 0.0,
            label: str = "collect") -> Collected:
    """``wait_all`` while draining every process's stdout/stderr pipes (text or bytes; a stream that is not
    a pipe is left alone). A killed process's stderr ends with one ``[label]`` line saying why: "killed
    after <timeout>s (hang)", or "killed: rank <i> failed first (...)"."""
    drain = _Drain(procs)
    waited = wait_all(procs, timeout, grace=grace)
    drain.finish()
    outputs = []
    for i, code in enumerate(waited.codes):
        out, err = drain.output(i)
        if i in waited.killed:
            if waited.timed_out:
                note = f"[{label}] rank {i} killed after {timeout:g}s (hang)\n"
            else:
                first = waited.first_failed
                note = (f"[{label}] rank {i} killed: rank {first} failed first "
                        f"({describe_code(waited.codes[first])}), so the others were stopped\n")
            if err and err[-1:] not in ("\n", b"\n"):
                note = "\n" + note
            err = err + (note if isinstance(err, str) else note.encode())
        outputs.append(RankOutput(i, code, out, err))
    return Collected(waited.codes, waited.first_failed, waited.timed_out, waited.killed, waited.elapsed_s,
                     waited.failed_after_s, outputs)


__all__ = ["RankOutput", "Waited", "Collected", "collect", "wait_all", "kill_group", "failed", "describe_code"]
