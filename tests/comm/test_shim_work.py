"""ShimWork: the handle async het_shim calls return (no process group needed)."""
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from het_plugin.comm.work import ShimWork, done_work


@pytest.fixture
def pool():
    with ThreadPoolExecutor(max_workers=1) as p:
        yield p


def test_wait_runs_the_finish_step_once_after_the_job(pool):
    gate, calls = threading.Event(), []
    t = torch.zeros(2)
    w = ShimWork(future=pool.submit(gate.wait), finish=lambda: calls.append(t.add_(1)), result=[t])
    assert not w.is_completed()
    gate.set()
    assert w.wait() and w.wait()
    assert len(calls) == 1 and t.tolist() == [1.0, 1.0]
    assert w.is_completed() and w.is_success() and w.result() == [t]


def test_job_errors_surface_from_wait_every_time(pool):
    def boom():
        raise RuntimeError("leader link down")
    w = ShimWork(future=pool.submit(boom))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="leader link down"):
            w.wait()
    assert w.is_completed() and not w.is_success() and isinstance(w.exception(), RuntimeError)


def test_waits_on_native_works_before_finishing():
    order = []

    class Native:
        def wait(self):
            order.append("native")

        def is_completed(self):
            return True

    w = ShimWork(works=[Native(), Native()], finish=lambda: order.append("finish"))
    w.wait()
    assert order == ["native", "native", "finish"]


def test_get_future_completes_with_the_result_tensors(pool):
    gate = threading.Event()
    t = torch.ones(3)
    fut = ShimWork(future=pool.submit(gate.wait), result=[t]).get_future()
    assert not fut.done()
    gate.set()
    assert fut.wait()[0] is t
    assert done_work([t]).get_future().wait()[0] is t
