"""The native quantized linear (`infinity.torch.quantize.linear`, `_native.quant_linear`): a
linear layer multiplied from its block-wise int8 or int4 codes, against a plain reference, on
every SIMD path this CPU runs, at odd sizes (features that neither the block nor the vector
width divides, odd output counts, 1 to 5 rows: one group of 4 rows and a remainder).

The reference: the weight dequantized plainly in float64 (each code times its block's scale,
exact), times x in float64, plus the bias: the exact y of the stored codes. The kernel sums
each block's code * x products in float32 (in its own order), multiplies the sum by the block's
scale, sums the blocks and adds the bias in float32, then rounds once to x's dtype. Each term of
y passes through at most n + 3 float32 roundings, so by the standard bound for sums and products
the float32 result is within gamma(n + 3) * S of y, where gamma(m) = m u / (1 - m u), u = 2^-24
and S = sum_i |x_i| |w_i| + |bias|; the final rounding adds at most u_out |result| (u_out =
2^-8 for bfloat16, 2^-11 for float16, 0 for float32, which is not rounded again). So the test
allows |kernel - y| <= u_out |y| + (1 + u_out) gamma(n + 3) S, element by element.
"""

from __future__ import annotations

import math

import pytest
import torch

from infinity import _native
from infinity.errors import InvalidRequestError
from infinity.torch.quantize import BLOCK_SIZES, linear, quantize
from simd_paths import implementations

UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 0.0}


def plain_weight(codes: torch.Tensor, scales: torch.Tensor, form: str, block: int,
                 n: int) -> torch.Tensor:
    """The weight the codes stand for, in float64, from the format's definition alone."""
    if form == "int8":
        values = codes.double()
    else:
        low, high = (codes & 15).double() - 8, (codes >> 4).double() - 8
        values = torch.stack((low, high), dim=-1).reshape(codes.shape[0], -1)[:, :n]
    per_element = scales.double().repeat_interleave(block, dim=1)[:, :n]
    return values * per_element


def check_against_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                            form: str, block: int, bias: torch.Tensor | None,
                            implementation: str) -> None:
    n = x.shape[-1]
    got = linear(x, codes, scales, form, block, bias, implementation=implementation)
    weight = plain_weight(codes, scales, form, block, n)
    exact = x.double() @ weight.T
    magnitude = x.double().abs() @ weight.abs().T
    if bias is not None:
        exact += bias.double()
        magnitude += bias.double().abs()
    u, u_out = 2.0 ** -24, UNIT_ROUNDOFF[x.dtype]
    gamma = (n + 3) * u / (1 - (n + 3) * u)
    allowed = u_out * exact.abs() + (1 + u_out) * gamma * magnitude
    error = (got.double() - exact).abs()
    assert got.dtype == x.dtype and got.shape == exact.shape
    assert bool((error <= allowed).all()), (error - allowed).max().item()


@pytest.mark.parametrize("implementation", implementations())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("form,block", [("int8", 128), ("int8", 40), ("int8", 7),
                                        ("int4", 64), ("int4", 18)])
def test_the_kernel_computes_the_plain_product_within_its_rounding_bound(
        implementation: str, dtype: torch.dtype, form: str, block: int) -> None:
    # Blocks of 40 (a 32-element step, a 16-element step, a scalar tail), 7 and 18 (tails
    # only, or one 16-element step and a tail); n of 1 (shorter than any block), 13 (than a
    # vector), 33 and 301 (short last blocks); 37 outputs; bias or none.
    generator = torch.Generator().manual_seed(block)
    for n in (1, 13, 33, 301):
        weight = torch.randn(37, n, generator=generator).to(dtype)
        weight[3, : n // 2] *= 40  # an outlier's block
        codes, scales = quantize(weight, form, block)
        for rows in range(1, 6):
            x = torch.randn(rows, n, generator=generator).to(dtype)
            bias = torch.randn(37, generator=generator).to(dtype) if rows % 2 else None
            check_against_reference(x, codes, scales, form, block, bias, implementation)


@pytest.mark.parametrize("form", ["int8", "int4"])
def test_a_layer_split_over_the_task_pool_computes_what_one_thread_does(form: str) -> None:
    # Over 2^18 weight elements: split by output rows, so each output's sum is the same.
    weight = torch.randn(701, 401).to(torch.bfloat16)
    codes, scales = quantize(weight, form, BLOCK_SIZES[form])
    x = torch.randn(3, 401).to(torch.bfloat16)
    outputs = []
    for threads in (1, 3):
        y = torch.empty(3, 701, dtype=torch.bfloat16)
        _native.quant_linear(x.data_ptr(), codes.data_ptr(), scales.data_ptr(), 0, y.data_ptr(),
                             form, "bfloat16", 3, 401, 701, BLOCK_SIZES[form], threads)
        outputs.append(y)
    assert torch.equal(outputs[0], outputs[1])
    check_against_reference(x, codes, scales, form, BLOCK_SIZES[form], None, "auto")


def test_inputs_of_more_dimensions_and_strided_ones_compute_row_by_row() -> None:
    weight = torch.randn(19, 150)
    codes, scales = quantize(weight, "int8", 128)
    x = torch.randn(2, 3, 300)[..., ::2]  # (2, 3, 150), not contiguous
    got = linear(x, codes, scales, "int8", 128)
    assert got.shape == (2, 3, 19)
    assert torch.equal(got, linear(x.reshape(6, 150).contiguous(), codes, scales, "int8",
                                   128).reshape(2, 3, 19))


def test_auto_names_the_widest_path_this_cpu_runs() -> None:
    assert _native.quant_linear_implementation() == implementations()[-1]


def test_a_path_this_cpu_cannot_run_is_refused_naming_what_it_offers() -> None:
    weight = torch.randn(4, 16)
    codes, scales = quantize(weight, "int8", 16)
    for name in ("avx512", "avx2", "sse"):
        if name in implementations():
            continue
        with pytest.raises(ValueError, match="cannot run on this CPU"):
            linear(torch.randn(1, 16), codes, scales, "int8", 16, implementation=name)


def test_a_copy_that_does_not_fit_the_input_is_refused() -> None:
    codes, scales = quantize(torch.randn(4, 32), "int4", 16)
    with pytest.raises(InvalidRequestError, match="import the model again"):
        linear(torch.randn(1, 30), codes, scales, "int4", 16)  # 30 features: 15 bytes a row
    with pytest.raises(InvalidRequestError, match="import the model again"):
        linear(torch.randn(1, 32).to(torch.bfloat16), codes, scales, "int4", 16)  # dtype


@pytest.mark.parametrize("change,message", [
    ({"block": 0}, "block is 0"),
    ({"form": "int4", "block": 9}, "int4 blocks must be even"),
    ({"form": "int2"}, "int8 or int4"),
    ({"dtype": "int32"}, "dtype"),
    ({"x": 0}, "null pointer"),
    ({"rows": -1}, ">= 0"),
])
def test_bad_calls_are_refused_with_a_sentence_and_write_nothing(change: dict[str, object],
                                                                 message: str) -> None:
    codes = torch.zeros(3, 16, dtype=torch.int8)
    scales, x, y = torch.ones(3, 1), torch.ones(2, 16), torch.zeros(2, 3)
    arguments: dict[str, object] = dict(
        x=x.data_ptr(), codes=codes.data_ptr(), scales=scales.data_ptr(), bias=0,
        y=y.data_ptr(), form="int8", dtype="float32", rows=2, n=16, out=3, block=16)
    arguments.update(change)
    with pytest.raises(ValueError, match=message):
        _native.quant_linear(*arguments.values())
    assert torch.equal(y, torch.zeros(2, 3))


def test_no_rows_or_no_features_give_an_empty_or_a_bias_only_output() -> None:
    codes, scales = quantize(torch.randn(5, 1), "int8", 128)
    assert linear(torch.randn(0, 1), codes, scales, "int8", 128).shape == (0, 5)
    empty_codes = torch.zeros(5, 0, dtype=torch.int8)
    empty_scales = torch.zeros(5, 0)
    bias = torch.arange(5.0)
    got = linear(torch.randn(2, 0), empty_codes, empty_scales, "int8", 128, bias)
    assert torch.equal(got, bias.expand(2, 5))
    assert math.isclose(got.sum().item(), 20.0)
