"""The native task pool: copies, per-block CRC32C and fills on fixed threads, completed
through an eventfd like the I/O engine (copy_bytes's own use of a pool: test_io_copy.py)."""

from __future__ import annotations

import ctypes
import gc
import random
import select
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from infinity import _native
from infinity.errors import AlignmentError, ChecksumError, IOEngineError
from infinity.io import TaskPool, crc_count
from infinity.io.future import IOFuture

MiB = 1 << 20


@pytest.fixture
def pool() -> Iterator[TaskPool]:
    with TaskPool(num_threads=3) as p:
        yield p


def random_buffer(nbytes: int, seed: int = 1) -> _native.AlignedBuffer:
    buf = _native.AlignedBuffer(max(nbytes, 1))
    memoryview(buf)[:nbytes] = random.Random(seed).randbytes(nbytes)
    return buf


def await_through_eventfd(pool: TaskPool, futures: list[IOFuture]) -> None:
    """Resolve `futures` the way the daemon's loop does: wait for the eventfd, then poll."""
    while not all(f._event.is_set() for f in futures):
        readable, _, _ = select.select([pool.completion_fd], [], [], 60.0)
        assert readable, "the completion eventfd never became readable"
        pool.poll()


@pytest.mark.parametrize("nbytes", [0, 1, 4095, MiB + 13, 17 * MiB + 5])
@pytest.mark.parametrize("pieces", [0, 1, 3])
def test_a_copy_of_odd_size_between_misaligned_addresses_equals_a_bytes_copy(
        pool: TaskPool, nbytes: int, pieces: int) -> None:
    src = random_buffer(nbytes + 11)
    dst = _native.AlignedBuffer(nbytes + 16)
    pool.submit_copy(dst=dst.address + 5, src=src.address + 11, nbytes=nbytes, pieces=pieces).result()
    view = memoryview(dst)
    assert bytes(view[5:5 + nbytes]) == bytes(memoryview(src)[11:11 + nbytes])
    assert bytes(view[:5]) == bytes(5)  # nothing written before the destination
    assert bytes(view[5 + nbytes:]) == bytes(len(view) - 5 - nbytes)  # nor after it


@pytest.mark.parametrize("nbytes", [1, 4097, 9 * MiB + 3])
def test_a_fill_sets_every_byte_and_none_around_them(pool: TaskPool, nbytes: int) -> None:
    buf = random_buffer(nbytes + 8, seed=2)
    before = bytes(memoryview(buf))
    pool.submit_fill(dst=buf.address + 3, nbytes=nbytes, value=0xA5, pieces=4).result()
    pool.submit_fill(dst=buf.address + 3, nbytes=nbytes // 2).result()  # value 0: zeroing
    after = bytes(memoryview(buf))
    half = nbytes // 2
    assert after[3:3 + half] == bytes(half)
    assert after[3 + half:3 + nbytes] == b"\xa5" * (nbytes - half)
    assert after[:3] == before[:3] and after[3 + nbytes:] == before[3 + nbytes:]


@pytest.mark.parametrize("nbytes,block", [(0, MiB), (5, MiB), (3 * MiB, MiB), (3 * MiB + 7, MiB),
                                          (100_003, 4096), (50_000, 3000)])
def test_crc_of_each_block_equals_the_portable_crc_of_that_block(pool: TaskPool, nbytes: int, block: int) -> None:
    data = random_buffer(nbytes + 1, seed=3)
    crcs = (ctypes.c_uint32 * max(1, crc_count(nbytes, block)))()
    pool.submit_crc32c(address=data.address + 1, nbytes=nbytes, crc_address=ctypes.addressof(crcs),
                       crc_block_bytes=block).result()
    raw = bytes(memoryview(data)[1:1 + nbytes])
    expected = [_native.crc32c_portable(raw[i:i + block]) for i in range(0, nbytes, block)]
    assert list(crcs)[:len(expected)] == expected


def test_crc_verify_passes_on_good_data_and_names_the_first_bad_block(pool: TaskPool) -> None:
    data = random_buffer(4 * MiB, seed=4)
    crcs = (ctypes.c_uint32 * 4)()
    args = dict(address=data.address, nbytes=4 * MiB, crc_address=ctypes.addressof(crcs))
    pool.submit_crc32c(**args).result()
    pool.submit_crc32c(**args, verify=True).result()
    memoryview(data)[2 * MiB + 10] ^= 0xFF
    with pytest.raises(ChecksumError, match=r"mismatch in block 2 .*rewrite the tensor"):
        pool.submit_crc32c(**args, verify=True).result()
    assert crcs[2] != _native.crc32c_portable(bytes(memoryview(data)[2 * MiB:3 * MiB]))  # only read


def test_completions_arrive_through_the_eventfd_and_run_callbacks_on_the_polling_thread(pool: TaskPool) -> None:
    src, dst = random_buffer(8 * MiB, seed=5), _native.AlignedBuffer(8 * MiB)
    called_on: list[int] = []
    future = pool.submit_copy(dst=dst.address, src=src.address, nbytes=8 * MiB, keepalive=(src, dst))
    future.add_done_callback(lambda f: called_on.append(threading.get_ident()))
    await_through_eventfd(pool, [future])
    assert future.exception() is None
    assert called_on == [threading.get_ident()]
    assert bytes(memoryview(dst)) == bytes(memoryview(src))
    assert pool.pending() == 0


def test_many_concurrent_tasks_from_several_threads_each_complete_once_with_the_right_bytes(pool: TaskPool) -> None:
    count, size = 48, 256 * 1024 + 3
    src = random_buffer(count * size, seed=6)
    dst = _native.AlignedBuffer(count * size)
    crcs = (ctypes.c_uint32 * (count * crc_count(size, 4096)))()
    futures: list[IOFuture] = []
    lock = threading.Lock()
    callbacks: list[int] = []

    def submit(first: int) -> None:
        for i in range(first, count, 4):
            at = i * size
            copy = pool.submit_copy(dst=dst.address + at, src=src.address + at, nbytes=size, pieces=1 + i % 3)
            crc = pool.submit_crc32c(address=src.address + at, nbytes=size,
                                     crc_address=ctypes.addressof(crcs) + 4 * i * crc_count(size, 4096),
                                     crc_block_bytes=4096)
            for f in (copy, crc):
                f.add_done_callback(lambda f: callbacks.append(f.batch_id))
            with lock:
                futures.extend((copy, crc))
            if i % 8 == 0:
                copy.result()  # some waited on here, the rest taken by poll()

    threads = [threading.Thread(target=submit, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    await_through_eventfd(pool, futures)
    assert all(f.exception() is None for f in futures)
    assert sorted(callbacks) == sorted(f.batch_id for f in futures)  # each exactly once
    assert bytes(memoryview(dst)) == bytes(memoryview(src))
    raw = bytes(memoryview(src))
    expected = []
    for i in range(count):
        part = raw[i * size:(i + 1) * size]
        expected += [_native.crc32c_portable(part[k:k + 4096]) for k in range(0, size, 4096)]
    assert list(crcs) == expected


def test_bad_arguments_are_typed_errors_with_a_sentence(pool: TaskPool) -> None:
    buf = _native.AlignedBuffer(2 * MiB)
    crcs = (ctypes.c_uint32 * 4)()
    with pytest.raises(IOEngineError, match="overlap"):
        pool.submit_copy(dst=buf.address + 1, src=buf.address, nbytes=MiB)
    with pytest.raises(IOEngineError, match="null pointer"):
        pool.submit_copy(dst=0, src=buf.address, nbytes=10)
    with pytest.raises(IOEngineError, match="must be >= 0"):
        pool.submit_fill(dst=buf.address, nbytes=-1)
    with pytest.raises(IOEngineError, match="must be a byte"):
        pool.submit_fill(dst=buf.address, nbytes=10, value=256)
    with pytest.raises(IOEngineError, match="crc_block_bytes is 0; it must be > 0"):
        pool.submit_crc32c(address=buf.address, nbytes=10, crc_address=ctypes.addressof(crcs), crc_block_bytes=0)
    with pytest.raises(AlignmentError, match="not 4-byte aligned"):
        pool.submit_crc32c(address=buf.address, nbytes=10, crc_address=ctypes.addressof(crcs) + 1)
    with pytest.raises(IOEngineError, match="pieces is -1"):
        pool.submit_copy(dst=buf.address, src=buf.address + MiB, nbytes=10, pieces=-1)
    with pytest.raises(IOEngineError, match="at least one thread"):
        TaskPool(num_threads=0)
    assert pool.pending() == 0  # nothing was queued


def test_close_with_tasks_in_flight_finishes_or_cancels_each_and_refuses_new_ones() -> None:
    pool = TaskPool(num_threads=1)
    big = _native.AlignedBuffer(32 * MiB)
    small = _native.AlignedBuffer(4 * MiB)
    futures = [pool.submit_fill(dst=big.address, nbytes=32 * MiB, value=1)]
    futures += [pool.submit_fill(dst=small.address, nbytes=4 * MiB, value=2, pieces=2) for _ in range(100)]
    pool.close()
    assert pool.pending() == 0  # every future resolved by close()
    for f in futures:
        error = f.exception(0)
        assert error is None or ("was cancelled: the task pool was closed" in str(error)
                                 and "Submit the task again" in str(error)), error
    if futures[0].exception(0) is None:
        assert bytes(memoryview(big)[-4096:]) == b"\x01" * 4096
    with pytest.raises(IOEngineError, match="closed: create a new TaskPool"):
        pool.submit_fill(dst=small.address, nbytes=1)
    pool.close()  # twice is fine


def test_dropping_an_open_pool_with_tasks_queued_joins_its_threads() -> None:
    buf = _native.AlignedBuffer(8 * MiB)
    pool = TaskPool(num_threads=2)
    for _ in range(20):
        pool.submit_fill(dst=buf.address, nbytes=8 * MiB, keepalive=buf)
    del pool
    gc.collect()  # the futures and the pool refer to each other
    # Closed in __del__ (without the GIL): its threads are joined, none left on freed memory.
    assert not [n for n in _thread_names() if n.startswith("infinity-task")]


def _thread_names() -> list[str]:
    return [(p / "comm").read_text().strip() for p in Path("/proc/self/task").iterdir()]
