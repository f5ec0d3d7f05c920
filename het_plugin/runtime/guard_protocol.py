"""The group guard's store protocol (:mod:`het_plugin.runtime.guard`): the keys one guarded phase uses under
``het_plugin/<restart>/groups/<call>/`` and the records in them, read and written the same way by every rank.

* ``at/<rank>``: where the rank is (JSON: creation number ``n``, description ``desc``, ``members`` cut to
  :data:`MEMBERS_KEPT`, their ``size``, ``state``: started, creating or done);
* ``beat/<rank>``: a counter the rank's watcher thread adds to every interval (its heartbeat);
* ``abort/<rank>``: why the rank gave up (JSON: ``message``, the ``missing`` ranks it blames, a short
  ``cause``); ``abort``: the rank that gave up first; ``abort-seen``: how many ranks read it (the store's host
  waits for them before its process goes);
* ``done/<rank>`` and the counter ``done``: who finished; ``end``: "done" (set by the last rank) or "abort".
"""
from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Optional, Sequence

MEMBERS_KEPT = 256          # members of a group a rank publishes with where it is
DESCRIBE_LIMIT = 1024       # ranks looked at when naming the missing ones (one store round trip each)


class GuardKeys:
    """One guarded phase's keys under ``prefix`` for a world of ``world_size`` ranks; every method takes the
    store connection to use (the main thread's, or the watcher thread's own)."""

    def __init__(self, prefix: str, world_size: int):
        self.prefix, self.world_size = prefix, world_size

    def key(self, kind: str, rank: Optional[int] = None) -> str:
        return f"{self.prefix}/{kind}" + ("" if rank is None else f"/{rank}")

    @staticmethod
    def read(store, key: str) -> Optional[bytes]:
        return store.get(key) if store.check([key]) else None

    # ---- where each rank is ------------------------------------------------------------------------------
    def set_at(self, store, rank: int, n: int, desc: Optional[str], members: Optional[Sequence[int]],
               state: str) -> None:
        """Where ``rank`` is (what the diagnosis reads); a large group's members are cut to MEMBERS_KEPT."""
        value = {"n": n, "desc": desc, "members": None if members is None else list(members)[:MEMBERS_KEPT],
                 "size": None if members is None else len(members), "state": state}
        store.set(self.key("at", rank), json.dumps(value))

    def at(self, store, rank: int) -> Optional[dict]:
        raw = self.read(store, self.key("at", rank))
        return json.loads(raw) if raw else None

    def add_beat(self, store, rank: int) -> None:
        store.add(self.key("beat", rank), 1)

    def beat(self, store, rank: int) -> Optional[int]:
        raw = self.read(store, self.key("beat", rank))
        return int(raw) if raw else None

    # ---- giving up ----------------------------------------------------------------------------------------
    def publish_abort(self, store, rank: int, record: str) -> None:
        """``rank``'s record, who gave up first, and ``end`` (which wakes the ranks waiting for it)."""
        store.set(self.key("abort", rank), record)
        store.set(self.key("abort"), str(rank))
        store.set(self.key("end"), "abort")

    def record(self, store, rank: int) -> Optional[dict]:
        """Why ``rank`` gave up (None: it did not)."""
        raw = self.read(store, self.key("abort", rank))
        return json.loads(raw) if raw else None

    def first_abort(self, store) -> Optional[int]:
        """The rank that gave up first (None: nobody)."""
        raw = self.read(store, self.key("abort"))
        return None if raw is None else int(raw)

    def abort_seen(self, store, add: int = 0) -> int:
        """Count this rank among those that read the abort (``add`` 1), or read the count (0)."""
        return store.add(self.key("abort-seen"), add)

    # ---- the end ------------------------------------------------------------------------------------------
    def finish(self, store, rank: int) -> None:
        """``rank`` finished; the last one sets ``end`` to done."""
        store.set(self.key("done", rank), "1")
        if store.add(self.key("done"), 1) >= self.world_size:
            store.set(self.key("end"), "done")

    def ended_done(self, store) -> bool:
        return store.get(self.key("end")) == b"done"

    @staticmethod
    def wait_key(store, key: str, deadline: float) -> bool:
        """Block until ``key`` exists or the deadline passes (False). A store that fails before the deadline
        is gone: its error propagates. (A wait that times out also makes torch's C++ store log one warning.)"""
        left = deadline - time.monotonic()
        if left > 0:
            try:
                store.wait([key], timedelta(seconds=left))
                return True
            except Exception:       # noqa: BLE001 - a timeout, or the store gone: the check below tells
                if time.monotonic() < deadline - 0.5:
                    raise
        return bool(store.check([key]))

    def not_done(self, store, limit: int = DESCRIBE_LIMIT) -> list[int]:
        """Ranks without their 'done' key, the first ``limit`` of them: halving ranges with the store's
        all-keys check, so k late ranks cost about 2k log2(world) round trips instead of one per rank (every
        finished rank runs this when it times out)."""
        late: list[int] = []
        todo = [(0, self.world_size)]
        while todo and len(late) < limit:
            lo, hi = todo.pop()
            if store.check([self.key("done", r) for r in range(lo, hi)]):
                continue
            if hi - lo == 1:
                late.append(lo)
                continue
            mid = (lo + hi) // 2
            todo += [(mid, hi), (lo, mid)]          # lower half first (popped first)
        return late


def store_host() -> tuple[str, list[int]]:
    """Who serves the default store, for messages: (a description, the rank it is, if it is one)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return "torchrun's agent, which hosts it (its node died or the agent was stopped?),", []
    return "rank 0, which hosts it (init_process_group's MASTER_ADDR store),", [0]
