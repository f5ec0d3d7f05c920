"""Every rank must use the same plan: compare plan hashes across ranks before any group is built.

Uses the default process group's key-value store, not a collective: a rank whose plan computation
failed publishes its error instead of a hash, so every rank stops with the same clear message instead
of some ranks waiting forever in a collective.
"""
from __future__ import annotations

import itertools
from datetime import timedelta
from .errors import PlanMismatchError

# One call sequence per (label, rank): every rank's n-th check uses the same keys. Keyed by rank too, so
# ranks simulated as threads of one process (tests) do not advance each other's sequence.
_calls: dict[tuple[str, int], itertools.count] = {}
ERROR_PREFIX = "error:"


def _default_store():
    from torch.distributed import distributed_c10d
    return distributed_c10d._get_default_store()


def check_plan_agreement(value: str, *, rank: int, world_size: int, store=None, label: str = "plan",
                         timeout_s: float = 300.0) -> None:
    """Publish ``value`` (a plan hash, or ``"error: <message>"``) and compare with every other rank.

    Raises PlanMismatchError on every rank, naming the ranks that differ (or that failed).
    """
    store = store or _default_store()
    call = next(_calls.setdefault((label, rank), itertools.count()))
    prefix = f"het_plugin/agree/{label}/{call}"
    store.set(f"{prefix}/{rank}", value)
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as exc:  # a rank never published: it died before computing a plan
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise PlanMismatchError(f"ranks {missing} never reported a {label} within {timeout_s:.0f}s "
                                f"(crashed before planning?): {exc}") from None
    values = [store.get(k).decode() for k in keys]
    describe_disagreement(values, label)


def describe_disagreement(values: list[str], label: str = "plan") -> None:
    """Raise PlanMismatchError when the per-rank values are not all the same valid hash."""
    failed = {r: v for r, v in enumerate(values) if v.startswith(ERROR_PREFIX)}
    if failed:
        first = min(failed)
        raise PlanMismatchError(f"rank(s) {sorted(failed)} could not compute the {label}; rank {first}: "
                                f"{failed[first][len(ERROR_PREFIX):].strip()}")
    by_value: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        by_value.setdefault(v, []).append(r)
    if len(by_value) > 1:
        parts = "; ".join(f"ranks {_ranges(rs)} have {v}" for v, rs in sorted(by_value.items(), key=lambda kv: kv[1][0]))
        raise PlanMismatchError(f"ranks computed different {label}s ({parts}); give every rank the same "
                                "cluster file (or plan file) and the same arguments")


def _ranges(ranks: list[int]) -> str:
    out, start = [], ranks[0]
    prev = start
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(out)


def error_value(exc: BaseException) -> str:
    return f"{ERROR_PREFIX} {exc}"


def agree_on_plan(make, *, rank: int, world_size: int, store=None, timeout_s: float = 300.0):
    """Call ``make()`` (returns a Plan), then check every rank got the same one; raise on any failure.

    A rank whose own planning failed tells the others first, then raises *its* error (the file, field
    and fix of its problem); the other ranks raise PlanMismatchError naming it.
    """
    try:
        plan = make()
    except Exception as exc:
        try:
            check_plan_agreement(error_value(exc), rank=rank, world_size=world_size, store=store,
                                 timeout_s=timeout_s)
        except PlanMismatchError:
            pass                # expected: this rank's own error is the clearer message
        raise
    check_plan_agreement(plan.hash, rank=rank, world_size=world_size, store=store, timeout_s=timeout_s)
    return plan
