"""Multi-stage jobs on the daemon's loop: read -> compute -> write through the real I/O engine
and the real task pool, on real files opened with O_DIRECT on the disk (not tmpfs)."""

from __future__ import annotations

import ctypes
import os
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generator

import pytest

from infinity import _native
from infinity.daemon.jobs import Stage, start_job
from infinity.daemon.loop import EventLoop
from infinity.daemon.tasks import LoopTaskPool, unwatch_completions, watch_completions
from infinity.errors import ChecksumError, IOEngineError
from infinity.io import IOEngine, IOOp, TaskPool, crc_count

MiB = 1 << 20
SIZE = 3 * MiB + 8192  # the last CRC block is short


@dataclass
class Daemonish:
    """A running loop with the engine and the task pool completing on it."""

    loop: EventLoop
    engine: IOEngine
    pool: TaskPool
    loop_thread: threading.Thread


@pytest.fixture
def daemon() -> Iterator[Daemonish]:
    loop = EventLoop()
    engine = IOEngine(num_threads=2, queue_depth=8)
    watch_completions(loop, engine)
    tasks = LoopTaskPool(loop, num_threads=2)
    thread = threading.Thread(target=loop.run, name="test-loop")
    thread.start()
    try:
        yield Daemonish(loop, engine, tasks.pool, thread)
    finally:
        def shut() -> None:
            tasks.close()
            unwatch_completions(loop, engine)
            engine.close()
            loop.stop()

        loop.call_soon_threadsafe(shut)
        thread.join()
        loop.close()


@pytest.fixture
def source_file(disk_tmp: str) -> tuple[str, bytes]:
    data = random.Random(11).randbytes(SIZE)
    path = os.path.join(disk_tmp, "source")
    with open(path, "wb") as f:
        f.write(data)
    return path, data


def open_direct(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_DIRECT)


def test_a_read_checksum_write_job_runs_every_stage_on_the_loop_thread_and_writes_the_bytes(
        daemon: Daemonish, source_file: tuple[str, bytes], disk_tmp: str) -> None:
    path, data = source_file
    buf, out = _native.AlignedBuffer(SIZE), _native.AlignedBuffer(SIZE)
    blocks = crc_count(SIZE)
    job_crcs, write_crcs = (ctypes.c_uint32 * blocks)(), (ctypes.c_uint32 * blocks)()
    stage_threads: list[int] = []

    def copy_with_checksums() -> Generator[Stage, None, int]:
        src = open_direct(path, os.O_RDONLY)
        dst = open_direct(os.path.join(disk_tmp, "copy"), os.O_WRONLY | os.O_CREAT)
        try:
            stage_threads.append(threading.get_ident())
            yield daemon.engine.submit(IOOp.read(fd=src, address=buf.address, nbytes=SIZE, offset=0))
            stage_threads.append(threading.get_ident())
            yield daemon.pool.submit_crc32c(address=buf.address, nbytes=SIZE,
                                            crc_address=ctypes.addressof(job_crcs))
            stage_threads.append(threading.get_ident())
            yield daemon.pool.submit_copy(dst=out.address, src=buf.address, nbytes=SIZE)
            stage_threads.append(threading.get_ident())
            yield daemon.engine.submit(IOOp.write(fd=dst, address=out.address, nbytes=SIZE, offset=0,
                                                  crc_address=ctypes.addressof(write_crcs)))
            stage_threads.append(threading.get_ident())
            return SIZE
        finally:
            os.close(src)
            os.close(dst)

    assert start_job(daemon.loop, copy_with_checksums(), name="copy").result(timeout=60) == SIZE
    assert stage_threads == [daemon.loop_thread.ident] * 5
    with open(os.path.join(disk_tmp, "copy"), "rb") as f:
        assert f.read() == data
    expected = [_native.crc32c_portable(data[i:i + MiB]) for i in range(0, SIZE, MiB)]
    assert list(job_crcs) == expected  # the pool's checksums of what was read
    assert list(write_crcs) == expected  # the engine's of what was written


def test_a_failed_stage_raises_its_typed_error_at_the_yield_where_the_job_may_handle_it(
        daemon: Daemonish, source_file: tuple[str, bytes]) -> None:
    path, data = source_file
    buf = _native.AlignedBuffer(SIZE)
    wrong = (ctypes.c_uint32 * crc_count(SIZE))()  # all zero: not the data's checksums

    def verify() -> Generator[Stage, None, str]:
        fd = open_direct(path, os.O_RDONLY)
        try:
            yield daemon.engine.submit(IOOp.read(fd=fd, address=buf.address, nbytes=SIZE, offset=0))
            try:
                yield daemon.pool.submit_crc32c(address=buf.address, nbytes=SIZE,
                                                crc_address=ctypes.addressof(wrong), verify=True)
            except ChecksumError as exc:
                return f"corrupt: {exc}"
            return "good"
        finally:
            os.close(fd)

    outcome = start_job(daemon.loop, verify(), name="verify").result(timeout=60)
    assert outcome.startswith("corrupt: ") and "mismatch in block 0" in outcome
    assert bytes(memoryview(buf)) == data  # the read stage before it completed


def test_an_error_the_job_does_not_handle_fails_its_future_after_its_cleanup_ran(
        daemon: Daemonish, disk_tmp: str) -> None:
    buf = _native.AlignedBuffer(MiB)
    path = os.path.join(disk_tmp, "short")
    with open(path, "wb") as f:
        f.write(b"x" * 4096)
    cleaned: list[bool] = []

    def read_past_the_end() -> Generator[Stage, None, None]:
        fd = open_direct(path, os.O_RDONLY)
        try:
            yield daemon.engine.submit(IOOp.read(fd=fd, address=buf.address, nbytes=MiB, offset=0))
        finally:
            os.close(fd)
            cleaned.append(True)

    with pytest.raises(IOEngineError, match="as large as the read expects"):
        start_job(daemon.loop, read_past_the_end(), name="short read").result(timeout=60)
    assert cleaned == [True]


def test_a_stage_of_several_futures_resumes_once_all_of_them_have_completed(
        daemon: Daemonish, source_file: tuple[str, bytes]) -> None:
    path, data = source_file
    buf = _native.AlignedBuffer(SIZE)
    zeros = _native.AlignedBuffer(4 * MiB)
    memoryview(zeros)[:] = b"\xff" * (4 * MiB)
    crcs = (ctypes.c_uint32 * crc_count(SIZE))()
    resumed: list[str] = []

    def parallel() -> Generator[Stage, None, None]:
        fd = open_direct(path, os.O_RDONLY)
        try:
            half = SIZE // 2 // 4096 * 4096
            yield [
                daemon.engine.submit(IOOp.read(fd=fd, address=buf.address, nbytes=half, offset=0)),
                daemon.engine.submit(IOOp.read(fd=fd, address=buf.address + half, nbytes=SIZE - half,
                                               offset=half)),
                daemon.pool.submit_fill(dst=zeros.address, nbytes=4 * MiB),
            ]
            resumed.append("read and filled")
            yield daemon.pool.submit_crc32c(address=buf.address, nbytes=SIZE, crc_address=ctypes.addressof(crcs))
        finally:
            os.close(fd)

    start_job(daemon.loop, parallel(), name="parallel").result(timeout=60)
    assert resumed == ["read and filled"]
    assert bytes(memoryview(buf)) == data and bytes(memoryview(zeros)) == bytes(4 * MiB)
    assert list(crcs) == [_native.crc32c_portable(data[i:i + MiB]) for i in range(0, SIZE, MiB)]


def test_yielding_something_that_is_not_a_future_fails_the_job_with_a_sentence(daemon: Daemonish) -> None:
    def confused() -> Generator[Stage, None, None]:
        yield 42  # type: ignore[misc]

    with pytest.raises(TypeError, match="a job stage must be an IOFuture"):
        start_job(daemon.loop, confused(), name="confused").result(timeout=60)


def test_closing_a_task_pool_under_a_waiting_stage_resolves_the_stage(daemon: Daemonish) -> None:
    buf = _native.AlignedBuffer(64 * MiB)

    def many_fills() -> Generator[Stage, None, str]:
        tasks = LoopTaskPool(daemon.loop, num_threads=1)  # jobs run on the loop thread
        futures = [tasks.pool.submit_fill(dst=buf.address, nbytes=64 * MiB) for _ in range(20)]
        tasks.close()  # with the fills queued behind the first
        try:
            yield futures
        except IOEngineError as exc:
            return str(exc)
        return "all ran"

    outcome = start_job(daemon.loop, many_fills(), name="fills").result(timeout=120)
    assert outcome == "all ran" or "was cancelled: the task pool was closed" in outcome
