"""The handle the shim returns: torch.distributed code calls ``wait()`` on it like on any backend's Work."""
from __future__ import annotations

import threading
from concurrent.futures import Future
from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist


class ShimWork(dist.Work):
    """Done when its worker-thread job (``future``) and its native ``works`` are done, then ``finish`` ran.

    ``finish`` runs once, on the thread that waits first (e.g. copying a host-staged receive into the
    caller's tensor); errors from the job are raised from ``wait()``. ``finish_on_caller``: ``finish`` issues
    native collectives, which must stay on the caller's thread: ``get_future`` then completes on the thread
    that asks for it (blocking there) instead of on the worker, and the work is not complete before a wait.
    """

    def __init__(self, *, future: Optional[Future] = None, works: Sequence[dist.Work] = (),
                 finish: Optional[Callable[[], None]] = None, result: Sequence[torch.Tensor] = (),
                 finish_on_caller: bool = False):
        super().__init__()
        self._finish_on_caller = finish_on_caller and finish is not None
        self._future = future
        self._works = list(works)
        self._finish = finish
        self._result = list(result)
        self._lock = threading.Lock()
        self._done = False
        self._error: Optional[BaseException] = None

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._done:
                return True
            try:
                if self._future is not None:
                    seconds = timeout.total_seconds() if timeout else None
                    self._future.result(timeout=seconds if seconds else None)
                for w in self._works:
                    w.wait()
                if self._finish is not None:
                    self._finish()
            except BaseException as exc:
                self._error = exc
                raise
            self._done = True
            return True

    def synchronize(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        if self._done or self._error is not None:
            return True
        if self._finish_on_caller:
            return False
        if self._future is not None and not self._future.done():
            return False
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return self._done and self._error is None

    def exception(self):
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        """A torch Future completed with the result tensors once the operation is done."""
        fut: torch.futures.Future = torch.futures.Future()

        def complete(*_):
            try:
                self.wait()
                fut.set_result(self._result)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                fut.set_exception(exc)

        if self._future is not None and not self._works and not self._finish_on_caller:
            self._future.add_done_callback(complete)
        else:
            complete()
        return fut


def done_work(result: Sequence[torch.Tensor] = ()) -> ShimWork:
    """An already completed handle (nothing to communicate)."""
    return ShimWork(result=result)
