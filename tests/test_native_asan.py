"""Builds an AddressSanitizer copy of infinity._native and runs I/O, CRC, task-pool, Adam,
dequantization, quantized-linear and error paths under it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[1]


def _gcc_library(name: str) -> str | None:
    gcc = shutil.which("gcc")
    if gcc is None:
        return None
    out = subprocess.run([gcc, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return out if os.path.isabs(out) and os.path.exists(out) else None


LIBASAN = _gcc_library("libasan.so")
# python itself does not link libstdc++; ASan must see it at start-up to
# intercept __cxa_throw, or the first C++ exception aborts the process.
LIBSTDCXX = _gcc_library("libstdc++.so")
CXX = shutil.which(os.environ.get("CXX", "g++"))

pytestmark = pytest.mark.skipif(
    CXX is None or LIBASAN is None,
    reason="needs g++ and gcc's libasan.so (apt install g++) to build the AddressSanitizer copy",
)

SCRIPT = textwrap.dedent(
    """
    import ctypes, errno, importlib.util, os, random, sys, tempfile

    so_path, work = sys.argv[1], sys.argv[2]
    spec = importlib.util.spec_from_file_location("infinity._native", so_path)
    n = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(n)

    MiB = 1 << 20
    assert n.crc32c_buffer(b"123456789") == 0xE3069283
    data = random.Random(1).randbytes(3 * MiB + 4096)
    assert n.crc32c_buffer(data) == n.crc32c_portable(data)

    for backend in ("io_uring", "aio", "threads"):
        usable = {"io_uring": n.probe_io_uring, "aio": n.probe_aio}.get(backend, lambda: (True, ""))()[0]
        if not usable:
            continue
        eng = n.Engine(2, 4, 256 * 1024, backend)
        nbytes = len(data)
        src, dst = n.AlignedBuffer(nbytes), n.AlignedBuffer(nbytes)
        memoryview(src)[:] = data
        crcs = (ctypes.c_uint32 * 4)()
        path = os.path.join(work, backend)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT)
        assert eng.wait(eng.submit([(True, fd, src.address, nbytes, 0, True, ctypes.addressof(crcs), MiB, True)])) == (0, "")
        assert eng.wait(eng.submit([(False, fd, dst.address, nbytes, 0, True, ctypes.addressof(crcs), MiB)])) == (0, "")
        assert bytes(memoryview(dst)) == data
        memoryview(dst)[:] = bytes(nbytes)
        staged = (False, fd, dst.address, nbytes, 0, True, ctypes.addressof(crcs), MiB, True)
        assert eng.wait(eng.submit([staged])) == (0, "")
        assert bytes(memoryview(dst)) == data and eng.staged_bytes == 2 * nbytes  # written, read
        # One staging block: staged ops wait for it while the direct ones between them go ahead.
        mixed = n.Engine(1, 4, 64 * 1024, backend, 1)
        memoryview(dst)[:] = bytes(nbytes)
        ops = [(False, fd, dst.address + i * MiB, MiB, i * MiB, True, 0, 0, i % 2 == 0) for i in range(3)]
        assert mixed.wait(mixed.submit(ops)) == (0, "")
        assert bytes(memoryview(dst)[:3 * MiB]) == data[:3 * MiB]
        mixed.close()
        with open(path, "r+b") as f:
            f.seek(MiB)
            f.write(b"X")
        err, msg = eng.wait(eng.submit([(False, fd, dst.address, nbytes, 0, True, ctypes.addressof(crcs), MiB)]))
        assert err == errno.EBADMSG, msg
        err, msg = eng.wait(eng.submit([staged]))
        assert err == errno.EBADMSG, msg
        err, msg = eng.wait(eng.submit([(False, fd, dst.address, nbytes, 4096, True, 0, 0)]))
        assert err == errno.EIO, msg
        err, msg = eng.wait(eng.submit([(False, fd, dst.address, nbytes, 4096, True, 0, 0, True)]))
        assert err == errno.EIO, msg
        try:
            eng.submit([(True, fd, src.address + 1, 4096, 0, True, 0, 0)])
            raise SystemExit("alignment not checked")
        except ValueError:
            pass
        err, msg = eng.wait(eng.submit([(False, 1 << 20, dst.address, 4096, 0, True, 0, 0)]))
        assert err == errno.EBADF, msg
        plain = os.open(path + ".plain", os.O_RDWR | os.O_CREAT)
        assert eng.wait(eng.submit([(True, plain, src.address + 3, 5000, 7, False, 0, 0)])) == (0, "")
        os.close(plain)
        pending = [eng.submit([(False, fd, dst.address, nbytes, 0, True, 0, 0, i % 2 == 1)]) for i in range(8)]
        eng.close()  # cancels what has not started
        for b in pending:
            assert eng.wait(b)[0] in (0, errno.ECANCELED)
        os.close(fd)

    # A batch whose checksum blocks would not fit a counter is refused, nothing allocated short.
    bounded = n.Engine(1, 4, 4096, "threads")
    huge = (1 << 63) - 1
    try:
        bounded.submit([(False, 0, dst.address, huge, 0, False, ctypes.addressof(crcs), 1)] * 2)
        raise SystemExit("checksum block count not bounded")
    except ValueError:
        pass
    # close() from several threads at once: each returns once the engine is closed.
    import threading
    closers = [threading.Thread(target=bounded.close) for _ in range(3)]
    for t in closers:
        t.start()
    for t in closers:
        t.join()
    # Dropped without close(), with a batch queued: the destructor closes it (without the GIL).
    dropped = n.Engine(1, 4, 4096, "threads")
    dropped.submit([(False, 0, dst.address, 0, 0, False, 0, 0)])
    del dropped

    # Streaming copy: odd sizes, odd offsets, split across threads.
    big = n.AlignedBuffer(40 * MiB + 8192)
    out = n.AlignedBuffer(40 * MiB + 8192)
    memoryview(big)[: len(data)] = data
    for size, shift, threads in ((0, 0, 1), (5, 3, 1), (MiB + 77, 1, 1), (40 * MiB + 3, 5, 3)):
        n.copy_bytes(out.address + shift, big.address + 7, size, threads)
        assert bytes(memoryview(out)[shift:shift + size]) == bytes(memoryview(big)[7:7 + size])

    # The task pool: copy, fill and CRC tasks side by side, reported through the eventfd.
    import select
    pool = n.TaskPool(3)
    crcs40 = (ctypes.c_uint32 * 40)()
    ids = {pool.submit_copy(out.address + 3, big.address + 5, 17 * MiB + 9),
           pool.submit_fill(out.address + 20 * MiB + 1, 4 * MiB + 1, 7, 3),
           pool.submit_crc32c(big.address, 40 * MiB, ctypes.addressof(crcs40), MiB)}
    while ids:
        assert select.select([pool.completion_fd], [], [], 60)[0]
        for task_id, err, msg in pool.poll():
            assert err == 0, msg
            ids.discard(task_id)
    assert bytes(memoryview(out)[3:3 + 17 * MiB + 9]) == bytes(memoryview(big)[5:5 + 17 * MiB + 9])
    assert bytes(memoryview(out)[20 * MiB + 1:24 * MiB + 2]) == b"\x07" * (4 * MiB + 1)
    assert crcs40[39] == n.crc32c_portable(bytes(memoryview(big)[39 * MiB:40 * MiB]))
    memoryview(big)[MiB + 5] ^= 1
    err, msg = pool.wait(pool.submit_crc32c(big.address, 40 * MiB, ctypes.addressof(crcs40), MiB, True))
    assert err == errno.EBADMSG and "block 1" in msg, msg
    for bad in (lambda: pool.submit_copy(out.address + 1, out.address, MiB),
                lambda: pool.submit_fill(0, 5),
                lambda: pool.submit_crc32c(big.address, 10, ctypes.addressof(crcs40) + 2, MiB)):
        try:
            bad()
            raise SystemExit("bad task arguments accepted")
        except ValueError:
            pass
    in_flight = [pool.submit_fill(out.address, 40 * MiB, i % 256, 4) for i in range(30)]
    pool.close()  # cancels the chunks not started, joins the threads
    for task_id in in_flight:
        assert pool.wait(task_id)[0] in (0, errno.ECANCELED)
    dropped_pool = n.TaskPool(2)
    for i in range(10):
        dropped_pool.submit_copy(out.address, big.address, 40 * MiB)
    del dropped_pool  # the destructor closes it (without the GIL)

    # The Adam kernel on every path this CPU has, odd sizes (vector bodies and scalar tails), a
    # bf16 gradient and low copy, and the same step as a task on a pool, chunk edges included.
    def floats(count):
        buf = n.AlignedBuffer(max(4096, count * 4))
        return buf, buf.address
    adam_hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=2,
                      decoupled=True)
    for count in (1, 15, 17, 1001, 65_537):
        bufs = [floats(count) for _ in range(4)]
        low = n.AlignedBuffer(max(4096, count * 2))
        grad16 = n.AlignedBuffer(max(4096, count * 2))
        for implementation in ("scalar", "avx2", "avx512", "auto", "bound"):
            try:
                n.adam_step(bufs[0][1], bufs[1][1], "float32", bufs[2][1], bufs[3][1], low.address,
                            "bfloat16", count, implementation=implementation, **adam_hyper)
            except ValueError as exc:
                assert "cannot run on this CPU" in str(exc), exc
        n.adam_step(bufs[0][1], grad16.address, "float16", bufs[2][1], bufs[3][1], 0, "none", count,
                    **adam_hyper)
        assert n.grad_stats(grad16.address, "bfloat16", count) == (0.0, False)
        adam_pool = n.TaskPool(3)
        task = adam_pool.submit_adam(bufs[0][1], bufs[1][1], "float32", bufs[2][1], bufs[3][1],
                                     low.address, "float16", count, chunk_elements=5, **adam_hyper)
        assert adam_pool.wait(task) == (0, "")
        adam_pool.close()
    try:
        n.adam_step(out.address, out.address, "float32", out.address + 64, out.address + 128, 0,
                    "none", 64, **adam_hyper)
        raise SystemExit("overlapping Adam buffers accepted")
    except ValueError:
        pass

    # Dequantization (int8, int4) into each type, buffers of exactly their size (over 512 bytes:
    # malloc's, which ASan watches): vector loops and scalar tails stay inside them, split over
    # the task pool too.
    for form, block in (("int8", 8), ("int4", 10)):
        for dtype, size in (("bfloat16", 2), ("float16", 2), ("float32", 4)):
            for rows, cols, threads in ((9, 301, 1), (700, 401, 3)):
                codes = (ctypes.c_uint8 * (rows * (cols if form == "int8" else (cols + 1) // 2)))()
                scales = (ctypes.c_uint8 * (rows * -(-cols // block) * size))()
                result = (ctypes.c_uint8 * (rows * cols * size))()
                n.dequantize(ctypes.addressof(codes), ctypes.addressof(scales),
                             ctypes.addressof(result), form, dtype, rows, cols, block, threads)

    # The quantized linear (int8, int4) on every path this CPU has, each input type, 1 to 5 rows
    # (a group of 4 and a remainder), features that neither the block nor a vector divides,
    # buffers of exactly their size (over 512 bytes: malloc's): the vector loops, the scalar
    # tails and the bias stay inside them, split over the task pool too (700 x 401 weights).
    for form, block in (("int8", 40), ("int4", 18)):
        for dtype, size in (("bfloat16", 2), ("float16", 2), ("float32", 4)):
            for rows, cols, outs, threads in ((1, 301, 9, 1), (5, 301, 9, 1), (3, 401, 700, 3)):
                x = (ctypes.c_uint8 * (rows * cols * size))()
                codes = (ctypes.c_uint8 * (outs * (cols if form == "int8" else (cols + 1) // 2)))()
                scales = (ctypes.c_uint8 * (outs * -(-cols // block) * size))()
                bias = (ctypes.c_uint8 * (outs * size))()
                y = (ctypes.c_uint8 * (rows * outs * size))()
                for implementation in ("scalar", "avx2", "avx512"):
                    try:
                        n.quant_linear(ctypes.addressof(x), ctypes.addressof(codes), ctypes.addressof(scales),
                                       ctypes.addressof(bias), ctypes.addressof(y), form, dtype, rows, cols,
                                       outs, block, threads, implementation)
                    except ValueError as exc:
                        assert "cannot run on this CPU" in str(exc), exc

    # Huge pages for shared memory: a memfd with bytes in it, an odd length, a bad fd.
    fd = os.memfd_create("asan")
    os.ftruncate(fd, 4 * MiB + 4096)
    os.pwrite(fd, data[:MiB], 4096)
    assert n.collapse_shared_memory(fd, 4 * MiB + 4096) in (0, errno.EINVAL, errno.ENOMEM, errno.EAGAIN)
    assert os.pread(fd, MiB, 4096) == data[:MiB]
    assert n.collapse_shared_memory(fd, 4096) == 0  # under one huge page: nothing to do
    os.close(fd)
    try:
        n.collapse_shared_memory(fd, 4 * MiB)
    except OSError as exc:
        assert exc.errno == errno.EBADF, exc
    else:
        raise AssertionError("a closed fd was mapped")
    print("ASAN-SCRIPT-OK")
    """
)


@pytest.fixture
def asan_build() -> Iterator[Path]:
    out = Path(tempfile.mkdtemp(prefix="infinity-asan-", dir="/var/tmp"))
    try:
        env = dict(os.environ, INFINITY_NATIVE_ASAN="1")
        proc = subprocess.run(
            [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(out / "lib"),
             "--build-temp", str(out / "tmp")],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        found = list((out / "lib").rglob("_native*.so"))
        assert len(found) == 1, found
        yield found[0]
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_io_crc_task_pool_and_error_paths_are_clean_under_address_sanitizer(asan_build: Path, disk_tmp: str) -> None:
    assert LIBASAN is not None
    preload = ":".join(p for p in (LIBASAN, LIBSTDCXX) if p)
    env = dict(os.environ, LD_PRELOAD=preload, ASAN_OPTIONS="detect_leaks=0")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(asan_build), disk_tmp],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert "ERROR: AddressSanitizer" not in proc.stderr, proc.stderr[-6000:]
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "ASAN-SCRIPT-OK" in proc.stdout
