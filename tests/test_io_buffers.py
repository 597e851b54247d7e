"""infinity.io.aligned_empty and crc32c."""

from __future__ import annotations

import gc

import pytest
import torch

from infinity.io import aligned_capacity, aligned_empty, crc32c


def test_int_means_bytes_and_gives_a_zeroed_aligned_1d_tensor() -> None:
    t = aligned_empty(10_000)
    assert t.dtype == torch.uint8 and t.shape == (10_000,)
    assert t.data_ptr() % 4096 == 0
    assert int(t.count_nonzero()) == 0


def test_capacity_rounds_up_to_4096_with_zero_padding() -> None:
    t = aligned_empty(10_000)
    assert aligned_capacity(t) == 12_288
    whole = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    assert whole.numel() == 12_288 and int(whole.count_nonzero()) == 0


def test_shape_and_dtype_are_honoured() -> None:
    t = aligned_empty((3, 5), torch.float32)
    assert t.shape == (3, 5) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % 4096 == 0 and aligned_capacity(t) == 4096


def test_byte_count_must_fit_the_dtype() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        aligned_empty(10, torch.float32)


def test_zero_bytes_gives_an_empty_tensor() -> None:
    t = aligned_empty(0)
    assert t.numel() == 0 and aligned_capacity(t) == 4096


def test_tensor_keeps_its_memory_alive() -> None:
    t = aligned_empty(1 << 20)
    view = t[4096:]
    del t
    gc.collect()
    view.fill_(3)
    assert int(view.sum()) == 3 * ((1 << 20) - 4096)


def test_lock_true_gives_locked_memory() -> None:
    t = aligned_empty(1 << 20, lock=True)
    assert t.data_ptr() % 4096 == 0


def test_crc32c_of_tensor_and_bytes_agree() -> None:
    t = torch.arange(1000, dtype=torch.int32)
    assert crc32c(t) == crc32c(bytes(t.view(torch.uint8).tolist()))
    assert crc32c(b"123456789") == 0xE3069283
