"""Aligned host memory as torch tensors, CRC32C of buffers, and the streaming copy.

`aligned_empty` is the one way to get memory that O_DIRECT accepts: a
zero-filled, page-aligned native buffer viewed by a tensor that keeps it
alive. Its capacity is rounded up to 4096 bytes and the padding is zero,
so a direct op may always transfer the rounded size. `copy_into` fills
shared slices (put), by the method measured best here (`FillMethod`).
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


class FillMethod:
    """How the large copies of `copy_into` run in this process, chosen by measurement.

    Which copy fills a shared slice fastest depends on the machine, and on this project's VM on
    the memory a process happens to get: on a 16-core machine the streaming copy split over 4
    threads filled 64 MiB in 1.6 ms, against 5.7 on one thread and 3.0 for `copy_` on torch's 4
    threads; on the 2-vCPU VM one streaming thread took 2.7 ms against 3.3 for `copy_` in some
    processes, and 3.1 against 2.0 in others. So the first large copies try in turn `copy_`,
    the streaming copy on one thread, and (where torch runs several) the streaming copy split
    over torch's intra-op thread count, at least 4 MiB each, `trials` of each, and the method
    with the lowest median time per byte is kept from then on. A split never uses more threads
    than torch's count at the time of the copy (a forked worker that torch runs on one thread
    copies on one), and a large copy that starts while another runs (several threads putting
    at once) streams on one thread: the threads those copies ask for together would otherwise
    be more than there are, and a trial timed then would measure the crowd, not the method.
    A split runs on the calling thread and the process's native copy pool (`infinity-copy`
    threads, made once), so no copy starts threads of its own."""

    def __init__(self, *, trials: int = 5) -> None:
        self.trials = trials
        self.method: str | None = None  # "copy_" | "stream" | "split", once chosen
        self._lock = threading.Lock()
        self._methods: tuple[str, ...] = ()  # the ones tried, fixed at the first trial
        self._times: dict[str, list[float]] = {}
        self._running = 0  # large copies between `begin` and `end`

    def method_for(self, nbytes: int) -> tuple[str, int, bool]:
        """(method, threads, whether this copy is a trial) for a copy of `nbytes`."""
        most = min(torch.get_num_threads(), nbytes // _MIN_BYTES_PER_THREAD)
        if nbytes < _SPLIT_MIN_BYTES:
            return "stream", 1, False
        with self._lock:
            if self._running:
                return "stream", 1, False
            if self.method is not None:
                method, trial = self.method, False
            else:
                if not self._methods:
                    self._methods = ("split",) * (most > 1) + ("stream", "copy_")
                    self._times = {m: [] for m in self._methods}
                method, trial = min(self._methods, key=lambda m: len(self._times[m])), True
        if method == "split" and most <= 1:
            return "stream", 1, False  # torch runs one thread now: not a trial of the split
        return method, (most if method == "split" else 1), trial

    def begin(self, nbytes: int) -> tuple[str, int, bool]:
        """`method_for`, and the copy counts as running until `end(nbytes)`."""
        method = self.method_for(nbytes)
        if nbytes >= _SPLIT_MIN_BYTES:
            with self._lock:
                self._running += 1
        return method

    def end(self, nbytes: int) -> None:
        """The copy that `begin(nbytes)` started is done."""
        if nbytes >= _SPLIT_MIN_BYTES:
            with self._lock:
                self._running -= 1

    def record(self, method: str, seconds: float, nbytes: int) -> None:
        """A trial copy of `nbytes` by `method` took `seconds`."""
        with self._lock:
            if self.method is not None:
                return
            self._times[method].append(seconds / nbytes)
            if all(len(times) >= self.trials for times in self._times.values()):
                self.method = min(self._times, key=lambda m: statistics.median(self._times[m]))


_fill = FillMethod()


def fill_method() -> str | None:
    """How large `copy_into` copies run in this process ("copy_", "stream" or "split"); None
    until the trials have chosen."""
    return _fill.method


def copy_into(dst: torch.Tensor, src: torch.Tensor, *, num_threads: int | None = None) -> None:
    """dst.copy_(src) for contiguous CPU tensors of the same dtype and size, with streaming stores.

    Meant for filling memory that another process reads (a shared-memory slice
    being `put`): large copies skip loading the destination into the cache.
    Anything else (other dtypes, strides, devices) falls back to `copy_`.
    Without `num_threads`, large copies run as `FillMethod` measured best in this process
    (which may be `copy_` itself).
    """
    if (dst.device.type != "cpu" or src.device.type != "cpu" or dst.dtype != src.dtype
            or dst.shape != src.shape or not dst.is_contiguous() or not src.is_contiguous()):
        dst.copy_(src)
        return
    nbytes = dst.numel() * dst.element_size()
    if num_threads is not None:
        native().copy_bytes(dst.data_ptr(), src.data_ptr(), nbytes, num_threads)
        return
    method, threads, trial = _fill.begin(nbytes)
    try:
        start = time.perf_counter() if trial else 0.0
        if method == "copy_":
            dst.copy_(src)
        else:
            native().copy_bytes(dst.data_ptr(), src.data_ptr(), nbytes, threads)
        if trial:
            _fill.record(method, time.perf_counter() - start, nbytes)
    finally:
        _fill.end(nbytes)
