"""Typed Python API over the native async I/O engine: futures, aligned buffers.

    with IOEngine(config.io) as eng:
        buf = aligned_empty(64 << 20)
        eng.submit([IOOp.read(fd=fd, address=buf.data_ptr(), nbytes=buf.nbytes, offset=0)]).result()

Modules: engine (IOEngine), future (IOFuture), ops (IOOp), buffers
(aligned_empty, crc32c), errno_map (native errno -> infinity.errors),
native (loading and typing infinity._native).
"""

from infinity.io.buffers import ALIGNMENT, aligned_capacity, aligned_empty, copy_into, crc32c, round_up
from infinity.io.engine import IOEngine
from infinity.io.errno_map import error_from_errno
from infinity.io.future import IOFuture
from infinity.io.native import probe_aio, probe_io_uring, simd_level
from infinity.io.ops import CRC_BLOCK_BYTES, IOOp, crc_count

__all__ = [
    "ALIGNMENT",
    "CRC_BLOCK_BYTES",
    "IOEngine",
    "IOFuture",
    "IOOp",
    "aligned_capacity",
    "aligned_empty",
    "copy_into",
    "crc32c",
    "crc_count",
    "error_from_errno",
    "probe_aio",
    "probe_io_uring",
    "round_up",
    "simd_level",
]
