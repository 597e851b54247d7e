"""Residency: which versions are in the CPU tier, which have I/O on them, and which may leave now.

`Residency` is the one owner of that state; it is built first (before the
scheduler, the tiers and the catalog) and the others ask it:

- `resident`: the current version of each name whose bytes are in the CPU tier
  (kept only with an NVMe tier: without one nothing ever leaves). A version's
  own `cpu` slot says where its bytes are; this map is the index over the
  current ones that eviction walks, changed only by `place` and `displace`;
- `loads` and `writebacks`: the I/O in flight per version (`Load`, `WriteBack`),
  written only by `infinity.daemon.loads` and `infinity.daemon.eviction`. A
  version with either is not freed nor evicted until it ends (`busy`);
- `write_error`: the last write-back failed, so dirty versions may not be chosen
  as victims until NVMe space is freed or a write-back succeeds;
- `candidates`: the versions that may be evicted now, as the live map that the
  eviction policy and the scheduler ask (`is_pinned` is its negation by key);
- `tensors`: the same residency by tensor, as the scheduler asks it
  (`infinity.daemon.scheduler.view.ResidencyView`): each resident tensor's
  size, the loads in flight by tensor, byte totals overall and per namespace,
  the last size seen of each tensor, and a watcher told of each arrival and
  departure. The scheduler keeps none of it; it is built on this view. Kept
  with an NVMe tier, changed by the tiers where they change `resident` and
  `loads` (and tell the eviction policy), by the data service (a read's size,
  a deletion) and the steps service (a client's write), each just before it
  reports the same to the scheduler. A tensor with a load in flight arrives in
  it when the load ends, whatever newer version was published meanwhile.

It does no work itself: it never allocates, reads, writes or blocks.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Callable

from infinity.daemon.arena import CpuSlice
from infinity.daemon.catalog import Key, Version
from infinity.daemon.scheduler.view import TensorResidency
from infinity.errors import InfinityError

Callback = Callable[[InfinityError | None], None]


@dataclass(eq=False, slots=True)
class Load:
    """A load of a version from NVMe into a fresh CPU slice (shared by every request for it)."""

    version: Version
    waiters: list[Callback]
    piece: CpuSlice | None = None
    # Started as a prefetch and nobody waits for it yet: its room may only come from tensors
    # needed later than it (the scheduler's rule), and it is dropped quietly if there is none.
    prefetch: bool = False


@dataclass(eq=False, slots=True)
class WriteBack:
    """A write of a dirty resident version to fresh NVMe extents."""

    version: Version
    edits: int  # the version's exclusive-lease count when it started: more means stale
    waiters: list[Callback]
    ahead: int = 0  # bytes it counts against nvme.write_behind_bytes (0 once it is an eviction)
    evicting: int = 0  # CPU bytes its eviction will free, once it is one
    sync_failures_before: int = 0  # `DiskCopy.sync_failures_before` of the copy it writes
    directory_failures_before: int = 0  # the tier's failed directories when it was submitted
    evict: bool = False  # chosen as a victim: the version is evicted once this write-back is done


@dataclass(slots=True)
class TierCounters:
    """Counters of the tiers' work, kept as it happens (read by `stats` and the monitor)."""

    segments_created: int = 0
    segment_failures: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    writebacks: int = 0
    writeback_bytes: int = 0
    writeback_failures: int = 0
    writebacks_stale: int = 0  # written in place while being written back: discarded
    reloads: int = 0
    reload_bytes: int = 0
    reload_failures: int = 0
    checksum_errors: int = 0
    prefetches: int = 0
    prefetch_bytes: int = 0
    prefetches_skipped: int = 0  # no room without evicting something needed sooner: not loaded
    load_waits: int = 0  # requests that joined a load already under way
    space_waits: int = 0  # allocations that waited for a segment or a write-back
    flushes: int = 0  # index transactions committed
    flushed_tensors: int = 0
    flushed_bytes: int = 0
    flush_failures: int = 0
    index_removals: int = 0
    disk_growths: int = 0
    stream_read_bytes: int = 0
    stream_write_bytes: int = 0


class Candidates(Mapping[Key, int]):
    """The tensors that may be evicted now, as a live map key -> CPU bytes freed.

    Membership is O(1); iteration walks the resident tensors (policies that keep
    their own order should test membership instead).
    """

    def __init__(self, residency: Residency) -> None:
        self._residency = residency

    def _evictable(self, version: Version) -> bool:
        # A resident version's only I/O may be its own write-back; one written back ahead of
        # need may still be chosen (it is then evicted once written), one already chosen may not.
        if version.shared or version.exclusive or version.cpu is None:
            return False
        residency = self._residency
        writebacks = residency.writebacks
        writeback = writebacks.get(version) if writebacks else None
        if writeback is not None and writeback.evict:
            return False
        loads = residency.loads
        if loads and version in loads:
            return False
        return not version.dirty or writeback is not None or residency.write_error is None

    def __getitem__(self, key: Key) -> int:
        version = self._residency.resident.get(key)
        if version is None or not self._evictable(version):
            raise KeyError(key)
        assert version.cpu is not None
        return version.cpu.length

    def __contains__(self, key: object) -> bool:
        version = self._residency.resident.get(key)  # type: ignore[call-overload]
        return version is not None and self._evictable(version)

    def __iter__(self) -> Iterator[Key]:
        return iter([key for key, version in self._residency.resident.items()
                     if self._evictable(version)])

    def __len__(self) -> int:
        return sum(1 for _ in self)


class Residency:
    """Where each current version is (CPU tier or not) and what I/O is on it. Loop thread only."""

    def __init__(self) -> None:
        self.resident: dict[Key, Version] = {}  # current versions in the CPU tier (with NVMe only)
        # Bytes of the resident versions that are dirty (no clean NVMe copy), kept as versions
        # come, go and change (`set_dirty`), for the telemetry: never summed by a walk.
        self.dirty_bytes = 0
        self.loads: dict[Version, Load] = {}
        self.writebacks: dict[Version, WriteBack] = {}
        # The last write-back failed (no NVMe room, or an I/O error): dirty tensors are not
        # chosen as victims until NVMe space is freed or a write-back succeeds, so a failing
        # disk is not retried in a loop; requests get this error instead.
        self.write_error: InfinityError | None = None
        self.candidates = Candidates(self)
        self.tensors = TensorResidency()  # by tensor, for the scheduler (with NVMe only)

    def is_pinned(self, key: Key) -> bool:
        """Whether the name's resident version may not be evicted now (the scheduler asks)."""
        return key not in self.candidates

    def busy(self, version: Version) -> bool:
        """Whether I/O (a load or a write-back) is on the version: it is neither freed nor
        evicted until that ends."""
        return version in self.loads or version in self.writebacks

    def place(self, version: Version) -> Version | None:
        """`version` is its name's current version and in the CPU tier; returns the version of
        the name that was there before, if another. (`Eviction.published` does the same
        inline, on every commit.)"""
        replaced = self.resident.get(version.key)
        self.resident[version.key] = version
        if replaced is version:
            return None
        self.dirty_bytes += (version.nbytes if version.dirty else 0) - (
            replaced.nbytes if replaced is not None and replaced.dirty else 0)
        return replaced

    def displace(self, version: Version) -> bool:
        """`version` left the CPU tier or stopped being current; whether it was resident."""
        if self.resident.get(version.key) is version:
            del self.resident[version.key]
            if version.dirty:
                self.dirty_bytes -= version.nbytes
            return True
        return False

    def set_dirty(self, version: Version, dirty: bool) -> None:
        """Every change of `version.dirty` after it is installed goes through here."""
        if version.dirty != dirty and self.resident.get(version.key) is version:
            self.dirty_bytes += version.nbytes if dirty else -version.nbytes
        version.dirty = dirty

    def is_resident(self, version: Version) -> bool:
        return self.resident.get(version.key) is version
