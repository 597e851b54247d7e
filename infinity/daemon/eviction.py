"""Eviction and write-behind: making room in the CPU tier by moving tensors to NVMe (`Eviction`).

The eviction policy (`infinity.daemon.policy`, or the scheduler's) picks
victims among the tensors that may go (`Residency.candidates`); clean ones are
dropped at once, dirty ones are written back first (the engine writes straight
from the shared segment) and evicted when their write-back ends. Up to
`nvme.write_behind_bytes` more of the coldest dirty tensors are written back
ahead, so that later evictions find clean victims. A tensor larger than a
segment needs whole segments emptied (`_empty_segments_for`).

It also keeps the policy and `Residency.tensors` (the scheduler's view) told
of residency changes (`published`, `unpublished`, `touched`, evictions), the
policy first, and owns the write-backs (`Residency.writebacks`),
which flushes (`infinity.daemon.durability`) join through `write_back`.
Loop thread only; nothing here blocks.
"""

from __future__ import annotations

import functools
import logging
import time

from infinity.config import InfinityConfig
from infinity.daemon.arena import CpuSlice, SpaceShortage
from infinity.daemon.catalog import Key, Version, clear_placement
from infinity.daemon.diskcopy import DiskCopy
from infinity.daemon.growth import TierSpace
from infinity.daemon.policy import EvictionPolicy
from infinity.daemon.residency import Callback, Residency, TierCounters, WriteBack
from infinity.daemon.scheduler import Scheduler
from infinity.daemon.scheduler.eviction import later
from infinity.errors import InfinityError, IOEngineError, LeaseError, TierFullError
from infinity.store.nvme import GrowthNeeded, NvmeWrite, TensorLayout

log = logging.getLogger("infinityd.tiers")

_FREED, _PENDING, _NOTHING, _RETRY = "freed", "pending", "nothing", "retry"
_NO_SEGMENT = "no segment"  # a tensor over a segment's size, and no segment can be emptied


def stale_error(version: Version) -> LeaseError:
    return LeaseError(
        f"tensor {version.key[1]!r} in namespace {version.key[0]!r} was leased exclusively "
        f"while it was written to NVMe; flush again once the lease ends")


class Eviction:
    """Victims, evictions and write-backs of the CPU tier. Loop thread only."""

    def __init__(self, config: InfinityConfig, space: TierSpace, residency: Residency,
                 counters: TierCounters, policy: EvictionPolicy, *,
                 scheduler: Scheduler | None) -> None:
        self.config = config
        self.space = space
        self.arena = space.arena
        self.nvme = space.nvme
        self.residency = residency
        self.tensors = residency.tensors
        self.counters = counters
        self.policy = policy
        self.scheduler = scheduler
        self.evicting = 0  # write-backs whose version is evicted once written
        self._evicting_bytes = 0  # the CPU bytes those will free
        self.write_behind_bytes = 0  # bytes being written back ahead of need

    # --- residency changes, told to the policy ----------------------------------------------

    def published(self, version: Version) -> None:
        """`version` just became its name's current version (the catalog's hook)."""
        # On every commit: `TierSpace.born` and `Residency.place` written out, saving two calls.
        space = self.space
        space.num_versions += 1
        space.version_bytes += version.nbytes
        if self.nvme is not None and version.cpu is not None and version.nbytes:
            resident = self.residency.resident
            replaced = resident.get(version.key)
            tensors = self.tensors
            if replaced is not None and replaced is not version:
                if replaced.dirty:
                    self.residency.dirty_bytes -= replaced.nbytes
                # The version it replaces leaves the tier as far as the policy goes: a prefetch
                # of it that nobody read was wasted, and a read of the new one is no hit of it.
                self.policy.forget(version.key)
                tensors.drop(version.key)
            if replaced is not version and version.dirty:
                self.residency.dirty_bytes += version.nbytes
            resident[version.key] = version
            self.policy.touched(version.key, version.nbytes)
            tensors.make_resident(version.key, version.nbytes)

    def unpublished(self, version: Version) -> None:
        """`version` is no longer current (the catalog's hook)."""
        if self.nvme is not None and self.residency.displace(version):
            self.policy.forget(version.key)
            self.tensors.drop(version.key)

    def written(self, version: Version) -> None:
        """An exclusive lease that was handed out ended: the NVMe copy is stale (the catalog's hook)."""
        self.residency.set_dirty(version, True)
        self.space.drop_copy(version)

    def touched(self, version: Version) -> None:
        """A resident version was used (the policy's recency; with a scheduler, the server
        reports gets to the scheduler itself)."""
        self.policy.touched(version.key, version.nbytes)
        if self.nvme is not None:
            self.tensors.make_resident(version.key, version.nbytes)

    # --- allocation with eviction -------------------------------------------------------------

    def allocate(self, nbytes: int, *, what: str, segment_class: str | None = None) -> CpuSlice:
        """A fresh CPU slice for a reservation, its 4 KiB padding zeroed (it is written to
        NVMe with the tensor). Raises SpaceShortage: wait with `when_space`, then retry."""
        piece = self.allocate_slice(nbytes, what=what, segment_class=segment_class)
        self.space.zero_padding(piece, nbytes)
        return piece

    def allocate_slice(self, nbytes: int, *, what: str, prefetch_of: Key | None = None,
                       segment_class: str | None = None) -> CpuSlice:
        """A CPU slice of `nbytes` (> 0), evicting if the tier is full.

        Raises TooLargeError (more than the whole tier), TierFullError or the NVMe tier's
        StoreFullError / DiskFullError (nothing can be evicted), or SpaceShortage: a segment
        is being created or victims are being written back; `when_space` says when to retry.
        `prefetch_of`: the room is for prefetching this tensor, so only tensors needed later
        than it may go (TierFullError if there are not enough).
        """
        arena = self.arena
        while True:
            try:
                return arena.allocate(nbytes, what=what, segment_class=segment_class)
            except SpaceShortage as shortage:
                if self.space.start_growth(shortage):
                    raise
                full: InfinityError = self.space.tier_full(nbytes, what)
            except TierFullError as exc:
                # Kept without its traceback: that holds this frame, which holds `full`, a
                # reference cycle per full tier that only the daemon's rare full collections
                # free (the soak's small tier made ~10 a second).
                full = exc.with_traceback(None)
            if self.nvme is None:
                try:
                    raise full
                finally:
                    del full  # raised from here, it would hold this frame again
            outcome = self._evict_for(nbytes, prefetch_of=prefetch_of,
                                      segment_class=segment_class)
            if outcome in (_FREED, _RETRY):
                continue
            if outcome == _PENDING:
                raise SpaceShortage(nbytes, dedicated=False)
            error = self.residency.write_error
            if error is not None and any(v.dirty for v in self.residency.resident.values()):
                raise type(error)(
                    f"the CPU tier is full and its dirty tensors cannot be written back to make "
                    f"room for {what}: {error}")
            if outcome == _NO_SEGMENT:
                raise TierFullError(
                    f"{what} needs {nbytes} bytes, more than half a CPU-tier segment "
                    f"(cpu.segment_bytes={self.arena.config.segment_bytes}), so it needs a "
                    f"segment of its own, and every segment that would make the budget for one "
                    f"holds a leased or busy slice, or a spare that a client keeps for its next "
                    f"put (given back unused after daemon.client_timeout_s / 2); release leases, "
                    f"or raise cpu.budget_bytes or cpu.segment_bytes")
            raise self.space.tier_full(nbytes, what)

    # --- choosing victims ---------------------------------------------------------------------

    def _evict_for(self, nbytes: int, *, prefetch_of: Key | None = None,
                   segment_class: str | None = None) -> str:
        """Free CPU space for an allocation of `nbytes`: _FREED (retry now), _PENDING (victims
        are being written back: wait for `when_space`), _RETRY (a write-back failed at once:
        choose again without dirty victims) or _NOTHING (nothing may go)."""
        if self.arena.segment_bytes_to_empty(nbytes):
            # Victims chosen tensor by tensor free bytes all over the segments, and a tensor
            # larger than a segment needs whole segments emptied to make the budget for its
            # own: it could evict the whole tier and still not fit. A prefetch empties only
            # segments whose every tensor is needed after the prefetched one.
            if prefetch_of is None:
                return self._empty_segments_for(nbytes, segment_class)
            if self.scheduler is None:
                return _NOTHING
            return self._empty_segments_for(nbytes, segment_class,
                                            later_than_s=self.scheduler.next_use_s(prefetch_of))
        residency = self.residency
        candidates = residency.candidates
        ahead = self.config.nvme.write_behind_bytes
        error_before = residency.write_error
        wanted = nbytes
        victims: list[Key] | None
        if prefetch_of is not None and self.scheduler is not None:
            free = self.arena.budget_bytes - self.arena.used_bytes
            victims = self.scheduler.victims_for_prefetch(
                prefetch_of, candidates, nbytes - free if 0 < free < nbytes else nbytes,
                nbytes=nbytes)
            if victims is None:
                return _NOTHING  # everything that could go is needed before the prefetched tensor
            ahead = 0
        else:
            # Allocations waiting at once (several puts into a full tier) would each choose
            # victims for their whole size, though the write-backs the first ones started
            # free room for the later ones too.
            unclaimed = self._evicting_bytes - self.space.awaited_bytes
            if unclaimed >= nbytes:
                self.space.awaited_bytes += nbytes
                return _PENDING
            nbytes -= max(0, unclaimed)
            victims = self.policy.choose_victims(candidates, nbytes + ahead)
        freed = False
        covered = 0
        writebacks = residency.writebacks
        for key in victims:
            version = residency.resident.get(key)
            if version is None or key not in candidates:
                continue  # the policy named something that may not go now
            assert version.cpu is not None
            if covered < nbytes:
                covered += version.cpu.length
                freed = self.let_go(version) or freed
            elif (version.dirty and version not in writebacks
                  and self.write_behind_bytes < ahead):
                self.write_back(version, evict=False, ahead=True)
        if freed:
            return _FREED
        if self.evicting:
            # A write-back in flight will evict and wake the waiters.
            self.space.awaited_bytes += wanted
            return _PENDING
        if residency.write_error is not None and error_before is None:
            return _RETRY
        being_read = self._bytes_being_read() if prefetch_of is None else 0
        free = self.arena.budget_bytes - self.arena.used_bytes
        if being_read and free + covered + being_read >= wanted:
            # Slices being read into from NVMe (prefetches, mostly) may go once their reads end,
            # which wakes the waiters: wait for them rather than call a busy tier full (free
            # bytes count, though scattered: they may join a slice that goes).
            return _PENDING
        return _NOTHING

    def _bytes_being_read(self) -> int:
        return sum(load.piece.length for load in self.residency.loads.values()
                   if load.piece is not None)

    def _empty_segments_for(self, nbytes: int, segment_class: str | None, *,
                            later_than_s: float | None = None) -> str:
        """Evict every tensor of the fewest-used segments whose bytes all belong to
        tensors that may go (or are going), until retiring them makes the budget for the
        dedicated segment of an allocation of `nbytes`: _FREED, _PENDING (dirty ones are
        written back first), or _NO_SEGMENT, evicting nothing, if those cannot make it.
        One segment that can hold the tensor alone once emptied (`segments_to_hold`) is
        enough, and goes first: it changes kind, no segment is retired or created.
        `later_than_s` (a prefetch's): only tensors whose next use is later than that may go."""
        short = self.arena.segment_bytes_to_empty(nbytes)
        residency = self.residency
        candidates = residency.candidates
        scheduler = self.scheduler
        going: dict[int, int] = {}  # segment -> bytes of its tensors that may go or are going
        members: dict[int, list[Version]] = {}
        for key, version in residency.resident.items():
            piece = version.cpu
            if piece is None:
                continue
            if key in candidates and (later_than_s is None or scheduler is None
                                      or later(scheduler.next_use_s(key), later_than_s)):
                members.setdefault(piece.segment, []).append(version)
            else:
                writeback = residency.writebacks.get(version)
                if (writeback is None or not writeback.evict or version.shared
                        or version.exclusive):
                    continue  # one leased since it was chosen stays when its write-back ends
            going[piece.segment] = going.get(piece.segment, 0) + piece.length
        # Slices being read into from NVMe hold their segments only until the read ends.
        reading: dict[int, int] = {}
        for load in residency.loads.values():
            if load.piece is not None:
                reading[load.piece.segment] = reading.get(load.piece.segment, 0) + load.piece.length
        chosen: list[int] = []
        made = after_reads = 0
        in_use = sorted(self.arena.segments_in_use(), key=lambda s: s[2])
        holders = self.arena.segments_to_hold(nbytes, segment_class)
        alone = [s for s in in_use if s[0] in holders and going.get(s[0], 0) == s[2]]
        if alone:  # emptied, it changes kind: no budget to make, the loop below adds nothing
            chosen.append(alone[0][0])
            made = short
        for segment, size, used in in_use:
            if made >= short:
                break
            if going.get(segment, 0) == used:
                chosen.append(segment)
                made += size
            elif going.get(segment, 0) + reading.get(segment, 0) == used:
                after_reads += size
        if made < short:
            if later_than_s is not None:
                return _NOTHING  # a prefetch waits for nothing: it is skipped (and asked again)
            # Where segments busy with reads would make it, wait for them (a load's end wakes
            # the waiters) rather than fail.
            if made + after_reads >= short:
                return _PENDING
            return _PENDING if self.space.spares_in_the_way() else _NO_SEGMENT
        freed = False
        for segment in chosen:
            for version in members.get(segment, []):
                freed = self.let_go(version) or freed
        if freed:
            return _FREED
        return _PENDING if self.evicting else _NOTHING

    def let_go(self, version: Version) -> bool:
        """Evict a victim: now if it is clean (True), else once its write-back ends."""
        if version.dirty or version in self.residency.writebacks:
            self.write_back(version, evict=True)
            return False
        self._evict(version)
        return True

    def _evict(self, version: Version) -> None:
        assert version.cpu is not None and not version.dirty
        self.arena.free(version.cpu)
        self.counters.evictions += 1
        self.counters.evicted_bytes += version.nbytes
        version.cpu = None
        clear_placement(version)
        self.residency.displace(version)
        self.policy.forget(version.key)
        self.tensors.drop(version.key)
        self.space.wake_space()

    # --- write-back ---------------------------------------------------------------------------

    def write_back(self, version: Version, *, evict: bool, ahead: bool = False,
                   waiter: Callback | None = None) -> None:
        """Write a dirty resident version to fresh extents (joining a write-back under way).
        evict: free its CPU slice once written; ahead: written ahead of need (write-behind)."""
        writebacks = self.residency.writebacks
        wb = writebacks.get(version)
        if wb is not None and wb.edits != version.edits and waiter is not None:
            # The one under way copies bytes from before an in-place edit and will be dropped:
            # the waiter (a flush) gets a write-back of the bytes there now, once it ends.
            wb.waiters.append(functools.partial(self._after_stale_write_back, version, waiter))
            waiter = None
        fresh = wb is None
        if wb is None:
            wb = writebacks[version] = WriteBack(version, version.edits, [])
            if ahead:
                wb.ahead = version.nbytes
                self.write_behind_bytes += wb.ahead
        if evict and not wb.evict:
            wb.evict = True
            self.evicting += 1
            assert version.cpu is not None
            wb.evicting = version.cpu.length
            self._evicting_bytes += wb.evicting
            self.write_behind_bytes -= wb.ahead  # needed now, no longer ahead
            wb.ahead = 0
        if waiter is not None:
            wb.waiters.append(waiter)
        if fresh:
            self._submit_write_back(wb)

    def _submit_write_back(self, wb: WriteBack) -> None:
        version = wb.version
        nvme = self.nvme
        assert nvme is not None
        if self.space.closing:
            self._wrote_back(wb, None, IOEngineError("infinityd is stopping; nothing more is "
                                                     "written to NVMe"))
            return
        if version.cpu is None or version.edits != wb.edits:
            # Leased exclusively while waiting for the store file to grow: not settled now.
            self._wrote_back(wb, None, stale_error(version))
            return
        wb.directory_failures_before = nvme.failed_directories
        try:
            layout = nvme.allocate(version.nbytes, grow=False)
        except GrowthNeeded as need:
            self.space.grow_disk(need.index, need.nbytes, lambda error: (
                self._submit_write_back(wb) if error is None else self._write_failed(wb, error)))
            return
        except InfinityError as exc:
            self._wrote_back(wb, None, exc)
            return
        wb.sync_failures_before = nvme.sync_failures
        try:
            write = nvme.write_from(self.arena.address_of(version.cpu), version.nbytes,
                                    layout=layout)
        except InfinityError as exc:
            nvme.free(layout)
            self._wrote_back(wb, None, exc)
            return
        write.future.add_done_callback(lambda _: self._write_done(wb, write, layout))

    def _after_stale_write_back(self, version: Version, waiter: Callback,
                                error: InfinityError | None) -> None:
        if version.exclusive:
            waiter(stale_error(version))  # being written in place again: not settled
        elif version.nvme is not None and not version.dirty:
            waiter(None)  # written back since, as it is now
        elif version.cpu is not None:
            self.write_back(version, evict=False, waiter=waiter)
        else:
            waiter(error or InfinityError(f"tensor {version.key[1]!r} has no bytes anywhere "
                                          f"(internal error); see infinityd's log"))

    def _write_done(self, wb: WriteBack, write: NvmeWrite, layout: TensorLayout) -> None:
        try:
            final = write.result()
        except InfinityError as exc:
            assert self.nvme is not None
            self.nvme.free(layout)
            self._write_failed(wb, exc)
            return
        self._wrote_back(wb, final, None)

    def _write_failed(self, wb: WriteBack, error: InfinityError) -> None:
        """A write-back that failed because a store directory failed meanwhile (read-only, or
        its device) is written again at once, to the directories left, as one that found a
        file system full goes to another directory: only the first write to a failed
        directory, or none, fails for it. (Each retry needs another directory to fail: at
        most one per directory.)"""
        nvme = self.nvme
        assert nvme is not None
        if (wb.directory_failures_before < nvme.failed_directories < len(nvme.directories)
                and not self.space.closing):
            log.warning("write-back of %r in %r goes to the store directories left: %s",
                        wb.version.key[1], wb.version.key[0], error)
            self._submit_write_back(wb)
            return
        self._wrote_back(wb, None, error)

    def _wrote_back(self, wb: WriteBack, layout: TensorLayout | None,
                    error: InfinityError | None) -> None:
        version = wb.version
        residency = self.residency
        del residency.writebacks[version]
        evict = wb.evict
        if evict:
            self.evicting -= 1
            self._evicting_bytes -= wb.evicting
        self.write_behind_bytes -= wb.ahead
        counters = self.counters
        if layout is not None:
            if version.edits != wb.edits:
                # Leased exclusively while the engine read it: the copy may be torn. Drop it.
                self.space.free_disk(layout)
                counters.writebacks_stale += 1
                error = stale_error(version)
            else:
                version.nvme = DiskCopy(layout, edits=wb.edits,
                                        sync_failures_before=wb.sync_failures_before)
                residency.set_dirty(version, False)
                counters.writebacks += 1
                counters.writeback_bytes += version.nbytes
                residency.write_error = None
                if self.scheduler is not None:
                    self.scheduler.written_back(version.key, version.nbytes, time.monotonic())
        if layout is None and error is not None:
            counters.writeback_failures += 1
            if not isinstance(error, LeaseError):
                residency.write_error = error
            log.warning("write-back of %r in %r failed: %s", version.key[1], version.key[0], error)
        if (evict and not version.dirty and version.cpu is not None and not version.shared
                and not version.exclusive and version not in residency.loads
                and residency.is_resident(version)):
            self._evict(version)
        for waiter in wb.waiters:
            waiter(error)
        self.space.settle(version)
        # Space waiters retry: the victim is gone, or they must pick another (this one failed).
        self.space.retry_waiters()
