"""CRC32C of infinity._native against a pure-Python table reference."""

from __future__ import annotations

import random

import pytest

from infinity import _native

POLY = 0x82F63B78


def _table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (POLY if c & 1 else 0)
        table.append(c)
    return table


TABLE = _table()


def crc32c_reference(data: bytes, crc: int = 0) -> int:
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc = (crc >> 8) ^ TABLE[(crc ^ byte) & 0xFF]
    return crc ^ 0xFFFFFFFF


def test_check_value_of_123456789_is_e3069283() -> None:
    assert _native.crc32c_buffer(b"123456789") == 0xE3069283
    assert crc32c_reference(b"123456789") == 0xE3069283


def test_empty_input_gives_the_seed_back() -> None:
    assert _native.crc32c_buffer(b"") == 0
    assert _native.crc32c_buffer(b"", 0x12345678) == 0x12345678


@pytest.mark.parametrize("length", [1, 7, 8, 9, 63, 255, 767, 768, 769, 1000, 24575, 24576, 24577, 30001])
def test_matches_reference_for_odd_lengths(length: int) -> None:
    data = random.Random(length).randbytes(length)
    assert _native.crc32c_buffer(data) == crc32c_reference(data)


@pytest.mark.parametrize("misalign", range(1, 8))
def test_matches_reference_at_unaligned_addresses(misalign: int) -> None:
    buf = _native.AlignedBuffer(8192)
    data = random.Random(misalign).randbytes(5000)
    memoryview(buf)[misalign : misalign + len(data)] = data
    assert _native.crc32c(buf.address + misalign, len(data)) == crc32c_reference(data)


def test_seed_chains_pieces_into_the_crc_of_the_whole() -> None:
    data = random.Random(1).randbytes(100_000)
    whole = _native.crc32c_buffer(data)
    crc = 0
    for start in range(0, len(data), 33_333):
        crc = _native.crc32c_buffer(data[start : start + 33_333], crc)
    assert crc == whole


def test_hardware_and_table_paths_agree_on_large_buffers() -> None:
    rng = random.Random(2)
    for length in (1 << 20, (1 << 20) + 4093, 3 * 8192 * 5 + 3 * 256 * 2 + 13):
        data = rng.randbytes(length)
        assert _native.crc32c_buffer(data) == _native.crc32c_portable(data)


def test_address_and_buffer_forms_agree() -> None:
    buf = _native.AlignedBuffer(1 << 20)
    memoryview(buf)[:] = random.Random(3).randbytes(1 << 20)
    assert _native.crc32c(buf.address, buf.nbytes) == _native.crc32c_buffer(buf)


def test_uses_the_crc32_instruction_where_the_cpu_has_it() -> None:
    with open("/proc/cpuinfo") as f:
        has_sse42 = " sse4_2" in f.read()
    assert _native.crc32c_implementation() == ("sse4.2" if has_sse42 else "table")


def test_simd_level_is_one_of_the_documented_names() -> None:
    assert _native.simd_level() in ("avx512", "avx2", "sse4.2", "scalar")


def test_negative_length_is_refused() -> None:
    with pytest.raises(ValueError, match="nbytes"):
        _native.crc32c(4096, -1)


def test_strided_buffer_is_refused() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        _native.crc32c_buffer(memoryview(bytes(100))[::2])
