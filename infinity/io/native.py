"""Loads `infinity._native` on first use and gives it static types.

The extension is compiled from native/ by setup.py. Importing `infinity.io`
never fails because it is missing; the first call that needs it raises
`IOEngineError` saying how to build it. The Protocol classes below describe
the extension's API for mypy (see docs/ARCHITECTURE.md, "Native core").
"""

from __future__ import annotations

import errno
import functools
import importlib
import os
import threading
from typing import Protocol, Sequence, cast

from infinity.errors import IOEngineError

# (is_write, fd, buf_addr, nbytes, file_offset, direct, crc_addr, crc_block_bytes, staged);
# the engine also takes the first eight alone (staged=False).
OpTuple = tuple[bool, int, int, int, int, bool, int, int, bool]


class NativeEngine(Protocol):
    @property
    def backend(self) -> str: ...

    @property
    def backend_note(self) -> str: ...

    @property
    def completion_fd(self) -> int: ...

    @property
    def staged_bytes(self) -> int: ...

    def submit(self, ops: Sequence[OpTuple]) -> int: ...

    def poll(self) -> list[tuple[int, int, str]]: ...

    def wait(self, batch_id: int, timeout_s: float = -1.0) -> tuple[int, str]: ...

    def close(self) -> None: ...


class NativeTaskPool(Protocol):
    @property
    def num_threads(self) -> int: ...

    @property
    def completion_fd(self) -> int: ...

    def submit_copy(self, dst: int, src: int, nbytes: int, pieces: int = 0) -> int: ...

    def submit_fill(self, dst: int, nbytes: int, value: int = 0, pieces: int = 0) -> int: ...

    def submit_crc32c(self, addr: int, nbytes: int, crc_addr: int, crc_block_bytes: int,
                      verify: bool = False, pieces: int = 0) -> int: ...

    def submit_adam(
        self, param: int, grad: int, grad_dtype: str, exp_avg: int, exp_avg_sq: int, low: int,
        low_dtype: str, numel: int, *, lr: float, beta1: float, beta2: float, eps: float,
        weight_decay: float, step: int, decoupled: bool, grad_scale: float = 1.0,
        chunk_elements: int = 1 << 20,
    ) -> int: ...

    def poll(self) -> list[tuple[int, int, str]]: ...

    def wait(self, task_id: int, timeout_s: float = -1.0) -> tuple[int, str]: ...

    def close(self) -> None: ...


class NativeAlignedBuffer(Protocol):
    @property
    def address(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def alignment(self) -> int: ...

    @property
    def locked(self) -> bool: ...

    def __len__(self) -> int: ...


class NativeModule(Protocol):
    AlignmentError: type[ValueError]

    def Engine(  # noqa: N802 - a class in the extension
        self, num_threads: int, queue_depth: int, block_size_bytes: int, backend: str = "auto",
        staging_bytes: int = 4 << 20,
    ) -> NativeEngine: ...

    def TaskPool(  # noqa: N802 - a class in the extension
        self, num_threads: int, thread_name: str = "infinity-task"
    ) -> NativeTaskPool: ...

    def AlignedBuffer(  # noqa: N802
        self, nbytes: int, alignment: int = 4096, lock: bool = False
    ) -> NativeAlignedBuffer: ...

    def crc32c(self, addr: int, nbytes: int, seed: int = 0) -> int: ...

    def crc32c_buffer(self, data: object, seed: int = 0) -> int: ...

    def crc32c_portable(self, data: object, seed: int = 0) -> int: ...

    def crc32c_implementation(self) -> str: ...

    def copy_bytes(self, dst: int, src: int, nbytes: int, num_threads: int = 1) -> None: ...

    def copy_implementation(self) -> str: ...

    def adam_step(
        self, param: int, grad: int, grad_dtype: str, exp_avg: int, exp_avg_sq: int, low: int,
        low_dtype: str, numel: int, *, lr: float, beta1: float, beta2: float, eps: float,
        weight_decay: float, step: int, decoupled: bool, grad_scale: float = 1.0,
        implementation: str = "auto",
    ) -> None: ...

    def grad_stats(self, grad: int, dtype: str, numel: int) -> tuple[float, bool]: ...

    def adam_implementation(self) -> str: ...

    def dequantize(self, codes: int, scales: int, out: int, form: str, dtype: str, rows: int,
                   n: int, block: int, num_threads: int = 1) -> None: ...

    def dequantize_implementation(self) -> str: ...

    def quant_linear(self, x: int, codes: int, scales: int, bias: int, y: int, form: str,
                     dtype: str, rows: int, n: int, out: int, block: int, num_threads: int = 1,
                     implementation: str = "auto") -> None: ...

    def quant_linear_implementation(self) -> str: ...

    def collapse_shared_memory(self, fd: int, nbytes: int) -> int: ...

    def simd_level(self) -> str: ...

    def probe_io_uring(self) -> tuple[bool, str]: ...

    def probe_aio(self) -> tuple[bool, str]: ...


_lock = threading.Lock()
_module: NativeModule | None = None


def native() -> NativeModule:
    """The loaded extension; raises IOEngineError with build instructions if it is missing."""
    global _module
    if _module is None:
        with _lock:
            if _module is None:
                try:
                    _module = cast(NativeModule, importlib.import_module("infinity._native"))
                except ImportError as exc:
                    raise IOEngineError(
                        f"the native extension infinity._native is not available ({exc}); build it with "
                        "`pip install .` or, in a source checkout, `python setup.py build_ext --inplace` "
                        "(needs a C++17 compiler and the kernel headers)"
                    ) from exc
    return _module


def simd_level() -> str:
    """The CPU's vector level as the native kernels see it: avx512, avx2, sse4.2 or scalar."""
    return native().simd_level()


def probe_io_uring() -> tuple[bool, str]:
    """Whether io_uring works in this process, and a sentence saying why not."""
    return native().probe_io_uring()


def probe_aio() -> tuple[bool, str]:
    """Whether kernel AIO works in this process, and a sentence saying why not."""
    return native().probe_aio()


@functools.lru_cache(maxsize=None)
def probe_shared_memory_collapse() -> tuple[bool, str]:
    """Whether this kernel turns shared memory (a memfd) into huge pages on request
    (MADV_COLLAPSE, Linux 6.1+), whatever shmem_enabled says; and a sentence saying why not.
    Tried once per process on 2 MiB."""
    fd = -1
    try:
        fd = os.memfd_create("infinity-probe", os.MFD_CLOEXEC)
        os.ftruncate(fd, 2 << 20)
        os.pwrite(fd, b"\0", 0)  # a page to collapse: a range that is all hole is refused
        failed = native().collapse_shared_memory(fd, 2 << 20)
    except (OSError, IOEngineError) as exc:
        return False, f"the probe failed: {exc}"
    finally:
        if fd >= 0:
            os.close(fd)
    if failed == errno.EINVAL:
        return False, "the kernel has no MADV_COLLAPSE for shared memory (Linux 6.1+), or shmem_enabled is deny"
    if failed:
        return False, f"MADV_COLLAPSE failed: {os.strerror(failed)} (memory too fragmented?)"
    return True, ""
