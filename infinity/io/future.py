"""`IOFuture`: the pending result of one submitted batch (I/O engine) or task (task pool).

A future is resolved exactly once, by whichever comes first: the owner of
the event loop calling `IOEngine.poll()` or `TaskPool.poll()`, or a thread calling `result()`,
which waits in native code with the GIL released and no Python lock held.
Callbacks run in the thread that resolves the future.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Protocol

from infinity.errors import IOEngineError
from infinity.io.errno_map import error_from_errno

_log = logging.getLogger(__name__)


class _Collector(Protocol):
    def _collect(self, future: IOFuture, timeout_s: float | None) -> None: ...


class IOFuture:
    """Completion of one batch of I/O ops; thread-safe."""

    def __init__(self, collector: _Collector, batch_id: int, keepalive: object = None, *,
                 to_error: Callable[[int, str], IOEngineError] = error_from_errno) -> None:
        self._collector = collector
        self._to_error = to_error
        self.batch_id = batch_id
        self._keepalive = keepalive  # buffers the native threads use; dropped once done
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._error: IOEngineError | None = None
        self._callbacks: list[Callable[[IOFuture], None]] = []

    def __repr__(self) -> str:
        state = "pending" if not self._event.is_set() else ("failed" if self._error else "done")
        unit = getattr(self._collector, "unit_name", "batch")  # "I/O batch" or "task"
        return f"<IOFuture {unit} {self.batch_id} {state}>"

    def done(self) -> bool:
        """True once the batch has completed; never blocks."""
        if not self._event.is_set():
            try:
                self._collector._collect(self, 0.0)
            except TimeoutError:
                return False
        return self._event.is_set()

    def result(self, timeout_s: float | None = None) -> None:
        """Wait for the batch (or task); raise its error (IOEngineError or a subclass) if it failed.

        Raises TimeoutError if it is still running after timeout_s seconds.
        """
        if not self._event.is_set():
            self._collector._collect(self, timeout_s)
        if self._error is not None:
            raise self._error

    def exception(self, timeout_s: float | None = None) -> IOEngineError | None:
        """Wait like result(), but return the error instead of raising it."""
        if not self._event.is_set():
            self._collector._collect(self, timeout_s)
        return self._error

    def add_done_callback(self, fn: Callable[[IOFuture], None]) -> None:
        """Call fn(future) once it completes; at once, in this thread, if it already has."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        self._run(fn)

    def _wait_resolved(self, timeout_s: float | None) -> bool:
        return self._event.wait(timeout_s)

    def _resolve(self, err: int, message: str) -> bool:
        with self._lock:
            if self._event.is_set():
                return False
            self._error = self._to_error(err, message) if err else None
            callbacks, self._callbacks = self._callbacks, []
            self._keepalive = None
            self._event.set()
        for fn in callbacks:
            self._run(fn)
        return True

    def _run(self, fn: Callable[[IOFuture], None]) -> None:
        try:
            fn(self)
        except Exception:
            # Like concurrent.futures: one bad callback must not break the
            # event loop that happened to resolve the future.
            _log.exception("exception in an IOFuture done-callback for batch %d", self.batch_id)
