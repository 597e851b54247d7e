"""Aligned host memory as torch tensors, CRC32C of buffers, and the streaming copy.

`aligned_empty` is the one way to get memory that O_DIRECT accepts: a
zero-filled, page-aligned native buffer viewed by a tensor that keeps it
alive. Its capacity is rounded up to 4096 bytes and the padding is zero,
so a direct op may always transfer the rounded size. `copy_into` fills
shared slices (put), on as many threads as measured best here (`FillThreads`).
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from typing import Sequence, Union

import torch

from infinity.io.native import native

ALIGNMENT = 4096

Shape = Union[int, Sequence[int], torch.Size]


def round_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """nbytes rounded up to a multiple of alignment."""
    return -(-nbytes // alignment) * alignment


def aligned_empty(nbytes_or_shape: Shape, dtype: torch.dtype = torch.uint8, *, lock: bool = False) -> torch.Tensor:
    """A zero-filled CPU tensor on 4096-aligned memory.

    An int is a size in bytes (a multiple of the dtype's size) and gives a
    1-D tensor; a sequence is a shape. lock=True pins the pages with mlock
    (OSError mentioning RLIMIT_MEMLOCK when the limit is too low). The
    buffer behind the tensor spans round_up(nbytes, 4096) bytes, at least
    one page; `aligned_capacity(t)` says how many.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    if isinstance(nbytes_or_shape, int):
        nbytes = nbytes_or_shape
        if nbytes < 0 or nbytes % itemsize:
            raise ValueError(f"nbytes {nbytes} must be >= 0 and a multiple of {itemsize} (the size of {dtype})")
        shape: tuple[int, ...] = (nbytes // itemsize,)
    else:
        shape = tuple(int(d) for d in nbytes_or_shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"shape {shape} has a negative dimension")
        nbytes = math.prod(shape) * itemsize
    capacity = max(ALIGNMENT, round_up(nbytes))
    buf = native().AlignedBuffer(capacity, ALIGNMENT, lock)
    # frombuffer holds a reference to buf, so the memory lives as long as any view.
    flat = torch.frombuffer(buf, dtype=torch.uint8)  # type: ignore[call-overload]
    return flat[:nbytes].view(dtype).view(shape)


def aligned_capacity(t: torch.Tensor) -> int:
    """Bytes of the storage behind t (for a tensor from aligned_empty: nbytes rounded up to 4096)."""
    return int(t.untyped_storage().nbytes())


def crc32c(data: torch.Tensor | bytes | bytearray | memoryview, seed: int = 0) -> int:
    """CRC32C (Castagnoli) of a contiguous CPU tensor or bytes-like object; chain with seed."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu" or not data.is_contiguous():
            raise ValueError("crc32c needs a contiguous CPU tensor")
        return native().crc32c(data.data_ptr(), data.numel() * data.element_size(), seed)
    return native().crc32c_buffer(data, seed)


_SPLIT_MIN_BYTES = 16 << 20  # the native copy splits copies of this size and more
_MIN_BYTES_PER_THREAD = 4 << 20


class FillThreads:
    """How many threads the large copies of `copy_into` use in this process, by measurement.

    One thread cannot saturate the memory of a many-core machine (on a 16-core one, 64 MiB took
    5.7 ms on one thread against 1.6 ms on four), yet on a 2-vCPU VM two threads streaming at
    once were slower than one (3.3 ms against 2.7). So the first large copies alternate between
    one thread and torch's intra-op thread count at that time (the parallelism `copy_` would
    use), `trials` of each, and the one with the lower median time per byte is kept from then
    on; never more than torch's count at the time of a copy (a forked worker that torch runs on
    one thread copies on one). Only copies that give each thread of the candidate at least
    4 MiB are trials, so both candidates are timed doing what they will do."""

    def __init__(self, *, trials: int = 5) -> None:
        self.trials = trials
        self.chosen: int | None = None
        self._lock = threading.Lock()
        self._many = 0  # torch's count when the trials began
        self._times: dict[int, list[float]] = {}

    def candidate(self, nbytes: int) -> int | None:
        """The thread count to try or use for a copy of `nbytes`; None: too small to split."""
        if nbytes < _SPLIT_MIN_BYTES:
            return None
        now = torch.get_num_threads()
        with self._lock:
            if self.chosen is None:
                if not self._many:
                    self._many = now
                if self._many <= 1:
                    self.chosen = 1
                else:
                    tried = {n: len(self._times.get(n, ())) for n in (1, self._many)}
                    pick = min(tried, key=lambda n: (tried[n], -n))  # the less tried; many first
                    return min(pick, now)
            return min(self.chosen, now)

    def record(self, threads: int, seconds: float, nbytes: int) -> None:
        """A copy of `nbytes` took `seconds` on `threads` threads."""
        with self._lock:
            if self.chosen is not None or threads not in (1, self._many):
                return  # chosen already, or torch's count changed: not one of the candidates
            if nbytes < threads * _MIN_BYTES_PER_THREAD:
                return  # fewer threads than the candidate ran: not a fair trial
            self._times.setdefault(threads, []).append(seconds / nbytes)
            if len(self._times) == 2 and all(len(t) >= self.trials for t in self._times.values()):
                self.chosen = min(self._times, key=lambda n: statistics.median(self._times[n]))


_fill_threads = FillThreads()


def fill_thread_count() -> int | None:
    """The thread count large `copy_into` copies use in this process; None until chosen."""
    return _fill_threads.chosen


def copy_into(dst: torch.Tensor, src: torch.Tensor, *, num_threads: int | None = None) -> None:
    """dst.copy_(src) for contiguous CPU tensors of the same dtype and size, with streaming stores.

    Meant for filling memory that another process reads (a shared-memory slice
    being `put`): large copies skip loading the destination into the cache.
    Anything else (other dtypes, strides, devices) falls back to `copy_`.
    `num_threads` defaults to what `FillThreads` measured best in this process,
    with at least 4 MiB for each thread.
    """
    if (dst.device.type != "cpu" or src.device.type != "cpu" or dst.dtype != src.dtype
            or dst.shape != src.shape or not dst.is_contiguous() or not src.is_contiguous()):
        dst.copy_(src)
        return
    nbytes = dst.numel() * dst.element_size()
    if num_threads is not None:
        native().copy_bytes(dst.data_ptr(), src.data_ptr(), nbytes, num_threads)
        return
    candidate = _fill_threads.candidate(nbytes)
    if candidate is None:
        native().copy_bytes(dst.data_ptr(), src.data_ptr(), nbytes, 1)
        return
    threads = min(candidate, max(1, nbytes // _MIN_BYTES_PER_THREAD))
    start = time.perf_counter()
    native().copy_bytes(dst.data_ptr(), src.data_ptr(), nbytes, threads)
    _fill_threads.record(threads, time.perf_counter() - start, nbytes)
