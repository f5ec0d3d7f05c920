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
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Sequence

from ..core.errors import HetPluginError
from ..core.ranks.dims import format_ranks
from .exchange import ENV_TIMEOUT, Exchange

PHASE = "group creation"
EXIT_STATUS = 1
DESCRIBE_LIMIT = 1024       # ranks looked at when naming the missing ones (one store round trip each)
MEMBERS_KEPT = 256          # members of a group a rank publishes with where it is


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


def _short(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def _members_text(members: Optional[Sequence[int]], size: Optional[int] = None) -> str:
    if members is None:
        return "every rank"
    if size is not None and size > len(members):
        return f"{size} ranks ({format_ranks(sorted(members))}, ...)"
    return f"ranks {format_ranks(sorted(members))}" if len(members) != 1 else f"rank {members[0]}"


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
        self.count = 0
        self.hard_exit = hard_exit or (lambda message: _hard_exit(message))
        self._current: Optional[tuple[int, Optional[str], Optional[list[int]], float]] = None
        self._handling = False          # the main thread is naming the missing ranks (it will raise)
        self._aborted = False           # this rank published abort
        self._seen_abort = False        # this rank counted itself in abort-seen (the store host waits for it)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ---- keys -------------------------------------------------------------------------------------------
    def _k(self, kind: str, rank: Optional[int] = None) -> str:
        return f"{self.prefix}/{kind}" + ("" if rank is None else f"/{rank}")

    def _set_at(self, n: int, desc: Optional[str], members: Optional[Sequence[int]], state: str) -> None:
        """Where this rank is (what describe() reads); a large group's members are cut to MEMBERS_KEPT."""
        value = {"n": n, "desc": desc, "members": None if members is None else list(members)[:MEMBERS_KEPT],
                 "size": None if members is None else len(members), "state": state}
        self.store.set(self._k("at", self.rank), json.dumps(value))

    @staticmethod
    def _read(store, key: str) -> Optional[bytes]:
        return store.get(key) if store.check([key]) else None

    def _at(self, store, rank: int) -> Optional[dict]:
        raw = self._read(store, self._k("at", rank))
        return json.loads(raw) if raw else None

    def _beat(self, store, rank: int) -> Optional[int]:
        raw = self._read(store, self._k("beat", rank))
        return int(raw) if raw else None

    # ---- the phase ----------------------------------------------------------------------------------------
    def __enter__(self) -> "GroupGuard":
        try:
            self._set_at(0, None, None, "started")
            self.store.add(self._k("beat", self.rank), 1)
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
                text = f"rank {self.rank} failed during {PHASE} ({self.what}): {_short(exc)}"
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
        self._set_at(n, desc, members, "creating")
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
        return f"group #{n}{f' ({desc})' if desc else ''} of {self.what}, {_members_text(members, size)}"

    def _creation_failed(self, n, desc, members, exc: BaseException, elapsed: float) -> BaseException:
        where = self.where(n, desc, members)
        if not (_from_peers(exc) or elapsed >= 0.9 * self.bound):
            # this rank's own error (bad arguments, a backend refusing): tell the others, raise it as it is
            self._abort(f"rank {self.rank} failed at {where}: {_short(exc)}", [self.rank],
                        f"rank {self.rank} failed at {where}: {_short(exc, 200)}")
            return exc
        self._handling = True
        try:
            others = [r for r in (range(self.world_size) if members is None else members) if r != self.rank]
            try:
                missing, details = self.describe(others, n)
            except Exception as store_exc:      # noqa: BLE001 - the store itself is gone
                return self._store_gone(where, store_exc, exc)
            if not missing:
                self._abort(f"rank {self.rank} failed at {where}: {_short(exc)}", [self.rank],
                            f"rank {self.rank} failed at {where}: {_short(exc, 200)}")
                return exc
            msg = (f"{PHASE} stopped on rank {self.rank} at {where} after {elapsed:.1f}s: missing rank(s) "
                   f"{format_ranks(missing)}: {details}; every rank waits at most {self.bound:g}s ({ENV_TIMEOUT} "
                   f"or the adapter's timeout_s) [torch: {_short(exc, 160)}]")
            self._abort(msg, missing, details)
            return GroupCreationTimeout(msg, missing)
        finally:
            self._handling = False

    def _store_gone(self, where: str, store_exc: BaseException,
                    torch_exc: Optional[BaseException] = None) -> "GroupCreationTimeout":
        """The error when the store itself stopped answering: its host (rank 0, or torchrun's agent) is gone."""
        host, missing = store_host()
        torch_error = "" if torch_exc is None or str(store_exc) == str(torch_exc) else \
            f" [torch: {_short(torch_exc, 160)}]"
        msg = (f"{PHASE} stopped on rank {self.rank} at {where}: the store stopped answering "
               f"({_short(store_exc, 160)}): {host} is gone{torch_error}")
        return GroupCreationTimeout(msg, missing, PHASE)

    def describe(self, ranks: Sequence[int], n: Optional[int], store=None) -> tuple[list[int], str]:
        """(the missing ranks, one clause per rank that did not arrive), for the ranks this rank waits
        for (``ranks``) in creation ``n`` (None: at the end).

        The missing ranks are the root causes: a rank that is alive but itself waits in another group
        is followed to what it waits for (the wait-for chain, through each rank's ``at`` record); a rank
        that gave up stands for the ranks it named. Sleeps 3 heartbeat intervals to tell the living from
        the dead."""
        store = store or self.store
        first: dict[int, Optional[int]] = {}
        ats: dict[int, Optional[dict]] = {}
        records: dict[int, Optional[dict]] = {}
        queue = [r for r in ranks if r != self.rank]
        while queue and len(first) < DESCRIBE_LIMIT:
            r = queue.pop(0)
            if r in first:
                continue
            first[r], ats[r], records[r] = self._beat(store, r), self._at(store, r), self._record(store, r)
            at = ats[r]
            if records[r] is None and first[r] is not None and at and at.get("state") == "creating":
                queue += [m for m in self._group_of(at) if m not in first and m != self.rank]
        if any(b is not None and records[r] is None for r, b in first.items()):
            time.sleep(3 * self.interval)
        status: dict[int, str] = {}
        for r in first:
            records[r] = records[r] or self._record(store, r)
            beat = self._beat(store, r)
            at = ats[r] = self._at(store, r) or ats[r]
            if records[r] is not None:
                status[r] = "gave up"
            elif beat is None:
                status[r] = "never"
            elif beat == first[r]:
                status[r] = "stale"
            elif at and at.get("state") == "creating":
                status[r] = "waiting"
            else:
                status[r] = "busy"

        def roots(r: int, seen: set) -> list[int]:
            seen.add(r)
            if status.get(r) == "gave up":
                return [m for m in records[r].get("missing", []) if m != self.rank] or [r]
            if status.get(r) == "waiting":
                found = [x for m in self._group_of(ats[r]) if m != r and m != self.rank and m not in seen
                         for x in roots(m, seen)]
                return found or [r]
            if status.get(r) in ("never", "stale", "busy"):
                return [r]
            return []           # not looked at (beyond DESCRIBE_LIMIT)

        def place(r: int) -> str:
            at = ats.get(r)
            return f"at {self.where(at['n'], at['desc'], at['members'], at.get('size'))}" if at and at.get("n") else \
                "before its first group"

        missing: list[int] = []
        parts: list[str] = []
        blamed: list[int] = []
        for r in [r for r in ranks if r in status]:
            st, at = status[r], ats.get(r)
            if st == "waiting" and n is not None and at and at.get("n") == n:
                continue                    # waits in this same group: it arrived
            if st == "busy" and n is None and at and at.get("state") == "done":
                continue                    # finished (its done key is on the way)
            root = sorted(set(roots(r, set())))
            missing += root
            if st == "gave up":
                parts.append(f"rank {r} gave up ({records[r].get('cause') or records[r].get('message', '?')})")
                continue
            if st == "waiting" and root != [r]:
                parts.append(f"rank {r} is alive but waits {place(r)} for rank(s) {format_ranks(root)}")
                blamed += [x for x in root if x != r]
            else:
                parts.append(self._clause(r, "busy" if st == "waiting" else st, place(r)))
        for r in sorted(set(blamed) - set(ranks)):
            if r in status:
                parts.append(self._clause(r, status[r], place(r)))
        return sorted(set(missing)), "; ".join(parts)

    def _clause(self, r: int, st: str, place: str) -> str:
        if st == "never":
            return f"rank {r} never started {PHASE} (it stopped after the plan check: killed, crashed or hung?)"
        if st == "stale":
            return (f"rank {r} stopped responding, last {place} (no heartbeat for {3 * self.interval:g}s: killed, "
                    "crashed or hung?)")
        return f"rank {r} is alive but still {place}"

    def _group_of(self, at: dict) -> list[int]:
        members = at.get("members")
        return list(range(self.world_size)) if members is None else list(members)

    def _finish(self) -> None:
        """Wait (bounded) until every rank finished; stop at once when a rank gave up.

        One counter and one ``end`` key, whatever the world size: every rank adds itself to the counter, the
        last one sets ``end`` to "done", a rank that gives up sets it to "abort" (:meth:`_publish_abort`), and
        the others block in one ``store.wait`` on ``end`` for the bound -- no polling, so a rank's requests do
        not grow with how long the slowest rank takes (about 6 per rank; docs/benchmark-startup.md)."""
        end = self._k("end")
        deadline = time.monotonic() + self.bound
        try:
            self._set_at(self.count, None, None, "done")
            self.store.set(self._k("done", self.rank), "1")
            if self.store.add(self._k("done"), 1) >= self.world_size:
                self.store.set(end, "done")
            ended = self._wait_key(end, deadline)
            if ended and self.store.get(end) == b"done":
                return
            self._check_abort()
        except GroupCreationTimeout:
            raise
        except Exception as store_exc:      # noqa: BLE001 - the store's host is gone
            raise self._store_gone(f"the end of {self.what}", store_exc) from store_exc
        self._handling = True
        try:
            late = self._not_done()
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

    def _wait_key(self, key: str, deadline: float) -> bool:
        """Block until ``key`` exists or the deadline passes (False). A store that fails before the deadline
        is gone: its error propagates. (A wait that times out also makes torch's C++ store log one warning.)"""
        left = deadline - time.monotonic()
        if left > 0:
            try:
                self.store.wait([key], timedelta(seconds=left))
                return True
            except Exception:       # noqa: BLE001 - a timeout, or the store gone: the check below tells
                if time.monotonic() < deadline - 0.5:
                    raise
        return bool(self.store.check([key]))

    def _not_done(self) -> list[int]:
        """Ranks without their 'done' key, the first DESCRIBE_LIMIT of them: halving ranges with the store's
        all-keys check, so k late ranks cost about 2k log2(world) round trips instead of one per rank (every
        finished rank runs this when it times out)."""
        late: list[int] = []
        todo = [(0, self.world_size)]
        while todo and len(late) < DESCRIBE_LIMIT:
            lo, hi = todo.pop()
            if self.store.check([self._k("done", r) for r in range(lo, hi)]):
                continue
            if hi - lo == 1:
                late.append(lo)
                continue
            mid = (lo + hi) // 2
            todo += [(mid, hi), (lo, mid)]          # lower half first (popped first)
        return late

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
        store.set(self._k("abort", self.rank), record)
        store.set(self._k("abort"), str(self.rank))
        store.set(self._k("end"), "abort")

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
                if store.add(self._k("abort-seen"), 0) >= expected:
                    return
            except Exception:   # noqa: BLE001 - the store is gone already
                return
            time.sleep(0.05)

    def _record(self, store, rank: int) -> Optional[dict]:
        raw = self._read(store, self._k("abort", rank))
        return json.loads(raw) if raw else None

    def _abort_message(self, store) -> Optional[tuple[int, dict]]:
        raw = self._read(store, self._k("abort"))
        if raw is None:
            return None
        by = int(raw)
        found = by, self._record(store, by) or {}
        if by != self.rank and not self._seen_abort:
            self._seen_abort = True
            try:
                store.add(self._k("abort-seen"), 1)      # the store's host waits for this before it goes
            except Exception:   # noqa: BLE001
                pass
        return found

    def _gave_up(self, by: int, record: dict) -> str:
        missing = record.get("missing") or [by]
        return (f"{PHASE} ({self.what}) stopped: missing rank(s) {format_ranks(missing)}: rank {by} gave up: "
                f"{record.get('message', '?')}")

    def _check_abort(self) -> None:
        """While waiting at the end: another rank gave up -> stop here too."""
        found = self._abort_message(self.store)
        if found is not None and found[0] != self.rank:
            by, record = found
            raise GroupCreationTimeout(self._gave_up(by, record), record.get("missing") or [by], PHASE)

    def _watch(self) -> None:
        try:
            store = self.store.clone()
        except Exception:       # noqa: BLE001 - no second connection: torch's creation timeout bounds alone
            return
        beat_key = self._k("beat", self.rank)
        seen_abort: Optional[float] = None
        store_down: Optional[float] = None
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            try:
                store.add(beat_key, 1)
                found = self._abort_message(store)
                store_down = None
            except Exception as exc:        # noqa: BLE001
                store_down = store_down or now
                if now - store_down > self.grace and not self._handling and not self._stop.is_set():
                    self._end(f"{PHASE} stopped on rank {self.rank}: the store stopped answering for "
                              f"{now - store_down:.0f}s ({_short(exc, 160)}): {store_host()[0]} is gone")
                continue
            if found is not None and found[0] != self.rank and not self._aborted:
                # inside torch's creation the main thread cannot see it: end now; elsewhere (the final wait
                # wakes on the end key) give the main thread the grace to raise by itself
                seen_abort = seen_abort or now
                if ((self._current is not None or now - seen_abort > self.grace) and not self._handling
                        and not self._stop.is_set()):
                    self._end(self._gave_up(*found))
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


def _from_peers(exc: BaseException) -> bool:
    """torch's store and network errors (a rendezvous that timed out, a connection a peer closed), also
    gloo's, which arrive as a plain RuntimeError."""
    try:
        import torch.distributed as tdist
        kinds = tuple(k for k in (getattr(tdist, "DistError", None),) if k is not None)
    except ImportError:     # pragma: no cover
        kinds = ()
    if kinds and isinstance(exc, kinds):
        return True
    return isinstance(exc, RuntimeError) and bool(
        re.search(r"connection|peer|timed? ?out|socket|broken pipe", str(exc), re.IGNORECASE))


def store_host() -> tuple[str, list[int]]:
    """Who serves the default store, for messages: (a description, the rank it is, if it is one)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return "torchrun's agent, which hosts it (its node died or the agent was stopped?),", []
    return "rank 0, which hosts it (init_process_group's MASTER_ADDR store),", [0]


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
