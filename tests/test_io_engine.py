"""infinity.io.IOEngine: futures, polling, callbacks and typed errors on real files."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from infinity.config import IOConfig
from infinity.errors import AlignmentError, ChecksumError, DiskFullError, IOEngineError
from infinity.io import CRC_BLOCK_BYTES, IOEngine, IOFuture, IOOp, aligned_empty, crc_count, probe_aio, probe_io_uring
from conftest import wait_until_worker_blocks_in_io

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(params=["io_uring", "aio", "threads"])
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    probe = {"io_uring": probe_io_uring, "aio": probe_aio}.get(name)
    if probe is not None:
        usable, reason = probe()
        if not usable:
            pytest.skip(f"{name} is not usable on this machine: {reason}")
    return name


@pytest.fixture
def engine() -> Iterator[IOEngine]:
    with IOEngine(num_threads=2, queue_depth=8, block_size_bytes=256 * 1024) as eng:
        yield eng


@pytest.fixture
def data_fd(disk_tmp: str) -> Iterator[int]:
    fd = os.open(os.path.join(disk_tmp, "data"), os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    yield fd
    os.close(fd)


def random_tensor(nbytes: int, seed: int) -> torch.Tensor:
    t = aligned_empty(nbytes)
    t.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return t


def write_op(fd: int, t: torch.Tensor, offset: int = 0, crcs: torch.Tensor | None = None) -> IOOp:
    return IOOp.write(fd=fd, address=t.data_ptr(), nbytes=t.numel(), offset=offset,
                      crc_address=0 if crcs is None else crcs.data_ptr())


def read_op(fd: int, t: torch.Tensor, offset: int = 0, crcs: torch.Tensor | None = None) -> IOOp:
    return IOOp.read(fd=fd, address=t.data_ptr(), nbytes=t.numel(), offset=offset,
                     crc_address=0 if crcs is None else crcs.data_ptr())


@pytest.fixture
def pipe_engine() -> Iterator[tuple[IOEngine, int, int]]:
    """An engine whose reads from an empty pipe stay in flight until the test writes to it.

    (engine, read end, write end); one worker with one slot, so a second op waits in the queue.
    """
    kind = "io_uring" if probe_io_uring()[0] else "aio" if probe_aio()[0] else None
    if kind is None:
        pytest.skip("needs io_uring or kernel AIO: a read from an empty pipe is the op that waits")
    r, w = os.pipe()
    eng = IOEngine(backend=kind, num_threads=1, queue_depth=1, block_size_bytes=4096)
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


def pipe_read(r: int, buf: torch.Tensor) -> IOOp:
    return IOOp.read(fd=r, address=buf.data_ptr(), nbytes=4096, offset=0)


# --- construction ---------------------------------------------------------------


def test_engine_from_config_uses_its_backend(backend: str) -> None:
    with IOEngine.from_config(IOConfig(backend=backend, num_threads=1, queue_depth=4)) as eng:
        assert eng.backend == backend


def test_keyword_arguments_override_the_config() -> None:
    with IOEngine(IOConfig(queue_depth=4), backend="threads", block_size_bytes=8192) as eng:
        assert eng.backend == "threads"
        assert eng.config.queue_depth == 4 and eng.config.block_size_bytes == 8192


def test_invalid_setting_raises_config_error() -> None:
    from infinity.errors import ConfigError

    with pytest.raises(ConfigError, match="block_size_bytes"):
        IOEngine(block_size_bytes=1000)


# --- round trips ------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [4096, 4096 * 7, 64 * MiB])
def test_round_trip_through_futures_is_bit_exact(backend: str, data_fd: int, nbytes: int) -> None:
    src, dst = random_tensor(nbytes, nbytes), aligned_empty(nbytes)
    crcs = torch.zeros(crc_count(nbytes), dtype=torch.int32)
    with IOEngine(backend=backend, queue_depth=32, block_size_bytes=MiB) as eng:
        eng.submit([write_op(data_fd, src, crcs=crcs)]).result()
        eng.submit([read_op(data_fd, dst, crcs=crcs)]).result()
    assert torch.equal(src, dst)


def test_non_direct_op_round_trips_on_ramfs(engine: IOEngine, ramfs_dir: str) -> None:
    src = torch.randint(0, 256, (MiB + 3,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    fd = os.open(os.path.join(ramfs_dir, "plain"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        engine.run(IOOp.write(fd=fd, address=src.data_ptr(), nbytes=src.numel(), offset=5, direct=False))
        engine.run(IOOp.read(fd=fd, address=dst.data_ptr(), nbytes=dst.numel(), offset=5, direct=False))
    finally:
        os.close(fd)
    assert torch.equal(src, dst)


def test_many_futures_resolve_once_with_poller_and_waiters_racing(data_fd: int) -> None:
    src = random_tensor(16 * MiB, 3)
    calls: dict[int, int] = {}
    lock = threading.Lock()

    def count(future: IOFuture) -> None:
        with lock:
            calls[future.batch_id] = calls.get(future.batch_id, 0) + 1

    with IOEngine(num_threads=2, queue_depth=8, block_size_bytes=64 * 1024) as eng:
        futures = []
        for i in range(64):
            piece = src[i * 256 * 1024 : (i + 1) * 256 * 1024]
            future = eng.submit([write_op(data_fd, piece, offset=i * 256 * 1024)])
            future.add_done_callback(count)
            futures.append(future)
        stop = threading.Event()

        def poller() -> None:
            while not stop.is_set():
                select.select([eng.completion_fd], [], [], 0.05)
                eng.poll()

        poll_thread = threading.Thread(target=poller)
        waiters = [threading.Thread(target=lambda fs=futures[k::4]: [f.result(60) for f in fs]) for k in range(4)]
        poll_thread.start()
        for w in waiters:
            w.start()
        for w in waiters:
            w.join(120)
        stop.set()
        poll_thread.join(60)
        assert all(f.done() for f in futures)
        assert eng.pending() == 0
    assert calls == {f.batch_id: 1 for f in futures}


# --- completion ----------------------------------------------------------------------


def test_poll_resolves_futures_and_runs_callbacks(engine: IOEngine, data_fd: int) -> None:
    src = random_tensor(MiB, 4)
    seen: list[IOFuture] = []
    future = engine.submit([write_op(data_fd, src)])
    future.add_done_callback(seen.append)
    resolved = 0
    while resolved == 0:
        select.select([engine.completion_fd], [], [], 60)
        resolved = engine.poll()
    assert resolved == 1 and seen == [future] and future.done()
    future.result()


def test_completion_fd_becomes_readable(engine: IOEngine, data_fd: int) -> None:
    src = random_tensor(MiB, 5)
    engine.submit([write_op(data_fd, src)])
    assert select.select([engine.completion_fd], [], [], 60)[0] == [engine.completion_fd]


def test_poll_never_blocks_on_a_running_batch(pipe_engine: tuple[IOEngine, int, int]) -> None:
    eng, r, w = pipe_engine
    buf = aligned_empty(4096)
    future = eng.submit(pipe_read(r, buf))
    assert eng.poll() == 0
    assert not future.done()
    os.write(w, b"z" * 4096)
    future.result(60)
    assert bytes(buf.tolist()) == b"z" * 4096


def test_result_with_timeout_raises_timeout_error(pipe_engine: tuple[IOEngine, int, int]) -> None:
    eng, r, _ = pipe_engine
    buf = aligned_empty(4096)
    future = eng.submit(pipe_read(r, buf))
    with pytest.raises(TimeoutError):
        future.result(timeout_s=0.01)
    assert not future.done()


def test_result_waits_while_another_thread_polls(pipe_engine: tuple[IOEngine, int, int]) -> None:
    eng, r, w = pipe_engine
    buf = aligned_empty(4096)
    future = eng.submit(pipe_read(r, buf))
    waiter = threading.Thread(target=future.result, args=(60,))
    waiter.start()
    os.write(w, b"q" * 4096)
    while not future.done():  # races the waiter for the result; exactly one of them gets it
        select.select([eng.completion_fd], [], [], 0.05)
        eng.poll()
    waiter.join(60)
    assert not waiter.is_alive() and eng.pending() == 0


def test_callback_added_after_completion_runs_at_once(engine: IOEngine) -> None:
    future = engine.submit([])
    future.result()
    seen: list[IOFuture] = []
    future.add_done_callback(seen.append)
    assert seen == [future]


def test_failing_callback_does_not_break_poll(engine: IOEngine) -> None:
    first, second = engine.submit([]), engine.submit([])

    def boom(_: IOFuture) -> None:
        raise RuntimeError("callback bug")

    first.add_done_callback(boom)
    second.add_done_callback(boom)
    while engine.pending():
        select.select([engine.completion_fd], [], [], 60)
        engine.poll()
    first.result()
    second.result()


def test_close_fails_queued_futures_with_a_sentence(pipe_engine: tuple[IOEngine, int, int]) -> None:
    eng, r, w = pipe_engine
    bufs = [aligned_empty(4096) for _ in range(2)]
    running = eng.submit(pipe_read(r, bufs[0]))
    wait_until_worker_blocks_in_io()
    queued = eng.submit(pipe_read(r, bufs[1]))  # the only slot is taken
    closer = threading.Thread(target=eng.close)
    closer.start()
    with pytest.raises(IOEngineError, match="closed"):
        queued.result(60)  # cancelled before close() waits for the running read
    os.write(w, b"c" * 4096)
    closer.join(60)
    running.result(60)
    with pytest.raises(IOEngineError, match="closed"):
        eng.submit([])


# --- typed errors -----------------------------------------------------------------------


def test_unaligned_buffer_raises_alignment_error_and_engine_still_works(engine: IOEngine, data_fd: int) -> None:
    plain = torch.zeros(4096 * 2, dtype=torch.uint8)
    address = plain.data_ptr() | 1  # certainly not 4096-aligned
    with pytest.raises(AlignmentError, match="aligned_empty"):
        engine.submit([IOOp.write(fd=data_fd, address=address, nbytes=4096, offset=0)])
    with pytest.raises(AlignmentError, match="offset 512"):
        engine.submit([IOOp.write(fd=data_fd, address=aligned_empty(4096).data_ptr(), nbytes=4096, offset=512)])
    src = random_tensor(4096, 6)
    engine.run(write_op(data_fd, src))


def test_corrupted_data_raises_checksum_error(engine: IOEngine, disk_tmp: str) -> None:
    path = os.path.join(disk_tmp, "rot")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        src, dst = random_tensor(3 * MiB, 7), aligned_empty(3 * MiB)
        crcs = torch.zeros(3, dtype=torch.int32)
        engine.run(write_op(fd, src, crcs=crcs))
        with open(path, "r+b") as f:
            f.seek(MiB + 99)
            byte = f.read(1)[0]
            f.seek(MiB + 99)
            f.write(bytes([byte ^ 1]))
        with pytest.raises(ChecksumError, match=f"file offset {MiB}") as info:
            engine.run(read_op(fd, dst, crcs=crcs))
        assert "corrupted" in str(info.value)
    finally:
        os.close(fd)


def test_bad_fd_raises_io_engine_error(engine: IOEngine) -> None:
    import resource

    # Past the open-file limit: no thread of this process can be handed that number meanwhile,
    # as it could a closed one (a ZeroMQ thread reconnecting, say).
    r = resource.getrlimit(resource.RLIMIT_NOFILE)[0] + 1
    buf = aligned_empty(4096)
    with pytest.raises(IOEngineError, match="EBADF") as info:
        engine.run(IOOp.read(fd=r, address=buf.data_ptr(), nbytes=4096, offset=0))
    assert type(info.value) is IOEngineError


def test_full_file_system_raises_disk_full_error_and_process_stays_healthy(
    engine: IOEngine, tiny_tmpfs_dir: str, data_fd: int
) -> None:
    big = random_tensor(16 * MiB, 8)
    fd = os.open(os.path.join(tiny_tmpfs_dir, "fill"), os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        with pytest.raises(DiskFullError, match="nvme.capacity_bytes_per_dir") as info:
            engine.run(write_op(fd, big))
        assert "ENOSPC" in str(info.value)
    finally:
        os.close(fd)
    engine.run(write_op(data_fd, big))  # the engine and the process carry on


def test_file_size_limit_raises_disk_full_error_in_a_subprocess(disk_tmp: str) -> None:
    script = textwrap.dedent(
        f"""
        import os, resource, signal
        from infinity.errors import DiskFullError
        from infinity.io import IOEngine, IOOp, aligned_empty
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        buf = aligned_empty(4 << 20)
        fd = os.open({os.path.join(disk_tmp, "limited")!r}, os.O_RDWR | os.O_CREAT | os.O_DIRECT)
        with IOEngine() as eng:
            try:
                eng.run(IOOp.write(fd=fd, address=buf.data_ptr(), nbytes=4 << 20, offset=0))
            except DiskFullError as exc:
                print("DISKFULL", exc)
            eng.run(IOOp.write(fd=fd, address=buf.data_ptr(), nbytes=4096, offset=0))
            print("HEALTHY")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "DISKFULL" in proc.stdout and "EFBIG" in proc.stdout and "ulimit -f" in proc.stdout
    assert "HEALTHY" in proc.stdout


def test_short_read_raises_io_engine_error_saying_file_is_too_small(engine: IOEngine, data_fd: int) -> None:
    src, dst = random_tensor(4096, 9), aligned_empty(2 * 4096)
    engine.run(write_op(data_fd, src))
    with pytest.raises(IOEngineError, match="short read"):
        engine.run(read_op(data_fd, dst))


def test_io_op_helpers_describe_the_tuple() -> None:
    op = IOOp.read(fd=3, address=4096, nbytes=3 * MiB + 1, offset=8192, direct=False, crc_address=64)
    assert op.as_tuple() == (False, 3, 4096, 3 * MiB + 1, 8192, False, 64, CRC_BLOCK_BYTES, False)
    assert op.crc_count() == 4
    staged = IOOp.read(fd=3, address=4096, nbytes=4096, offset=0, staged=True)
    assert staged.as_tuple()[-1] is True
    with pytest.raises(TypeError):
        IOOp(False, 3, 4096, 10, 0)  # type: ignore[misc]  # keyword-only


def test_engine_refuses_work_in_a_forked_child(engine: IOEngine) -> None:
    pid = os.fork()
    if pid == 0:
        try:
            engine.submit([])
        except IOEngineError as exc:
            os._exit(0 if "fork" in str(exc) else 2)
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


# --- review findings: overflow, concurrent close, interrupts, fork ---------------------------


def test_a_batch_with_more_checksum_blocks_than_it_can_count_is_refused() -> None:
    from infinity import _native

    engine = _native.Engine(1, 4, 4096, "threads")
    crcs = aligned_empty(16)
    huge = (1 << 63) - 1
    ops = [(False, 0, crcs.data_ptr(), huge, 0, False, crcs.data_ptr(), 1)] * 2
    with pytest.raises(ValueError, match="more than 2\\*\\*32 checksum blocks"):
        engine.submit(ops)  # the block count summed past 2**64: a tiny array, written past
    engine.close()


def read_in_flight(eng: IOEngine, r: int) -> tuple[IOFuture, torch.Tensor]:
    """A read of the pipe that the engine's worker has taken and waits on; its buffer."""
    buf = aligned_empty(4096)
    future = eng.submit(pipe_read(r, buf), keepalive=buf)
    wait_until_worker_blocks_in_io()
    return future, buf


def test_a_second_close_returns_only_once_the_ops_in_flight_have_ended(
        pipe_engine: tuple[IOEngine, int, int]) -> None:
    eng, r, w = pipe_engine
    future, buf = read_in_flight(eng, r)
    closers = [threading.Thread(target=eng.close) for _ in range(2)]
    for closer in closers:
        closer.start()
    closers[1].join(timeout=0.3)  # a bounded look: it must still be waiting for the read
    assert closers[1].is_alive() and closers[0].is_alive()
    os.write(w, b"c" * 4096)
    for closer in closers:
        closer.join(timeout=60)
    assert not any(closer.is_alive() for closer in closers)
    future.result(60)
    assert bytes(buf.tolist()) == b"c" * 4096


def test_a_callback_raising_keyboard_interrupt_in_poll_leaves_no_future_unresolved(
        engine: IOEngine) -> None:
    first, second = engine.submit([]), engine.submit([])  # empty batches complete at once

    def interrupt(_: IOFuture) -> None:
        raise KeyboardInterrupt

    first.add_done_callback(interrupt)  # both completed within submit: one poll fetches both
    with pytest.raises(KeyboardInterrupt):
        while engine.pending():
            engine.poll()
    second.result(timeout_s=5)
    assert engine.pending() == 0


class Interrupted(Exception):
    pass


def test_a_signal_handler_runs_while_result_waits_and_the_result_is_kept(
        pipe_engine: tuple[IOEngine, int, int]) -> None:
    eng, r, w = pipe_engine
    future, buf = read_in_flight(eng, r)

    def handler(signum: int, frame: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        with pytest.raises(Interrupted):
            future.result()  # no timeout: the wait used to hold the handler off until the read
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert not future.done()
    os.write(w, b"s" * 4096)
    future.result(60)
    assert bytes(buf.tolist()) == b"s" * 4096


@pytest.mark.parametrize("backend_name,used", [("threads", False), ("io_uring", True)])
def test_a_forked_child_that_inherits_an_engine_exits_cleanly(
        disk_tmp: str, backend_name: str, used: bool) -> None:
    if backend_name == "io_uring" and not probe_io_uring()[0]:
        pytest.skip("io_uring is not usable here")
    script = textwrap.dedent(f"""
        import os, sys
        from infinity.io import IOEngine, IOOp, aligned_empty
        engine = IOEngine(backend={backend_name!r}, num_threads=2, queue_depth=4)
        if {used!r}:  # a buffered op: its thread pool exists too
            buf = aligned_empty(4096)
            fd = os.open(os.path.join({disk_tmp!r}, "f"), os.O_RDWR | os.O_CREAT, 0o600)
            engine.run(IOOp.write(fd=fd, address=buf.data_ptr(), nbytes=4096, offset=0,
                                  direct=False))
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # an ordinary exit: the inherited engine is finalized with the rest
        _, status = os.waitpid(pid, 0)
        engine.close()
        print("child", status)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60, cwd=REPO)
    assert result.returncode == 0 and result.stdout.strip() == "child 0", result.stderr[-2000:]
