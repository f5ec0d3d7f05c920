"""A store that counts what goes through it: requests and bytes, per operation.

Why: "linear in the world size" is a property of the protocol, and a test on a busy machine can only check
it by counting (a time bound fails under load). Wrap each rank's store in a :class:`CountingStore` and the
requests and bytes of every exchange are known exactly; the start-up benchmark (benchmarks/bench_startup.py)
sums them per phase and extrapolates from them.

One request is one call on the store (a ``wait`` on many keys, a ``multi_get`` of many keys: one request,
their names and values counted in the bytes). Bytes are keys and values sent plus values received, not the
protocol's framing.
"""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional


def _size(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    return len(str(value).encode())


@dataclass
class StoreCounts:
    """Requests and bytes by operation; shared by a store and its clones (one rank's connections)."""
    requests: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, op: str, nbytes: int) -> None:
        with self.lock:
            self.requests[op] += 1
            self.bytes[op] += nbytes

    @property
    def total_requests(self) -> int:
        return sum(self.requests.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def snapshot(self) -> tuple[int, int]:
        with self.lock:
            return sum(self.requests.values()), sum(self.bytes.values())

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()
            self.bytes.clear()


class CountingStore:
    """Wraps a torch.distributed store (TCPStore, HashStore, PrefixStore, ...) and counts every call.

    Has the calls het_plugin makes (set, get, multi_get, wait, check, add, compare_set, delete_key,
    num_keys, clone, set_timeout); for code that needs a real c10d Store (``init_process_group(store=)``)
    pass ``.inner``.
    """

    def __init__(self, inner, counts: Optional[StoreCounts] = None):
        self.inner = inner
        self.counts = counts if counts is not None else StoreCounts()

    def set(self, key: str, value) -> None:
        self.counts.add("set", len(key) + _size(value))
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        value = self.inner.get(key)
        self.counts.add("get", len(key) + _size(value))
        return value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self.inner.multi_get(keys)
        self.counts.add("multi_get", sum(len(k) for k in keys) + sum(_size(v) for v in values))
        return values

    def wait(self, keys: list[str], *timeout) -> None:
        self.counts.add("wait", sum(len(k) for k in keys))
        self.inner.wait(keys, *timeout)

    def check(self, keys: Iterable[str]) -> bool:
        keys = list(keys)
        self.counts.add("check", sum(len(k) for k in keys))
        return self.inner.check(keys)

    def add(self, key: str, amount: int) -> int:
        self.counts.add("add", len(key) + 8)
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected, desired) -> bytes:
        value = self.inner.compare_set(key, expected, desired)
        self.counts.add("compare_set", len(key) + _size(expected) + _size(desired) + _size(value))
        return value

    def delete_key(self, key: str) -> bool:
        self.counts.add("delete_key", len(key))
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        self.counts.add("num_keys", 0)
        return self.inner.num_keys()

    def set_timeout(self, timeout) -> None:
        self.inner.set_timeout(timeout)

    def clone(self) -> "CountingStore":
        """A second connection (the group guard's heartbeat thread); counted with this one. The connect itself
        counts as one request."""
        self.counts.add("clone", 0)
        return CountingStore(self.inner.clone(), self.counts)
