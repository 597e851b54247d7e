"""copy_into: the streaming copy used to fill shared slices."""

import os
import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from infinity import _native
from infinity.io import copy_into
from infinity.io import buffers
from infinity.io.buffers import FillMethod

MiB = 1 << 20


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to `count` for the block, then put back."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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


def test_every_fill_method_copies_exactly_while_one_is_being_chosen(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A fresh choice, not the process's (which an earlier test may have settled already).
    choice = FillMethod(trials=2)
    monkeypatch.setattr(buffers, "_fill", choice)
    src = torch.randint(0, 256, (33 * MiB + 5,), dtype=torch.uint8)
    for _ in range(8):  # past the trials of every method
        dst = torch.zeros_like(src)
        copy_into(dst, src)
        assert torch.equal(dst, src)
    assert choice.method is not None


def test_fill_method_keeps_the_one_with_the_lowest_median_time() -> None:
    choice = FillMethod(trials=3)
    # Durations given, not measured: which method is fastest depends on the machine.
    seconds = {"split": [4.0, 3.5, 3.2], "stream": [3.0, 2.5, 9.0], "copy_": [3.1, 3.1, 3.1]}
    tried: list[str] = []
    with torch_threads(2):
        while choice.method is None and len(tried) < 20:
            method, threads, trial = choice.method_for(64 * MiB)
            assert trial and threads == (2 if method == "split" else 1)
            tried.append(method)
            choice.record(method, seconds[method][tried.count(method) - 1], 64 * MiB)
        assert tried == ["split", "stream", "copy_"] * 3  # in turn
        assert choice.method == "stream"  # median 3.0 against 3.1 and 3.5, whatever the outlier
        assert choice.method_for(64 * MiB) == ("stream", 1, False)


def test_fill_method_settles_when_torchs_thread_count_changes_during_the_trials() -> None:
    choice = FillMethod(trials=1)
    with torch_threads(torch.get_num_threads()):  # put back whatever the loop sets
        for count in (2, 3, 1, 4, 2):
            torch.set_num_threads(count)
            method, threads, trial = choice.method_for(64 * MiB)
            if trial:
                choice.record(method, {"split": 1.0, "stream": 2.0, "copy_": 3.0}[method], 64 * MiB)
        assert choice.method == "split"
        assert choice.method_for(64 * MiB) == ("split", 2, False)
        torch.set_num_threads(1)  # e.g. a forked worker: never more threads than torch's count
        assert choice.method_for(64 * MiB) == ("stream", 1, False)


def test_a_split_gives_each_thread_at_least_4_MiB() -> None:
    with torch_threads(16):
        choice = FillMethod()
        choice.method = "split"
        assert choice.method_for(32 * MiB) == ("split", 8, False)


def test_small_copies_are_not_split_or_timed() -> None:
    assert FillMethod().method_for(16 * MiB - 1) == ("stream", 1, False)


def test_a_large_copy_beside_another_streams_on_one_thread_untimed() -> None:
    with torch_threads(4):
        choice = FillMethod()
        choice.method = "split"
        assert choice.begin(64 * MiB) == ("split", 4, False)
        # A second put's fill while the first runs: 4 + 4 threads would crowd 4.
        assert choice.begin(64 * MiB) == ("stream", 1, False)
        choice.end(64 * MiB)
        choice.end(64 * MiB)
        assert choice.method_for(64 * MiB) == ("split", 4, False)


def test_a_copy_beside_another_is_not_a_trial_of_the_method() -> None:
    choice = FillMethod(trials=1)
    first = choice.begin(64 * MiB)
    assert first[2]  # the first large copy is a trial
    assert choice.begin(64 * MiB) == ("stream", 1, False)  # the crowd is not measured
    choice.end(64 * MiB)
    choice.end(64 * MiB)


def test_copies_from_several_threads_at_once_are_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    choice = FillMethod(trials=1)
    monkeypatch.setattr(buffers, "_fill", choice)
    sources = [torch.randint(0, 256, (17 * MiB + 3 * i,), dtype=torch.uint8) for i in range(4)]
    targets = [torch.zeros_like(s) for s in sources]
    barrier = threading.Barrier(len(sources))

    def fill(i: int) -> None:
        barrier.wait()
        for _ in range(3):
            copy_into(targets[i], sources[i])

    threads = [threading.Thread(target=fill, args=(i,)) for i in range(len(sources))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(t, s) for t, s in zip(targets, sources))
    assert choice._running == 0


def _random_buffer(nbytes: int) -> _native.AlignedBuffer:
    buf = _native.AlignedBuffer(nbytes)
    memoryview(buf)[:] = random.Random(nbytes).randbytes(nbytes)
    return buf


def _copy_threads() -> set[str]:
    return {p.name for p in Path("/proc/self/task").iterdir()
            if (p / "comm").read_text().startswith("infinity-copy")}


def test_copy_bytes_splits_large_copies_over_one_lasting_pool_not_new_threads() -> None:
    src, dst = _random_buffer(17 * MiB + 5), _native.AlignedBuffer(17 * MiB + 5)
    _native.copy_bytes(dst.address, src.address, 17 * MiB + 5, 3)
    first = _copy_threads()
    assert first, "no infinity-copy threads: the split copy did not use the shared pool"
    for shift in range(1, 6):
        _native.copy_bytes(dst.address + shift, src.address, 17 * MiB + 5 - shift, 3)
        assert bytes(memoryview(dst)[shift:]) == bytes(memoryview(src)[:17 * MiB + 5 - shift])
    assert _copy_threads() == first  # the same threads, not a new set per call
    assert len(first) == min(64, os.cpu_count() or 1)


def test_copy_bytes_in_a_forked_child_gets_a_pool_of_its_own() -> None:
    src, dst = _random_buffer(17 * MiB), _native.AlignedBuffer(17 * MiB)
    _native.copy_bytes(dst.address, src.address, 17 * MiB, 2)  # the parent's pool exists now
    memoryview(dst)[:] = bytes(17 * MiB)
    pid = os.fork()
    if pid == 0:  # the child: the parent's pool threads are not here
        try:
            _native.copy_bytes(dst.address, src.address, 17 * MiB, 2)
            ok = bytes(memoryview(dst)) == bytes(memoryview(src))
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
