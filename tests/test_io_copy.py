"""copy_into: the streaming copy used to fill shared slices."""

import pytest
import torch

from infinity import _native
from infinity.io import copy_into
from infinity.io.buffers import FillThreads

MiB = 1 << 20


@pytest.mark.parametrize("nbytes", [0, 1, 4095, MiB + 13, 17 * MiB + 5])
@pytest.mark.parametrize("num_threads", [1, 3])
def test_copy_is_exact_for_odd_sizes_and_offsets(nbytes: int, num_threads: int) -> None:
    src = torch.randint(0, 256, (nbytes + 11,), dtype=torch.uint8)[11:]  # unaligned source
    dst_storage = torch.zeros(nbytes + 5, dtype=torch.uint8)
    dst = dst_storage[5:]  # unaligned destination
    copy_into(dst, src, num_threads=num_threads)
    assert torch.equal(dst, src)
    assert torch.count_nonzero(dst_storage[:5]) == 0  # nothing written before the destination


def test_other_dtypes_and_strides_fall_back_to_copy() -> None:
    src = torch.randn(300, 7)
    dst = torch.empty(7, 300).t()  # non-contiguous destination
    copy_into(dst, src)
    assert torch.equal(dst, src)


def test_overlapping_buffers_are_refused() -> None:
    t = torch.zeros(2 * MiB, dtype=torch.uint8)
    with pytest.raises(ValueError, match="overlap"):
        _native.copy_bytes(t.data_ptr() + 1, t.data_ptr(), MiB, 1)


def test_large_copies_use_streaming_stores_where_the_cpu_has_them() -> None:
    expected = {"avx512": "avx512-stream", "avx2": "avx2-stream"}.get(_native.simd_level(), "memcpy")
    assert _native.copy_implementation() == expected


def test_the_default_thread_count_copies_exactly_while_it_is_being_chosen() -> None:
    src = torch.randint(0, 256, (33 * MiB + 5,), dtype=torch.uint8)
    for _ in range(12):  # past the trials of both candidates
        dst = torch.zeros_like(src)
        copy_into(dst, src)
        assert torch.equal(dst, src)


def test_fill_threads_keeps_the_candidate_with_the_lower_median_time() -> None:
    many = torch.get_num_threads()
    if many < 2:
        pytest.skip("torch runs one thread here: there is nothing to choose")
    choice = FillThreads(trials=3)
    # Durations given, not measured: which count is faster depends on the machine.
    seconds = {1: [3.0, 2.5, 9.0], many: [4.0, 3.5, 3.2]}
    tried: list[int] = []
    while choice.chosen is None and len(tried) < 10:
        n = choice.candidate(64 * MiB)
        assert n is not None
        tried.append(n)
        choice.record(n, seconds[n][tried.count(n) - 1], 64 * MiB)
    assert tried == [many, 1] * 3  # in turn, the many-thread count first
    assert choice.chosen == 1  # median 3.0 against 3.5, whatever the outlier
    assert choice.candidate(64 * MiB) == 1


def test_small_copies_are_not_split_or_timed() -> None:
    choice = FillThreads()
    assert choice.candidate(16 * MiB - 1) is None


def test_fill_threads_settles_when_torchs_thread_count_changes_during_the_trials() -> None:
    before = torch.get_num_threads()
    choice = FillThreads(trials=2)
    try:
        torch.set_num_threads(2)
        for i in range(20):
            if choice.chosen is not None:
                break
            if i == 1:
                torch.set_num_threads(3)  # not one of the candidates: its copies do not count
            n = choice.candidate(64 * MiB)
            assert n is not None
            choice.record(n, 1.0 if n == 1 else 2.0, 64 * MiB)
            torch.set_num_threads(2)
        assert choice.chosen == 1
        choice.chosen = 2
        torch.set_num_threads(1)  # e.g. a forked worker: never more threads than torch's count
        assert choice.candidate(64 * MiB) == 1
    finally:
        torch.set_num_threads(before)
