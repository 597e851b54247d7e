"""Aligned host memory as torch tensors, and CRC32C of buffers.

`aligned_empty` is the one way to get memory that O_DIRECT accepts: a
zero-filled, page-aligned native buffer viewed by a tensor that keeps it
alive. Its capacity is rounded up to 4096 bytes and the padding is zero,
so a direct op may always transfer the rounded size.
"""

from __future__ import annotations

import math
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


def copy_into(dst: torch.Tensor, src: torch.Tensor, *, num_threads: int | None = None) -> None:
    """dst.copy_(src) for contiguous CPU tensors of the same dtype and size, with streaming stores.

    Meant for filling memory that another process reads (a shared-memory slice
    being `put`): large copies skip loading the destination into the cache.
    Anything else (other dtypes, strides, devices) falls back to `copy_`.
    `num_threads` defaults to torch's intra-op thread count, the parallelism `copy_`
    itself would use (one thread cannot saturate the memory of a many-core machine), with
    at least 4 MiB for each thread, so a small copy does not pay for starting many.
    """
    if num_threads is None:
        nbytes = dst.numel() * dst.element_size()
        num_threads = min(torch.get_num_threads(), max(1, nbytes >> 22))
    if (dst.device.type != "cpu" or src.device.type != "cpu" or dst.dtype != src.dtype
            or dst.shape != src.shape or not dst.is_contiguous() or not src.is_contiguous()):
        dst.copy_(src)
        return
    native().copy_bytes(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size(), num_threads)
