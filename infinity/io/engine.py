"""`IOEngine`: submits batches of `IOOp` to the native engine and returns `IOFuture`s.

It owns turning ops into native batches; the map from batch id to future is
its `CompletionSource` base's (shared with the task pool). The daemon's loop registers
`completion_fd` with its poller and calls `poll()` when it becomes
readable; other callers simply block in `IOFuture.result()`, which waits in
slices of `WAIT_SLICE_S` so that Ctrl-C and signal handlers get through.

A forked child inherits the engine's memory but not its threads: the native
engine of every live `IOEngine` is left alone there, never destroyed (its
destructor would join threads and destroy condition variables that only the
parent has), and the child's `submit` says to make a new engine.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import weakref
from typing import Callable, Iterable

from infinity.config import IOConfig
from infinity.errors import AlignmentError, IOEngineError
from infinity.io.completions import WAIT_SLICE_S, CompletionSource
from infinity.io.errno_map import error_from_errno
from infinity.io.future import IOFuture
from infinity.io.native import NativeEngine, native
from infinity.io.ops import IOOp

__all__ = ["IOEngine", "WAIT_SLICE_S"]

_live: weakref.WeakSet[IOEngine] = weakref.WeakSet()


def _abandon_in_child() -> None:
    for engine in list(_live):
        # One more reference that nothing drops: the child never runs the native destructor.
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(engine._native))


os.register_at_fork(after_in_child=_abandon_in_child)


class IOEngine(CompletionSource):
    """Asynchronous O_DIRECT / pread-pwrite engine with futures (poll, pending, completion_fd:
    see `CompletionSource`).

    Built from an `IOConfig` (the `[io]` table), with keyword arguments
    overriding single fields: `IOEngine(backend="threads", queue_depth=8)`.
    """

    unit_name = "I/O batch"

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
        super().__init__(self._native, error_from_errno)
        _live.add(self)

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
    def staged_bytes(self) -> int:
        """Bytes that staged reads (`IOOp.staged`) brought in through the staging memory."""
        return int(self._native.staged_bytes)

    # --- submitting -----------------------------------------------------------

    def submit(self, ops: Iterable[IOOp] | IOOp, *, keepalive: object = None,
               to_error: Callable[[int, str], IOEngineError] | None = None) -> IOFuture:
        """Queue a batch and return its future at once.

        The buffers (and checksum arrays) must stay alive until the future
        completes; pass them as `keepalive` to have the future hold them.
        `to_error(errno, message)` makes the future's exception if the batch
        fails (default `error_from_errno`; the message starts with "op N: ",
        N the first failed op's index, see `errno_map.failed_op`), for a
        caller that knows more about the ops' files than the engine does.
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
            return self._track(batch_id, keepalive, to_error)

    def run(self, ops: Iterable[IOOp] | IOOp, timeout_s: float | None = None) -> None:
        """submit() and wait for the result."""
        self.submit(ops).result(timeout_s)

    # --- completing -----------------------------------------------------------

    def __repr__(self) -> str:
        return f"<IOEngine backend={self.backend} {'closed' if self._closed else 'open'}>"
