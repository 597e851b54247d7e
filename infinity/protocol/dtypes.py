"""Tensor element types as they travel on the wire: names, sizes, and the byte size of a shape.

The daemon never imports torch: to the daemon a tensor is a dtype name, a shape
and a byte count. The client maps the same names to `torch.dtype`s
(`str(torch.float32) == "torch.float32"`, minus the prefix).
"""

from __future__ import annotations

from infinity.errors import InvalidRequestError

# Every dtype the store accepts, with its element size in bytes.
DTYPE_ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

MAX_DIMS = 32
# A shape whose byte size passes this is refused before any arithmetic on it can mislead.
MAX_TENSOR_BYTES = 1 << 50


def itemsize(dtype: str) -> int:
    """The element size of a dtype name, or InvalidRequestError naming the accepted ones."""
    size = DTYPE_ITEMSIZE.get(dtype)
    if size is None:
        raise InvalidRequestError(
            f"dtype {dtype[:80]!r} is not supported; use one of {', '.join(DTYPE_ITEMSIZE)}")
    return size


def tensor_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Byte size of a contiguous tensor of this dtype and shape (validated)."""
    size = itemsize(dtype)
    if len(shape) > MAX_DIMS:
        raise InvalidRequestError(f"a shape has at most {MAX_DIMS} dimensions, not {len(shape)}")
    count = span = 1
    for dim in shape:
        if dim < 0:
            raise InvalidRequestError(f"shape {list(shape)} has a negative dimension")
        # Each dimension on its own too: a zero elsewhere makes the product 0 whatever this
        # is, and torch refuses a dimension past 2**63 (a tensor nobody could then get).
        if dim * size > MAX_TENSOR_BYTES:
            raise InvalidRequestError(f"shape {list(shape)} of {dtype} has a dimension of more "
                                      f"than 2**50 bytes")
        count *= dim
        if count * size > MAX_TENSOR_BYTES:
            raise InvalidRequestError(f"shape {list(shape)} of {dtype} is larger than 2**50 bytes")
        # Strides too, which a zero elsewhere does not shrink: past 2**63 elements torch could
        # not build the view (short of that, a zero-element tensor of any such shape is fine).
        span *= max(dim, 1)
        if span >= 1 << 63:
            raise InvalidRequestError(f"shape {list(shape)} has strides of 2**63 elements or "
                                      f"more, which torch cannot represent")
    return count * size


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides, in elements, of a contiguous tensor of this shape."""
    strides = [1] * len(shape)
    step = 1
    for i in range(len(shape) - 1, -1, -1):
        strides[i] = step
        step *= max(shape[i], 1)
    return tuple(strides)
