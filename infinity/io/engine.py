"""`IOEngine`: submits batches of `IOOp` to the native engine and returns `IOFuture`s.

It owns the map from batch id to future. The daemon's loop registers
`completion_fd` with its poller and calls `poll()` when it becomes
readable; other callers simply block in `IOFuture.result()`.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from types import TracebackType
from typing import Iterable

from infinity.config import IOConfig
from infinity.errors import AlignmentError, IOEngineError
from infinity.io.future import IOFuture
from infinity.io.native import NativeEngine, native
from infinity.io.ops import IOOp


class IOEngine:
    """Asynchronous O_DIRECT / pread-pwrite engine with futures.

    Built from an `IOConfig` (the `[io]` table), with keyword arguments
    overriding single fields: `IOEngine(backend="threads", queue_depth=8)`.
    """

    def __init__(
        self,
        config: IOConfig | None = None,
        *,
        backend: str | None = None,
        num_threads: int | None = None,
        queue_depth: int | None = None,
        block_size_bytes: int | None = None,
    ) -> None:
        cfg = config if config is not None else IOConfig()
        cfg = dataclasses.replace(
            cfg,
            backend=cfg.backend if backend is None else backend,
            num_threads=cfg.num_threads if num_threads is None else num_threads,
            queue_depth=cfg.queue_depth if queue_depth is None else queue_depth,
            block_size_bytes=cfg.block_size_bytes if block_size_bytes is None else block_size_bytes,
        )
        cfg.validate()
        self.config = cfg
        try:
            self._native: NativeEngine = native().Engine(
                cfg.resolved_num_threads(), cfg.queue_depth, cfg.block_size_bytes, cfg.backend,
                cfg.staging_bytes,
            )
        except (RuntimeError, OSError) as exc:
            raise IOEngineError(str(exc)) from exc
        self._lock = threading.Lock()
        self._futures: dict[int, IOFuture] = {}
        self._closed = False
        self._pid = os.getpid()  # the worker threads do not survive fork()

    @classmethod
    def from_config(cls, config: IOConfig) -> IOEngine:
        """An engine built from the `[io]` table."""
        return cls(config)

    # --- properties -----------------------------------------------------------

    @property
    def backend(self) -> str:
        """io_uring, aio or threads: what O_DIRECT ops use ("auto" resolved)."""
        return self._native.backend

    @property
    def backend_note(self) -> str:
        """Why "auto" passed over io_uring (and aio); empty when it did not."""
        return self._native.backend_note

    @property
    def completion_fd(self) -> int:
        """An eventfd that becomes readable when a batch completes; poll() clears it."""
        return self._native.completion_fd

    @property
    def staged_bytes(self) -> int:
        """Bytes that staged reads (`IOOp.staged`) brought in through the staging memory."""
        return int(self._native.staged_bytes)

    @property
    def closed(self) -> bool:
        return self._closed

    # --- submitting -----------------------------------------------------------

    def submit(self, ops: Iterable[IOOp] | IOOp, *, keepalive: object = None) -> IOFuture:
        """Queue a batch and return its future at once.

        The buffers (and checksum arrays) must stay alive until the future
        completes; pass them as `keepalive` to have the future hold them.
        Raises AlignmentError for a direct op whose address, size or offset
        is not 4096-aligned (nothing of the batch is queued then).
        """
        batch = [ops] if isinstance(ops, IOOp) else list(ops)
        tuples = [op.as_tuple() for op in batch]
        mod = native()
        with self._lock:
            if self._closed:
                raise IOEngineError("the I/O engine is closed: create a new IOEngine")
            if os.getpid() != self._pid:
                raise IOEngineError(
                    "this IOEngine was created in the parent process and has no I/O threads after fork(): "
                    "create a new IOEngine in the child"
                )
            try:
                batch_id = self._native.submit(tuples)
            except mod.AlignmentError as exc:
                raise AlignmentError(str(exc)) from exc
            except ValueError as exc:
                raise IOEngineError(f"invalid I/O op: {exc}") from exc
            except RuntimeError as exc:
                raise IOEngineError(str(exc)) from exc
            future = IOFuture(self, batch_id, keepalive)
            self._futures[batch_id] = future
        return future

    def run(self, ops: Iterable[IOOp] | IOOp, timeout_s: float | None = None) -> None:
        """submit() and wait for the result."""
        self.submit(ops).result(timeout_s)

    # --- completing -----------------------------------------------------------

    def poll(self) -> int:
        """Resolve every completed batch's future (running its callbacks); never blocks.

        Returns how many futures it resolved.
        """
        resolved = 0
        for batch_id, err, message in self._native.poll():
            if self._resolve(batch_id, err, message):
                resolved += 1
        return resolved

    def pending(self) -> int:
        """Futures submitted and not yet resolved."""
        with self._lock:
            return len(self._futures)

    def _resolve(self, batch_id: int, err: int, message: str) -> bool:
        with self._lock:
            future = self._futures.pop(batch_id, None)
        return future is not None and future._resolve(err, message)

    def _collect(self, future: IOFuture, timeout_s: float | None) -> None:
        # No Python lock is held while the native wait blocks (GIL released).
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            err, message = self._native.wait(future.batch_id, -1.0 if timeout_s is None else max(0.0, timeout_s))
        except TimeoutError:
            raise TimeoutError(
                f"I/O batch {future.batch_id} did not complete within {timeout_s} s"
            ) from None
        except KeyError:
            # poll() or another waiter took the result and is resolving it now.
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not future._wait_resolved(remaining):
                raise TimeoutError(
                    f"I/O batch {future.batch_id} did not complete within {timeout_s} s"
                ) from None
            return
        self._resolve(future.batch_id, err, message)

    # --- lifetime ---------------------------------------------------------------

    def close(self) -> None:
        """Cancel queued ops (their futures fail), wait for those in flight, stop the threads."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._native.close()
        self.poll()

    def __enter__(self) -> IOEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<IOEngine backend={self.backend} {'closed' if self._closed else 'open'}>"
