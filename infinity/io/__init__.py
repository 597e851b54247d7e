"""Typed Python API over the native async I/O engine: futures, aligned buffers.

    with IOEngine(config.io) as eng:
        buf = aligned_empty(64 << 20)
        eng.submit([IOOp.read(fd=fd, address=buf.data_ptr(), nbytes=buf.nbytes, offset=0)]).result()

Modules: engine (IOEngine), tasks (TaskPool: copies, checksums and fills on
native threads), completions (the id -> future map both share), future
(IOFuture), ops (IOOp), buffers
(aligned_empty, crc32c), errno_map (native errno -> infinity.errors),
native (loading and typing infinity._native).

The buffer helpers need torch and are loaded on first use, so that infinityd,
which moves bytes by address and never imports torch, can use the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from infinity.io.engine import IOEngine
from infinity.io.errno_map import error_from_errno, failed_op
from infinity.io.future import IOFuture
from infinity.io.native import (probe_aio, probe_io_uring, probe_shared_memory_collapse,
                                simd_level)
from infinity.io.ops import CRC_BLOCK_BYTES, IOOp, crc_count
from infinity.io.tasks import TaskPool, default_task_threads

if TYPE_CHECKING:
    from infinity.io.buffers import (ALIGNMENT, aligned_capacity, aligned_empty, copy_into, crc32c,
                                     round_up)

_BUFFER_NAMES = frozenset({"ALIGNMENT", "aligned_capacity", "aligned_empty", "copy_into", "crc32c",
                           "round_up"})


def __getattr__(name: str) -> Any:
    if name in _BUFFER_NAMES:
        value = getattr(importlib.import_module("infinity.io.buffers"), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module 'infinity.io' has no attribute {name!r}")

__all__ = [
    "ALIGNMENT",
    "CRC_BLOCK_BYTES",
    "IOEngine",
    "IOFuture",
    "IOOp",
    "TaskPool",
    "aligned_capacity",
    "aligned_empty",
    "copy_into",
    "crc32c",
    "crc_count",
    "default_task_threads",
    "error_from_errno",
    "failed_op",
    "probe_aio",
    "probe_io_uring",
    "probe_shared_memory_collapse",
    "round_up",
    "simd_level",
]
