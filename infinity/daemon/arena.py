"""The CPU tier's memory: memfd segments created lazily up to the budget, and ranges inside them.

A standard segment is `cpu.segment_bytes` (the last one may be smaller, to fit
the budget); a tensor larger than half that gets a dedicated segment of its own,
rounded up to 2 MiB. (Half: a standard segment holds only one such tensor, and
the rest of it would be stranded; a few of them, leased together as an optimizer
step leases a parameter's tensors, could find the tier less than half used and
still no room.) Emptied, a dedicated segment stays, idle, for the next tensor of
about its size, and is retired when an allocation needs its budget: an offloaded
parameter's tensors come and go every step, and creating a segment zero-fills it
(29% of the daemon's Python-visible samples in a GPT-2 training step before they
stayed). Nor is an empty segment retired where it can change kind instead, in the same
class: an idle dedicated one becomes standard for an allocation the budget has no room
for, an empty standard one of about a large tensor's size becomes that tensor's dedicated
segment (a streamed model's output projection, larger than half a segment, comes and goes
every token). Ranges inside a segment come from one `ExtentAllocator` per segment
(4 KiB-aligned offsets, so O_DIRECT reads can land in place).

Segments have classes. The default class (None) holds every read-write
tensor; a read-only namespace's tensors sit in segments of their own class
(named after the namespace), never mixed with other tensors, so that the fd
channel can hand those segments to the namespace's readers through a
read-only fd (`Segment.read_only_fd`) and the kernel refuses their writes.

Creating a segment zero-fills and prefaults it, which takes milliseconds per
hundred MiB, so it is split in two: the loop asks `allocate`, which raises
`SpaceShortage` when a new segment would help; the loop then runs
`create_segment` on a worker thread and `install`s the result. The arena never
blocks, and never touches tensor bytes except to poison freed ranges in debug
mode.

Memory the VM has not backed yet makes that slow: 180-250 ms for a 64 MiB segment with huge
pages on this project's VM, against 17 ms for memory freed a moment before; a fresh daemon's
first step waited on its segments one after the other. With `cpu.create_at_start` the daemon
makes its budget's segments ahead, one at a time on the worker thread, as blanks (`Blank`):
memory with no id, no class and no client, which counts against the budget and becomes a
standard segment of whatever class first needs one (`install_blank`), at no cost then. A
dedicated segment's budget takes blanks back (they are retired first).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
from dataclasses import dataclass
from typing import Callable

from infinity.config import CpuTierConfig, MiB
from infinity.errors import ConfigError, IOEngineError, TierFullError, TooLargeError
from infinity.io.native import native
from infinity.store.allocator import Extent, ExtentAllocator

log = logging.getLogger("infinityd.arena")

ALIGNMENT_BYTES = 4096
SEGMENT_GRANULE_BYTES = 2 * MiB
# An idle dedicated segment serves a tensor that needs at least this part less than its size
# (8: 1/8 of it at most stranded); a larger one is retired for it instead.
IDLE_SLACK_DIVISOR = 8
_HUGE_PAGE_BYTES = 2 * MiB  # what MADV_COLLAPSE makes
POISON_BYTE = 0xFF  # every float dtype reads 0xFF..FF as NaN, so stale reads stand out
_MADV_POPULATE_WRITE = 23  # Linux 5.14; Python's mmap module does not name it yet

_libc = ctypes.CDLL(None, use_errno=True)
_ANY_CLASS = object()  # "segments of every class", where None names the default class


@dataclass(frozen=True, slots=True)
class CpuSlice:
    """A range of one segment: `length` is the allocated (4 KiB-rounded) size."""

    segment: int
    offset: int
    length: int


class SpaceShortage(Exception):
    """Internal signal: no segment has room, but the tier may still grow (or is growing)."""

    def __init__(self, nbytes: int, *, dedicated: bool, segment_class: str | None = None) -> None:
        super().__init__(f"{nbytes} bytes need a new segment")
        self.nbytes = nbytes
        self.dedicated = dedicated
        self.segment_class = segment_class


@dataclass(frozen=True, slots=True)
class SegmentPlan:
    """A segment about to be created on a worker thread; its bytes already count against the budget."""

    segment: int
    size_bytes: int
    dedicated: bool
    segment_class: str | None = None  # None: the default (read-write) class


class Segment:
    """One shared-memory segment: its memfd, the daemon's mapping, and its allocator."""

    def __init__(self, plan: SegmentPlan, fd: int, mm: mmap.mmap, *, hugepages: bool,
                 locked: bool) -> None:
        self.id = plan.segment
        self.size_bytes = plan.size_bytes
        self.dedicated = plan.dedicated
        self.segment_class = plan.segment_class
        self.fd = fd
        # For a classed segment: the same memory opened read-only, for clients that only read it.
        self.read_only_fd = _read_only_fd(fd) if plan.segment_class is not None else -1
        self.mm = mm
        # The address stays valid for the mapping's life; the temporary buffer export is dropped at once.
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        self.hugepages = hugepages
        self.locked = locked
        self.allocator = ExtentAllocator(plan.size_bytes, alignment_bytes=ALIGNMENT_BYTES)

    def destroy(self) -> None:
        """Give the memory back now, even while clients still map the segment."""
        _give_back(self.fd, self.mm)
        if self.read_only_fd >= 0:
            os.close(self.read_only_fd)


class Blank:
    """A segment's memory made ahead (`cpu.create_at_start`): not live, never handed to a
    client, until `CpuArena.install_blank` makes it a standard segment."""

    def __init__(self, fd: int, mm: mmap.mmap, size_bytes: int, *, hugepages: bool,
                 locked: bool) -> None:
        self.fd, self.mm, self.size_bytes = fd, mm, size_bytes
        self.hugepages, self.locked = hugepages, locked

    def destroy(self) -> None:
        _give_back(self.fd, self.mm)


def _give_back(fd: int, mm: mmap.mmap) -> None:
    """Free a memfd's memory (MADV_REMOVE: at once, even where clients map it), unmap it and
    close it."""
    try:
        mm.madvise(mmap.MADV_REMOVE)
    except OSError:
        pass
    mm.close()
    os.close(fd)


def _read_only_fd(fd: int) -> int:
    """The file of `fd` opened anew for reading only: a client mapping it cannot ask for
    PROT_WRITE (EACCES), and mprotect cannot add it later. The file's mode drops to 0400 first,
    so that a client of the same user cannot reopen it read-write through /proc/<pid>/fd either
    (root still can: this guards against stray writes, not against a hostile root)."""
    try:
        os.fchmod(fd, 0o400)
    except OSError:
        pass  # the read-only fd still keeps every mapping of it read-only
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


def _shared_memory_fd(name: str) -> int:
    """A memfd; named shared memory (created and unlinked at once) where memfd is unavailable."""
    if hasattr(os, "memfd_create"):
        try:
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
        except OSError as exc:
            if exc.errno != errno.ENOSYS:
                raise
        else:
            # A memfd is born 0777 whatever the umask; /proc/<pid>/fd already keeps other users
            # out, and 0600 keeps them out should that ever be reachable (a core dumper, a
            # debugger granted access): the daemon's user alone may open it again.
            os.fchmod(fd, 0o600)
            return fd
    path = f"/dev/shm/{name}-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    os.unlink(path)
    return fd


def shmem_hugepage_mode() -> str | None:
    """The kernel's shmem_enabled choice ("never", "advise", ...); None where it says nothing."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            setting = f.read()
    except OSError:
        return None
    return setting[setting.find("[") + 1:setting.find("]")] if "[" in setting else setting.strip()


def shmem_hugepages_allowed() -> bool:
    """Whether the kernel gives transparent huge pages to shared memory that asks (madvise)."""
    return shmem_hugepage_mode() in ("always", "within_size", "advise", "force")


def _prefault(mm: mmap.mmap, size_bytes: int) -> None:
    try:
        mm.madvise(_MADV_POPULATE_WRITE)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            # ENOMEM: no memory; EFAULT: a page could not be had (a full /dev/shm where memfd is
            # missing), where touching it would kill the daemon with SIGBUS.
            raise TierFullError(
                f"the system has no memory for a {size_bytes}-byte CPU-tier segment "
                f"({exc.strerror}); lower cpu.budget_bytes or free memory") from None
        for page in range(0, size_bytes, mmap.PAGESIZE):  # kernels before 5.14
            mm[page] = 0


def _collapse(name: str, fd: int, size_bytes: int) -> bool:
    """Huge pages for a new segment where shmem_enabled does not give them on request:
    MADV_COLLAPSE (Linux 6.1+). What decides is not the TLB but the disk: O_DIRECT loads into
    scattered 4 KiB pages ran at a third of the disk's speed on this project's VM
    (docs/BENCHMARKS.md). One page in each 2 MiB first, since the kernel refuses a range that
    is all hole and fills the rest of one with zeros: four times faster than collapsing a
    prefaulted segment, which copies every page. Whether it worked: False on older kernels,
    where shmem_enabled is "deny", or where memory is too fragmented (pages stay small there)."""
    try:
        for offset in range(0, size_bytes, _HUGE_PAGE_BYTES):
            os.pwrite(fd, b"\0", offset)
        failed = native().collapse_shared_memory(fd, size_bytes)
    except (OSError, IOEngineError) as exc:
        log.debug("no huge pages for CPU-tier segment %s: %s", name, exc)
        return False
    if failed in (errno.ENOMEM, errno.EAGAIN):
        log.warning("CPU-tier segment %s keeps 4 KiB pages, at least in part (MADV_COLLAPSE: %s; "
                    "memory too fragmented, or a memory cgroup at its limit): NVMe loads into it "
                    "run slower; nvme.staged_reads=on avoids that", name, os.strerror(failed))
    elif failed:
        log.debug("no huge pages for CPU-tier segment %s: %s", name, os.strerror(failed))
    return not failed


def _dedicated_size(nbytes: int) -> int:
    """The size of the dedicated segment an allocation of `nbytes` gets: 4 KiB-aligned, then
    whole 2 MiB granules."""
    length = -(-nbytes // ALIGNMENT_BYTES) * ALIGNMENT_BYTES
    return -(-length // SEGMENT_GRANULE_BYTES) * SEGMENT_GRANULE_BYTES


def create_segment(plan: SegmentPlan, config: CpuTierConfig) -> Segment:
    """Create, map, prefault (and optionally lock) a segment. Blocking: runs off the loop thread."""
    fd, mm, hugepages, locked = _make_memory(f"infinity-seg-{plan.segment}", plan.size_bytes,
                                             config)
    try:
        return Segment(plan, fd, mm, hugepages=hugepages, locked=locked)
    except BaseException:
        mm.close()
        os.close(fd)
        raise


def create_blank(size_bytes: int, config: CpuTierConfig) -> Blank:
    """A segment's memory made ahead, as `create_segment` makes it. Blocking: off the loop."""
    fd, mm, hugepages, locked = _make_memory("infinity-seg-blank", size_bytes, config)
    return Blank(fd, mm, size_bytes, hugepages=hugepages, locked=locked)


def _make_memory(name: str, size_bytes: int,
                 config: CpuTierConfig) -> tuple[int, mmap.mmap, bool, bool]:
    """A memfd of `size_bytes`, mapped, prefaulted (and optionally locked): (fd, mapping,
    huge pages, locked)."""
    fd = _shared_memory_fd(name)
    mm: mmap.mmap | None = None
    try:
        os.ftruncate(fd, size_bytes)
        hugepages = False
        on_request = config.hugepages and shmem_hugepages_allowed()
        if config.hugepages and config.prefault and not on_request:
            # Not without prefault: that setting asks for no memory until it is used.
            hugepages = _collapse(name, fd, size_bytes)
        mm = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
        if on_request:
            try:
                mm.madvise(mmap.MADV_HUGEPAGE)
                hugepages = True
            except OSError:
                pass  # unsupported here: 4 KiB pages, as the setting promises
        if config.prefault:
            _prefault(mm, size_bytes)
        locked = False
        if config.lock:
            address = ctypes.addressof(ctypes.c_char.from_buffer(mm))
            if _libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(size_bytes)) != 0:
                err = ctypes.get_errno()
                raise ConfigError(
                    f"cannot lock a {size_bytes}-byte CPU-tier segment in memory "
                    f"({os.strerror(err)}); raise the memlock limit (ulimit -l, or LimitMEMLOCK="
                    f"infinity in the systemd unit) or set cpu.lock=false")
            locked = True
        return fd, mm, hugepages, locked
    except BaseException:
        if mm is not None:
            mm.close()
        os.close(fd)
        raise


class CpuArena:
    """The segments of the CPU tier and the budget they share. Loop thread only (not thread-safe)."""

    def __init__(self, config: CpuTierConfig, *, poison: bool = False,
                 on_retire: Callable[[int], None] = lambda segment: None) -> None:
        self.config = config
        self.poison = poison
        self._on_retire = on_retire
        self.segments: dict[int, Segment] = {}
        self._next_segment = 1
        self._segment_bytes_total = 0  # live segments
        self._planned_bytes = 0  # segments being created
        self._planned: dict[int, SegmentPlan] = {}
        self._blanks: list[Blank] = []  # made ahead (cpu.create_at_start), not live
        self._blank_bytes = 0
        self._preparing_bytes = 0  # blanks being made
        self.used_bytes = 0  # allocated ranges (rounded), all segments
        self.counters_converted = 0  # empty segments that changed kind instead of being retired
        # Namespaces whose tensors sit in segments of their own class (read-only ones): the class
        # is the namespace's name. Set by the namespace records; asked by every allocation.
        self._namespace_classes: set[str] = set()

    # --- sizes ------------------------------------------------------------------

    @property
    def budget_bytes(self) -> int:
        return self.config.budget_bytes

    @property
    def segment_bytes_total(self) -> int:
        return self._segment_bytes_total

    @property
    def growing(self) -> bool:
        return bool(self._planned)

    @property
    def preparing(self) -> bool:
        """Whether a blank is being made (its budget comes back as a blank soon)."""
        return self._preparing_bytes > 0

    def _room_bytes(self) -> int:
        """Budget not yet given to a segment or a blank, rounded down to whole 2 MiB granules."""
        room = (self.budget_bytes - self._segment_bytes_total - self._planned_bytes
                - self._blank_bytes - self._preparing_bytes)
        return max(0, room) // SEGMENT_GRANULE_BYTES * SEGMENT_GRANULE_BYTES

    # --- segment classes ----------------------------------------------------------

    def add_namespace_class(self, namespace: str) -> None:
        """From now on the tensors of `namespace` are placed in segments of its own class."""
        self._namespace_classes.add(namespace)

    def class_for(self, namespace: str) -> str | None:
        """The class of the segments `namespace`'s tensors are placed in (None: the default)."""
        return namespace if namespace in self._namespace_classes else None

    # --- allocation ---------------------------------------------------------------

    def allocate(self, nbytes: int, *, what: str, segment_class: str | None = None) -> CpuSlice:
        """A 4 KiB-aligned range of at least nbytes (> 0), in a segment of `segment_class`.

        Raises TooLargeError (bigger than the whole tier), TierFullError (no room
        and no way to grow), or SpaceShortage (the loop should grow the tier and retry).
        """
        if nbytes > self.budget_bytes:
            raise TooLargeError(
                f"{what} needs {nbytes} bytes, more than the whole CPU tier (cpu.budget_bytes="
                f"{self.budget_bytes}); raise cpu.budget_bytes, or move it in pieces with "
                f"client.write_from(name, src) / client.read_into(name, out) (needs nvme.dirs)")
        length = -(-nbytes // ALIGNMENT_BYTES) * ALIGNMENT_BYTES
        dedicated = self.needs_dedicated(length)
        need = _dedicated_size(length) if dedicated else length
        for segment in self.segments.values():
            if segment.dedicated != dedicated or segment.segment_class != segment_class:
                continue
            if dedicated and (segment.allocator.used_bytes
                              or segment.size_bytes > need + need // IDLE_SLACK_DIVISOR):
                continue  # a dedicated segment holds exactly one tensor, of about its size
            extent = segment.allocator.allocate(length)
            if extent is not None:
                self.used_bytes += extent.length_bytes
                return CpuSlice(segment.id, extent.offset_bytes, extent.length_bytes)
        # An empty segment of the other kind and the same class may change kind instead of
        # being retired for a new one, which would zero-fill the same bytes again.
        converted = self._convertible(length, need, dedicated=dedicated,
                                      segment_class=segment_class)
        if converted is not None:
            converted.dedicated = dedicated
            extent = converted.allocator.allocate(length)
            assert extent is not None  # empty, and at least `length`
            self.used_bytes += extent.length_bytes
            self.counters_converted += 1
            log.debug("CPU tier: segment %d is now %s", converted.id,
                      "dedicated" if dedicated else "standard")
            return CpuSlice(converted.id, extent.offset_bytes, extent.length_bytes)
        # The tier may grow (or is growing): the caller waits for it. (The exception is made in
        # the raise, never kept in a local: this frame, in its traceback, would hold it, a
        # reference cycle per shortage that only the daemon's rare full collections free.)
        # A blank (a segment made ahead) large enough becomes the standard segment this needs.
        if not dedicated and any(b.size_bytes >= length for b in self._blanks):
            raise SpaceShortage(length, dedicated=False, segment_class=segment_class)
        # Empty segments that cannot serve this allocation give their budget back (after any
        # blanks): idle dedicated ones, and standard ones: any of them for a dedicated segment,
        # those of other classes for a standard one (without read-only namespaces, there are
        # none).
        other_classes: object = _ANY_CLASS if dedicated else segment_class
        if (not self.growing and self._room_bytes() < need
                and self._room_bytes() + self._retirable_bytes(other_classes) >= need):
            self._retire_empty(need, other_classes)
            raise SpaceShortage(length, dedicated=dedicated, segment_class=segment_class)
        if self.growing or self.preparing or self._room_bytes() >= need:
            raise SpaceShortage(length, dedicated=dedicated, segment_class=segment_class)
        raise TierFullError(
            f"the CPU tier is full: {self.used_bytes} of {self.budget_bytes} bytes are in use "
            f"and {what} needs {nbytes} more; raise cpu.budget_bytes or delete tensors (with "
            f"nvme.dirs set, tensors that are not leased are evicted to NVMe instead)")

    def fits_dedicated(self, size_bytes: int, need: int) -> bool:
        """Whether a segment of `size_bytes` may hold, alone, a tensor whose dedicated segment
        would be `need` bytes (2 MiB granules): at most 1/IDLE_SLACK_DIVISOR of it stranded."""
        return need <= size_bytes <= need + need // IDLE_SLACK_DIVISOR

    def _convertible(self, length: int, need: int, *, dedicated: bool,
                     segment_class: str | None) -> Segment | None:
        """An empty segment of `segment_class` to change kind for an allocation of `length`
        (`need`: its segment's size if dedicated) rather than retire it for a new segment: for
        a dedicated allocation, an empty standard segment of about its size (one emptied for
        it: `segments_to_hold`); for a standard one, an idle dedicated segment, where the
        budget has no room for a new standard segment (room left: it stays for its tensor)."""
        if not dedicated and (self.growing or self._room_bytes() >= need):
            return None
        fitting = [s for s in self.segments.values()
                   if s.dedicated != dedicated and s.segment_class == segment_class
                   and not s.allocator.used_bytes
                   and (self.fits_dedicated(s.size_bytes, need) if dedicated
                        else s.size_bytes >= length)]
        return min(fitting, key=lambda s: s.size_bytes, default=None)

    def plan_growth(self, shortage: SpaceShortage) -> SegmentPlan | None:
        """Claim budget for the segment that resolves `shortage`, or None if it no longer fits."""
        if shortage.dedicated:
            size = _dedicated_size(shortage.nbytes)
        else:
            size = min(self.config.segment_bytes, self._room_bytes())
        if size < shortage.nbytes or size > self._room_bytes() or size <= 0:
            return None
        plan = SegmentPlan(self._next_segment, size, shortage.dedicated, shortage.segment_class)
        self._next_segment += 1
        self._planned[plan.segment] = plan
        self._planned_bytes += size
        return plan

    def install(self, segment: Segment) -> None:
        plan = self._planned.pop(segment.id)
        self._planned_bytes -= plan.size_bytes
        self.segments[segment.id] = segment
        self._segment_bytes_total += segment.size_bytes
        self._log_segment(segment)

    @staticmethod
    def _log_segment(segment: Segment, how: str = "") -> None:
        log.info("CPU tier: segment %d of %d bytes%s%s%s%s%s", segment.id, segment.size_bytes,
                 " (dedicated)" if segment.dedicated else "",
                 "" if segment.segment_class is None else
                 f" for read-only namespace {segment.segment_class!r}",
                 ", huge pages" if segment.hugepages else "", ", locked" if segment.locked else "",
                 f", {how}" if how else "")

    # --- blanks (segments made ahead) -------------------------------------------------

    def plan_blank(self) -> int | None:
        """Claim budget for a blank to make ahead: its size, or None where the budget has no
        room for one."""
        size = min(self.config.segment_bytes, self._room_bytes())
        if size <= 0:
            return None
        self._preparing_bytes += size
        return size

    def add_blank(self, blank: Blank) -> None:
        """A blank planned with `plan_blank` was made."""
        self._preparing_bytes -= blank.size_bytes
        self._blanks.append(blank)
        self._blank_bytes += blank.size_bytes

    def abandon_blank(self, size_bytes: int) -> None:
        """A blank planned with `plan_blank` could not be made (or is not wanted)."""
        self._preparing_bytes -= size_bytes

    def install_blank(self, shortage: SpaceShortage) -> Segment | None:
        """A blank made live as the standard segment `shortage` asks for (of its class), or
        None: a dedicated shortage, or no blank large enough."""
        if shortage.dedicated:
            return None
        fitting = [b for b in self._blanks if b.size_bytes >= shortage.nbytes]
        if not fitting:
            return None
        blank = max(fitting, key=lambda b: b.size_bytes)
        self._blanks.remove(blank)
        self._blank_bytes -= blank.size_bytes
        plan = SegmentPlan(self._next_segment, blank.size_bytes, False, shortage.segment_class)
        self._next_segment += 1
        segment = Segment(plan, blank.fd, blank.mm, hugepages=blank.hugepages,
                          locked=blank.locked)
        self.segments[segment.id] = segment
        self._segment_bytes_total += segment.size_bytes
        self._log_segment(segment, "made ahead")
        return segment

    def abandon(self, plan: SegmentPlan) -> None:
        """A planned segment could not be created: its budget is free again."""
        self._planned.pop(plan.segment, None)
        self._planned_bytes -= plan.size_bytes

    def free(self, piece: CpuSlice) -> None:
        segment = self.segments[piece.segment]
        if self.poison:
            ctypes.memset(segment.address + piece.offset, POISON_BYTE, piece.length)
        segment.allocator.free(Extent(piece.offset, piece.length))
        self.used_bytes -= piece.length
        # An emptied dedicated segment stays, idle: see the module's docstring.

    def segment_fds(self) -> dict[int, tuple[int, int]]:
        """Each live segment's (memfd, size), for the fd channel."""
        return {s.id: (s.fd, s.size_bytes) for s in self.segments.values()}

    def segment_class(self, segment_id: int) -> str | None:
        """The class of a live segment (None: the default class, or no such segment)."""
        segment = self.segments.get(segment_id)
        return None if segment is None else segment.segment_class

    def read_only_fd(self, segment_id: int) -> int:
        """A live classed segment's read-only fd (-1 for a default-class segment)."""
        return self.segments[segment_id].read_only_fd

    def address_of(self, piece: CpuSlice) -> int:
        """The daemon's address of a slice (for the native engine's I/O into it)."""
        return self.segments[piece.segment].address + piece.offset

    # --- segments going away -----------------------------------------------------

    def needs_dedicated(self, nbytes: int) -> bool:
        """Whether an allocation of `nbytes` gets a segment of its own (see the module's
        docstring)."""
        return -(-nbytes // ALIGNMENT_BYTES) * ALIGNMENT_BYTES > self.config.segment_bytes // 2

    def segment_bytes_to_empty(self, nbytes: int) -> int:
        """For an allocation of `nbytes` that needs a dedicated segment: the bytes of segments
        holding something that must be emptied (then retired) before that segment fits the
        budget; 0 when it fits already, or the allocation needs no dedicated segment."""
        if not self.needs_dedicated(nbytes):
            return 0
        return max(0, _dedicated_size(nbytes) - self._room_bytes() - self._retirable_bytes())

    def segments_to_hold(self, nbytes: int, segment_class: str | None) -> set[int]:
        """For an allocation of `nbytes` that needs a dedicated segment: the segments in use of
        `segment_class`, of either kind, that could hold it alone once emptied (a standard one
        then changes kind, `_convertible`), so that emptying one of them is enough."""
        need = _dedicated_size(nbytes)
        return {s.id for s in self.segments.values()
                if s.allocator.used_bytes and s.segment_class == segment_class
                and self.fits_dedicated(s.size_bytes, need)}

    def segments_in_use(self) -> list[tuple[int, int, int]]:
        """(segment id, size, bytes in use) of each segment that holds something. Emptied, a
        segment is retired when an allocation it cannot serve needs its budget."""
        return [(s.id, s.size_bytes, s.allocator.used_bytes) for s in self.segments.values()
                if s.allocator.used_bytes]

    def _retirable(self, other_than: object = _ANY_CLASS) -> list[Segment]:
        """Empty segments that may be retired for an allocation: idle dedicated ones first,
        then standard ones of every class, or of a class other than `other_than` (for a
        standard allocation of that class, which an empty one of its own would have served)."""
        empty = [s for s in self.segments.values() if s.allocator.used_bytes == 0
                 and (s.dedicated or other_than is _ANY_CLASS or s.segment_class != other_than)]
        return sorted(empty, key=lambda s: not s.dedicated)

    def _retirable_bytes(self, other_than: object = _ANY_CLASS) -> int:
        return self._blank_bytes + sum(s.size_bytes for s in self._retirable(other_than))

    def _retire_empty(self, need: int, other_than: object = _ANY_CLASS) -> None:
        """Blanks first (no client maps them), then empty segments, until `need` fits."""
        while self._blanks and self._room_bytes() < need:
            blank = self._blanks.pop()
            self._blank_bytes -= blank.size_bytes
            blank.destroy()
        for segment in self._retirable(other_than):
            if self._room_bytes() >= need:
                break
            self._retire(segment)

    def retire_if_empty(self, segment_id: int) -> None:
        """Retire the segment if it is still there and holds nothing."""
        segment = self.segments.get(segment_id)
        if segment is not None and segment.allocator.used_bytes == 0:
            self._retire(segment)

    def _retire(self, segment: Segment) -> None:
        del self.segments[segment.id]
        self._segment_bytes_total -= segment.size_bytes
        segment.destroy()
        log.debug("CPU tier: segment %d retired", segment.id)
        self._on_retire(segment.id)

    def close(self) -> None:
        for segment in list(self.segments.values()):
            segment.destroy()
        self.segments.clear()
        self._segment_bytes_total = 0
        for blank in self._blanks:
            blank.destroy()
        self._blanks.clear()
        self._blank_bytes = 0

    def stats(self) -> dict[str, int]:
        return {
            "budget_bytes": self.budget_bytes,
            "segment_bytes": self.config.segment_bytes,
            "allocated_bytes": self._segment_bytes_total,
            "used_bytes": self.used_bytes,
            "free_bytes": self.budget_bytes - self.used_bytes,
            "num_segments": len(self.segments),
            "num_dedicated_segments": sum(1 for s in self.segments.values()
                                          if s.dedicated and s.allocator.used_bytes),
            "num_idle_dedicated_segments": sum(1 for s in self.segments.values()
                                               if s.dedicated and not s.allocator.used_bytes),
            "num_read_only_segments": sum(1 for s in self.segments.values()
                                          if s.segment_class is not None),
            "growing_bytes": self._planned_bytes,
            "blank_bytes": self._blank_bytes,  # made ahead, not live yet (cpu.create_at_start)
            "huge_page_bytes": sum(s.size_bytes for s in self.segments.values() if s.hugepages),
            "segments_converted": self.counters_converted,
        }
