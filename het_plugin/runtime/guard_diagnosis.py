"""Naming who is missing when group creation stops (:mod:`het_plugin.runtime.guard`): from the other ranks'
records in the store (:mod:`het_plugin.runtime.guard_protocol`), which ranks are the root causes -- gave up,
never started, stopped beating (killed, crashed, hung), or alive but somewhere else -- and one clause per rank
saying where each one was."""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from ..core.ranks.dims import format_ranks
from .guard_protocol import DESCRIBE_LIMIT, GuardKeys

PHASE = "group creation"


def short(exc: BaseException, limit: int = 300) -> str:
    """An exception on one line, cut to ``limit`` characters."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def members_text(members: Optional[Sequence[int]], size: Optional[int] = None) -> str:
    if members is None:
        return "every rank"
    if size is not None and size > len(members):
        return f"{size} ranks ({format_ranks(sorted(members))}, ...)"
    return f"ranks {format_ranks(sorted(members))}" if len(members) != 1 else f"rank {members[0]}"


def from_peers(exc: BaseException) -> bool:
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


@dataclass
class Diagnosis:
    """What rank ``rank`` of ``world_size`` says about the others in the phase ``what`` names; ``interval``:
    the heartbeat interval (3 of them without a beat: stopped)."""
    keys: GuardKeys
    rank: int
    world_size: int
    what: str
    interval: float

    def where(self, n: int, desc: Optional[str], members: Optional[Sequence[int]], size: Optional[int] = None) -> str:
        return f"group #{n}{f' ({desc})' if desc else ''} of {self.what}, {members_text(members, size)}"

    def gave_up(self, by: int, record: dict) -> str:
        """The message of a rank that stops because rank ``by`` gave up with ``record``."""
        missing = record.get("missing") or [by]
        return (f"{PHASE} ({self.what}) stopped: missing rank(s) {format_ranks(missing)}: rank {by} gave up: "
                f"{record.get('message', '?')}")

    def describe(self, store, ranks: Sequence[int], n: Optional[int]) -> tuple[list[int], str]:
        """(the missing ranks, one clause per rank that did not arrive), for the ranks this rank waits
        for (``ranks``) in creation ``n`` (None: at the end).

        The missing ranks are the root causes: a rank that is alive but itself waits in another group
        is followed to what it waits for (the wait-for chain, through each rank's ``at`` record); a rank
        that gave up stands for the ranks it named. Sleeps 3 heartbeat intervals to tell the living from
        the dead."""
        keys = self.keys
        first: dict[int, Optional[int]] = {}
        ats: dict[int, Optional[dict]] = {}
        records: dict[int, Optional[dict]] = {}
        queue = [r for r in ranks if r != self.rank]
        while queue and len(first) < DESCRIBE_LIMIT:
            r = queue.pop(0)
            if r in first:
                continue
            first[r], ats[r], records[r] = keys.beat(store, r), keys.at(store, r), keys.record(store, r)
            at = ats[r]
            if records[r] is None and first[r] is not None and at and at.get("state") == "creating":
                queue += [m for m in self.group_of(at) if m not in first and m != self.rank]
        if any(b is not None and records[r] is None for r, b in first.items()):
            time.sleep(3 * self.interval)
        status: dict[int, str] = {}
        for r in first:
            records[r] = records[r] or keys.record(store, r)
            beat = keys.beat(store, r)
            at = ats[r] = keys.at(store, r) or ats[r]
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
                found = [x for m in self.group_of(ats[r]) if m != r and m != self.rank and m not in seen
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
                parts.append(self.clause(r, "busy" if st == "waiting" else st, place(r)))
        for r in sorted(set(blamed) - set(ranks)):
            if r in status:
                parts.append(self.clause(r, status[r], place(r)))
        return sorted(set(missing)), "; ".join(parts)

    def clause(self, r: int, st: str, place: str) -> str:
        if st == "never":
            return f"rank {r} never started {PHASE} (it stopped after the plan check: killed, crashed or hung?)"
        if st == "stale":
            return (f"rank {r} stopped responding, last {place} (no heartbeat for {3 * self.interval:g}s: killed, "
                    "crashed or hung?)")
        return f"rank {r} is alive but still {place}"

    def group_of(self, at: dict) -> list[int]:
        members = at.get("members")
        return list(range(self.world_size)) if members is None else list(members)
