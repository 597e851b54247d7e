"""`CompletionSource`: the futures of a native object that finishes work by id.

The I/O engine (batches) and the task pool (tasks) report completions the same
way: an eventfd that becomes readable, `poll()` returning `(id, errno,
message)` for each finished id, and a blocking `wait(id, timeout_s)`. This
module owns what both do with that on the Python side: the map from id to
`IOFuture`, resolving futures from `poll()` (the daemon's loop) or from a
caller blocked in `IOFuture.result()`, in slices so that Ctrl-C gets through;
and their lifetime: closing (from several threads at once), the finalizer, the
context manager, and refusing the parent's object in a forked child.
"""

from __future__ import annotations

import os
import threading
import time
from types import TracebackType
from typing import Callable, Protocol, Self

from infinity.errors import IOEngineError
from infinity.io.future import IOFuture

WAIT_SLICE_S = 0.1


class NativeCompletions(Protocol):
    """What the native engine and task pool both offer."""

    @property
    def completion_fd(self) -> int: ...

    def poll(self) -> list[tuple[int, int, str]]: ...

    def wait(self, task_id: int, timeout_s: float = -1.0) -> tuple[int, str]: ...

    def close(self) -> None: ...


class CompletionSource:
    """Futures by id over a `NativeCompletions`; subclasses submit and call `_track`."""

    # "I/O batch" or "task": how messages name one unit of work.
    unit_name = "unit"

    def __init__(self, completions: NativeCompletions,
                 to_error: Callable[[int, str], IOEngineError]) -> None:
        self._completions = completions
        self._to_error = to_error
        self._lock = threading.Lock()
        self._futures: dict[int, IOFuture] = {}
        self._closed = False
        self._pid = os.getpid()  # native threads do not survive fork()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Cancel the work not started (its futures fail), wait for the work running, stop the
        threads. A close from several threads at once returns in each once all that is done."""
        if os.getpid() != self._pid:
            self._closed = True  # the parent's object: nothing of it runs here
            return
        with self._lock:
            self._closed = True
        self._completions.close()  # a second caller waits there for the first
        self.poll()

    def __del__(self) -> None:
        # Closed here, with the GIL released while its threads are joined, rather than by the
        # native object's deallocation, which would hold the GIL until the work in flight ends.
        try:
            if not self._closed and os.getpid() == self._pid:
                self._completions.close()
        except Exception:  # noqa: BLE001 - nothing may escape a finalizer
            pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @property
    def completion_fd(self) -> int:
        """An eventfd that becomes readable when work completes; poll() clears it."""
        return self._completions.completion_fd

    def _track(self, unit_id: int, keepalive: object,
               to_error: Callable[[int, str], IOEngineError] | None = None) -> IOFuture:
        """The future of a unit just submitted; call with `self._lock` held. `to_error` makes
        its exception instead of the source's own, should it fail."""
        future = IOFuture(self, unit_id, keepalive, to_error=to_error or self._to_error)
        self._futures[unit_id] = future
        return future

    def poll(self) -> int:
        """Resolve every completed unit's future (running its callbacks); never blocks.

        Returns how many futures it resolved.
        """
        resolved = 0
        done = iter(self._completions.poll())  # taken out of the native object: only here now
        try:
            for unit_id, err, message in done:
                if self._resolve(unit_id, err, message):
                    resolved += 1
        finally:
            # A callback that raised KeyboardInterrupt (or SystemExit) must not leave the
            # futures of the rest unresolved for ever: they are resolved before it goes on.
            for unit_id, err, message in done:
                try:
                    self._resolve(unit_id, err, message)
                except BaseException:  # noqa: BLE001 - the first one is the one raised
                    pass
        return resolved

    def pending(self) -> int:
        """Futures submitted and not yet resolved."""
        with self._lock:
            return len(self._futures)

    def _resolve(self, unit_id: int, err: int, message: str) -> bool:
        with self._lock:
            future = self._futures.pop(unit_id, None)
        return future is not None and future._resolve(err, message)

    def _collect(self, future: IOFuture, timeout_s: float | None) -> None:
        # No Python lock is held while the native wait blocks (GIL released). It waits in
        # slices: the native wait cannot be interrupted, and a signal's Python handler (Ctrl-C)
        # runs only between them, while the unit's result stays in the native object.
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining = WAIT_SLICE_S if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                err, message = self._completions.wait(future.batch_id, min(WAIT_SLICE_S, remaining))
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{self.unit_name} {future.batch_id} did not complete within {timeout_s} s"
                    ) from None
                continue
            except KeyError:
                # poll() or another waiter took the result and is resolving it now.
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not future._wait_resolved(left):
                    raise TimeoutError(
                        f"{self.unit_name} {future.batch_id} did not complete within {timeout_s} s"
                    ) from None
                return
            self._resolve(future.batch_id, err, message)
            return
