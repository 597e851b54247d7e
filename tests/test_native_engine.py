"""infinity._native.Engine on real files: every backend, batches, checksums, failures."""

from __future__ import annotations

import ctypes
import errno
import os
import random
import select
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from infinity import _native
from conftest import wait_until_worker_blocks_in_io

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(params=["io_uring", "aio", "threads"])
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    probe = {"io_uring": _native.probe_io_uring, "aio": _native.probe_aio}.get(name)
    if probe is not None:
        usable, reason = probe()
        if not usable:
            pytest.skip(f"{name} is not usable on this machine: {reason}")
    return name


@pytest.fixture
def engine(backend: str) -> Iterator[_native.Engine]:
    eng = _native.Engine(2, 8, 256 * 1024, backend)
    yield eng
    eng.close()


def open_direct(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)


def random_buffer(nbytes: int, seed: int) -> _native.AlignedBuffer:
    buf = _native.AlignedBuffer(nbytes)
    memoryview(buf)[:] = random.Random(seed).randbytes(nbytes)
    return buf


def run(eng: _native.Engine, ops: list[tuple]) -> tuple[int, str]:
    return eng.wait(eng.submit(ops), 60.0)


def crc_array(count: int) -> ctypes.Array:
    return (ctypes.c_uint32 * count)()


@pytest.fixture
def pipe_engine() -> Iterator[tuple[_native.Engine, int, int]]:
    """An engine whose reads from an empty pipe stay in flight until the test writes to it.

    (engine, read end, write end); one worker with one slot, so a second op waits in the queue.
    """
    kind = "io_uring" if _native.probe_io_uring()[0] else "aio" if _native.probe_aio()[0] else None
    if kind is None:
        pytest.skip("needs io_uring or kernel AIO: a read from an empty pipe is the op that waits")
    r, w = os.pipe()
    eng = _native.Engine(1, 1, 4096, kind)
    try:
        yield eng, r, w
    finally:
        os.set_blocking(w, False)
        try:
            os.write(w, bytes(16 * 4096))  # satisfy any read still waiting
        except BlockingIOError:
            pass
        eng.close()
        os.close(r)
        os.close(w)


# --- round trips ------------------------------------------------------------


@pytest.mark.parametrize("pages", [1, 3, 17, 255, 1000])
def test_round_trip_is_bit_exact(engine: _native.Engine, disk_tmp: str, pages: int) -> None:
    nbytes = 4096 * pages
    src, dst = random_buffer(nbytes, pages), _native.AlignedBuffer(nbytes)
    fd = open_direct(os.path.join(disk_tmp, "data"))
    try:
        assert run(engine, [(True, fd, src.address, nbytes, 8192, True, 0, 0)]) == (0, "")
        assert run(engine, [(False, fd, dst.address, nbytes, 8192, True, 0, 0)]) == (0, "")
    finally:
        os.close(fd)
    assert bytes(memoryview(dst)) == bytes(memoryview(src))


def test_64mib_round_trip_with_checksums_is_bit_exact(backend: str, disk_tmp: str) -> None:
    eng = _native.Engine(2, 32, MiB, backend)
    src, dst = random_buffer(64 * MiB, 64), _native.AlignedBuffer(64 * MiB)
    crcs = crc_array(64)
    fd = open_direct(os.path.join(disk_tmp, "big"))
    try:
        assert run(eng, [(True, fd, src.address, 64 * MiB, 0, True, ctypes.addressof(crcs), MiB)]) == (0, "")
        assert run(eng, [(False, fd, dst.address, 64 * MiB, 0, True, ctypes.addressof(crcs), MiB)]) == (0, "")
    finally:
        os.close(fd)
        eng.close()
    assert bytes(memoryview(dst)) == bytes(memoryview(src))
    view = memoryview(src)
    assert list(crcs) == [_native.crc32c_buffer(view[i * MiB : (i + 1) * MiB]) for i in range(64)]


def test_backend_is_reported_as_chosen(backend: str) -> None:
    eng = _native.Engine(1, 4, 4096, backend)
    assert eng.backend == backend
    eng.close()


def test_auto_prefers_io_uring_when_usable() -> None:
    eng = _native.Engine(1, 4, 4096, "auto")
    expected = "io_uring" if _native.probe_io_uring()[0] else ("aio" if _native.probe_aio()[0] else "threads")
    assert eng.backend == expected
    eng.close()


def test_many_batches_in_flight_all_complete_intact(engine: _native.Engine, disk_tmp: str) -> None:
    rng = random.Random(7)
    sizes = [4096 * rng.randint(1, 300) for _ in range(48)]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    total = sum(sizes)
    src, dst = random_buffer(total, 8), _native.AlignedBuffer(total)
    fd = open_direct(os.path.join(disk_tmp, "many"))
    try:
        writes = [engine.submit([(True, fd, src.address + o, n, o, True, 0, 0)]) for o, n in zip(offsets, sizes)]
        assert len(set(writes)) == len(writes)
        assert all(engine.wait(b, 60.0) == (0, "") for b in writes)
        reads = [engine.submit([(False, fd, dst.address + o, n, o, True, 0, 0)]) for o, n in zip(offsets, sizes)]
        done: set[int] = set()
        while len(done) < len(reads):
            select.select([engine.completion_fd], [], [], 60.0)
            for batch, err, message in engine.poll():
                assert err == 0, message
                done.add(batch)
        assert done == set(reads)
    finally:
        os.close(fd)
    assert bytes(memoryview(dst)) == bytes(memoryview(src))


def test_ops_of_one_batch_go_to_different_files(engine: _native.Engine, disk_tmp: str) -> None:
    src, dst = random_buffer(3 * MiB, 9), _native.AlignedBuffer(3 * MiB)
    fds = [open_direct(os.path.join(disk_tmp, f"stripe{i}")) for i in range(3)]
    try:
        assert run(engine, [(True, fd, src.address + i * MiB, MiB, 0, True, 0, 0) for i, fd in enumerate(fds)])[0] == 0
        assert run(engine, [(False, fd, dst.address + i * MiB, MiB, 0, True, 0, 0) for i, fd in enumerate(fds)])[0] == 0
    finally:
        for fd in fds:
            os.close(fd)
    assert bytes(memoryview(dst)) == bytes(memoryview(src))


def test_empty_batch_and_zero_byte_ops_complete_at_once(engine: _native.Engine) -> None:
    assert engine.wait(engine.submit([]), 5.0) == (0, "")
    assert engine.wait(engine.submit([(False, 12345, 0, 0, 0, True, 0, 0)]), 5.0) == (0, "")


def test_non_direct_ops_round_trip_on_ramfs(backend: str, ramfs_dir: str) -> None:
    path = os.path.join(ramfs_dir, "plain")
    with pytest.raises(OSError) as refused:
        os.close(os.open(path + ".direct", os.O_RDWR | os.O_CREAT | os.O_DIRECT))
    assert refused.value.errno == errno.EINVAL  # ramfs really refuses O_DIRECT
    eng = _native.Engine(2, 8, 64 * 1024, backend)
    nbytes = 3 * MiB + 12345  # no alignment needed off the O_DIRECT path
    src = _native.AlignedBuffer(nbytes)
    memoryview(src)[:] = random.Random(10).randbytes(nbytes)
    dst = _native.AlignedBuffer(nbytes + 1)
    crcs = crc_array(4)
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        assert run(eng, [(True, fd, src.address, nbytes, 777, False, ctypes.addressof(crcs), MiB)]) == (0, "")
        assert run(eng, [(False, fd, dst.address + 1, nbytes, 777, False, ctypes.addressof(crcs), MiB)]) == (0, "")
    finally:
        os.close(fd)
        eng.close()
    assert bytes(memoryview(dst)[1:]) == bytes(memoryview(src))


# --- checksums ---------------------------------------------------------------


@pytest.mark.parametrize(
    "block_size, crc_block",
    [(64 * 1024, MiB), (4 * MiB, MiB), (8192, 12288), (4096, 4096 * 3 + 5)],
    ids=["chunks-smaller-than-crc-block", "chunks-span-crc-blocks", "unaligned-crc-blocks", "odd-crc-block"],
)
def test_write_checksums_each_block_however_chunks_fall(
    backend: str, disk_tmp: str, block_size: int, crc_block: int
) -> None:
    nbytes = 3 * MiB + 8192
    count = -(-nbytes // crc_block)
    eng = _native.Engine(2, 4, block_size, backend)
    src, dst = random_buffer(nbytes, 11), _native.AlignedBuffer(nbytes)
    crcs = crc_array(count)
    fd = open_direct(os.path.join(disk_tmp, "crc"))
    try:
        assert run(eng, [(True, fd, src.address, nbytes, 0, True, ctypes.addressof(crcs), crc_block)]) == (0, "")
        view = memoryview(src)
        assert list(crcs) == [
            _native.crc32c_portable(view[k * crc_block : min((k + 1) * crc_block, nbytes)]) for k in range(count)
        ]
        assert run(eng, [(False, fd, dst.address, nbytes, 0, True, ctypes.addressof(crcs), crc_block)]) == (0, "")
    finally:
        os.close(fd)
        eng.close()


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_corrupted_block_fails_read_with_ebadmsg_naming_its_offset(
    engine: _native.Engine, disk_tmp: str, staged: bool
) -> None:
    path = os.path.join(disk_tmp, "corrupt")
    src, dst = random_buffer(4 * MiB, 12), _native.AlignedBuffer(4 * MiB)
    crcs = crc_array(4)
    fd = open_direct(path)
    try:
        assert run(engine, [(True, fd, src.address, 4 * MiB, 0, True, ctypes.addressof(crcs), MiB)])[0] == 0
        with open(path, "r+b") as f:  # an ordinary buffered write, as bit rot would look
            f.seek(2 * MiB + 12345)
            byte = f.read(1)
            f.seek(2 * MiB + 12345)
            f.write(bytes([byte[0] ^ 0x40]))
        err, message = run(engine, [(False, fd, dst.address, 4 * MiB, 0, True, ctypes.addressof(crcs), MiB, staged)])
    finally:
        os.close(fd)
    assert err == errno.EBADMSG
    assert "checksum mismatch" in message and f"file offset {2 * MiB}" in message


# --- staged reads ------------------------------------------------------------


@pytest.mark.parametrize(
    "block_size, crc_block",
    [(MiB, MiB), (64 * 1024, MiB), (4 * MiB, MiB), (8192, 12288)],
    ids=["block-is-crc-block", "crc-block-spans-chunks", "chunk-spans-crc-blocks", "unaligned-crc-blocks"],
)
def test_staged_read_lands_bit_exact_with_checksums_checked(
    backend: str, disk_tmp: str, block_size: int, crc_block: int
) -> None:
    nbytes = 5 * MiB + 3 * 4096  # a short last chunk and a short last CRC block
    count = -(-nbytes // crc_block)
    eng = _native.Engine(2, 4, block_size, backend)
    src, dst = random_buffer(nbytes, 21), _native.AlignedBuffer(nbytes + 8192)
    crcs = crc_array(count)
    fd = open_direct(os.path.join(disk_tmp, "staged"))
    try:
        assert run(eng, [(True, fd, src.address, nbytes, 4096, True, ctypes.addressof(crcs), crc_block)]) == (0, "")
        # Into the middle of a buffer, so a copy to the wrong place or of the wrong length shows.
        op = (False, fd, dst.address + 4096, nbytes, 4096, True, ctypes.addressof(crcs), crc_block, True)
        assert run(eng, [op]) == (0, "")
        assert eng.staged_bytes == nbytes  # every block came through the staging memory
    finally:
        os.close(fd)
        eng.close()
    view = memoryview(dst)
    assert bytes(view[4096 : 4096 + nbytes]) == bytes(memoryview(src))
    assert bytes(view[:4096]) == bytes(4096) and bytes(view[4096 + nbytes :]) == bytes(4096)


@pytest.mark.parametrize("staging_bytes", [1, 4 << 20], ids=["one-block-each", "default"])
def test_staged_read_without_checksums_many_ops_in_flight(backend: str, disk_tmp: str, staging_bytes: int) -> None:
    # With one staging block per worker, most chunks wait in the queue for a block.
    eng = _native.Engine(2, 8, 256 * 1024, backend, staging_bytes)
    sizes = [4096 * p for p in (1, 3, 64, 255, 257, 1024)]
    src = random_buffer(sum(sizes), 22)
    dst = _native.AlignedBuffer(sum(sizes))
    fd = open_direct(os.path.join(disk_tmp, "staged-many"))
    try:
        assert run(eng, [(True, fd, src.address, sum(sizes), 0, True, 0, 0)]) == (0, "")
        ops, at = [], 0
        for n in sizes:
            ops.append((False, fd, dst.address + at, n, at, True, 0, 0, True))
            at += n
        assert run(eng, ops) == (0, "")
        assert eng.staged_bytes == sum(sizes)
    finally:
        os.close(fd)
        eng.close()
    assert bytes(memoryview(dst)) == bytes(memoryview(src))


def test_a_staged_read_waiting_for_a_staging_block_does_not_hold_back_direct_ops(disk_tmp: str) -> None:
    kind = "io_uring" if _native.probe_io_uring()[0] else "aio" if _native.probe_aio()[0] else None
    if kind is None:
        pytest.skip("needs io_uring or kernel AIO: a read from an empty pipe is the op that waits")
    eng = _native.Engine(1, 2, 4096, kind, 1)  # one worker, two slots, one staging block
    r, w = os.pipe()
    src, dst = random_buffer(2 * 4096, 33), _native.AlignedBuffer(3 * 4096)
    fd = open_direct(os.path.join(disk_tmp, "staged-and-direct"))
    try:
        assert run(eng, [(True, fd, src.address, 2 * 4096, 0, True, 0, 0)]) == (0, "")
        # One batch, so the worker finds all three ops queued in this order. The pipe's read takes
        # the only staging block and stays in flight until the pipe is written to; the worker then
        # waits for a completion, so whatever it did not take in that round stays queued.
        batch = eng.submit([(False, r, dst.address, 4096, 0, True, 0, 0, True),
                            (False, fd, dst.address + 4096, 4096, 0, True, 0, 0, True),
                            (False, fd, dst.address + 8192, 4096, 4096, True, 0, 0)])
        # No event marks one op of a batch as done: watch its bytes arrive.
        expected, deadline = bytes(memoryview(src)[4096:]), time.monotonic() + 10.0
        while bytes(memoryview(dst)[8192:]) != expected and time.monotonic() < deadline:
            time.sleep(0.001)
        # The direct read went ahead of the staged read queued before it.
        assert bytes(memoryview(dst)[8192:]) == expected
        assert bytes(memoryview(dst)[4096:8192]) == bytes(4096)  # the staged one still waits
        os.write(w, bytes(range(256)) * 16)
        assert eng.wait(batch, 10.0) == (0, "")  # and ran once the block was free
        assert bytes(memoryview(dst)[4096:8192]) == bytes(memoryview(src)[:4096])
        assert bytes(memoryview(dst)[:4096]) == bytes(range(256)) * 16
    finally:
        os.set_blocking(w, False)
        try:
            os.write(w, bytes(4096))  # satisfy the pipe's read if an assertion left it waiting
        except BlockingIOError:
            pass
        eng.close()
        os.close(fd)
        os.close(r)
        os.close(w)


def test_staged_read_past_end_of_file_is_eio_short_read(engine: _native.Engine, disk_tmp: str) -> None:
    src, dst = random_buffer(MiB, 24), _native.AlignedBuffer(2 * MiB)
    fd = open_direct(os.path.join(disk_tmp, "staged-short"))
    try:
        assert run(engine, [(True, fd, src.address, MiB, 0, True, 0, 0)])[0] == 0
        err, message = run(engine, [(False, fd, dst.address, 2 * MiB, 0, True, 0, 0, True)])
    finally:
        os.close(fd)
    assert err == errno.EIO and "short read" in message
    assert bytes(memoryview(dst)[:MiB]) == bytes(memoryview(src))


@pytest.mark.parametrize("is_write", [True, False], ids=["write", "read"])
def test_staged_applies_to_direct_ops_only(engine: _native.Engine, is_write: bool) -> None:
    with pytest.raises(ValueError, match="staged applies to O_DIRECT ops only"):
        engine.submit([(is_write, 0, 4096, 4096, 0, False, 0, 0, True)])


@pytest.mark.parametrize("block_size", [64 * 1024, MiB, 4 * MiB], ids=["small-chunks", "mib-chunks", "big-chunks"])
def test_staged_write_goes_out_bit_exact_with_its_checksums(backend: str, disk_tmp: str, block_size: int) -> None:
    nbytes = 5 * MiB + 3 * 4096
    count = -(-nbytes // MiB)
    eng = _native.Engine(2, 4, block_size, backend, 1)  # one staging block per worker: chunks wait
    src, dst = random_buffer(nbytes, 25), _native.AlignedBuffer(nbytes)
    crcs = crc_array(count)
    fd = open_direct(os.path.join(disk_tmp, "staged-write"))
    try:
        assert run(eng, [(True, fd, src.address, nbytes, 8192, True, ctypes.addressof(crcs), MiB, True)]) == (0, "")
        assert eng.staged_bytes == nbytes
        assert run(eng, [(False, fd, dst.address, nbytes, 8192, True, ctypes.addressof(crcs), MiB)]) == (0, "")
    finally:
        os.close(fd)
        eng.close()
    assert bytes(memoryview(dst)) == bytes(memoryview(src))
    view = memoryview(src)
    assert list(crcs) == [_native.crc32c_buffer(view[k * MiB : min((k + 1) * MiB, nbytes)]) for k in range(count)]


# --- failures ----------------------------------------------------------------


@pytest.mark.parametrize("field", ["address", "nbytes", "offset"])
def test_unaligned_direct_op_raises_alignment_error_and_engine_still_works(
    engine: _native.Engine, disk_tmp: str, field: str
) -> None:
    buf = random_buffer(2 * 4096, 13)
    fd = open_direct(os.path.join(disk_tmp, "align"))
    try:
        address, nbytes, offset = buf.address, 4096, 0
        if field == "address":
            address += 512
        elif field == "nbytes":
            nbytes = 1000
        else:
            offset = 100
        with pytest.raises(ValueError, match="aligned_empty") as info:
            engine.submit([(True, fd, address, nbytes, offset, True, 0, 0)])
        assert isinstance(info.value, _native.AlignmentError)
        assert str(nbytes if field == "nbytes" else offset if field == "offset" else hex(address)) in str(info.value)
        assert run(engine, [(True, fd, buf.address, 4096, 0, True, 0, 0)]) == (0, "")
    finally:
        os.close(fd)


def test_bad_fd_fails_the_batch_with_ebadf(engine: _native.Engine) -> None:
    import resource

    buf = _native.AlignedBuffer(MiB)
    # Above the process's fd limit: never open. (A number just closed is not safe: another
    # thread of the test process, a client's heartbeat or ZeroMQ's, may get it meanwhile.)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    bad = (1 << 30 if hard == resource.RLIM_INFINITY else min(hard, 1 << 30)) + 7
    err, message = run(engine, [(False, bad, buf.address, MiB, 0, True, 0, 0)])
    assert err == errno.EBADF
    # Whichever of the op's chunks fails first is reported (two workers race): its fd and offset.
    assert f"fd {bad}, offset " in message and "Bad file descriptor" in message


def test_read_past_end_of_file_is_eio_short_read(engine: _native.Engine, disk_tmp: str) -> None:
    src, dst = random_buffer(MiB, 14), _native.AlignedBuffer(2 * MiB)
    fd = open_direct(os.path.join(disk_tmp, "short"))
    try:
        assert run(engine, [(True, fd, src.address, MiB, 0, True, 0, 0)])[0] == 0
        err, message = run(engine, [(False, fd, dst.address, 2 * MiB, 0, True, 0, 0)])
    finally:
        os.close(fd)
    assert err == errno.EIO and "short read" in message
    assert bytes(memoryview(dst)[:MiB]) == bytes(memoryview(src))


def test_full_file_system_fails_with_enospc_and_engine_stays_usable(
    backend: str, tiny_tmpfs_dir: str, disk_tmp: str
) -> None:
    eng = _native.Engine(2, 8, MiB, backend)
    buf = random_buffer(16 * MiB, 15)
    full = open_direct(os.path.join(tiny_tmpfs_dir, "fill"))  # tmpfs takes O_DIRECT on recent kernels
    roomy = open_direct(os.path.join(disk_tmp, "after"))
    try:
        err, message = run(eng, [(True, full, buf.address, 16 * MiB, 0, True, 0, 0)])
        assert err == errno.ENOSPC, message
        assert run(eng, [(True, roomy, buf.address, 16 * MiB, 0, True, 0, 0)]) == (0, "")
    finally:
        os.close(full)
        os.close(roomy)
        eng.close()


def test_file_size_limit_fails_with_efbig_in_a_healthy_process(backend: str, disk_tmp: str) -> None:
    script = textwrap.dedent(
        f"""
        import os, resource, signal
        from infinity import _native
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))
        eng = _native.Engine(2, 8, 1 << 20, {backend!r})
        buf = _native.AlignedBuffer(8 << 20)
        fd = os.open({os.path.join(disk_tmp, "limited")!r}, os.O_RDWR | os.O_CREAT | os.O_DIRECT)
        err, message = eng.wait(eng.submit([(True, fd, buf.address, 8 << 20, 0, True, 0, 0)]))
        print("FIRST", err)
        print(message)
        err, message = eng.wait(eng.submit([(True, fd, buf.address, 1 << 20, 0, True, 0, 0)]))
        print("SECOND", err)
        eng.close()
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert f"FIRST {errno.EFBIG}" in proc.stdout
    assert "SECOND 0" in proc.stdout


# --- completion: poll, wait, eventfd ---------------------------------------------


def test_completion_fd_becomes_readable_and_poll_clears_it(engine: _native.Engine, disk_tmp: str) -> None:
    buf = _native.AlignedBuffer(MiB)
    fd = open_direct(os.path.join(disk_tmp, "efd"))
    try:
        batch = engine.submit([(True, fd, buf.address, MiB, 0, True, 0, 0)])
        readable, _, _ = select.select([engine.completion_fd], [], [], 60.0)
        assert readable == [engine.completion_fd]
        assert engine.poll() == [(batch, 0, "")]
        assert select.select([engine.completion_fd], [], [], 0)[0] == []
    finally:
        os.close(fd)


def test_poll_returns_while_a_batch_is_still_running(pipe_engine: tuple[_native.Engine, int, int]) -> None:
    eng, r, w = pipe_engine
    buf = _native.AlignedBuffer(4096)
    batch = eng.submit([(False, r, buf.address, 4096, 0, True, 0, 0)])
    assert eng.poll() == []
    with pytest.raises(TimeoutError):
        eng.wait(batch, 0.0)
    os.write(w, b"x" * 4096)
    assert eng.wait(batch, 60.0) == (0, "")
    assert bytes(memoryview(buf)) == b"x" * 4096


def test_wait_with_timeout_raises_timeout_error(pipe_engine: tuple[_native.Engine, int, int]) -> None:
    eng, r, _ = pipe_engine
    buf = _native.AlignedBuffer(4096)
    batch = eng.submit([(False, r, buf.address, 4096, 0, True, 0, 0)])
    with pytest.raises(TimeoutError, match=f"batch {batch}"):
        eng.wait(batch, 0.01)


def test_wait_releases_the_gil(pipe_engine: tuple[_native.Engine, int, int]) -> None:
    eng, r, _ = pipe_engine
    buf = _native.AlignedBuffer(4096)
    batch = eng.submit([(False, r, buf.address, 4096, 0, True, 0, 0)])
    counter = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            counter[0] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        before = counter[0]
        with pytest.raises(TimeoutError):
            eng.wait(batch, 0.3)
        during = counter[0] - before  # stays ~0 if wait() held the GIL for its 0.3 s
    finally:
        stop.set()
        spinner.join(60)
    assert during > 100


def test_an_engine_dropped_without_close_waits_for_its_ops_without_the_gil() -> None:
    kind = "io_uring" if _native.probe_io_uring()[0] else "aio" if _native.probe_aio()[0] else None
    if kind is None:
        pytest.skip("needs io_uring or kernel AIO: a read from an empty pipe is the op that waits")
    r, w = os.pipe()
    buf = _native.AlignedBuffer(4096)
    holder = [_native.Engine(1, 1, 4096, kind)]
    holder[0].submit([(False, r, buf.address, 4096, 0, True, 0, 0)])
    wait_until_worker_blocks_in_io()
    # The pipe is written a second from now by another process: a Python thread could not
    # do it while the dropping thread held the GIL.
    writer = subprocess.Popen(["sh", "-c", "sleep 1 && head -c 4096 /dev/zero"], stdout=w)
    dropper = threading.Thread(target=holder.clear)  # the last reference: the destructor runs
    longest_gap_s, last = 0.0, time.monotonic()
    dropper.start()
    while dropper.is_alive():  # this thread runs Python all along if the drop let go of the GIL
        now = time.monotonic()
        longest_gap_s, last = max(longest_gap_s, now - last), now
    dropper.join()
    assert writer.wait(60) == 0
    os.close(r)
    os.close(w)
    assert longest_gap_s < 0.5, f"this thread stood still for {longest_gap_s:.2f}s"


def test_each_batch_is_reported_exactly_once(engine: _native.Engine) -> None:
    first, second = engine.submit([]), engine.submit([])
    assert engine.wait(first, 5.0) == (0, "")
    assert [b for b, _, _ in engine.poll()] == [second]
    assert engine.poll() == []
    for batch in (first, second):
        with pytest.raises(KeyError):
            engine.wait(batch, 0.0)


def test_close_cancels_queued_ops_and_waits_for_the_running_one(
    pipe_engine: tuple[_native.Engine, int, int]
) -> None:
    eng, r, w = pipe_engine
    bufs = [_native.AlignedBuffer(4096) for _ in range(2)]
    # One slot: the first batch is in flight on the pipe, the second waits in the queue.
    running = eng.submit([(False, r, bufs[0].address, 4096, 0, True, 0, 0)])
    wait_until_worker_blocks_in_io()
    queued = eng.submit([(False, r, bufs[1].address, 4096, 0, True, 0, 0)])
    closer = threading.Thread(target=eng.close)
    closer.start()
    err, message = eng.wait(queued, 60.0)  # cancelled before close() waits for the running op
    assert err == errno.ECANCELED and message.startswith("op 0:") and "closed" in message
    assert closer.is_alive()  # still waiting for the read on the pipe
    os.write(w, b"y" * 4096)
    closer.join(60)
    assert not closer.is_alive()
    assert eng.wait(running, 60.0) == (0, "")
    assert bytes(memoryview(bufs[0])) == b"y" * 4096
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit([])


# --- arguments ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, words",
    [
        ((0, 8, 4096, "auto"), "num_threads"),
        ((1, 0, 4096, "auto"), "queue_depth"),
        ((1, 8, 1000, "auto"), "block_size_bytes"),
        ((1, 8, 4096, "libaio"), "backend"),
    ],
)
def test_bad_engine_arguments_raise_value_error(args: tuple, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        _native.Engine(*args)


def test_malformed_op_tuple_is_refused(engine: _native.Engine) -> None:
    with pytest.raises(ValueError, match="8"):
        engine.submit([(True, 1, 2)])
    with pytest.raises(ValueError, match="nbytes"):
        engine.submit([(True, 1, 4096, -4096, 0, True, 0, 0)])


def test_probes_explain_themselves() -> None:
    for usable, reason in (_native.probe_io_uring(), _native.probe_aio()):
        assert isinstance(usable, bool) and len(reason) > 10
