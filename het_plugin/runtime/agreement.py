"""Every rank must use the same plan: compare plan hashes across ranks before any group is built.

Runs over :class:`het_plugin.runtime.exchange.Exchange` (the default store, not a collective): a rank
whose plan computation failed publishes its error instead of a hash, so every rank stops with the same
clear message, and a rank that never arrives is named after one bounded wait (``HET_PLUGIN_TIMEOUT``).
Linear in the world size (:meth:`Exchange.decide`): every rank publishes its hash, rank 0 compares them all
and publishes one verdict that every rank reads (a few store requests per rank, whatever the world size;
the all-gather it replaces was N requests per rank, N^2 on the one store).

A rank may send a *fact* with its hash, something about itself that only the whole launch can judge (its
hostname, for a plan that leaves nodes out: :mod:`het_plugin.runtime.launch_hosts`); rank 0 judges every rank's
fact once the hashes agree, in the same verdict: no request more.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from ..core.errors import PlanMismatchError
from .exchange import Entry, Exchange, ExchangeTimeout
from ..core.ranks.dims import format_ranks


def _default_store():
    from torch.distributed import distributed_c10d
    return distributed_c10d._get_default_store()


#: rank 0's judge of every rank's fact (in rank order; None where a rank sent none): a ConfigError it raises
#: stops every rank with its source, field and fix
JudgeFacts = Callable[[Sequence[Any]], None]


def check_plan_agreement(value: str, *, rank: int, world_size: int, store=None, label: str = "plan",
                         timeout_s: Optional[float] = None, error: Optional[BaseException] = None,
                         fact: Any = None, judge_facts: Optional[JudgeFacts] = None) -> None:
    """Publish ``value`` (a plan hash) or ``error`` and compare with every other rank; ``fact`` (JSON-able, None:
    none) travels with the hash, and rank 0 (``judge_facts``) judges every rank's once the hashes agree.

    Raises PlanMismatchError on every rank, naming the ranks that differ, failed, or never reported; the judge's
    ConfigError on every rank.
    """
    ex = Exchange(store or _default_store(), f"agree/{label}", index=rank, members=range(world_size),
                  what=f"the {label} check", timeout=timeout_s)
    published = value if fact is None or error is not None else {"hash": value, "fact": fact}
    try:
        verdict = ex.decide(published, error=error, judge=lambda entries: _verdict(entries, label, judge_facts),
                            stops=lambda reply: reply.error is not None or reply.value is not None)
    except ExchangeTimeout as exc:
        raise PlanMismatchError(f"{exc} (crashed before planning?)") from None
    if verdict.error is not None and verdict.error.get("config"):     # the facts' judge refused the launch
        verdict.raise_error("")
    if verdict.error is not None:       # rank 0's judging itself failed: say so, on every rank
        raise PlanMismatchError(f"rank {verdict.rank} could not compare the {label}s: "
                                f"{verdict.error.get('problem', '?')}")
    if verdict.value is not None:
        raise PlanMismatchError(verdict.value)


def _hash(value: Any) -> Any:
    return value["hash"] if isinstance(value, dict) else value


def _verdict(entries: list[Entry], label: str, judge_facts: Optional[JudgeFacts] = None) -> Optional[str]:
    """Rank 0: None when every entry is the same value (and the facts pass), else the message every rank
    raises; the facts' judge raises its ConfigError (it travels as the answer's error)."""
    try:
        describe_disagreement(entries, label)
    except PlanMismatchError as exc:
        return str(exc)
    if judge_facts is not None:
        judge_facts([e.value.get("fact") if isinstance(e.value, dict) else None for e in entries])
    return None


def describe_disagreement(entries: list[Entry], label: str = "plan") -> None:
    """Raise PlanMismatchError when the entries are not all the same value."""
    failed = [e for e in entries if e.error is not None]
    if failed:
        first = failed[0]
        raise PlanMismatchError(f"rank(s) {format_ranks([e.rank for e in failed])} could not compute the {label}; "
                                f"rank {first.rank}: {_error_text(first.error)}")
    by_value: dict[str, list[int]] = {}
    for e in entries:
        by_value.setdefault(_hash(e.value), []).append(e.rank)
    if len(by_value) > 1:
        parts = "; ".join(f"ranks {format_ranks(rs)} have {v}"
                          for v, rs in sorted(by_value.items(), key=lambda kv: kv[1][0]))
        raise PlanMismatchError(f"ranks computed different {label}s ({parts}); give every rank the same "
                                "cluster file (or plan file) and the same arguments")


def _error_text(err: dict) -> str:
    where = "".join(f"{err[k]}: " for k in ("source", "field") if err.get(k))
    return where + err.get("problem", "?") + (f" (fix: {err['fix']})" if err.get("fix") else "")


def agree_on_plan(make, *, rank: int, world_size: int, store=None, timeout_s: Optional[float] = None,
                  hash_of=None, fact=None):
    """Call ``make()`` (returns a Plan), then check every rank got the same one; raise on any failure.
    ``hash_of(value)``: what is compared when ``make`` returns more than the plan (default: ``value.hash``);
    the value itself is returned. ``fact``: what each rank sends with its hash for rank 0 to judge
    (``fact.of(value)``, None: nothing; ``fact.judge(value, facts)`` on rank 0 with every rank's, in rank
    order: :class:`het_plugin.runtime.launch_hosts.HostCheck`, the launch's hostnames).

    A rank whose own planning failed tells the others first, then raises *its* error (the file, field
    and fix of its problem); the other ranks raise PlanMismatchError naming it. Called by
    :func:`het_plugin.runtime.startup.startup` only: one start-up sequence for every adapter.
    """
    try:
        value = make()
    except Exception as exc:
        try:
            check_plan_agreement("", rank=rank, world_size=world_size, store=store, timeout_s=timeout_s, error=exc)
        except PlanMismatchError:
            pass                # expected: this rank's own error is the clearer message
        raise
    digest = hash_of(value) if hash_of is not None else value.hash
    mine = fact.of(value) if fact is not None else None
    judge = (lambda facts: fact.judge(value, facts)) if fact is not None and mine is not None else None
    check_plan_agreement(digest, rank=rank, world_size=world_size, store=store, timeout_s=timeout_s, fact=mine,
                         judge_facts=judge)
    return value
