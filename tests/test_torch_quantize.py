"""Block-wise int8 and int4 quantization (`infinity.torch.quantize`) against a plain reference:
odd sizes, a last block shorter than the others, int4's two codes a byte, and the buffers that
copies are dequantized into. No daemon: the format and the arithmetic alone."""

from __future__ import annotations

import math

import pytest
import torch

from infinity.errors import InvalidRequestError
from infinity.torch.quantize import (DequantBuffers, QuantizedWeight, dequantize,
                                     linear_weight_names, output_projection_name, quantize,
                                     round_trip)

QMAX = {"int8": 127, "int4": 7}


def reference(values: torch.Tensor, form: str, block: int) -> tuple[list[list[int]],
                                                                    torch.Tensor, torch.Tensor]:
    """The format written out plainly, block by block: each block's scale (its largest absolute
    value over QMAX, rounded to the dtype), each element's code against that scale, and what
    the code dequantizes to (code * scale, rounded once to the dtype)."""
    rows, n = values.shape
    qmax = QMAX[form]
    codes: list[list[int]] = []
    scales = torch.empty(rows, math.ceil(n / block), dtype=values.dtype)
    restored = torch.empty_like(values)
    for r in range(rows):
        row: list[int] = []
        for b, start in enumerate(range(0, n, block)):
            chunk = values[r, start:start + block].float()
            scale = (chunk.abs().max() / qmax).to(values.dtype)
            scales[r, b] = scale
            for j, x in enumerate(chunk.tolist()):
                code = 0 if scale == 0 else int(max(-qmax, min(qmax, round(x / float(scale)))))
                row.append(code)
                restored[r, start + j] = torch.tensor(code * float(scale)).to(values.dtype)
        codes.append(row)
    return codes, scales, restored


def sample(rows: int, n: int, dtype: torch.dtype, seed: int = 3) -> torch.Tensor:
    values = torch.randn(rows, n, generator=torch.Generator().manual_seed(seed)) * 0.05
    values[1, 5] = 0.9  # an outlier in one block
    values[2, :] = 0.0  # a row of zero blocks
    return values.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_int8_codes_scales_and_values_match_the_reference_with_a_short_last_block(
        dtype: torch.dtype) -> None:
    values = sample(5, 37, dtype)  # blocks of 16: 16, 16 and a last one of 5
    codes, scales = quantize(values, "int8", 16)
    expected_codes, expected_scales, expected = reference(values, "int8", 16)
    assert codes.dtype == torch.int8 and tuple(codes.shape) == (5, 37)
    assert scales.dtype == dtype and tuple(scales.shape) == (5, 3)
    assert codes.tolist() == expected_codes
    assert torch.equal(scales, expected_scales)
    restored = dequantize(codes, scales, "int8", 16, out=torch.empty_like(values))
    assert torch.equal(restored, expected)


def test_int4_packs_two_codes_a_byte_low_nibble_first_plus_eight() -> None:
    # One block of 5: scale 0.7 / 7 = 0.1, codes -7, 7, 0, 3, 1; the odd row's last high nibble
    # holds code 0 (8).
    values = torch.tensor([[-0.7, 0.7, 0.0, 0.3, 0.1]])
    codes, scales = quantize(values, "int4", 8)
    assert codes.dtype == torch.uint8 and tuple(codes.shape) == (1, 3)
    assert codes.tolist() == [[(-7 + 8) | (7 + 8) << 4, (0 + 8) | (3 + 8) << 4, (1 + 8) | 8 << 4]]
    assert scales.tolist() == [[pytest.approx(0.1)]]


@pytest.mark.parametrize("n", [37, 38])
def test_int4_values_match_the_reference_for_odd_and_even_rows(n: int) -> None:
    values = sample(4, n, torch.bfloat16)
    codes, scales = quantize(values, "int4", 8)
    expected_codes, expected_scales, expected = reference(values, "int4", 8)
    assert torch.equal(scales, expected_scales)
    low, high = (codes & 15).int() - 8, (codes >> 4).int() - 8
    unpacked = torch.stack([low, high], dim=-1).view(4, -1)[:, :n]
    assert unpacked.tolist() == expected_codes
    assert torch.equal(dequantize(codes, scales, "int4", 8, out=torch.empty_like(values)),
                       expected)


@pytest.mark.parametrize("form", ["int8", "int4"])
def test_every_value_is_within_half_a_step_of_its_block(form: str) -> None:
    values = sample(7, 301, torch.float32)
    block = 64
    restored = round_trip(values, form, block)
    _, scales = quantize(values, form, block)
    step = scales.repeat_interleave(block, dim=1)[:, :301]
    assert torch.all((restored - values).abs() <= step / 2 * (1 + 1e-6))


def test_a_block_larger_than_the_row_is_one_short_block() -> None:
    values = sample(3, 11, torch.bfloat16)
    _, _, expected = reference(values, "int8", 128)
    assert torch.equal(round_trip(values, "int8", 128), expected)


@pytest.mark.parametrize("form,block", [("int8", 24), ("int8", 128), ("int4", 10), ("int4", 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(700, 401), (520, 1024)], ids=["odd", "streamed"])
def test_the_native_kernel_writes_the_bits_torchs_kernels_write(
        form: str, block: int, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    # Blocks that 16 does not divide (the vector loop's scalar tails), a short last block,
    # enough rows to be split over the task pool; and rows on 32-byte lines in a buffer of over
    # 1 MiB, which goes out by streaming stores.
    values = sample(*shape, dtype)
    codes, scales = quantize(values, form, block)
    native = dequantize(codes, scales, form, block, out=torch.empty_like(values),
                        implementation="native")
    assert torch.equal(native, dequantize(codes, scales, form, block,
                                          out=torch.empty_like(values), implementation="torch"))


def test_buffers_are_reused_by_shape_and_hold_only_what_is_taken() -> None:
    buffers = DequantBuffers()
    weight = QuantizedWeight("w", "int4", 8, (6, 13), torch.bfloat16)
    codes, scales = quantize(sample(6, 13, torch.bfloat16), "int4", 8)
    first = buffers.take(weight, codes, scales)
    assert buffers.idle_bytes() == 0
    second = buffers.take(weight, codes, scales)
    assert first.data_ptr() != second.data_ptr()
    buffers.give(first)
    buffers.give(second)
    again = buffers.take(weight, codes, scales)
    assert again.data_ptr() in (first.data_ptr(), second.data_ptr())


def test_a_copy_laid_out_otherwise_than_the_manifest_says_is_refused() -> None:
    codes, scales = quantize(sample(6, 13, torch.bfloat16), "int8", 8)
    weight = QuantizedWeight("w", "int8", 8, (6, 12), torch.bfloat16)
    with pytest.raises(InvalidRequestError, match="import the model again"):
        DequantBuffers().take(weight, codes, scales)


def test_an_unknown_form_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(InvalidRequestError, match="int8 or int4"):
        quantize(torch.ones(2, 4), "int3", 4)


def test_the_linear_layers_are_quantized_not_embeddings_head_or_norms(tmp_path: str) -> None:
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=24, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=50,
                tie_word_embeddings=False).save_pretrained(str(tmp_path))
    stored = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
              "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.weight",
              "model.layers.0.mlp.down_proj.weight"]
    assert linear_weight_names(str(tmp_path), stored) == {
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"}
    assert linear_weight_names(str(tmp_path), stored, with_output_projection=True) == {
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight",
        "lm_head.weight"}
    assert output_projection_name(str(tmp_path), stored) == "lm_head.weight"


def test_an_output_projection_tied_to_the_embeddings_is_never_quantized(tmp_path: str) -> None:
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=24, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=50,
                tie_word_embeddings=True).save_pretrained(str(tmp_path))
    stored = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"]
    assert linear_weight_names(str(tmp_path), stored, with_output_projection=True) == {
        "model.layers.0.self_attn.q_proj.weight"}
    assert output_projection_name(str(tmp_path), stored) is None
