"""`TaskPool`: compute beside the data on native threads, with futures.

The native pool (native/task_pool.*) runs copies, per-block CRC32C, fills and Adam steps
on a fixed set of threads without the GIL, each task split into chunks across
them and reported once, when its last chunk is done, through an eventfd: the
same shape as the I/O engine, so the daemon's loop watches `completion_fd`
and calls `poll()` for both (see infinity.daemon.tasks), and other callers
block in `IOFuture.result()`. This module owns the typed submit calls, the
mapping of bad arguments to typed errors, and the pool's life across fork().

    with TaskPool(num_threads=2) as pool:
        pool.submit_crc32c(address=buf.address, nbytes=n, crc_address=addressof(crcs)).result()
"""

from __future__ import annotations

import ctypes
import errno
import os
import weakref
from typing import Callable

from infinity.errors import AlignmentError, IOEngineError
from infinity.io.completions import CompletionSource
from infinity.io.errno_map import error_from_errno
from infinity.io.future import IOFuture
from infinity.io.native import NativeTaskPool, native
from infinity.io.ops import CRC_BLOCK_BYTES

_live: weakref.WeakSet[TaskPool] = weakref.WeakSet()


def _abandon_in_child() -> None:
    for pool in list(_live):
        # As for IOEngine: the child has none of the pool's threads, so it never runs the
        # native destructor (which would join them).
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(pool._native))


os.register_at_fork(after_in_child=_abandon_in_child)


def default_task_threads() -> int:
    """Threads for a pool when the caller names no count: the cores this process may use."""
    return max(1, len(os.sched_getaffinity(0)))


def task_error(err: int, message: str) -> IOEngineError:
    """The exception for a failed task: a closed pool gets its own advice, the rest the engine's."""
    if err == errno.ECANCELED:
        return IOEngineError(f"{message}. Submit the task again on an open TaskPool.")
    return error_from_errno(err, message)


class TaskPool(CompletionSource):
    """A fixed set of native threads running copy, CRC32C and fill tasks (poll, pending,
    completion_fd: see `CompletionSource`).

    Addresses are raw: the memory must stay valid until the future completes; pass the objects
    that own it as `keepalive` to have the future hold them. `pieces` is how many chunks a
    task is cut into for the threads (0: one per thread, none too small to be worth it).
    """

    unit_name = "task"

    def __init__(self, *, num_threads: int | None = None, thread_name: str = "infinity-task") -> None:
        count = default_task_threads() if num_threads is None else num_threads
        if count < 1:
            raise IOEngineError(f"num_threads is {count}; a task pool needs at least one thread")
        try:
            self._native: NativeTaskPool = native().TaskPool(count, thread_name)
        except (ValueError, OSError) as exc:
            raise IOEngineError(f"could not start the task pool: {exc}") from exc
        super().__init__(self._native, task_error)
        _live.add(self)

    @property
    def num_threads(self) -> int:
        return int(self._native.num_threads)

    # --- submitting -----------------------------------------------------------

    def submit_copy(self, *, dst: int, src: int, nbytes: int, pieces: int = 0,
                    keepalive: object = None) -> IOFuture:
        """Copy `nbytes` from address `src` to address `dst` (which must not overlap), with the
        streaming stores of `copy_bytes` for large pieces."""
        return self._submit(lambda: self._native.submit_copy(dst, src, nbytes, pieces), keepalive)

    def submit_fill(self, *, dst: int, nbytes: int, value: int = 0, pieces: int = 0,
                    keepalive: object = None) -> IOFuture:
        """Set `nbytes` at address `dst` to the byte `value` (0: zero them)."""
        return self._submit(lambda: self._native.submit_fill(dst, nbytes, value, pieces), keepalive)

    def submit_crc32c(self, *, address: int, nbytes: int, crc_address: int,
                      crc_block_bytes: int = CRC_BLOCK_BYTES, verify: bool = False, pieces: int = 0,
                      keepalive: object = None) -> IOFuture:
        """CRC32C of each `crc_block_bytes` block of `nbytes` at `address` into
        uint32[crc_count(nbytes, crc_block_bytes)] at `crc_address`, as the engine's
        `IOOp.crc_address` holds them. verify=True compares with the values there instead, and
        the future fails with ChecksumError naming the first block that differs."""
        return self._submit(
            lambda: self._native.submit_crc32c(address, nbytes, crc_address, crc_block_bytes, verify,
                                               pieces),
            keepalive,
        )

    def submit_adam(self, *, param: int, grad: int, grad_dtype: str, exp_avg: int,
                    exp_avg_sq: int, numel: int, lr: float, beta1: float, beta2: float,
                    eps: float, weight_decay: float, step: int, decoupled: bool,
                    grad_scale: float = 1.0, low: int = 0, low_dtype: str = "none",
                    chunk_elements: int = 1 << 20, keepalive: object = None) -> IOFuture:
        """One Adam (decoupled=False) or AdamW step over `numel` fp32 elements in place (the
        parameter or its master copy at `param`, both moments), from a gradient of `grad_dtype`;
        with `low`, the parameter rounded to `low_dtype` is written in the same pass. Chunks of
        `chunk_elements` run on the pool's threads (see `_native.adam_step` for the arithmetic)."""
        return self._submit(
            lambda: self._native.submit_adam(
                param, grad, grad_dtype, exp_avg, exp_avg_sq, low, low_dtype, numel, lr=lr,
                beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
                decoupled=decoupled, grad_scale=grad_scale, chunk_elements=chunk_elements),
            keepalive,
        )

    def _submit(self, call: Callable[[], int], keepalive: object) -> IOFuture:
        mod = native()
        with self._lock:
            if self._closed:
                raise IOEngineError("the task pool is closed: create a new TaskPool")
            if os.getpid() != self._pid:
                raise IOEngineError(
                    "this TaskPool was created in the parent process and has no threads after fork(): "
                    "create a new TaskPool in the child"
                )
            try:
                task_id = call()
            except mod.AlignmentError as exc:
                raise AlignmentError(str(exc)) from exc
            except (ValueError, TypeError) as exc:
                raise IOEngineError(f"invalid task: {exc}") from exc
            except RuntimeError as exc:
                raise IOEngineError(str(exc)) from exc
            return self._track(task_id, keepalive)

    def __repr__(self) -> str:
        return f"<TaskPool {self.num_threads} threads {'closed' if self._closed else 'open'}>"

