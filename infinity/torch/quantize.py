"""Block-wise int8 and int4 copies of weights: their format, which weights get one, quantizing
rows of a weight, and dequantizing a copy into a reused buffer of the compute dtype.

The format (a contract: an import writes it, streamed generation reads it; `model_store` says
where in a namespace the copies are stored). A weight of shape (..., n) is cut along its last
dimension into blocks of `block` consecutive elements (the last block of a row is shorter where
`block` does not divide n). Each block has one scale, its largest absolute value over QMAX
(127 for int8, 7 for int4: symmetric, no zero point), stored in the weight's own dtype (bf16 for
a bf16 model); its codes are round(x / scale) (half to even), clamped to [-QMAX, QMAX]:

- scales: the weight's dtype, shape (..., ceil(n / block));
- int8 codes: int8, shape (..., n);
- int4 codes: uint8, shape (..., ceil(n / 2)), two codes a byte, each stored as code + 8 (a
  nibble of 1 to 15): element 2j of a row in the low nibble of byte j, element 2j + 1 in the
  high one; a row of odd length leaves its last high nibble 8 (code 0).

A weight dequantizes to code * scale in its own dtype. Since a code is an integer of at most 7
bits and a scale has its dtype's mantissa, that product is exact in float32 before its one
rounding to the dtype, so every way of computing it gives the same bits as the reference (code *
scale in float32, then rounded). The codes are computed against the scale as stored (rounded to
the dtype), so that rounding adds no error of its own; a block whose scale underflows the dtype
(float16, largest value under about 4e-6) dequantizes to zeros.

Dequantizing on the CPU is the native kernel's (`infinity._native.dequantize`: one pass, AVX2 or
AVX-512, streaming stores into a buffer of 1 MiB and more, rows split over the process's task
pool), on a GPU torch's element-wise kernels. Measured on the 7 weights of one layer of
tools/bench_infer.py's 1B Llama in bf16 (2 threads, best of 7, three runs on the 2-vCPU
machine, lightly loaded): their matrix-vector products 7.0-8.4 ms; dequantizing int8 with torch
9.4-15 ms, natively 6.2-10.5 ms; int4 with torch 28-42 ms (it unpacks through a scratch buffer,
several passes), natively 11-12 ms. Scales in the compute dtype keep torch's path to as few
passes as it takes: with float32 scales, its multiply into a bf16 buffer goes through a float32
temporary (several times slower again). Either way a dequantized weight is written and read
again, so a CPU computing from quantized copies that way spends about twice the time on each
linear layer that it spends on one in memory. So for inputs of few rows (a decode step; at most
`FUSED_MAX_ROWS`) an `nn.Linear` on the CPU multiplies from the codes instead (`linear`, the
native `quant_linear`: each code read once and converted in registers, float32 sums per block
times the block's scale, the weight's rows split over the task pool), and no weight is written
out. Measured on the same machine (tools/bench_quant_linear.py, 1 row, weights read from
memory, quiet): a 2048x2048 layer in 0.31 ms from int8 codes and 0.51 ms from int4, against
1.9 and 3.3 ms to dequantize and multiply, and 0.73 ms for torch's bf16 product with the
weight in memory (docs/BENCHMARKS.md has the table). Transformers' `Conv1D` (GPT-2, weight (in, out)) keeps
dequantizing: the kernel takes the (out, in) layout only.

Block sizes: 128 for int8 (scales cost 1/64 of the codes' bytes in bf16), 64 for int4, whose
grid of 15 steps makes an outlier cost a block more, so smaller blocks pay for their scales
(1/16 of the codes' bytes). Both are recorded per form in the model's manifest.

Which weights (`linear_weight_names`): the weights of the model's linear layers (`nn.Linear`,
and transformers' `Conv1D` of GPT-2, whose weight is (in, out): its blocks run along its output
dimension, which the format allows as well), found by building the model from its config on the
meta device. The output projection (`get_output_embeddings()`, lm_head) gets a copy too where its
weight is its own (`output_projection_name`), but streamed generation computes with it only on
request (`load_causal_lm(quantized_lm_head=True)`): its error goes straight into the logits,
where it changes greedy tokens most. It is one matrix (about 6% of a 1B Llama's bytes, but 11%
of what such a model streams a token in int8 with the head in bf16), so the choice is the user's.
Left in full precision, and read so by streamed generation:

- an output projection tied to the input embeddings (they are one tensor): the embeddings would
  have to compute from the copy too, and an embedding lookup reads a few rows per token, where
  dequantizing before the module's forward would expand the whole table every token;
- the input embeddings, for that reason;
- norms, biases and every 1-D tensor: a fraction of a percent of the bytes, and a norm's weight
  scales every activation.

`DequantBuffers` holds the buffers that copies are dequantized into, on the device the codes
are on: one taken per weight while its module computes, given back after it and reused by the
next weight of the same shape and dtype, so a process holds at most the buffers of the modules
present at once, plus one idle buffer per shape it has seen, never the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch.nn import functional

from infinity.errors import InvalidRequestError
from infinity.io.native import native

__all__ = ["BLOCK_SIZES", "FORMS", "FUSED_MAX_ROWS", "DequantBuffers", "QuantizedWeight",
           "copied_weight_names", "dequantize", "linear", "linear_weight_names",
           "output_projection_name", "quantize", "round_trip"]

FORMS = ("int8", "int4")
BLOCK_SIZES = {"int8": 128, "int4": 64}
QMAX = {"int8": 127, "int4": 7}
# Rows of input up to which a linear layer computing on the CPU multiplies from its codes
# (`linear`, no dequantized weight) rather than dequantizing the weight and running torch's
# matrix product. The kernel reads each code once however many rows there are, but its
# arithmetic grows with the rows (a multiply-add per row per element, without the blocking of
# torch's matrix product), so past some rows dequantizing once and letting torch multiply wins.
# Measured with tools/bench_quant_linear.py --sweep (bf16, 2048x2048, 2 threads, 2 vCPUs; one
# busy run, one quiet, docs/results/bench_quant_linear.json): the kernel was faster up to 8
# rows for int8 (1.2x and 1.9x at 8, 0.95-0.99x at 12, 0.75x at 24) and up to 16 for int4
# (1.5x and 1.3x at 16, 0.75-0.82x at 24), whose dequantization costs more.
# A decode step has 1 row a sequence; a prompt's prefill has one a token.
FUSED_MAX_ROWS = {"int8": 8, "int4": 16}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # of weights that can be quantized
# Where a namespace stores a form's copies (see `model_store`): its codes, then its scales.
CODES_PREFIX = {"int8": "__int8__/", "int4": "__int4__/"}
SCALES_PREFIX = {"int8": "__int8_scales__/", "int4": "__int4_scales__/"}
RESERVED_PREFIXES = tuple(CODES_PREFIX.values()) + tuple(SCALES_PREFIX.values())


def check_form(form: str) -> str:
    """`form` if it is one of FORMS; InvalidRequestError, saying which are, if not."""
    if form not in FORMS:
        raise InvalidRequestError(f"quantized form {form!r} is not one Infinity makes; use "
                                  f"{' or '.join(FORMS)}")
    return form


def codes_shape(form: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    n = shape[-1]
    return (*shape[:-1], n if form == "int8" else (n + 1) // 2)


def scales_shape(shape: tuple[int, ...], block: int) -> tuple[int, ...]:
    return (*shape[:-1], math.ceil(shape[-1] / block))


@dataclass(frozen=True)
class QuantizedWeight:
    """The quantized copy of one weight: where it is stored and how it is laid out."""

    name: str                 # the full-precision tensor's stored name
    form: str                 # "int8" | "int4"
    block: int
    shape: tuple[int, ...]    # the weight's
    dtype: torch.dtype        # the weight's and its scales': what it dequantizes to

    @property
    def codes_name(self) -> str:
        return CODES_PREFIX[self.form] + self.name

    @property
    def scales_name(self) -> str:
        return SCALES_PREFIX[self.form] + self.name

    @property
    def names(self) -> tuple[str, str]:
        """The stored tensors, in the order a lease of the copy takes them."""
        return self.codes_name, self.scales_name

    @property
    def codes_shape(self) -> tuple[int, ...]:
        return codes_shape(self.form, self.shape)

    @property
    def scales_shape(self) -> tuple[int, ...]:
        return scales_shape(self.shape, self.block)

    @property
    def nbytes(self) -> int:
        """Bytes stored: codes and scales."""
        return math.prod(self.codes_shape) + math.prod(self.scales_shape) * self.dtype.itemsize


def quantize(values: torch.Tensor, form: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes and scales of `values` (a floating tensor of at least one dimension, blocked
    along its last), in the module docstring's format; scales in `values`' dtype."""
    check_form(form)
    if values.dtype not in DTYPES or values.dim() == 0:
        raise InvalidRequestError(f"only float32, bfloat16 and float16 tensors of at least one "
                                  f"dimension are quantized, not {values.dtype} of shape "
                                  f"{list(values.shape)}")
    if block <= 0 or (form == "int4" and block % 2):
        raise InvalidRequestError(f"block {block} is not a positive (for int4: even) number of "
                                  f"elements")
    shape, n = tuple(values.shape), values.shape[-1]
    qmax = QMAX[form]
    rows = math.prod(shape[:-1])
    blocks_per_row = math.ceil(n / block)
    # Zeros past the row's end change no block's largest value.
    padded = functional.pad(values.reshape(rows, n).float(), (0, blocks_per_row * block - n))
    blocks = padded.view(rows, blocks_per_row, block)
    scales = (blocks.abs().amax(dim=-1) / qmax).to(values.dtype)
    stored = scales.float()
    divisors = torch.where(stored > 0, stored, torch.ones_like(stored)).unsqueeze(-1)
    codes = blocks.div(divisors).round_().clamp_(-qmax, qmax).view(rows, blocks_per_row * block)
    if form == "int8":
        packed = codes[:, :n].to(torch.int8)
    else:
        nibbles = codes[:, :2 * ((n + 1) // 2)].add_(8).to(torch.uint8)  # block is even
        packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    return (packed.reshape(codes_shape(form, shape)).contiguous(),
            scales.reshape(scales_shape(shape, block)))


def dequantize(codes: torch.Tensor, scales: torch.Tensor, form: str, block: int, *,
               out: torch.Tensor, scratch: torch.Tensor | None = None,
               implementation: str = "auto") -> torch.Tensor:
    """Write code * scale into `out` (the weight's shape and dtype, contiguous, on the codes'
    device); returns `out`. implementation: "native" (CPU tensors only), "torch", or "auto" (the
    native kernel on the CPU, torch elsewhere). torch's int4 unpacks its codes into `scratch`
    (uint8, at least 2 * ceil(n / 2) bytes a row; allocated if not given)."""
    n = out.shape[-1]
    rows = out.numel() // n if n else 0
    if rows == 0 or n == 0:
        return out
    on_cpu = all(t.device.type == "cpu" and t.is_contiguous() for t in (codes, scales, out))
    if implementation == "native" or (implementation == "auto" and on_cpu):
        if not on_cpu:
            raise InvalidRequestError("the native dequantization takes contiguous CPU tensors")
        native().dequantize(codes.data_ptr(), scales.data_ptr(), out.data_ptr(), form,
                            str(out.dtype).removeprefix("torch."), rows, n, block,
                            torch.get_num_threads())
        return out
    full_blocks = n // block
    flat = out.view(rows, n)
    per_row = scales.reshape(rows, -1)
    if form == "int8":
        signed = codes.view(rows, n)
    else:
        half = (n + 1) // 2
        if scratch is None:
            scratch = torch.empty(rows * half * 2, dtype=torch.uint8, device=codes.device)
        pairs = scratch[:rows * half * 2].view(rows, half, 2)
        packed = codes.view(rows, half)
        torch.bitwise_and(packed, 15, out=pairs[..., 0])
        torch.bitwise_right_shift(packed, 4, out=pairs[..., 1])
        signed = pairs.view(torch.int8).view(rows, 2 * half)
        signed.sub_(8)
    # int8 codes times scales of the dtype multiply in the dtype (exact, then one rounding).
    if full_blocks:
        width = full_blocks * block
        torch.mul(signed[:, :width].view(rows, full_blocks, block),
                  per_row[:, :full_blocks].unsqueeze(-1),
                  out=flat[:, :width].view(rows, full_blocks, block))
    if full_blocks * block < n:  # the last block of each row, shorter
        torch.mul(signed[:, full_blocks * block:n], per_row[:, full_blocks:full_blocks + 1],
                  out=flat[:, full_blocks * block:])
    return out


def linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, form: str, block: int,
           bias: torch.Tensor | None = None, *, implementation: str = "auto") -> torch.Tensor:
    """`functional.linear(x, W, bias)` for the weight W (out, n) whose copy is `codes` and
    `scales`, computed by the native kernel from the codes (no dequantized W; see the module
    docstring): float32 sums, code * scale exact, one rounding to x's dtype. CPU tensors; x of
    shape (..., n) and the scales' dtype. implementation: "auto", or "avx512", "avx2", "scalar"
    (for tests; ValueError where this CPU cannot run it)."""
    n, out = x.shape[-1], scales.shape[0]
    if (codes.dim() != 2 or scales.dim() != 2 or codes.shape[0] != out
            or codes.shape[1] != (n if form == "int8" else (n + 1) // 2)
            or scales.shape[1] != math.ceil(n / block) or scales.dtype != x.dtype
            or (bias is not None and (bias.shape != (out,) or bias.dtype != x.dtype))):
        raise InvalidRequestError(
            f"a {form} copy with codes {list(codes.shape)} and scales {list(scales.shape)} "
            f"{scales.dtype} is not the weight of a linear layer taking {x.dtype} inputs of "
            f"{n} features (block {block}); import the model again")
    tensors = (x, codes, scales) if bias is None else (x, codes, scales, bias)
    if any(t.device.type != "cpu" for t in tensors):
        raise InvalidRequestError("the native quantized linear takes CPU tensors; on a GPU, "
                                  "dequantize the copy and use functional.linear")
    x, codes, scales = x.contiguous(), codes.contiguous(), scales.contiguous()
    bias = bias.contiguous() if bias is not None else None
    y = torch.empty((*x.shape[:-1], out), dtype=x.dtype)
    rows = x.numel() // n if n else math.prod(x.shape[:-1])
    native().quant_linear(x.data_ptr(), codes.data_ptr(), scales.data_ptr(),
                          0 if bias is None else bias.data_ptr(), y.data_ptr(), form,
                          str(x.dtype).removeprefix("torch."), rows, n, out, block,
                          torch.get_num_threads(), implementation)
    return y


def round_trip(values: torch.Tensor, form: str, block: int | None = None) -> torch.Tensor:
    """What the quantized copy of `values` dequantizes to (block: the form's default), as a
    new tensor: for measuring a form's error, and for a model in memory that computes as a
    streamed quantized one does."""
    codes, scales = quantize(values, form, BLOCK_SIZES[form] if block is None else block)
    out = torch.empty(values.shape, dtype=values.dtype, device=values.device)
    return dequantize(codes, scales, form, BLOCK_SIZES[form] if block is None else block, out=out)


class DequantBuffers:
    """Buffers that quantized weights are dequantized into (see the module docstring)."""

    def __init__(self) -> None:
        self._idle: dict[tuple[Any, ...], list[torch.Tensor]] = {}

    def _buffer(self, shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
        idle = self._idle.get((shape, dtype, device))
        if idle:
            return idle.pop()
        return torch.empty(shape, dtype=dtype, device=device)

    def take(self, weight: QuantizedWeight, codes: torch.Tensor,
             scales: torch.Tensor) -> torch.Tensor:
        """`weight` dequantized from its stored `codes` and `scales` (on one device) into a
        buffer of its dtype there, held until `give`."""
        if (tuple(codes.shape) != weight.codes_shape or tuple(scales.shape) != weight.scales_shape
                or scales.dtype != weight.dtype):
            raise InvalidRequestError(
                f"the stored {weight.form} copy of {weight.name!r} is not laid out as the "
                f"model's manifest says (codes {list(codes.shape)}, scales {list(scales.shape)} "
                f"{scales.dtype}); import the model again")
        out = self._buffer(weight.shape, weight.dtype, codes.device)
        scratch = None
        if weight.form == "int4" and codes.device.type != "cpu":  # torch's unpacking
            scratch = self._buffer((2 * math.prod(weight.codes_shape),), torch.uint8,
                                   codes.device)
        try:
            return dequantize(codes, scales, weight.form, weight.block, out=out, scratch=scratch)
        finally:
            if scratch is not None:
                self.give(scratch)

    def give(self, tensor: torch.Tensor) -> None:
        """A buffer `take` handed out, no longer used: the next weight of its shape reuses it."""
        key = (tuple(tensor.shape), tensor.dtype, tensor.device)
        self._idle.setdefault(key, []).append(tensor)

    def idle_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self._idle.values() for t in ts)


def linear_weight_names(folder: str, stored: Iterable[str], *,
                        with_output_projection: bool = False) -> set[str]:
    """The names among `stored` of the weights of the linear layers of the causal LM whose
    config.json is in `folder`: the output projection only `with_output_projection` and where it
    is not tied to the input embeddings (see the module docstring). InvalidRequestError where
    transformers cannot build the model as a causal LM."""
    return _linear_weight_names(_meta_causal_lm(folder), set(stored), with_output_projection)


def output_projection_name(folder: str, stored: Iterable[str]) -> str | None:
    """The name among `stored` of the output projection's weight of the causal LM whose
    config.json is in `folder`, where it is a linear layer's weight of its own (not tied to the
    input embeddings); None otherwise."""
    return _output_projection_name(_meta_causal_lm(folder), set(stored))


def copied_weight_names(folder: str, stored: Iterable[str]) -> tuple[set[str], str | None]:
    """What an import makes copies of: `linear_weight_names(..., with_output_projection=True)`
    and `output_projection_name`, from one build of the model."""
    model, names = _meta_causal_lm(folder), set(stored)
    return _linear_weight_names(model, names, True), _output_projection_name(model, names)


def _linear_weight_names(model: Any, stored: set[str], with_output_projection: bool) -> set[str]:
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    left_out = _weight_ids(model.get_input_embeddings())
    if not with_output_projection:
        left_out |= _weight_ids(model.get_output_embeddings())
    found: set[str] = set()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not _is_linear(module) or not isinstance(weight, torch.Tensor) or id(weight) in left_out:
            continue
        found.update(name for name in names.get(id(weight), ()) if name in stored)
    return found


def _output_projection_name(model: Any, stored: set[str]) -> str | None:
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if (not _is_linear(head) or not isinstance(weight, torch.Tensor)
            or id(weight) in _weight_ids(model.get_input_embeddings())):
        return None
    for name, param in model.named_parameters(remove_duplicate=False):
        if param is weight and name in stored:
            return name
    return None


def _is_linear(module: Any) -> bool:
    """nn.Linear, or transformers' Conv1D (GPT-2's, weight (in, out))."""
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"


def _meta_causal_lm(folder: str) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except ValueError as exc:
        raise InvalidRequestError(
            f"transformers cannot build the model of {folder} as a causal LM ({exc}), so its "
            f"linear layers are not known; import it without quantized copies") from None


def _weight_ids(module: Any) -> set[int]:
    weight = getattr(module, "weight", None) if module is not None else None
    return {id(weight)} if isinstance(weight, torch.Tensor) else set()
