"""What the client accepts as a tensor: checks and conversions of the tensors and specs callers
pass to put, reserve, write_from and read_into, each refusal an InvalidRequestError with advice.

Pure functions of torch tensors; no session, no daemon.
"""

from __future__ import annotations

import operator
from typing import Any, Iterable, Sequence, Union

import torch

from infinity.client.segments import dtype_name
from infinity.errors import InvalidRequestError
from infinity.protocol.dtypes import tensor_nbytes

# What reserve() accepts per name: a tensor to mimic, or (dtype, shape).
TensorSpec = Union[torch.Tensor, tuple[torch.dtype, Sequence[int]]]


def byte_view(t: torch.Tensor, what: str, *, written: bool) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 view (no copy); written: the bytes will be written to."""
    check_dense(t, what)
    if is_zero_tensor(t):
        if written:
            raise InvalidRequestError(f"`{what}` is a ZeroTensor, which has no memory to write "
                                      f"into; pass a tensor of its own (torch.empty(...))")
        t = materialized(t)
    if t.is_conj() or t.is_neg():
        raise InvalidRequestError(f"`{what}` is a conjugate or negative view, whose bytes are not "
                                  f"its values; pass {what}.resolve_conj().resolve_neg()")
    if not t.is_contiguous():
        raise InvalidRequestError(f"`{what}` must be contiguous; pass {what}.contiguous() or a "
                                  f"contiguous buffer")
    return t.detach().reshape(-1).view(torch.uint8)


def check_dense(t: torch.Tensor, what: str) -> None:
    """InvalidRequestError, with advice, for anything but a dense tensor whose memory can be
    read (a ZeroTensor passes: it reads as zeros)."""
    if not isinstance(t, torch.Tensor):
        raise InvalidRequestError(f"`{what}` must be a torch tensor, not {type(t).__name__}")
    if t.is_nested:
        raise InvalidRequestError(f"`{what}` is a nested tensor; store its parts (unbind()) or a "
                                  f"padded tensor (to_padded_tensor(0.0))")
    if t.is_quantized:
        raise InvalidRequestError(f"`{what}` is a quantized tensor, and the store holds plain "
                                  f"dtypes: use {what}.int_repr() (with its scale and zero point) "
                                  f"or {what}.dequantize()")
    if t.layout is not torch.strided:
        raise InvalidRequestError(f"`{what}` is a {t.layout} tensor; the store holds dense ones: "
                                  f"pass {what}.to_dense()")
    if t.device.type == "meta":
        raise InvalidRequestError(f"`{what}` is on the meta device and has no bytes; materialize "
                                  f"it first (torch.empty_like(..., device='cpu'), say)")
    if not t.numel() or is_zero_tensor(t):
        return
    if type(t) is not torch.Tensor and is_fake(t):
        address = 0  # whatever device it claims
    elif t.device.type != "cpu":
        return  # on other devices (CUDA, XLA, lazy) copy_ does the work: no address needed
    else:
        try:
            address = t.data_ptr()
        except RuntimeError:  # a tensor inside torch.func transforms (vmap, grad)
            address = 0
    if not address:
        raise InvalidRequestError(
            f"`{what}` has no memory of its own (a FakeTensor, or a tensor inside a "
            f"torch.func transform); pass a real tensor")


def is_fake(t: torch.Tensor) -> bool:
    """A torch.compile FakeTensor (shape and device, no memory), by torch's own test."""
    try:
        from torch._subclasses.fake_tensor import is_fake  # private in torch, hence the care
    except ImportError:
        return False
    return bool(is_fake(t))


def is_zero_tensor(t: torch.Tensor) -> bool:
    is_zero = getattr(t, "_is_zerotensor", None)  # private in torch, hence the care
    return bool(is_zero()) if is_zero is not None else False


def materialized(t: torch.Tensor) -> torch.Tensor:
    """A ZeroTensor (zeros without memory, from autograd) as a real tensor of zeros."""
    return torch.zeros(t.shape, dtype=t.dtype, device=t.device) if is_zero_tensor(t) else t


def reserve_spec(name: str, spec: Any) -> tuple[str, tuple[int, ...]]:
    """(wire dtype name, shape) of one `reserve` item: a tensor to mimic or a (dtype, shape)
    pair, checked here (InvalidRequestError) rather than refused by the daemon or msgpack."""
    if isinstance(spec, torch.Tensor):  # only its dtype and shape: meta, fake or sparse will do
        if spec.is_nested:
            raise InvalidRequestError(f"{name!r}: a nested tensor has no single shape to "
                                      f"reserve; reserve its parts")
        return dtype_name(spec.dtype), tuple(spec.shape)  # the daemon checks the sizes
    if isinstance(spec, (tuple, list)) and len(spec) == 2:
        dtype, dims = spec
        if not isinstance(dtype, torch.dtype):
            raise InvalidRequestError(f"{name!r}: a reserve item's dtype must be a torch.dtype, "
                                      f"not {type(dtype).__name__}")
        if isinstance(dims, (str, bytes)) or not isinstance(dims, Iterable):
            raise InvalidRequestError(f"{name!r}: a reserve item's shape is a sequence of sizes "
                                      f"(torch.Size, tuple or list), not {type(dims).__name__}; "
                                      f"one dimension is ({dims!r},)")
        dims = tuple(dims)
        for dim in dims:
            if isinstance(dim, bool) or not hasattr(type(dim), "__index__"):
                raise InvalidRequestError(f"{name!r}: shape {dims!r} has a size that is not an "
                                          f"integer ({dim!r})")
        dims = tuple(operator.index(dim) for dim in dims)
    else:
        raise InvalidRequestError(f"{name!r}: a reserve item is a tensor to mimic or a (dtype, "
                                  f"shape) pair, not {type(spec).__name__}")
    wire_dtype = dtype_name(dtype)
    try:
        tensor_nbytes(wire_dtype, dims)  # sizes in range: the daemon checks the same
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{name!r}: {exc}") from None
    return wire_dtype, dims


def storable(t: torch.Tensor, name: str) -> torch.Tensor:
    """What `put` copies of `t`: its values as they read (a conjugate or negative view
    resolved), outside autograd; InvalidRequestError for a tensor that has no bytes to store."""
    if not isinstance(t, torch.Tensor):
        raise InvalidRequestError(f"{name!r}: put takes torch tensors, not {type(t).__name__}")
    check_dense(t, name)
    t = materialized(t)
    if t.requires_grad:
        t = t.detach()  # the copy is then not part of anyone's graph
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t

