"""The NVMe tier: tensor bytes in preallocated extent files, one per store directory, striped.

`NvmeTier` owns the directories' extent files and their `ExtentAllocator`s and
turns "write these bytes" / "read this tensor back" into batches of I/O ops for
the native engine. It knows nothing about names, namespaces or sockets: it
hands out a `TensorLayout` (where the bytes went and their checksums) that
whoever keeps the catalog persists, and takes it back to read or free.

Layout rules (fixed, because checksums and restarts depend on them):
- capacity is nbytes rounded up to 4 KiB; the padding is written as zeros;
- the capacity is cut into stripes of `nvme.stripe_bytes` (a multiple of 1 MiB)
  dealt round robin over the directories, starting at the one with the most room
  left (so tensors smaller than a stripe spread over all of them); each directory
  keeps all of that tensor's stripes in one contiguous extent, and the layout
  lists the extents in dealing order;
- one CRC32C per 1 MiB block of the capacity, in tensor order.

The core moves bytes by address (`write_from`, `write_part`, `read_into`) and
keeps checksums in `array.array` buffers, so infinityd uses it without
importing torch; only the `*_tensor` conveniences load torch.

A directory whose file system turned read-only, or whose device failed a write
(EROFS or EIO from a write, a growth or under the store index; EROFS from an
fdatasync: `NvmeDirectory.fail`), is failed until the daemon restarts: nothing
more is allocated there, and tensors are dealt over the directories left (reads
of what it holds go on: a read-only file system still reads). Not failures:
ENOSPC (space may come back), and EIO from an fdatasync (a write-back that
failed is reported once; the copies it may have lost are written anew, see
`NvmeTier.sync_failures`).

Buffered I/O (no O_DIRECT) meets one more trap: on ext4 (seen on Linux 6.18), once
the write-back of cached pages failed, bytes written over those pages again are
lost though the next fdatasync succeeds (the pages keep a state in which the
preallocated blocks under them are never marked written). So the cached pages
of freed extents are dropped before the extents can be handed out again, and
an extent file's whole cache when it is opened (`forget_cached_pages`). Pages
still in use stay: after a failed write-back, the cache may hold the only good
copy of a tensor not yet durable, which a read can still bring back.

Space: `allocate` hands out extents and, by default, grows a directory's
extent file on the spot (`fallocate`). The daemon's loop must not wait on
the file system, so it passes `grow=False`, gets `GrowthNeeded` instead, runs
`grow` on a worker thread and retries. The allocators are guarded by a lock,
held only for the allocator's own bookkeeping, never across a system call.
"""

from __future__ import annotations

import array
import errno
import functools
import logging
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from infinity.config import MiB, NvmeConfig
from infinity.errors import (
    DiskFullError,
    InvalidRequestError,
    IOEngineError,
    OutOfRangeError,
    StoreDirectoryError,
    StoreFullError,
)
from infinity.io import IOEngine, IOFuture, IOOp, error_from_errno, failed_op
from infinity.store.allocator import Extent, ExtentAllocator

if TYPE_CHECKING:
    import torch

PAGE_BYTES = 4096
# Room the extent files on the index's file system (the first directory's) leave it: its
# write-ahead log grows with every delete and flush, a few pages each.
INDEX_ROOM_BYTES = 1 << 20
CRC_BLOCK_BYTES = 1 * MiB
EXTENT_FILE_NAME = "infinity-extents.dat"
# Errors of a write that take its directory out of use: its file system went read-only, or
# its device failed.
DIRECTORY_FAULTS = (errno.EROFS, errno.EIO)

log = logging.getLogger(__name__)


def round_up(nbytes: int, multiple: int) -> int:
    return (nbytes + multiple - 1) // multiple * multiple


def _tensor_address(t: "torch.Tensor") -> int:
    return t.data_ptr()


def crc_blocks(nbytes: int) -> int:
    """How many 1 MiB checksum blocks a tensor of `nbytes` has (its capacity, in tensor order)."""
    return -(-round_up(nbytes, PAGE_BYTES) // CRC_BLOCK_BYTES)


def crc_buffer(count_or_values: int | Sequence[int]) -> "array.array[int]":
    """A uint32 array the engine fills (writes) or checks against (reads); its address is stable."""
    if isinstance(count_or_values, int):
        return array.array("I", bytes(4 * count_or_values))
    return array.array("I", count_or_values)


def _address_of(buffer: "array.array[int]") -> int:
    return buffer.buffer_info()[0]


class GrowthNeeded(Exception):
    """Internal signal of `allocate(grow=False)`: directory `index` must grow before it fits.

    Run `NvmeTier.grow(index, nbytes)` (blocking: on a worker thread) and allocate again.
    """

    def __init__(self, index: int, nbytes: int) -> None:
        super().__init__(f"store directory {index} must grow by {nbytes} bytes")
        self.index = index
        self.nbytes = nbytes


def deal_stripes(capacity_bytes: int, stripe_bytes: int, num_slots: int) -> list[tuple[int, int, int]]:
    """Deal a capacity's stripes round robin: (slot, offset within the slot's extent, length).

    A tensor with fewer stripes than directories uses only as many slots as it has stripes.
    """
    num_slots = max(1, min(num_slots, (capacity_bytes + stripe_bytes - 1) // stripe_bytes))
    plan, used = [], [0] * num_slots
    for k, start in enumerate(range(0, capacity_bytes, stripe_bytes)):
        length = min(stripe_bytes, capacity_bytes - start)
        slot = k % num_slots
        plan.append((slot, used[slot], length))
        used[slot] += length
    return plan


def stripe_totals(capacity_bytes: int, stripe_bytes: int, num_slots: int) -> dict[int, int]:
    """Bytes per slot of `deal_stripes(...)`, computed without dealing: a size checked before
    allocating must not cost a list of one entry per stripe."""
    num_stripes = -(-capacity_bytes // stripe_bytes)
    num_slots = max(1, min(num_slots, num_stripes))
    totals = {slot: (num_stripes // num_slots + (slot < num_stripes % num_slots)) * stripe_bytes
              for slot in range(num_slots)}
    short = num_stripes * stripe_bytes - capacity_bytes  # the last stripe's missing bytes
    totals[(num_stripes - 1) % num_slots] -= short
    return {slot: total for slot, total in totals.items() if total}


@dataclass(frozen=True)
class TensorLayout:
    """Where a tensor's bytes live on the NVMe tier, and their checksums."""

    nbytes: int
    stripe_bytes: int
    extents: tuple[tuple[int, Extent], ...]  # (directory index, extent), in dealing order
    crcs: tuple[int, ...]

    @property
    def capacity_bytes(self) -> int:
        return round_up(self.nbytes, PAGE_BYTES)

    def to_wire(self) -> dict[str, Any]:
        """A plain dict (msgpack / SQLite friendly)."""
        return {
            "nbytes": self.nbytes,
            "stripe_bytes": self.stripe_bytes,
            "extents": [[d, e.offset_bytes, e.length_bytes] for d, e in self.extents],
            "crcs": list(self.crcs),
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "TensorLayout":
        """The layout `to_wire` wrote; ValueError, saying what, for one no write could have
        made. A layout read back from the index is trusted with the disk: extents shorter than
        its stripes would let the allocator hand the rest of its bytes to other tensors."""
        layout = cls(
            nbytes=int(data["nbytes"]),
            stripe_bytes=int(data["stripe_bytes"]),
            extents=tuple((int(d), Extent(int(o), int(n))) for d, o, n in data["extents"]),
            crcs=tuple(int(c) for c in data["crcs"]),
        )
        layout._check()
        return layout

    def _check(self) -> None:
        if self.nbytes < 0:
            raise ValueError(f"a tensor of {self.nbytes} bytes")  # zero: no extents, no checksums
        if self.stripe_bytes <= 0 or self.stripe_bytes % PAGE_BYTES:
            raise ValueError(f"stripe size {self.stripe_bytes} is not a positive multiple of 4096")
        directories = [d for d, _ in self.extents]
        if any(d < 0 for d in directories) or len(set(directories)) != len(directories):
            raise ValueError(f"directory numbers {directories} are not distinct and >= 0")
        for _, extent in self.extents:
            if (extent.offset_bytes < 0 or extent.length_bytes <= 0
                    or extent.offset_bytes % PAGE_BYTES or extent.length_bytes % PAGE_BYTES):
                raise ValueError(f"extent {extent} is not 4 KiB-aligned and non-empty")
        totals = stripe_totals(self.capacity_bytes, self.stripe_bytes, len(self.extents))
        lengths = [extent.length_bytes for _, extent in self.extents]
        if lengths != [totals.get(slot, 0) for slot in range(len(lengths))]:
            raise ValueError(f"extents of {lengths} bytes do not hold {self.nbytes} bytes in "
                             f"stripes of {self.stripe_bytes}")
        if len(self.crcs) != crc_blocks(self.nbytes):
            raise ValueError(f"{len(self.crcs)} checksums for {crc_blocks(self.nbytes)} blocks")


@dataclass(frozen=True)
class _Piece:
    """One I/O op's worth of a tensor: a stripe, or the part of it a range covers."""

    dir_index: int
    file_offset_bytes: int
    tensor_offset_bytes: int
    nbytes: int


class NvmeDirectory:
    """One store directory: its extent file, its allocator, and how it is opened."""

    def __init__(self, path: str, *, index: int, config: NvmeConfig) -> None:
        self.path = os.path.abspath(path)
        self.index = index
        self.capacity_bytes = config.capacity_bytes_per_dir
        self.grow_bytes = config.file_grow_bytes
        if not os.path.isdir(self.path):
            raise StoreDirectoryError(
                f"store directory {self.path} does not exist or is not a directory; "
                f"create it (mkdir -p {self.path}) or fix nvme.dirs")
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise StoreDirectoryError(
                f"store directory {self.path} is not writable by this user; "
                f"fix its permissions or choose another directory in nvme.dirs")
        self.file_path = os.path.join(self.path, EXTENT_FILE_NAME)
        self.direct, self.mode_reason = self._open(config.direct)
        size = os.fstat(self.fd).st_size
        if size % PAGE_BYTES:
            os.close(self.fd)
            raise StoreDirectoryError(
                f"{self.file_path} has a size that is not a multiple of 4096; it was not written "
                f"by Infinity: move it away")
        self.opened_bytes = size  # the file's size when opened: 0 if this just created it
        if not self.direct:
            self.forget_cached_pages(0, 0)  # a daemon before may have met failed write-backs
        self.allocator = ExtentAllocator(min(size, self.capacity_bytes), alignment_bytes=PAGE_BYTES)
        self._grow_lock = threading.Lock()  # one fallocate at a time per file
        self.keeps_index_room = index == 0  # set by the tier: on the index's file system
        self.failure: StoreDirectoryError | None = None  # see `fail`
        # Counters, kept as I/O is submitted (the monitor reads them per directory).
        self.bytes_read = 0
        self.bytes_written = 0
        self.ops_in_flight = 0  # submitted, batch not completed: the directory's queue

    def _open(self, direct_setting: str) -> tuple[bool, str]:
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        if direct_setting != "off":
            try:
                self.fd = os.open(self.file_path, flags | os.O_DIRECT, 0o600)
                return True, "O_DIRECT"
            except OSError as exc:
                if exc.errno != errno.EINVAL or direct_setting == "on":
                    raise StoreDirectoryError(
                        f"cannot open {self.file_path} with O_DIRECT: {exc.strerror}; "
                        + ("set nvme.direct = \"auto\" to fall back to buffered I/O"
                           if exc.errno == errno.EINVAL else "check the directory")) from None
        try:
            self.fd = os.open(self.file_path, flags, 0o600)
        except OSError as exc:
            raise StoreDirectoryError(f"cannot open {self.file_path}: {exc.strerror}") from None
        if direct_setting == "off":
            return False, "buffered: nvme.direct = off"
        return False, "buffered: the file system refuses O_DIRECT (tmpfs or ramfs?), pread/pwrite pool"

    def forget_cached_pages(self, offset_bytes: int, nbytes: int) -> None:
        """Drop the extent file's clean cached pages in [offset, offset + nbytes) (0 bytes: to
        the end): pages whose write-back failed must not be written over (see the module
        docstring). Buffered files only; best effort; any thread."""
        if self.direct:
            return
        try:
            os.posix_fadvise(self.fd, offset_bytes, nbytes, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass  # only a bad fd or arguments fail, and neither is left to fix here

    def fail(self, err: int, what: str) -> StoreDirectoryError:
        """`what` (a write, a growth, an fdatasync) failed with `err`, one of DIRECTORY_FAULTS:
        the directory's file system turned read-only, or its device failed. Nothing more is
        allocated here until infinityd restarts (any thread may call this; the first failure
        is kept and logged). Returns the error to raise."""
        if err == errno.EROFS:
            error = StoreDirectoryError(
                f"store directory {self.path} is read-only now ({what}: {os.strerror(err)}): its "
                f"file system was remounted read-only, after errors of its device or its "
                f"metadata; nothing more is written there. See the kernel log (dmesg); stop "
                f"infinityd, repair the file system (fsck) and mount it read-write again: what "
                f"was made durable there is kept")
        else:
            error = StoreDirectoryError(
                f"store directory {self.path} failed ({what}: {os.strerror(err)}): its device or "
                f"file system reports errors; nothing more is written there. See the kernel log "
                f"(dmesg); stop infinityd, check the device, and run `infinity verify` before "
                f"using this store again")
        if self.failure is None:
            self.failure = error
            log.error("%s", error)
        return error

    @property
    def can_grow(self) -> bool:
        return self.allocator.capacity_bytes < self.capacity_bytes and self.failure is None

    @property
    def room_bytes(self) -> int:
        """What more it may hold: free space in its file, and what the file may still grow,
        as far as its file system has room for that; none once it failed."""
        if self.failure is not None:
            return 0
        growable = self.capacity_bytes - self.allocator.capacity_bytes
        if growable <= 0:
            return self.allocator.free_bytes  # a file at its full size: no need to ask (statvfs)
        available = self._file_system_available_bytes()
        if available is not None:
            kept = INDEX_ROOM_BYTES if self.keeps_index_room else 0
            growable = max(0, min(growable, available - kept))
        return self.allocator.free_bytes + growable

    def _file_system_available_bytes(self) -> int | None:
        """What its file system can still give; None where that is not known (an error, or a
        file system that counts no space at all, as ramfs)."""
        try:
            stat = os.statvfs(self.path)
        except OSError:
            return None  # the growth itself will say what is wrong
        return stat.f_bavail * stat.f_frsize if stat.f_blocks else None

    def _leave_room_for_the_index(self, current: int, need: int, target: int) -> int:
        """The store's index lives in the first directory, and every delete and flush writes
        to it: no extent file on its file system may take the last bytes, or neither could
        run again to free space. What growth to `target` may take, keeping INDEX_ROOM_BYTES."""
        available = self._file_system_available_bytes()
        if available is None:
            return target
        spare = (available - INDEX_ROOM_BYTES) // PAGE_BYTES * PAGE_BYTES
        if spare < need:
            raise DiskFullError(
                f"the file system of {self.path} has no room to grow the store by {need} bytes "
                f"and keep {INDEX_ROOM_BYTES} for the store index; free space there, lower "
                f"nvme.capacity_bytes_per_dir, or add another directory to nvme.dirs")
        return min(target, current + spare)

    def grow_for(self, nbytes: int, *, lock: threading.Lock | None = None) -> bool:
        """Extend the extent file so that `nbytes` more could fit; False at the capacity limit.

        Grows by `nvme.file_grow_bytes` at a time; when the file system cannot give that much,
        by just what is needed: the part of `nbytes` the free space at the file's end does not
        hold already. `lock` guards the allocator (not the system call).
        """
        with self._grow_lock:
            current = self.allocator.capacity_bytes
            if current >= self.capacity_bytes:
                return False
            if lock is None:
                tail = self.allocator.free_tail_bytes()
            else:
                with lock:
                    tail = self.allocator.free_tail_bytes()
            need = max(PAGE_BYTES, round_up(nbytes, PAGE_BYTES) - tail)
            target = min(self.capacity_bytes, current + max(self.grow_bytes, need))
            if self.keeps_index_room:
                target = self._leave_room_for_the_index(current, need, target)
            try:
                os.posix_fallocate(self.fd, current, target - current)
            except OSError as exc:
                if exc.errno in DIRECTORY_FAULTS:
                    raise self.fail(exc.errno, f"growing {self.file_path}") from None
                if exc.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                    raise StoreDirectoryError(
                        f"cannot grow {self.file_path}: {exc.strerror}; check the directory and "
                        f"the device (dmesg)") from None
                smaller = min(self.capacity_bytes, current + need)
                try:
                    if smaller >= target:
                        raise exc
                    os.posix_fallocate(self.fd, current, smaller - current)
                    target = smaller
                except OSError as again:
                    raise DiskFullError(
                        f"the file system of {self.path} has no room to grow the store to "
                        f"{smaller} bytes ({again.strerror}); free space there, lower "
                        f"nvme.capacity_bytes_per_dir, or add another directory to nvme.dirs"
                    ) from None
            if lock is None:
                self.allocator.grow(target)
            else:
                with lock:
                    self.allocator.grow(target)
            return True

    def allocate(self, nbytes: int, *, grow: bool = True) -> Extent | None:
        """An extent of `nbytes`; None when the directory is at its capacity. With grow=False,
        GrowthNeeded instead of growing the file here."""
        while True:
            extent = self.allocator.allocate(nbytes)
            if extent is not None:
                return extent
            if not self.can_grow:
                return None
            if not grow:
                raise GrowthNeeded(self.index, nbytes)
            self.grow_for(nbytes)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def finished_layout(layout: TensorLayout, crcs: "array.array[int]") -> TensorLayout:
    """The layout with the checksums the engine computed while writing it."""
    return TensorLayout(layout.nbytes, layout.stripe_bytes, layout.extents, tuple(crcs))


class NvmeWrite:
    """A write in flight: its layout is known at once, its checksums once `result()` returns."""

    def __init__(self, layout: TensorLayout, future: IOFuture, crcs: "array.array[int]",
                 keepalive: Sequence[object], on_failure: Callable[[], None]) -> None:
        self._layout = layout
        self.future = future
        self._crcs = crcs
        self._keepalive = keepalive  # staging buffers must outlive the I/O
        self._on_failure: Callable[[], None] | None = on_failure
        self._final: TensorLayout | None = None

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout_s: float | None = None) -> TensorLayout:
        if self._final is None:
            try:
                self.future.result(timeout_s)
            except TimeoutError:
                raise  # still in flight: its extents are not free yet
            except BaseException:
                # Once: the extents it frees may be another write's by the next call.
                on_failure, self._on_failure = self._on_failure, None
                if on_failure is not None:
                    on_failure()
                raise
            self._final = finished_layout(self._layout, self._crcs)
            self._keepalive = ()
        return self._final


class NvmeTier:
    """Tensor extents over one or more directories, moved by the native engine."""

    def __init__(self, config: NvmeConfig, engine: IOEngine, *, staged_reads: bool = False,
                 staged_writes: bool = False) -> None:
        """staged_reads / staged_writes: direct ops of that direction go through the engine's
        staging memory (`IOOp.staged`)."""
        if not config.dirs:
            raise StoreDirectoryError("no NVMe directories configured; set nvme.dirs to one "
                                      "directory per drive")
        config.validate()  # a config built in code has not met the loader's checks
        self.config = config
        self.engine = engine
        self.staged_reads = staged_reads
        self.staged_writes = staged_writes
        self.stripe_bytes = config.stripe_bytes
        self._lock = threading.Lock()
        self._queue_lock = threading.Lock()  # the directories' ops_in_flight
        # fdatasyncs of the store's files that failed so far (counted by the index's writer
        # thread). Linux reports a failed write-back once: the next fdatasync succeeds though
        # the bytes written before the failure may never reach the disk, so a copy written
        # before a failure must not be called durable on the strength of a later sync.
        self.sync_failures = 0
        self.directories: list[NvmeDirectory] = []
        try:
            for i, path in enumerate(config.dirs):
                self.directories.append(NvmeDirectory(path, index=i, config=config))
        except BaseException:
            self.close()
            raise
        self._by_fd = {directory.fd: directory for directory in self.directories}
        # The store's index lives in the first directory: every directory on its file system
        # leaves it room (several directories may share one file system).
        index_device = os.stat(self.directories[0].path).st_dev
        for directory in self.directories:
            directory.keeps_index_room = os.stat(directory.path).st_dev == index_device

    # --- layout -----------------------------------------------------------

    def _pieces(self, layout: TensorLayout, start: int, end: int) -> list[_Piece]:
        """The ops covering bytes [start, end) of a layout's capacity, one per stripe touched."""
        pieces = []
        for k, (slot, offset_in_extent, length) in enumerate(
                deal_stripes(layout.capacity_bytes, layout.stripe_bytes, len(layout.extents))):
            d, extent = layout.extents[slot]
            stripe_start = k * layout.stripe_bytes
            lo, hi = max(start, stripe_start), min(end, stripe_start + length)
            if lo < hi:
                pieces.append(_Piece(d, extent.offset_bytes + offset_in_extent + (lo - stripe_start),
                                     lo, hi - lo))
        return pieces

    # --- space ------------------------------------------------------------

    def allocate(self, nbytes: int, *, grow: bool = True) -> TensorLayout:
        """Reserve extents for a tensor of `nbytes` (no I/O); StoreFullError if it cannot fit.

        grow=False: raise GrowthNeeded rather than extend a file here (see the module docstring).
        """
        if nbytes <= 0:
            raise InvalidRequestError(f"cannot store a tensor of {nbytes} bytes; store at least one byte")
        capacity = round_up(nbytes, PAGE_BYTES)
        # A failed directory takes nothing more: the stripes are dealt over those left.
        usable = [d.index for d in self.directories if d.failure is None]
        if not usable:
            first_failure = self.directories[0].failure
            assert first_failure is not None
            raise first_failure
        num_dirs = len(usable)
        totals = stripe_totals(capacity, self.stripe_bytes, num_dirs)
        largest = max(totals.values())
        if largest > self.config.capacity_bytes_per_dir:
            raise StoreFullError(
                f"a tensor of {nbytes} bytes needs {largest} in one directory, more than its "
                f"nvme.capacity_bytes_per_dir of {self.config.capacity_bytes_per_dir}; raise "
                f"that setting or add directories to nvme.dirs")
        # Without the lock: room only picks where the deal starts, and a stale figure costs a
        # retry at most, while each one asks the file system (statvfs), which may be slow.
        room = ([self.directories[d].room_bytes for d in usable] if num_dirs > 1
                else [0])  # one directory: nothing to pick
        # The deal starts at the directory with the most room; where the tensor does not fit
        # from there (free space in pieces, a file system full), from the next one, and so on.
        failure: StoreFullError | DiskFullError | None = None
        for first in sorted(range(num_dirs), key=lambda d: -room[d]):
            # Slot k of the deal (layout.extents[k]) goes to the k-th directory from `first`.
            per_dir = {usable[(first + slot) % num_dirs]: length
                       for slot, length in totals.items()}
            while True:
                try:
                    return self._allocate_once(nbytes, per_dir, grow=grow)
                except GrowthNeeded:
                    if not grow:
                        raise
                    # Another thread took the room grown here before this took it: grow again.
                except (StoreFullError, DiskFullError) as exc:
                    failure = failure or exc
                    break
        assert failure is not None
        raise failure

    def _allocate_once(self, nbytes: int, per_dir: dict[int, int], *, grow: bool) -> TensorLayout:
        taken: list[tuple[int, Extent]] = []
        if grow:
            # Growing holds no allocator lock across fallocate: make room first, then take it.
            for d, length in per_dir.items():
                directory = self.directories[d]
                while True:
                    with self._lock:
                        fits = directory.allocator.largest_free_bytes() >= length
                    if fits or not directory.can_grow:
                        break
                    directory.grow_for(length, lock=self._lock)
        with self._lock:
            for d, length in per_dir.items():
                try:
                    extent = self.directories[d].allocate(length, grow=False)
                except GrowthNeeded:
                    for dd, e in taken:
                        self.directories[dd].allocator.free(e)
                    raise
                if extent is None:
                    for dd, e in taken:
                        self.directories[dd].allocator.free(e)
                    raise StoreFullError(
                        f"the NVMe tier has no room for {nbytes} bytes in {self.directories[d].path} "
                        f"(capacity {self.directories[d].capacity_bytes} bytes, "
                        f"{self.directories[d].allocator.free_bytes} free); delete tensors, raise "
                        f"nvme.capacity_bytes_per_dir, or add a directory to nvme.dirs")
                taken.append((d, extent))
        return TensorLayout(nbytes, self.stripe_bytes, tuple(taken), ())

    @property
    def failed_directories(self) -> int:
        """How many directories failed (`NvmeDirectory.fail`) since the tier opened."""
        return sum(directory.failure is not None for directory in self.directories)

    def on_failed_directory(self, layout: TensorLayout) -> bool:
        """Whether any of a layout's extents lies in a failed directory."""
        return any(self.directories[d].failure is not None for d, _ in layout.extents)

    def grow(self, index: int, nbytes: int) -> bool:
        """Extend directory `index`'s file so that `nbytes` more fit (blocking; any thread).
        False when it is at nvme.capacity_bytes_per_dir; DiskFullError when the file system is full."""
        return self.directories[index].grow_for(nbytes, lock=self._lock)

    def free(self, layout: TensorLayout) -> None:
        """Give a tensor's extents back for reuse (their cached pages dropped first)."""
        for d, extent in layout.extents:
            self.directories[d].forget_cached_pages(extent.offset_bytes, extent.length_bytes)
        with self._lock:
            for d, extent in layout.extents:
                self.directories[d].allocator.free(extent)

    def check_present(self, layout: TensorLayout) -> None:
        """StoreDirectoryError unless every extent of a persisted layout lies within its
        directory's extent file as it was opened. A file that is missing (a directory not
        mounted yet, say) or shorter than the index says is never filled in with zeros: the
        tensors in it would be lost for good, and later writes with them."""
        for d, extent in layout.extents:
            if d >= len(self.directories):
                raise StoreDirectoryError(
                    f"the store index places bytes in store directory {d}, but nvme.dirs names "
                    f"{len(self.directories)}; restore the original nvme.dirs")
            directory = self.directories[d]
            if extent.end_bytes > directory.opened_bytes:
                state = ("is missing" if not directory.opened_bytes else
                         f"holds {directory.opened_bytes} bytes")
                raise StoreDirectoryError(
                    f"{directory.file_path} {state}, but the store index has tensors up to byte "
                    f"{extent.end_bytes} of it: is {directory.path} the right directory, and "
                    f"mounted? Restore the file and start again")

    def adopt(self, layout: TensorLayout) -> None:
        """Mark a persisted layout's extents as used (rebuilding the space map at restart)."""
        with self._lock:
            for d, extent in layout.extents:
                directory = self.directories[d]
                if extent.end_bytes > directory.capacity_bytes:
                    raise StoreDirectoryError(
                        f"{directory.file_path} holds tensors up to byte {extent.end_bytes}, past "
                        f"nvme.capacity_bytes_per_dir ({directory.capacity_bytes}); raise that "
                        f"setting to at least {extent.end_bytes} to open this store")
            self.check_present(layout)
            for d, extent in layout.extents:
                self.directories[d].allocator.reserve(extent)

    # --- I/O --------------------------------------------------------------

    def _ops(self, pieces: list[_Piece], address: int, *, is_write: bool, crc_address: int,
             first_block: int) -> list[IOOp]:
        ops = []
        for p in pieces:
            directory = self.directories[p.dir_index]
            if is_write:
                directory.bytes_written += p.nbytes
            else:
                directory.bytes_read += p.nbytes
            block = p.tensor_offset_bytes // CRC_BLOCK_BYTES - first_block
            ops.append(IOOp(is_write=is_write, fd=directory.fd,
                            address=address + p.tensor_offset_bytes, nbytes=p.nbytes,
                            offset=p.file_offset_bytes, direct=directory.direct,
                            crc_address=(crc_address + 4 * block) if crc_address else 0,
                            crc_block_bytes=CRC_BLOCK_BYTES,
                            staged=directory.direct and (self.staged_writes if is_write
                                                         else self.staged_reads)))
        return ops

    def _submit(self, ops: list[IOOp], *, keepalive: object) -> IOFuture:
        """Submit a batch, counted in each directory's queue until it completes."""
        future = self.engine.submit(ops, keepalive=keepalive,
                                    to_error=functools.partial(self._batch_error, ops))
        queued = [self._by_fd[op.fd] for op in ops]
        with self._queue_lock:
            for directory in queued:
                directory.ops_in_flight += 1

        def done(_: IOFuture) -> None:  # (in whichever thread resolves the batch)
            with self._queue_lock:
                for directory in queued:
                    directory.ops_in_flight -= 1

        future.add_done_callback(done)
        return future

    def _batch_error(self, ops: list[IOOp], err: int, message: str) -> IOEngineError:
        """A failed batch's error, naming the store directory: a write that failed with EROFS
        or EIO fails its directory (`NvmeDirectory.fail`)."""
        error = error_from_errno(err, message)
        index = failed_op(message)
        if err not in DIRECTORY_FAULTS or index is None or index >= len(ops):
            return error
        op = ops[index]
        directory = self._by_fd.get(op.fd)
        if directory is None:
            return error
        if op.is_write:
            return directory.fail(err, f"a write of {op.nbytes} bytes at byte {op.offset} of "
                                       f"{directory.file_path}")
        return IOEngineError(f"a read from store directory {directory.path} failed: {error}")

    def write_from(self, address: int, nbytes: int, *, layout: TensorLayout | None = None,
                   keepalive: Sequence[object] = ()) -> NvmeWrite:
        """Write `nbytes` from a 4 KiB-aligned buffer readable up to nbytes rounded up to 4 KiB
        (those padding bytes must be zero). A fresh layout is allocated unless one is given."""
        if address % PAGE_BYTES:
            raise InvalidRequestError("write_from needs a 4 KiB-aligned address; use write_tensor")
        fresh = layout is None
        layout = self.allocate(nbytes) if layout is None else layout
        if layout.nbytes != nbytes:
            raise InvalidRequestError(f"layout holds {layout.nbytes} bytes, not {nbytes}")
        crcs = crc_buffer(crc_blocks(nbytes))
        ops = self._ops(self._pieces(layout, 0, layout.capacity_bytes), address, is_write=True,
                        crc_address=_address_of(crcs), first_block=0)
        on_failure: Callable[[], None] = (lambda: self.free(layout)) if fresh else (lambda: None)
        try:
            # The future holds the buffers too, so a caller that drops the NvmeWrite cannot
            # free them under the I/O.
            future = self._submit(ops, keepalive=(*keepalive, crcs))
        except BaseException:
            on_failure()
            raise
        return NvmeWrite(layout, future, crcs, (*keepalive, crcs), on_failure)

    def write_part(self, layout: TensorLayout, address: int, *, offset_bytes: int, nbytes: int,
                   crcs: "array.array[int]") -> IOFuture:
        """Write bytes [offset, offset + nbytes) of a tensor from a 4 KiB-aligned buffer.

        For tensors written in pieces (streams): the range follows `read_into`'s rule (starts on
        a 1 MiB block, ends on one or at the tensor's end, where the buffer is read up to the
        4 KiB-rounded end, whose padding must be zero). The engine stores each block's CRC32C
        at its place in `crcs` (`crc_buffer(crc_blocks(layout.nbytes))`, kept alive by the
        caller until the future completes); `finished_layout(layout, crcs)` once every range
        is written.
        """
        stop = self._check_range(layout, address, offset_bytes, nbytes)
        if len(crcs) != crc_blocks(layout.nbytes) or crcs.itemsize != 4:
            raise InvalidRequestError(f"crcs must be a uint32 array of {crc_blocks(layout.nbytes)} "
                                      f"checksums; make it with crc_buffer(crc_blocks(nbytes))")
        first_block = offset_bytes // CRC_BLOCK_BYTES
        ops = self._ops(self._pieces(layout, offset_bytes, stop), address - offset_bytes,
                        is_write=True, crc_address=_address_of(crcs) + 4 * first_block,
                        first_block=first_block)
        return self._submit(ops, keepalive=crcs)

    def _check_range(self, layout: TensorLayout, address: int, offset_bytes: int, nbytes: int) -> int:
        """Validate a partial transfer; returns where it stops (the end rounded to 4 KiB at the
        tensor's end)."""
        end = offset_bytes + nbytes
        if offset_bytes < 0 or nbytes <= 0 or end > layout.nbytes:
            raise OutOfRangeError(
                f"bytes [{offset_bytes}, {end}) reach past the end of a {layout.nbytes}-byte tensor; "
                f"transfer at most {layout.nbytes - max(offset_bytes, 0)} bytes from offset "
                f"{offset_bytes}")
        if offset_bytes % CRC_BLOCK_BYTES or (end % CRC_BLOCK_BYTES and end != layout.nbytes):
            raise InvalidRequestError(
                f"partial transfers must start and end on 1 MiB boundaries (or at the end of the "
                f"tensor) so that their checksums cover whole blocks; got [{offset_bytes}, {end})")
        if address % PAGE_BYTES:
            raise InvalidRequestError("partial transfers need a 4 KiB-aligned address; use read_tensor")
        return round_up(end, PAGE_BYTES) if end == layout.nbytes else end

    def write_tensor(self, tensor: "torch.Tensor", *, layout: TensorLayout | None = None) -> NvmeWrite:
        """Write a CPU tensor's bytes; an unaligned or odd-sized tensor goes through a staging copy."""
        import torch

        from infinity.io import aligned_empty

        if tensor.device.type != "cpu":
            raise InvalidRequestError("the NVMe tier writes CPU tensors; call .cpu() first")
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if _tensor_address(tensor) % PAGE_BYTES == 0 and nbytes % PAGE_BYTES == 0:
            return self.write_from(_tensor_address(tensor), nbytes, layout=layout, keepalive=(tensor,))
        staging = aligned_empty(nbytes)
        staging[:nbytes].copy_(tensor.reshape(-1).view(torch.uint8))
        return self.write_from(_tensor_address(staging), nbytes, layout=layout, keepalive=(staging,))

    def read_into(self, layout: TensorLayout, address: int, *, offset_bytes: int = 0,
                  nbytes: int | None = None) -> IOFuture:
        """Read tensor bytes [offset, offset + nbytes) into a 4 KiB-aligned buffer, checksums verified.

        The range must start on a 1 MiB checksum block and end on one or at the tensor's end, so that
        every block read is verified whole. The buffer must hold the range rounded up to 4 KiB.
        """
        nbytes = layout.nbytes - offset_bytes if nbytes is None else nbytes
        stop = self._check_range(layout, address, offset_bytes, nbytes)
        if not layout.crcs:
            raise InvalidRequestError("this layout has no checksums yet: wait for its write to finish")
        first_block = offset_bytes // CRC_BLOCK_BYTES
        last_block = (stop + CRC_BLOCK_BYTES - 1) // CRC_BLOCK_BYTES
        expected = crc_buffer(layout.crcs[first_block:last_block])
        ops = self._ops(self._pieces(layout, offset_bytes, stop), address - offset_bytes,
                        is_write=False, crc_address=_address_of(expected), first_block=first_block)
        return self._submit(ops, keepalive=expected)

    def read_tensor(self, layout: TensorLayout, out: "torch.Tensor") -> None:
        """Read a whole tensor into `out` (any CPU tensor of exactly `layout.nbytes` bytes), blocking."""
        import torch

        from infinity.io import aligned_empty

        nbytes = out.numel() * out.element_size()
        if nbytes > layout.nbytes:
            raise OutOfRangeError(
                f"reading {nbytes} bytes reaches past the end of a {layout.nbytes}-byte tensor; "
                f"pass an output of exactly {layout.nbytes} bytes")
        if nbytes != layout.nbytes:
            raise InvalidRequestError(f"the output holds {nbytes} bytes; the tensor has {layout.nbytes}")
        if not out.is_contiguous() or out.device.type != "cpu":
            raise InvalidRequestError("read_tensor needs a contiguous CPU output tensor")
        if _tensor_address(out) % PAGE_BYTES == 0 and nbytes % PAGE_BYTES == 0:
            self.read_into(layout, _tensor_address(out)).result()
            return
        staging = aligned_empty(nbytes)
        self.read_into(layout, _tensor_address(staging)).result()
        out.reshape(-1).view(torch.uint8).copy_(staging[:nbytes])

    # --- reporting ----------------------------------------------------------

    def describe(self) -> list[dict[str, Any]]:
        return [{
            "path": d.path,
            "direct": d.direct,
            "mode": d.mode_reason,
            "capacity_bytes": d.capacity_bytes,
            "file_bytes": d.allocator.capacity_bytes,
            "used_bytes": d.allocator.used_bytes,
            "bytes_read": d.bytes_read,
            "bytes_written": d.bytes_written,
            "queue_depth": d.ops_in_flight,
            "failure": None if d.failure is None else str(d.failure),
        } for d in self.directories]

    def close(self) -> None:
        for d in self.directories:
            d.close()
