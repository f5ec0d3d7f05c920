"""The shim beside the caller's own collectives (issue: deadlock under Megatron's streams): native collectives
are issued on the caller's thread, native communicators are connected when the group is created (on the creating
thread), only the host hop runs on the worker, and nothing waits for the whole device.

CPU torch has no CUDA: the test runs four ranks as threads of this process (one HashStore, real gloo groups),
treats their CPU tensors as accelerator tensors (``shim._accelerated``), and stands in for CUDA's events,
streams and ``torch.cuda.synchronize`` with recorders; each vendor subgroup's native backend is wrapped to record
the thread that issues every call."""
from __future__ import annotations

import contextlib
import threading
import types
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from het_plugin.comm import ShimLayout, ShimProcessGroup
from het_plugin.comm import shim

VENDORS = ("nvidia", "nvidia", "amd", "amd")


class Recorder:
    def __init__(self):
        self.lock = threading.Lock()
        self.calls: list[tuple[str, str]] = []

    def add(self, what: str) -> None:
        with self.lock:
            self.calls.append((what, threading.current_thread().name))


class NativeProxy:
    """Delegates to a real gloo backend and records which thread issued each call."""

    def __init__(self, pg, rec: Recorder):
        self._pg, self._rec = pg, rec

    def __getattr__(self, name):
        target = getattr(self._pg, name)
        if not callable(target):
            return target

        def call(*args, **kwargs):
            self._rec.add(f"native.{name}")
            return target(*args, **kwargs)
        return call


@pytest.fixture
def fake_cuda(monkeypatch):
    rec = Recorder()

    class Event:
        def record(self, stream=None):
            rec.add("event.record")

        def synchronize(self):
            rec.add("event.synchronize")

    class Stream:
        def __init__(self, device=None):
            rec.add("stream.new")

        def wait_stream(self, other):
            rec.add("stream.wait_stream")

        def synchronize(self):
            rec.add("stream.synchronize")

    @contextlib.contextmanager
    def stream(s):
        yield

    class FakeNCCL:
        def __init__(self, store, rank, size, options):
            rec.add("nccl.create")

        def eager_connect_single_device(self, device):
            rec.add("nccl.eager_connect")
    FakeNCCL.Options = lambda: types.SimpleNamespace(config=types.SimpleNamespace())

    monkeypatch.setattr(shim, "_accelerated", lambda t: True)
    monkeypatch.setattr(shim, "_device_native_kind", lambda: "nccl")
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: rec.add("cuda.synchronize"))
    return rec


def run_ranks(fn, n=4):
    out, threads = {}, []

    def body(r):
        try:
            out[r] = fn(r)
        except Exception as exc:     # noqa: BLE001 - reported below
            out[r] = exc
    for r in range(n):
        threads.append(threading.Thread(target=body, args=(r,), name=f"caller-{r}"))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    for r, v in out.items():
        if isinstance(v, Exception):
            raise v
    return out


def test_native_collectives_stay_on_the_callers_thread_and_no_device_wide_sync(fake_cuda):
    store = dist.HashStore()
    rec = fake_cuda
    n = len(VENDORS)

    def rank(r):
        pg = ShimProcessGroup(store, r, n, list(range(n)), timedelta(seconds=60), ShimLayout(VENDORS))
        try:
            pg._native["cpu"] = NativeProxy(pg._native["cpu"], rec)
            t = torch.arange(10, dtype=torch.float32) + r
            pg.allreduce([t]).wait()
            b = torch.full((7,), float(r))
            pg.broadcast([b], dist.BroadcastOptions()).wait()            # root 0
            out = torch.empty(n * 3)
            pg.all_gather_single(out, torch.full((3,), float(r))).wait()
            rs = torch.empty(2)
            pg.reduce_scatter_single(rs, torch.arange(n * 2, dtype=torch.float32)).wait()
            # async: two all-reduces in flight, waited in order (as Megatron's overlapped gradient reduction)
            x, y = torch.ones(5) * r, torch.ones(5) * (r + 1)
            wx, wy = pg.allreduce([x]), pg.allreduce([y])
            wx.wait()
            wy.wait()
            one = torch.tensor([float(r)])       # one element: one stripe, so two of the four ranks own no piece
            pg.allreduce([one]).wait()
            assert one.tolist() == [float(sum(range(n)))]
            return t.tolist(), b.tolist(), out.tolist(), rs.tolist(), x.tolist(), y.tolist()
        finally:
            pg.shutdown()
    results = run_ranks(rank)
    total = sum(range(n))
    for r, (t, b, out, rs, x, y) in results.items():
        assert t == [float(i * n + total) for i in range(10)]
        assert b == [0.0] * 7
        assert out == [float(k) for k in range(n) for _ in range(3)]
        assert rs == [float(n * (2 * r)), float(n * (2 * r + 1))]
        assert x == [float(total)] * 5 and y == [float(total + n)] * 5
    calls = rec.calls
    native = [(w, th) for w, th in calls if w.startswith("native.")]
    assert native and all(th.startswith("caller-") for _, th in native), \
        f"native collectives issued off the caller's thread: {[c for c in native if not c[1].startswith('caller-')]}"
    assert not [c for c in calls if c[0] == "cuda.synchronize"], "a device-wide torch.cuda.synchronize"
    hops = [th for w, th in calls if w == "event.synchronize"]
    assert hops and all(th.startswith("het_shim") for th in hops), "the host hop waits for events on the worker"
    assert {th for w, th in calls if w == "event.record"} <= {f"caller-{r}" for r in range(n)}
    eager = [th for w, th in calls if w == "nccl.eager_connect"]
    assert sorted(eager) == [f"caller-{r}" for r in range(n)], "native communicators connected at creation"
