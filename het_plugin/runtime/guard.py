"""Bounded group creation: when a rank fails or disappears while the framework's groups are created,
every live rank stops within the bound (``HET_PLUGIN_TIMEOUT`` or the adapter's ``timeout_s``) plus a
few seconds, with a message naming the missing ranks and where each one was.

What torch does (measured on torch 2.13, gloo, the default store): ``new_group`` returns at once on a
non-member; on a member it blocks in the store rendezvous of the new group (each member publishes its
address under the group's keys and waits for the others') for the group's ``timeout`` -- torch's
default is 30 minutes. ``new_group(timeout=5s)`` with a member gone raises ``DistStoreError`` after
5.0 s; the default store's ``set_timeout`` does not shorten it. The group keeps that timeout for its
collectives, and ``_set_pg_timeout`` puts another one back afterwards. NCCL creates communicators
lazily (at the first collective): its ``new_group`` does not wait for the members.

The guard, one per adapter call around the group-building phase (:meth:`AppliedPlan.guarding
<het_plugin.runtime.applied.AppliedPlan.guarding>`), under keys ``het_plugin/<restart>/groups/<call>/``:

* every gloo creation (also the gloo half of ``cpu:gloo,cuda:nccl``) is made with ``timeout =
  min(framework's, bound)``, and the framework's timeout (or torch's default) is restored on the group
  right after: collectives keep the timeout the framework asked for;
* before each creation a rank publishes where it is (``at/<rank>``: the creation's number, the
  framework's description, the members); a background thread counts a heartbeat (``beat/<rank>``) every
  ``interval`` seconds and watches ``abort``. It has its own store connection: a TCPStore client
  serialises its calls, so the main thread's blocked rendezvous would block it too (measured);
* a creation that fails (torch's timeout, a closed connection, any error) looks at the other members --
  failed (their ``abort/<rank>``), no heartbeat over ``3 * interval`` (killed, crashed, hung), never
  started group creation, or alive but still at an earlier group -- publishes ``abort`` and raises
  :class:`GroupCreationTimeout` naming them; when every member is alive and waiting, the rank's own
  error is raised as it is (after ``abort`` tells the others);
* at the end every rank waits for every other one (a counter, and one ``end`` key the last rank -- or a rank
  that gives up -- sets; one bounded ``store.wait``, no polling): a rank that finished while another died
  stops too;
* a main thread that is inside torch's creation when another rank gives up (a rendezvous that can no
  longer complete), or whose creation outlives the bound (a backend that ignores the timeout), cannot be
  interrupted from Python: the thread prints the GroupCreationTimeout on stderr (with where the main
  thread is) and ends the process with exit status 1 (``os._exit``) -- at once in the first case,
  after ``bound + 4 * interval + 2`` seconds in the second; a main thread elsewhere gets a grace of
  ``3 * interval + 1`` seconds to raise by itself first.

This module is the phase and its watcher thread; the keys and records in the store are
:mod:`het_plugin.runtime.guard_protocol`, naming the missing ranks from them is
:mod:`het_plugin.runtime.guard_diagnosis`.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Sequence

from ..core.errors import HetPluginError
from ..core.ranks.dims import format_ranks
from .exchange import ENV_TIMEOUT, Exchange
from .guard_diagnosis import PHASE, Diagnosis, from_peers, short
from .guard_protocol import GuardKeys, store_host

EXIT_STATUS = 1


class GroupCreationTimeout(HetPluginError, RuntimeError):
    """A rank failed or disappeared while the groups were created; raised (or printed, where torch cannot be
    interrupted) on every live rank. ``missing``: the ranks that did not arrive or finish."""

    def __init__(self, message: str, missing: Sequence[int] = (), phase: str = PHASE):
        super().__init__(message)
        self.missing = list(missing)
        self.phase = phase


def heartbeat_interval(bound: float, world_size: int = 1) -> float:
    """Seconds between heartbeats (and abort checks): bound/20 within [0.25, 2], stretched on worlds over
    4096 ranks (each beat and check is a store round trip: about 2 * world / interval requests a second),
    and at most bound/5."""
    return min(min(2.0, max(0.25, bound / 20)) * max(1.0, world_size / 4096), bound / 5)


def _hard_exit(message: str) -> None:
    try:
        sys.stderr.write(f"\nhet_plugin: GroupCreationTimeout: {message}\n")
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(EXIT_STATUS)


class GroupGuard:
    """See the module docstring. ``what`` names the framework call in messages ("Megatron-Core's
    initialize_model_parallel"); ``hard_exit(message)`` is what ends the process (tests replace it)."""

    def __init__(self, store, *, rank: int, world_size: int, what: str, timeout: Optional[float] = None,
                 env=None, interval: Optional[float] = None, hard_exit: Optional[Callable[[str], None]] = None):
        self.store, self.rank, self.world_size, self.what = store, rank, world_size, what
        # an Exchange for its keys (restart count, per-call count) and the one timeout rule
        self.ex = Exchange(store, "groups", index=rank, members=range(world_size), what=PHASE, timeout=timeout,
                           env=env)
        self.bound = self.ex.timeout_s
        self.interval = interval if interval is not None else heartbeat_interval(self.bound, world_size)
        self.grace = 3 * self.interval + 1.0
        self.overrun = self.bound + 4 * self.interval + 2.0
        self.prefix = self.ex.prefix
        self.keys = GuardKeys(self.prefix, world_size)          # the store protocol (guard_protocol)
        self.diagnosis = Diagnosis(self.keys, rank, world_size, what, self.interval)   # who is missing
        self.count = 0
        self.hard_exit = hard_exit or (lambda message: _hard_exit(message))
        self._current: Optional[tuple[int, Optional[str], Optional[list[int]], float]] = None
        self._handling = False          # the main thread is naming the missing ranks (it will raise)
        self._aborted = False           # this rank published abort
        self._seen_abort = False        # this rank counted itself in abort-seen (the store host waits for it)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ---- the phase ----------------------------------------------------------------------------------------
    def __enter__(self) -> "GroupGuard":
        try:
            self.keys.set_at(self.store, self.rank, 0, None, None, "started")
            self.keys.add_beat(self.store, self.rank)
        except Exception as store_exc:      # noqa: BLE001 - the store host died before this rank got here
            raise self._store_gone(f"the start of {self.what}", store_exc) from store_exc
        self._thread = threading.Thread(target=self._watch, name="het_plugin-group-guard", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if exc is None:
                self._finish()
            elif not self._aborted:
                text = f"rank {self.rank} failed during {PHASE} ({self.what}): {short(exc)}"
                self._abort(text, [self.rank], text)
        finally:
            self._stop.set()
            if self._thread is not None:
                self._thread.join(self.interval + 1.0)
        return False

    def creation_timeout(self, asked: Optional[timedelta]) -> timedelta:
        """The timeout a gloo creation is made with: the framework's, shortened to the bound."""
        bound = timedelta(seconds=self.bound)
        return bound if asked is None or asked > bound else asked

    @contextlib.contextmanager
    def creating(self, members: Optional[Sequence[int]], desc: Optional[str]) -> Iterator[int]:
        """Around one creation: publish where this rank is; a failure names the missing members."""
        self.count += 1
        n = self.count
        members = None if members is None else [int(r) for r in members]
        if members is not None and self.rank not in members:
            yield n             # torch returns at once on a non-member: nothing to publish or bound
            return
        self.keys.set_at(self.store, self.rank, n, desc, members, "creating")
        self._current = (n, desc, members, time.monotonic())
        try:
            yield n
        except GroupCreationTimeout:
            self._current = None
            raise
        except Exception as exc:
            started = self._current[3] if self._current else time.monotonic()
            self._current = None
            err = self._creation_failed(n, desc, members, exc, time.monotonic() - started)
            if err is exc:
                raise
            raise err from exc
        finally:
            self._current = None

    def where(self, n: int, desc: Optional[str], members: Optional[Sequence[int]], size: Optional[int] = None) -> str:
        return self.diagnosis.where(n, desc, members, size)

    def describe(self, ranks: Sequence[int], n: Optional[int], store=None) -> tuple[list[int], str]:
        """(the missing ranks, what each one was doing): :meth:`Diagnosis.describe` over this rank's store."""
        return self.diagnosis.describe(store or self.store, ranks, n)

    def _creation_failed(self, n, desc, members, exc: BaseException, elapsed: float) -> BaseException:
        where = self.where(n, desc, members)
        if not (from_peers(exc) or elapsed >= 0.9 * self.bound):
            # this rank's own error (bad arguments, a backend refusing): tell the others, raise it as it is
            self._abort(f"rank {self.rank} failed at {where}: {short(exc)}", [self.rank],
                        f"rank {self.rank} failed at {where}: {short(exc, 200)}")
            return exc
        self._handling = True
        try:
            others = [r for r in (range(self.world_size) if members is None else members) if r != self.rank]
            try:
                missing, details = self.describe(others, n)
            except Exception as store_exc:      # noqa: BLE001 - the store itself is gone
                return self._store_gone(where, store_exc, exc)
            if not missing:
                self._abort(f"rank {self.rank} failed at {where}: {short(exc)}", [self.rank],
                            f"rank {self.rank} failed at {where}: {short(exc, 200)}")
                return exc
            msg = (f"{PHASE} stopped on rank {self.rank} at {where} after {elapsed:.1f}s: missing rank(s) "
                   f"{format_ranks(missing)}: {details}; every rank waits at most {self.bound:g}s ({ENV_TIMEOUT} "
                   f"or the adapter's timeout_s) [torch: {short(exc, 160)}]")
            self._abort(msg, missing, details)
            return GroupCreationTimeout(msg, missing)
        finally:
            self._handling = False

    def _store_gone(self, where: str, store_exc: BaseException,
                    torch_exc: Optional[BaseException] = None) -> "GroupCreationTimeout":
        """The error when the store itself stopped answering: its host (rank 0, or torchrun's agent) is gone."""
        host, missing = store_host()
        torch_error = "" if torch_exc is None or str(store_exc) == str(torch_exc) else \
            f" [torch: {short(torch_exc, 160)}]"
        msg = (f"{PHASE} stopped on rank {self.rank} at {where}: the store stopped answering "
               f"({short(store_exc, 160)}): {host} is gone{torch_error}")
        return GroupCreationTimeout(msg, missing, PHASE)

    def _finish(self) -> None:
        """Wait (bounded) until every rank finished; stop at once when a rank gave up.

        One counter and one ``end`` key, whatever the world size: every rank adds itself to the counter, the
        last one sets ``end`` to "done", a rank that gives up sets it to "abort" (:meth:`_publish_abort`), and
        the others block in one ``store.wait`` on ``end`` for the bound -- no polling, so a rank's requests do
        not grow with how long the slowest rank takes (about 6 per rank; docs/benchmark-startup.md)."""
        deadline = time.monotonic() + self.bound
        try:
            self.keys.set_at(self.store, self.rank, self.count, None, None, "done")
            self.keys.finish(self.store, self.rank)
            ended = self.keys.wait_key(self.store, self.keys.key("end"), deadline)
            if ended and self.keys.ended_done(self.store):
                return
            self._check_abort()
        except GroupCreationTimeout:
            raise
        except Exception as store_exc:      # noqa: BLE001 - the store's host is gone
            raise self._store_gone(f"the end of {self.what}", store_exc) from store_exc
        self._handling = True
        try:
            late = self.keys.not_done(self.store)
            try:
                missing, details = self.describe(late, None)
            except Exception:       # noqa: BLE001 - the store is gone: the plain message
                missing, details = late, "the store stopped answering"
            missing = missing or late
            msg = (f"{PHASE} ({self.what}) did not finish on every rank: rank {self.rank} finished its "
                   f"{self.count} groups, missing rank(s) {format_ranks(missing)} within {self.bound:g}s: "
                   f"{details}; every rank waits at most {self.bound:g}s ({ENV_TIMEOUT} or the adapter's "
                   "timeout_s)")
            self._abort(msg, missing, details)
        finally:
            self._handling = False
        raise GroupCreationTimeout(msg, missing)

    # ---- stopping every rank --------------------------------------------------------------------------------
    def _abort(self, message: str, missing: Sequence[int], cause: str) -> None:
        """Tell every rank this one gave up: ``missing`` the ranks it blames, ``cause`` the short reason."""
        self._aborted = True
        record = json.dumps({"message": message, "missing": list(missing), "cause": cause})
        try:
            self._publish_abort(self.store, record)
        except Exception:       # noqa: BLE001 - the store is gone: the others find out by themselves
            return
        self._linger_if_host(self.store, missing)

    def _publish_abort(self, store, record: str) -> None:
        """This rank's record, who gave up first, and ``end`` (which wakes the ranks waiting in :meth:`_finish`)."""
        self.keys.publish_abort(store, self.rank, record)

    def _linger_if_host(self, store, missing: Sequence[int]) -> None:
        """The store lives in rank 0's process (init_process_group's MASTER_ADDR store): before it goes, give the
        other live ranks' watchers (polling every interval) the time to read why -- else they can only say that
        the store's host is gone, not which rank was missing. Bounded: 2 intervals + 1 s."""
        if self.rank != 0 or store_host()[1] != [0]:
            return
        expected = len([r for r in range(self.world_size) if r != self.rank and r not in set(missing)])
        deadline = time.monotonic() + 2 * self.interval + 1.0
        while time.monotonic() < deadline:
            try:
                if self.keys.abort_seen(store) >= expected:
                    return
            except Exception:   # noqa: BLE001 - the store is gone already
                return
            time.sleep(0.05)

    def _abort_message(self, store) -> Optional[tuple[int, dict]]:
        by = self.keys.first_abort(store)
        if by is None:
            return None
        found = by, self.keys.record(store, by) or {}
        if by != self.rank and not self._seen_abort:
            self._seen_abort = True
            try:
                self.keys.abort_seen(store, 1)      # the store's host waits for this before it goes
            except Exception:   # noqa: BLE001
                pass
        return found

    def _check_abort(self) -> None:
        """While waiting at the end: another rank gave up -> stop here too."""
        found = self._abort_message(self.store)
        if found is not None and found[0] != self.rank:
            by, record = found
            raise GroupCreationTimeout(self.diagnosis.gave_up(by, record), record.get("missing") or [by], PHASE)

    def _watch(self) -> None:
        try:
            store = self.store.clone()
        except Exception:       # noqa: BLE001 - no second connection: torch's creation timeout bounds alone
            return
        seen_abort: Optional[float] = None
        store_down: Optional[float] = None
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            try:
                self.keys.add_beat(store, self.rank)
                found = self._abort_message(store)
                store_down = None
            except Exception as exc:        # noqa: BLE001
                store_down = store_down or now
                if now - store_down > self.grace and not self._handling and not self._stop.is_set():
                    self._end(f"{PHASE} stopped on rank {self.rank}: the store stopped answering for "
                              f"{now - store_down:.0f}s ({short(exc, 160)}): {store_host()[0]} is gone")
                continue
            if found is not None and found[0] != self.rank and not self._aborted:
                # inside torch's creation the main thread cannot see it: end now; elsewhere (the final wait
                # wakes on the end key) give the main thread the grace to raise by itself
                seen_abort = seen_abort or now
                if ((self._current is not None or now - seen_abort > self.grace) and not self._handling
                        and not self._stop.is_set()):
                    self._end(self.diagnosis.gave_up(*found))
                    return
            current = self._current
            if current is not None and now - current[3] > self.overrun and not self._handling:
                n, desc, members, _ = current
                where = self.where(n, desc, members)
                others = [r for r in (range(self.world_size) if members is None else members) if r != self.rank]
                try:
                    missing, details = self.describe(others, n, store)
                except Exception:   # noqa: BLE001
                    missing, details = [], "the store stopped answering"
                if self._current is not current or self._stop.is_set():
                    continue
                msg = (f"{PHASE} stopped on rank {self.rank}: {where} did not return from torch within "
                       f"{self.bound:g}s (the backend does not honour the creation timeout)"
                       + (f"; missing rank(s) {format_ranks(missing)}: {details}" if missing else "")
                       + f"; every rank waits at most {self.bound:g}s ({ENV_TIMEOUT} or the adapter's timeout_s)")
                record = json.dumps({"message": msg, "missing": missing or [self.rank],
                                     "cause": details or f"rank {self.rank} stuck in torch at {where}"})
                try:
                    self._publish_abort(store, record)
                    self._linger_if_host(store, missing)
                except Exception:   # noqa: BLE001
                    pass
                self._end(msg)
                return

    def _end(self, message: str) -> None:
        """The main thread cannot be interrupted: say where it is, then end the process."""
        current = self._current
        inside = (f"; this rank (rank {self.rank}) was inside torch at {self.where(*current[:3])}, which "
                  "het_plugin cannot interrupt: ending the process" if current is not None else
                  f"; this rank (rank {self.rank}) is ending its process")
        stack = _main_stack()
        self.hard_exit(message + inside + (f"\nmain thread at:\n{stack}" if stack else ""))


def _main_stack(limit: int = 6) -> str:
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return ""
    return "".join(traceback.format_stack(frame, limit=limit)).rstrip()


# ---- the creation timeout and its restoration -------------------------------------------------------------

def bounds_creation(backend: Optional[str], default_backend: str) -> bool:
    """Whether torch's creation waits for the members, bounded by new_group's timeout: gloo (and the gloo
    half of a device-mapped backend); not NCCL (lazy), not a custom backend (its own waits)."""
    effective = str(backend or default_backend).lower()
    parts = [p.split(":")[-1] for p in effective.split(",")]
    return "gloo" in parts and all(p in ("gloo", "nccl") for p in parts)


def torch_default_timeout(backend: Optional[str], default_backend: str) -> timedelta:
    """What ``new_group(timeout=None)`` gives the group (torch's per-backend default)."""
    from torch.distributed import distributed_c10d as c10d
    try:
        return c10d._get_default_timeout(c10d.Backend(str(backend or default_backend)))
    except Exception:   # noqa: BLE001 - older/newer torch: the constant
        from torch.distributed.constants import default_pg_timeout
        return default_pg_timeout


def restore_timeout(group: Any, timeout: timedelta) -> None:
    """Give a group created with the bounded timeout the one the framework asked for (its collectives')."""
    import torch.distributed as tdist
    from torch.distributed import distributed_c10d as c10d
    if not isinstance(group, tdist.ProcessGroup) or c10d._rank_not_in_group(group):
        return
    c10d._set_pg_timeout(timeout, group)
