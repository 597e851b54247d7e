"""collapse_shared_memory: 2 MiB pages for a memfd where shmem_enabled would not give them,
its bytes kept, its errors."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from collections.abc import Iterator

import pytest

from infinity import _native

MiB = 1 << 20
# Not reached for a reason of ours: the kernel lacks MADV_COLLAPSE (before 6.1), shmem huge
# pages are denied, or no 2 MiB of contiguous memory is free right now.
UNAVAILABLE = (errno.EINVAL, errno.ENOMEM, errno.EAGAIN)


def huge_bytes_of(fd: int, nbytes: int) -> int:
    """How much of the file's first nbytes a 2 MiB-aligned mapping of it maps with huge pages
    (ShmemPmdMapped of that mapping in /proc/self/smaps). The mapping is made here with the C
    library: Python's mmap cannot choose an address, and a file's huge pages are mapped whole
    only where the address lines up with them."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    huge = 2 * MiB
    span = nbytes + huge
    base = libc.mmap(None, span, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert base not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    try:
        start = (base + huge - 1) // huge * huge
        fixed = 0x10  # MAP_FIXED: over the reservation, which is ours
        mapped = libc.mmap(start, nbytes, mmap.PROT_READ, mmap.MAP_SHARED | fixed, fd, 0)
        assert mapped == start, os.strerror(ctypes.get_errno())
        assert libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(nbytes), 22) == 0  # POPULATE_READ
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                if "-" in line.split()[0] and ":" not in line.split()[0]:
                    low = int(line.split("-")[0], 16)
                    inside = low == start
                elif inside and line.startswith("ShmemPmdMapped:"):
                    return int(line.split()[1]) * 1024
        pytest.skip("this kernel does not report ShmemPmdMapped")
    finally:
        libc.munmap(ctypes.c_void_p(base), ctypes.c_size_t(span))


def shmem_huge_by_default() -> bool:
    """Whether the kernel gives shared memory huge pages unasked (shmem_enabled)."""
    from infinity.daemon.arena import shmem_hugepage_mode

    return shmem_hugepage_mode() in ("always", "within_size", "force")


@pytest.fixture
def memfd() -> Iterator[int]:
    fd = os.memfd_create("test-collapse", os.MFD_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def filled(fd: int, nbytes: int) -> bytes:
    """Writes a pattern over the first nbytes (pages must be present to be collapsed)."""
    os.ftruncate(fd, nbytes)
    pattern = bytes(range(251)) * (nbytes // 251 + 1)
    os.pwrite(fd, pattern[:nbytes], 0)
    return pattern[:nbytes]


def collapsed_or_skip(fd: int, nbytes: int) -> None:
    failed = _native.collapse_shared_memory(fd, nbytes)
    if failed in UNAVAILABLE:
        pytest.skip(f"no huge pages for shared memory here: {os.strerror(failed)}")
    assert failed == 0


def test_collapse_gives_the_file_huge_pages_and_keeps_its_bytes(memfd: int) -> None:
    nbytes = 8 * MiB + 12288  # four huge pages and a tail that stays in small ones
    expected = filled(memfd, nbytes)
    if not shmem_huge_by_default():
        assert huge_bytes_of(memfd, 8 * MiB) == 0  # as the kernel made them: small pages
    collapsed_or_skip(memfd, nbytes)
    assert huge_bytes_of(memfd, 8 * MiB) == 8 * MiB
    assert os.pread(memfd, nbytes, 0) == expected


def test_a_mapping_made_before_the_collapse_sees_the_same_bytes(memfd: int) -> None:
    expected = filled(memfd, 4 * MiB)
    mm = mmap.mmap(memfd, 4 * MiB)
    try:
        collapsed_or_skip(memfd, 4 * MiB)
        assert mm[:] == expected
        mm[5] = 7  # and writes through it reach the file's new pages
        assert os.pread(memfd, 1, 5) == b"\x07"
    finally:
        mm.close()


def test_nothing_past_the_files_end_is_collapsed(memfd: int) -> None:
    filled(memfd, 4096)
    assert _native.collapse_shared_memory(memfd, 4 * MiB) == 0  # nothing whole to collapse
    assert os.fstat(memfd).st_blocks * 512 <= 4096  # no huge page charged past the end


def test_one_page_in_each_huge_page_is_enough_and_the_holes_read_as_zeros(memfd: int) -> None:
    os.ftruncate(memfd, 4 * MiB)
    for offset in (77, 2 * MiB + 4095):
        os.pwrite(memfd, b"\1", offset)
    collapsed_or_skip(memfd, 4 * MiB)
    assert huge_bytes_of(memfd, 4 * MiB) == 4 * MiB
    expected = bytearray(4 * MiB)
    expected[77] = expected[2 * MiB + 4095] = 1
    assert os.pread(memfd, 4 * MiB, 0) == bytes(expected)


def test_less_than_one_huge_page_is_left_alone(memfd: int) -> None:
    filled(memfd, 2 * MiB - 4096)
    assert _native.collapse_shared_memory(memfd, 2 * MiB - 4096) == 0


def test_a_file_that_is_not_open_is_an_os_error() -> None:
    import resource

    # Past the open-file limit: a closed fd's number could be reused meanwhile by another thread.
    fd = resource.getrlimit(resource.RLIMIT_NOFILE)[0] + 1
    with pytest.raises(OSError) as info:
        _native.collapse_shared_memory(fd, 4 * MiB)
    assert info.value.errno == errno.EBADF
    assert "huge pages" in str(info.value)


def test_a_negative_size_is_refused() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        _native.collapse_shared_memory(0, -1)
