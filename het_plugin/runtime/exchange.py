"""Publish-wait-collect over a torch.distributed key-value store: the one primitive every cross-rank
check of het_plugin uses (plan agreement, vendor agreement, discovery).

A store, not a collective: a rank that failed publishes its error instead of a value, so every rank
stops with the same message, and a rank that never arrives is named after one bounded wait instead of
leaving the others in a collective forever. Keys carry the elastic restart count
(``TORCHELASTIC_RESTART_COUNT``), so a restarted job never reads the previous attempt's keys from
torchrun's long-lived agent store, and a per-(label, rank) call count, so the n-th exchange of a label
on every rank uses the same keys.

One timeout rule: an explicit ``timeout_s``, else the one an adapter was given for the duration of its
call (:func:`configured_timeout`: ``initialize_model_parallel(..., timeout_s=)``, the DeepSpeed section's
``timeout_s``), else ``HET_PLUGIN_TIMEOUT`` (seconds), else :data:`DEFAULT_TIMEOUT_S`.

Values are JSON; one over :data:`COMPRESS_FROM` bytes is stored zlib-compressed (:func:`encode_value`): the
store serves every byte once per reader, and what is large here (a rank's discovered node, the gathered
cluster every rank reads back) is repetitive JSON that shrinks several times (docs/benchmark-startup.md).
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

from ..core.errors import ConfigError, HetPluginError
from ..core.ranks.dims import format_ranks

ENV_TIMEOUT = "HET_PLUGIN_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
COMPRESS_FROM = 256         # bytes of JSON from which a value is stored compressed
_ZLIB = b"\x00z"            # marks a compressed value (JSON never starts with a NUL byte)


class ExchangeTimeout(HetPluginError, RuntimeError):
    """Some ranks never published within the timeout (crashed, hung, or never started)."""

    def __init__(self, message: str, missing: Sequence[int]):
        super().__init__(message)
        self.missing = list(missing)


class RemoteError(HetPluginError, RuntimeError):
    """Another rank published an error that is not a ConfigError (those are re-raised as ConfigError)."""


_configured: list[float] = []      # the adapters' timeout_s=, innermost last (configured_timeout)


def check_timeout(value: Any, field: str = "timeout_s", source: Optional[str] = None) -> float:
    """A timeout given as a parameter: a positive number of seconds (ConfigError otherwise)."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if isinstance(value, bool) or not seconds > 0 or seconds != seconds or seconds == float("inf"):
        raise ConfigError(f"{field}={value!r} is not a positive number of seconds", source=source, field=field,
                          fix=f"give {field} in seconds, e.g. 300, or leave it out ({ENV_TIMEOUT} or "
                              f"{DEFAULT_TIMEOUT_S:g} s then apply)")
    return seconds


@contextlib.contextmanager
def configured_timeout(seconds: Optional[float], field: str = "timeout_s",
                       source: Optional[str] = None) -> Iterator[Optional[float]]:
    """Every wait inside (plan check, group creation, the shim's vendor check, discovery) uses ``seconds``
    unless a call passes its own; None changes nothing (``HET_PLUGIN_TIMEOUT`` or the default apply)."""
    if seconds is None:
        yield None
        return
    value = check_timeout(seconds, field, source)
    with _calls_lock:
        _configured.append(value)
    try:
        yield value
    finally:
        with _calls_lock:
            _configured.remove(value)


def timeout_s(explicit: Optional[float] = None, env: Optional[Mapping[str, str]] = None) -> float:
    """The bound on every wait het_plugin owns (see the module docstring)."""
    if explicit is not None:
        return float(explicit)
    if _configured:
        return _configured[-1]
    text = (os.environ if env is None else env).get(ENV_TIMEOUT, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"{ENV_TIMEOUT}={text!r} is not a positive number of seconds", source="environment",
                          field=ENV_TIMEOUT, fix=f"set {ENV_TIMEOUT} to e.g. 300, or unset it")
    return value


@dataclass(frozen=True)
class Entry:
    """What one member published: a JSON-able value, or the error it hit."""
    index: int              # position among the members (group rank)
    rank: int               # global rank, for messages
    value: Any = None
    error: Optional[dict] = None

    def raise_error(self, prefix: Optional[str] = None) -> None:
        """Re-raise a published error here: a ConfigError keeps its source, field and fix. ``prefix``
        starts the message (default: "rank N: ")."""
        err = self.error or {}
        problem = (f"rank {self.rank}: " if prefix is None else prefix) + err.get("problem", "?")
        if err.get("config"):
            raise ConfigError(problem, source=err.get("source"), field=err.get("field"), fix=err.get("fix"))
        raise RemoteError(problem)


def encode_error(exc: BaseException) -> dict:
    if isinstance(exc, ExchangeTimeout):        # travels as itself: every member raises the root's message
        return {"config": False, "timeout": True, "problem": str(exc), "missing": list(exc.missing)}
    if isinstance(exc, ConfigError):
        return {"config": True, "problem": exc.problem, "source": exc.source, "field": exc.field, "fix": exc.fix}
    return {"config": False, "problem": f"{type(exc).__name__}: {exc}"}


_calls: dict[tuple[str, int], itertools.count] = {}
_calls_lock = threading.Lock()


def reset_call_counts() -> None:
    """Forget the per-label call counts (tests that reuse one store)."""
    with _calls_lock:
        _calls.clear()


class Exchange:
    """One exchange among ``members`` (global ranks, in member order) through ``store``.

    ``index`` is this process's position among the members. Use one Exchange per round; its keys are
    ``het_plugin/<restart>/<label>/<call>/...``.
    """

    def __init__(self, store, label: str, *, index: int, members: Sequence[int], what: str,
                 timeout: Optional[float] = None, env: Optional[Mapping[str, str]] = None,
                 key: Optional[str] = None):
        env = os.environ if env is None else env
        self.store, self.index, self.members, self.what = store, index, list(members), what
        self.timeout_s = timeout_s(timeout, env)
        if key is None:
            with _calls_lock:
                key = str(next(_calls.setdefault((label, self.members[index]), itertools.count())))
        self.prefix = f"het_plugin/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/{label}/{key}"

    # ---- the two shapes: everyone sees everything, or one root collects and answers -------------
    def all_gather(self, value: Any = None, *, error: Optional[BaseException] = None) -> list[Entry]:
        """Publish (value or error) and return every member's entry. Raises ExchangeTimeout naming the
        members that never published."""
        self._publish("v", self.index, value, error)
        return self._collect("v")

    def gather(self, value: Any = None, *, error: Optional[BaseException] = None,
               root: int = 0) -> Optional[list[Entry]]:
        """Publish; the root (a member index) waits for and returns every entry, the others get None."""
        self._publish("v", self.index, value, error)
        return self._collect("v") if self.index == root else None

    def broadcast(self, value: Any = None, *, error: Optional[BaseException] = None, root: int = 0) -> Entry:
        """The root publishes one answer (value or error); every member returns it (the root too)."""
        if self.index == root:
            self._publish("answer", 0, value, error)
        return self._collect("answer", indices=[0], who=[self.members[root]])[0]

    def decide(self, value: Any = None, *, judge: Callable[[list[Entry]], Any],
               error: Optional[BaseException] = None, root: int = 0,
               stops: Callable[[Entry], bool] = lambda reply: reply.error is not None) -> Entry:
        """Publish; the root gathers every entry and publishes ``judge(entries)`` (JSON-able; an exception it
        raises travels as the answer's error) under one key that every member reads: the linear shape of an
        all-gather whose members only need the verdict. A member makes 4 store requests whatever the world
        size (publish, wait, read, done); the root about 4 plus one per member's key in a multi-key call.

        Failures keep one message on every member: the root that times out publishes the ExchangeTimeout
        (naming the missing members) as the answer and raises it; the others raise the same. A member whose
        answer never comes (the root itself is missing or died) waits ``timeout + answer_margin`` and then
        names the missing members itself (a halving search over the members' keys). Returns the answer entry
        (its ``error`` set when the judge failed). When the answer ``stops`` every member (default: the judge
        failed) the root waits (bounded) until every member that published has read it, since it may host the
        store; otherwise it goes on at once (a member that died after publishing must not hold it back: the next
        phase names that member)."""
        self._publish("v", self.index, value, error)
        missing: list[int] = []
        if self.index == root:
            try:
                entries = self._collect("v")
            except ExchangeTimeout as exc:
                self._publish("answer", 0, None, exc)
                missing = list(exc.missing)
            else:
                try:
                    answer, failure = judge(entries), None
                except Exception as exc:        # noqa: BLE001 - every member stops with it
                    answer, failure = None, exc
                self._publish("answer", 0, answer, failure)
        try:
            reply = self._collect("answer", indices=[0], who=[self.members[root]],
                                  timeout=self.timeout_s + answer_margin(self.timeout_s))[0]
        except ExchangeTimeout:
            raise self._timeout_here(root) from None
        if missing or stops(reply):
            self.done(root=root, skip=missing)
        else:
            self.store.set(f"{self.prefix}/done/{self.index}", "1")
        if reply.error is not None and reply.error.get("timeout"):
            raise ExchangeTimeout(reply.error["problem"], reply.error.get("missing", []))
        return reply

    def done(self, *, root: int = 0, wait_s: float = 60.0, skip: Sequence[int] = ()) -> None:
        """Every member says it has read the answer; the root waits for that (best effort, at most
        ``wait_s``): the root may host the store, and leaving early would take it from the others.
        ``skip``: members (global ranks) known to be missing, not waited for."""
        self.store.set(f"{self.prefix}/done/{self.index}", "1")
        if self.index == root:
            gone = set(skip)
            keys = [f"{self.prefix}/done/{i}" for i, r in enumerate(self.members) if r not in gone]
            try:
                self.store.wait(keys, timedelta(seconds=min(wait_s, self.timeout_s)))
            except Exception:
                pass

    # ---- plumbing ---------------------------------------------------------------------------------
    def _publish(self, kind: str, slot: int, value: Any, error: Optional[BaseException]) -> None:
        payload = {"error": encode_error(error)} if error is not None else {"value": value}
        self.store.set(f"{self.prefix}/{kind}/{slot}", encode_value(payload))

    def _collect(self, kind: str, indices: Optional[Sequence[int]] = None,
                 who: Optional[Sequence[int]] = None, timeout: Optional[float] = None) -> list[Entry]:
        indices = list(range(len(self.members))) if indices is None else list(indices)
        who = [self.members[i] for i in indices] if who is None else list(who)
        keys = [f"{self.prefix}/{kind}/{i}" for i in indices]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout_s if timeout is None else timeout))
        except Exception as exc:    # the store's own timeout error; say who is missing instead
            try:
                missing = [r for r, k in zip(who, keys) if not self.store.check([k])]
            except Exception:       # noqa: BLE001 - the store itself is gone
                raise ExchangeTimeout(f"the store stopped answering while waiting for {self.what} "
                                      f"({type(exc).__name__}: {exc}): the process hosting it (rank 0 under "
                                      "init_process_group's MASTER_ADDR, or torchrun's agent) is gone?", []) from None
            raise ExchangeTimeout(
                f"rank(s) {format_ranks(missing)} never reached {self.what} within {self.timeout_s:g}s "
                f"(crashed, hung, or not started?); every rank waits at most {ENV_TIMEOUT} seconds or the adapter's "
                "timeout_s", missing) from None
        out = []
        for i, r, raw in zip(indices, who, _read_all(self.store, keys)):
            payload = decode_value(raw)
            out.append(Entry(i, r, payload.get("value"), payload.get("error")))
        return out

    def _timeout_here(self, root: int = 0) -> ExchangeTimeout:
        """No answer from the root within the bound: name the members that never published (or, when all
        did, the root that never answered) with the message the root would have published."""
        try:
            missing = self._missing("v")
        except Exception as exc:    # noqa: BLE001 - the store itself is gone
            return ExchangeTimeout(f"the store stopped answering while waiting for {self.what} "
                                   f"({type(exc).__name__}: {exc}): the process hosting it (rank 0 under "
                                   "init_process_group's MASTER_ADDR, or torchrun's agent) is gone?", [])
        if not missing:
            root = self.members[root]
            return ExchangeTimeout(f"rank {root} collected {self.what} but never answered within "
                                   f"{self.timeout_s:g}s (crashed or hung?); every rank waits at most "
                                   f"{ENV_TIMEOUT} seconds or the adapter's timeout_s", [root])
        return ExchangeTimeout(
            f"rank(s) {format_ranks(missing)} never reached {self.what} within {self.timeout_s:g}s "
            f"(crashed, hung, or not started?); every rank waits at most {ENV_TIMEOUT} seconds or the adapter's "
            "timeout_s", missing)

    def _missing(self, kind: str, limit: int = 1024) -> list[int]:
        """Members without their ``kind`` key: halving ranges with the store's all-keys check, so k missing
        members cost about 2k log2(N) requests instead of N."""
        found: list[int] = []
        todo = [(0, len(self.members))]
        while todo and len(found) < limit:
            lo, hi = todo.pop()
            if self.store.check([f"{self.prefix}/{kind}/{i}" for i in range(lo, hi)]):
                continue
            if hi - lo == 1:
                found.append(self.members[lo])
                continue
            mid = (lo + hi) // 2
            todo += [(mid, hi), (lo, mid)]
        return sorted(found)


def encode_value(payload: Any) -> bytes:
    """JSON, zlib-compressed (behind a marker) from :data:`COMPRESS_FROM` bytes on."""
    text = json.dumps(payload, default=str).encode()
    return text if len(text) < COMPRESS_FROM else _ZLIB + zlib.compress(text, 6)


def decode_value(raw: bytes) -> Any:
    raw = bytes(raw)
    return json.loads(zlib.decompress(raw[len(_ZLIB):]) if raw.startswith(_ZLIB) else raw)


def answer_margin(timeout: float) -> float:
    """How much longer than the root a member waits for the answer: the root's own timeout runs from when it
    started waiting, and its verdict (naming the missing) must reach the others before they give up."""
    return min(10.0, max(2.0, 0.1 * timeout))


def _read_all(store, keys: Sequence[str]) -> list[bytes]:
    """Every key's value in one request where the store has ``multi_get`` (torch >= 2.5), else one get each."""
    if len(keys) > 1:
        try:
            return list(store.multi_get(list(keys)))
        except Exception:       # noqa: BLE001 - a store without it (or an older torch): one get each
            pass
    return [store.get(k) for k in keys]


def first_error(entries: Sequence[Entry]) -> Optional[Entry]:
    return next((e for e in entries if e.error is not None), None)
