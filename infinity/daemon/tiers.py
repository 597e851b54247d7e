"""The tier manager: where each version's bytes live (CPU tier, NVMe, or both), and moving them.

It owns, for infinityd:

- the CPU tier's growth (segments created on a worker thread) and its slices;
- eviction: the policy (`infinity.daemon.policy`) picks victims among the
  tensors that may go; clean ones are dropped at once, dirty ones are written
  back first (the engine writes straight from the shared segment), and up to
  `nvme.write_behind_bytes` more of the coldest dirty tensors are written back
  ahead, so that later evictions find clean victims;
- loads: a tensor that is only on NVMe is read by the engine straight into a
  fresh slice of a shared segment, CRC32C verified; concurrent requests for it
  share one load (`ensure_resident`, `prefetch`);
- durability: `make_durable` writes back what is dirty, then one `DurableIndex`
  transaction (fdatasync first, on the index's thread) points the names at
  their new extents; replaced extents are freed only after that commit. A
  copy written before a failed fdatasync is never published (Linux reports
  such a failure once): resident versions are written anew instead;
  Deletes remove the name from the index the same way; `restore` rebuilds the
  catalog from the index at start;
- the counters of all of that, kept as it happens.

It implements the catalog's `Storage` hooks, so it hears of every version
that is published, replaced, leased exclusively, written in place or freed.
Everything runs on the loop thread and nothing here blocks: I/O completes on
the engine's threads and comes back through its completion fd, SQLite through
the index's. It knows nothing of sockets or sessions: callers pass callbacks,
which run on the loop thread with None or the typed error.

Invariants:
- a version with a lease, I/O in flight (`pins`) or a stream on it is never
  evicted; a version being written back is not evicted before the write ends;
- an NVMe copy (`DiskCopy`) is immutable once written; its extents are freed
  only when no version owns it, the index does not point at it, and no index
  transaction that would point at it is in flight;
- index updates for one name are issued in version order, and one issued for
  an older version after a newer update (or a delete) was issued is skipped,
  so the index never goes back in time.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Sequence

from infinity.config import InfinityConfig
from infinity.daemon.arena import (ALIGNMENT_BYTES, CpuArena, CpuSlice, Segment, SegmentPlan,
                                   SpaceShortage, create_segment, shmem_hugepages_allowed)
from infinity.daemon.catalog import Catalog, Key, Version, clear_placement, set_placement
from infinity.daemon.loop import EventLoop
from infinity.daemon.policy import EvictionPolicy, default_policy
from infinity.daemon.scheduler import Scheduler
from infinity.errors import (ChecksumError, InfinityError, InvalidRequestError, IOEngineError,
                             LeaseError, StoreDirectoryError, TierFullError, TooLargeError)
from infinity.io import IOEngine, IOFuture, probe_shared_memory_collapse
from infinity.protocol import dtypes
from infinity.store.durable import DurableIndex, DurableRecord
from infinity.store.nvme import GrowthNeeded, NvmeTier, NvmeWrite, TensorLayout

log = logging.getLogger("infinityd.tiers")

Callback = Callable[[InfinityError | None], None]


@dataclass(eq=False, slots=True)
class DiskCopy:
    """One tensor's bytes on NVMe: written once, never modified, freed when nothing refers to it."""

    layout: TensorLayout
    owned: bool = True  # the clean copy of a live version
    indexed: bool = False  # the durable index points its name at it
    publishing: int = 0  # index transactions in flight (or about to be) that will point at it
    # The version's `edits` when these bytes were read from it: of two copies of one version
    # (written in place between them), the index must end at the later one.
    edits: int = 0
    indexed_order: tuple[int, int] = (0, 0)  # (stamp, edits) of the index row pointing here
    # The NVMe tier's `sync_failures` when these bytes began to be written: if an fdatasync
    # failed since, they may never reach the disk, and only a fresh copy can be made durable.
    sync_failures_before: int = 0


@dataclass(eq=False, slots=True)
class _Load:
    version: Version
    waiters: list[Callback]
    piece: CpuSlice | None = None
    # Started as a prefetch and nobody waits for it yet: its room may only come from tensors
    # needed later than it (the scheduler's rule), and it is dropped quietly if there is none.
    prefetch: bool = False


@dataclass(eq=False, slots=True)
class _WriteBack:
    version: Version
    edits: int  # the version's exclusive-lease count when it started: more means stale
    waiters: list[Callback]
    ahead: int = 0  # bytes it counts against nvme.write_behind_bytes (0 once it is an eviction)
    evicting: int = 0  # CPU bytes its eviction will free, once it is one
    sync_failures_before: int = 0  # `DiskCopy.sync_failures_before` of the copy it writes


@dataclass(eq=False, slots=True)
class _Flush:
    """A make_durable request: write-backs to wait for, then one index transaction."""

    versions: list[Version]
    errors: list[InfinityError | None]
    done: Callable[[list[InfinityError | None]], None]
    ready: list[tuple[int, Version, DiskCopy]] = field(default_factory=list)
    waiting: int = 0


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


class _Candidates(Mapping[Key, int]):
    """The tensors that may be evicted now, as a live map key -> CPU bytes freed.

    Membership is O(1); iteration walks the resident tensors (policies that keep
    their own order should test membership instead).
    """

    def __init__(self, tiers: TierManager) -> None:
        self._tiers = tiers

    def _evictable(self, version: Version) -> bool:
        # A resident version's only pin is its own write-back; one written back ahead of need
        # may still be chosen (it is then evicted once written), one already chosen may not.
        if version.shared or version.exclusive or version.cpu is None or version.evict_when_clean:
            return False
        if version.pins != (1 if version.writeback is not None else 0):
            return False
        return not version.dirty or version.writeback is not None or self._tiers.write_error is None

    def __getitem__(self, key: Key) -> int:
        version = self._tiers.resident.get(key)
        if version is None or not self._evictable(version):
            raise KeyError(key)
        assert version.cpu is not None
        return version.cpu.length

    def __contains__(self, key: object) -> bool:
        version = self._tiers.resident.get(key)  # type: ignore[call-overload]
        return version is not None and self._evictable(version)

    def __iter__(self) -> Iterator[Key]:
        return iter([key for key, version in self._tiers.resident.items()
                     if self._evictable(version)])

    def __len__(self) -> int:
        return sum(1 for _ in self)


_FREED, _PENDING, _NOTHING, _RETRY = "freed", "pending", "nothing", "retry"
_NO_SEGMENT = "no segment"  # a tensor over a segment's size, and no segment can be emptied


def staged_wanted(config: InfinityConfig, setting: str) -> bool:
    """Whether a direction of NVMe I/O goes through the engine's staging memory, by its setting
    (nvme.staged_reads, nvme.staged_writes); auto: when the CPU tier's shared memory cannot get
    huge pages (on request or by MADV_COLLAPSE), so that direct I/O scatters."""
    if setting != "auto":
        return setting == "on"
    collapsed = config.cpu.prefault and probe_shared_memory_collapse()[0]  # see create_segment
    return not (config.cpu.hugepages and (shmem_hugepages_allowed() or collapsed))


def void(_: object) -> None:
    """Drop a result (poll() returns counts the loop has no use for)."""


class TierManager:
    """The CPU tier and the NVMe tier under one set of rules. Loop thread only."""

    def __init__(self, config: InfinityConfig, loop: EventLoop, arena: CpuArena, *,
                 scheduler: Scheduler | None = None) -> None:
        self.config = config
        self.loop = loop
        self.arena = arena
        # With a scheduler, it is the eviction policy and hears of every load and write-back.
        self.scheduler = scheduler
        self.policy: EvictionPolicy = scheduler.policy if scheduler is not None else default_policy()
        # Called after anything that can change what the scheduler would prefetch (a load
        # finished, a tensor left the tier, space was freed); the daemon plans on its next turn.
        self.on_change: Callable[[], None] = lambda: None
        self.catalog: Catalog | None = None  # set by attach(): the catalog is built on top of us
        self.engine: IOEngine | None = None
        self.nvme: NvmeTier | None = None
        self.index: DurableIndex | None = None
        self.counters = TierCounters()
        self.resident: dict[Key, Version] = {}  # current versions in the CPU tier (with NVMe only)
        self.candidates = _Candidates(self)
        # The last write-back failed (no NVMe room, or an I/O error): dirty tensors are not
        # chosen as victims until NVMe space is freed or a write-back succeeds, so a failing
        # disk is not retried in a loop; requests get this error instead.
        self.write_error: InfinityError | None = None
        self._space_waiters: list[Callback] = []
        self._wake_scheduled = False
        self._evicting = 0  # write-backs whose version is evicted once written
        self._evicting_bytes = 0  # the CPU bytes those will free
        # Bytes of allocations that have waited for those evictions since the waiters last
        # retried: what is being evicted beyond them is room nobody waits for yet.
        self._awaited_bytes = 0
        self._write_behind_bytes = 0  # bytes being written back ahead of need
        self._disk_growth: dict[int, list[Callback]] = {}
        self._indexed: dict[Key, DiskCopy] = {}  # what the committed index says, name by name
        # Flushes overtaken by a newer transaction about their name, still on its way to the
        # index: each learns that transaction's outcome (`_index_done`).
        self._index_waiters: dict[Key, list[Callable[[InfinityError | None], None]]] = {}
        # The order of the last delete of each name whose ordering is still kept: no flush of
        # a version older than it may reach the index, whatever becomes of later updates.
        self._delete_marks: dict[Key, tuple[int, int]] = {}
        # (version stamp, edits) of the last index update issued per name; a delete takes a
        # fresh stamp, so it orders after every version before it.
        self._index_issued: dict[Key, tuple[int, int]] = {}
        self._index_pending: dict[Key, int] = {}  # index transactions in flight, per name
        self._flushing: dict[Key, int] = {}  # make_durable jobs not yet at their transaction
        self._closing = False
        if config.nvme.dirs:
            self._open_nvme()

    def _open_nvme(self) -> None:
        engine = IOEngine.from_config(self.config.io)
        nvme: NvmeTier | None = None
        try:
            config = self.config
            nvme = NvmeTier(config.nvme, engine,
                            staged_reads=staged_wanted(config, config.nvme.staged_reads),
                            staged_writes=staged_wanted(config, config.nvme.staged_writes))
            self.index = DurableIndex(nvme)
        except BaseException:
            if nvme is not None:
                nvme.close()
            engine.close()
            raise
        self.engine, self.nvme = engine, nvme
        index = self.index
        self.loop.add_reader(engine.completion_fd, lambda: void(engine.poll()))
        self.loop.add_reader(index.completion_fd, lambda: void(index.poll()))
        log.info("NVMe tier: %s (engine %s%s); index %s",
                 ", ".join(f"{d['path']} ({d['mode']})" for d in nvme.describe()), engine.backend,
                 f": {engine.backend_note}" if engine.backend_note else "", self.index.path)

    def attach(self, catalog: Catalog) -> None:
        self.catalog = catalog

    @property
    def _catalog(self) -> Catalog:
        assert self.catalog is not None, "TierManager.attach(catalog) was not called"
        return self.catalog

    @property
    def durable(self) -> bool:
        """Whether this daemon has an NVMe tier, hence durable writes."""
        return self.index is not None

    def require_durable(self) -> None:
        if self.index is None:
            raise InvalidRequestError(
                "this infinityd has no NVMe tier (nvme.dirs is empty), so nothing can be made "
                "durable; set nvme.dirs to a directory on a local drive and restart infinityd")

    # --- the catalog's Storage hooks -------------------------------------------------

    def allocate(self, nbytes: int, *, what: str, segment_class: str | None = None) -> CpuSlice:
        """A fresh CPU slice for a reservation, its 4 KiB padding zeroed (it is written to
        NVMe with the tensor). Raises SpaceShortage: wait with `when_space`, then retry."""
        piece = self.allocate_slice(nbytes, what=what, segment_class=segment_class)
        self._zero_padding(piece, nbytes)
        return piece

    def allocate_spare(self, nbytes: int, *, what: str,
                       segment_class: str | None = None) -> CpuSlice | None:
        if nbytes > self.arena.config.segment_bytes:
            return None  # it would need a dedicated segment of its own: growth
        if self._space_waiters:
            return None  # reserves and loads wait for room: theirs first
        arena = self.arena
        try:
            piece = arena.allocate(nbytes, what=what, segment_class=segment_class)
        except SpaceShortage as shortage:
            # Not now: a spare never waits. But where the budget allows another segment, start
            # it, so that the next put of the tensor finds room for its spare.
            self._start_growth(shortage)
            return None
        except (TierFullError, TooLargeError):
            return None  # only evicting would make room: a spare is not worth a tensor
        self._zero_padding(piece, nbytes)
        return piece

    def free(self, piece: CpuSlice) -> None:
        self.arena.free(piece)
        self._wake_space()

    def published(self, version: Version) -> None:
        if self.nvme is not None and version.cpu is not None and version.nbytes:
            replaced = self.resident.get(version.key)
            if replaced is not None and replaced is not version:
                # The version it replaces leaves the tier as far as the policy goes: a prefetch
                # of it that nobody read was wasted, and a read of the new one is no hit of it.
                self.policy.forget(version.key)
            self.resident[version.key] = version
            self.policy.touched(version.key, version.nbytes)

    def unpublished(self, version: Version) -> None:
        if self.nvme is not None and self.resident.get(version.key) is version:
            del self.resident[version.key]
            self.policy.forget(version.key)

    def leased_exclusively(self, version: Version) -> None:
        version.edits += 1  # a write-back under way no longer describes what will be there

    def written(self, version: Version) -> None:
        version.dirty = True
        self._drop_copy(version)

    def retire(self, version: Version) -> None:
        if version.cpu is not None:
            self.arena.free(version.cpu)
            version.cpu = None
            self._wake_space()
        self._drop_copy(version)

    def _drop_copy(self, version: Version) -> None:
        """The version's NVMe copy no longer describes it (written in place) or is no longer
        needed (retired): it goes back to the store."""
        copy = version.nvme
        if copy is not None:
            version.nvme = None
            copy.owned = False
            self._release_copy(copy)

    def touched(self, version: Version) -> None:
        """A resident version was used (the policy's recency; with a scheduler, the server
        reports gets to the scheduler itself)."""
        self.policy.touched(version.key, version.nbytes)

    # --- CPU space ---------------------------------------------------------------------

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
                if self._start_growth(shortage):
                    raise
                full: InfinityError = self._tier_full(nbytes, what)
            except TierFullError as exc:
                full = exc
            if self.nvme is None:
                raise full
            outcome = self._evict_for(nbytes, prefetch_of=prefetch_of)
            if outcome in (_FREED, _RETRY):
                continue
            if outcome == _PENDING:
                raise SpaceShortage(nbytes, dedicated=False)
            error = self.write_error
            if error is not None and any(v.dirty for v in self.resident.values()):
                raise type(error)(
                    f"the CPU tier is full and its dirty tensors cannot be written back to make "
                    f"room for {what}: {error}")
            if outcome == _NO_SEGMENT:
                raise TierFullError(
                    f"{what} needs {nbytes} bytes, more than a CPU-tier segment "
                    f"(cpu.segment_bytes={self.arena.config.segment_bytes}), so it needs a "
                    f"segment of its own, and every segment that would make the budget for one "
                    f"holds a leased or busy slice, or a spare that a client keeps for its next "
                    f"put (given back unused after daemon.client_timeout_s / 2); release leases, "
                    f"or raise cpu.budget_bytes or cpu.segment_bytes")
            raise self._tier_full(nbytes, what)

    def _start_growth(self, shortage: SpaceShortage) -> bool:
        """Whether the tier is growing now: already, or by a segment started for `shortage`
        (False: the budget has no room for it)."""
        arena = self.arena
        if arena.growing:
            return True
        plan = arena.plan_growth(shortage)
        if plan is None:
            return False
        self._grow_arena(plan)
        return True

    def _tier_full(self, nbytes: int, what: str) -> TierFullError:
        return TierFullError(
            f"the CPU tier is full: {self.arena.used_bytes} of {self.arena.budget_bytes} bytes are "
            f"in use{', by leased or busy tensors' if self.nvme is not None else ''}, and {what} "
            f"needs {nbytes} more; raise cpu.budget_bytes or delete tensors (or release leases)")

    def free_slice(self, piece: CpuSlice) -> None:
        self.arena.free(piece)
        self._wake_space()

    def address_of(self, piece: CpuSlice) -> int:
        return self.arena.address_of(piece)

    def zero(self, piece: CpuSlice, start: int, end: int) -> None:
        """Zero bytes [start, end) of a slice (padding only: never tensor bytes)."""
        if end > start:
            ctypes.memset(self.arena.address_of(piece) + start, 0, end - start)

    def _zero_padding(self, piece: CpuSlice, nbytes: int) -> None:
        # Slices are reused without clearing; what lies past the tensor goes to NVMe with it.
        end = -(-nbytes // ALIGNMENT_BYTES) * ALIGNMENT_BYTES
        self.zero(piece, nbytes, end)

    def when_space(self, callback: Callback) -> None:
        """Call `callback(None)` once CPU space may have been freed (retry then), or
        `callback(error)` if the tier's growth failed."""
        self.counters.space_waits += 1
        self._space_waiters.append(callback)

    def _wake_space(self) -> None:
        self.on_change()
        # Deferred to the next loop turn: this may run inside a catalog call, which a waiter
        # (a parked request) must not re-enter.
        if self._space_waiters and not self._wake_scheduled:
            self._wake_scheduled = True
            self.loop.call_soon_threadsafe(self._run_space_waiters)

    def _run_space_waiters(self, error: InfinityError | None = None) -> None:
        self._wake_scheduled = False
        self._awaited_bytes = 0  # each waiter that must wait again counts itself anew
        waiters, self._space_waiters = self._space_waiters, []
        for waiter in waiters:
            try:
                waiter(error)
            except Exception:
                log.exception("error in a request waiting for CPU-tier space")

    def _grow_arena(self, plan: SegmentPlan) -> None:
        config = self.config.cpu
        self.loop.run_in_worker(lambda: create_segment(plan, config),
                                lambda done: self._arena_grown(plan, done))

    def _arena_grown(self, plan: SegmentPlan, done: Future[Segment]) -> None:
        try:
            segment = done.result()
        except Exception as exc:
            self.arena.abandon(plan)
            self.counters.segment_failures += 1
            error = exc if isinstance(exc, InfinityError) else TierFullError(
                f"could not create a {plan.size_bytes}-byte CPU-tier segment "
                f"({type(exc).__name__}: {exc}); lower cpu.budget_bytes or free memory")
            log.error("CPU tier: %s", error)
            self._run_space_waiters(error)
            return
        if self._closing:
            segment.destroy()
            return
        self.arena.install(segment)
        self.counters.segments_created += 1
        self._run_space_waiters()
        if segment.dedicated:
            # Made for one tensor, whose request went with its client while the segment was
            # being created (or took another): empty, it would hold its budget forever.
            self.arena.retire_if_empty(segment.id)

    # --- eviction ------------------------------------------------------------------------

    def _evict_for(self, nbytes: int, *, prefetch_of: Key | None = None) -> str:
        """Free CPU space for an allocation of `nbytes`: _FREED (retry now), _PENDING (victims
        are being written back: wait for `when_space`), _RETRY (a write-back failed at once:
        choose again without dirty victims) or _NOTHING (nothing may go)."""
        if self.arena.segment_bytes_to_empty(nbytes):
            # Victims chosen tensor by tensor free bytes all over the segments, and a tensor
            # larger than a segment needs whole segments emptied to make the budget for its
            # own: it could evict the whole tier and still not fit.
            return _NOTHING if prefetch_of is not None else self._empty_segments_for(nbytes)
        ahead = self.config.nvme.write_behind_bytes
        error_before = self.write_error
        wanted = nbytes
        victims: list[Key] | None
        if prefetch_of is not None and self.scheduler is not None:
            free = self.arena.budget_bytes - self.arena.used_bytes
            victims = self.scheduler.victims_for_prefetch(
                prefetch_of, self.candidates, nbytes - free if 0 < free < nbytes else nbytes,
                nbytes=nbytes)
            if victims is None:
                return _NOTHING  # everything that could go is needed before the prefetched tensor
            ahead = 0
        else:
            # Allocations waiting at once (several puts into a full tier) would each choose
            # victims for their whole size, though the write-backs the first ones started
            # free room for the later ones too.
            unclaimed = self._evicting_bytes - self._awaited_bytes
            if unclaimed >= nbytes:
                self._awaited_bytes += nbytes
                return _PENDING
            nbytes -= max(0, unclaimed)
            victims = self.policy.choose_victims(self.candidates, nbytes + ahead)
        freed = False
        covered = 0
        for key in victims:
            version = self.resident.get(key)
            if version is None or key not in self.candidates:
                continue  # the policy named something that may not go now
            assert version.cpu is not None
            if covered < nbytes:
                covered += version.cpu.length
                freed = self._let_go(version) or freed
            elif version.dirty and version.writeback is None and self._write_behind_bytes < ahead:
                self._write_back(version, evict=False, ahead=True)
        if freed:
            return _FREED
        if self._evicting:
            self._awaited_bytes += wanted  # a write-back in flight will evict and wake the waiters
            return _PENDING
        if self.write_error is not None and error_before is None:
            return _RETRY
        return _NOTHING

    def _empty_segments_for(self, nbytes: int) -> str:
        """Evict every tensor of the fewest-used segments whose bytes all belong to
        tensors that may go (or are going), until retiring them makes the budget for the
        dedicated segment of an allocation of `nbytes`: _FREED, _PENDING (dirty ones are
        written back first), or _NO_SEGMENT, evicting nothing, if those cannot make it."""
        short = self.arena.segment_bytes_to_empty(nbytes)
        going: dict[int, int] = {}  # segment -> bytes of its tensors that may go or are going
        members: dict[int, list[Version]] = {}
        for key, version in self.resident.items():
            piece = version.cpu
            if piece is None:
                continue
            if key in self.candidates:
                members.setdefault(piece.segment, []).append(version)
            elif not version.evict_when_clean or version.shared or version.exclusive:
                continue  # one leased since it was chosen stays when its write-back ends
            going[piece.segment] = going.get(piece.segment, 0) + piece.length
        chosen: list[int] = []
        made = 0
        for segment, size, used in sorted(self.arena.segments_in_use(), key=lambda s: s[2]):
            if made >= short:
                break
            if going.get(segment, 0) == used:
                chosen.append(segment)
                made += size
        if made < short:
            return _NO_SEGMENT
        freed = False
        for segment in chosen:
            for version in members.get(segment, []):
                freed = self._let_go(version) or freed
        if freed:
            return _FREED
        return _PENDING if self._evicting else _NOTHING

    def _let_go(self, version: Version) -> bool:
        """Evict a victim: now if it is clean (True), else once its write-back ends."""
        if version.dirty or version.writeback is not None:
            self._write_back(version, evict=True)
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
        del self.resident[version.key]
        self.policy.forget(version.key)
        self._wake_space()

    # --- write-back ---------------------------------------------------------------------

    def _write_back(self, version: Version, *, evict: bool, ahead: bool = False,
                    waiter: Callback | None = None) -> None:
        """Write a dirty resident version to fresh extents (joining a write-back under way).
        evict: free its CPU slice once written; ahead: written ahead of need (write-behind)."""
        wb = version.writeback
        if wb is not None and wb.edits != version.edits and waiter is not None:
            # The one under way copies bytes from before an in-place edit and will be dropped:
            # the waiter (a flush) gets a write-back of the bytes there now, once it ends.
            wb.waiters.append(functools.partial(self._after_stale_write_back, version, waiter))
            waiter = None
        fresh = wb is None
        if wb is None:
            wb = version.writeback = _WriteBack(version, version.edits, [])
            version.pins += 1
            if ahead:
                wb.ahead = version.nbytes
                self._write_behind_bytes += wb.ahead
        if evict and not version.evict_when_clean:
            version.evict_when_clean = True
            self._evicting += 1
            assert version.cpu is not None
            wb.evicting = version.cpu.length
            self._evicting_bytes += wb.evicting
            self._write_behind_bytes -= wb.ahead  # needed now, no longer ahead
            wb.ahead = 0
        if waiter is not None:
            wb.waiters.append(waiter)
        if fresh:
            self._submit_write_back(wb)

    def _submit_write_back(self, wb: _WriteBack) -> None:
        version = wb.version
        nvme = self.nvme
        assert nvme is not None
        if self._closing:
            self._wrote_back(wb, None, IOEngineError("infinityd is stopping; nothing more is "
                                                     "written to NVMe"))
            return
        if version.cpu is None or version.edits != wb.edits:
            # Leased exclusively while waiting for the store file to grow: not settled now.
            self._wrote_back(wb, None, self._stale(version))
            return
        try:
            layout = nvme.allocate(version.nbytes, grow=False)
        except GrowthNeeded as need:
            self._grow_disk(need.index, need.nbytes, lambda error: (
                self._submit_write_back(wb) if error is None else self._wrote_back(wb, None, error)))
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
            waiter(self._stale(version))  # being written in place again: not settled
        elif version.nvme is not None and not version.dirty:
            waiter(None)  # written back since, as it is now
        elif version.cpu is not None:
            self._write_back(version, evict=False, waiter=waiter)
        else:
            waiter(error or InfinityError(f"tensor {version.key[1]!r} has no bytes anywhere "
                                          f"(internal error); see infinityd's log"))

    @staticmethod
    def _stale(version: Version) -> LeaseError:
        return LeaseError(
            f"tensor {version.key[1]!r} in namespace {version.key[0]!r} was leased exclusively "
            f"while it was written to NVMe; flush again once the lease ends")

    def _write_done(self, wb: _WriteBack, write: NvmeWrite, layout: TensorLayout) -> None:
        try:
            final = write.result()
        except InfinityError as exc:
            assert self.nvme is not None
            self.nvme.free(layout)
            self._wrote_back(wb, None, exc)
            return
        self._wrote_back(wb, final, None)

    def _wrote_back(self, wb: _WriteBack, layout: TensorLayout | None,
                    error: InfinityError | None) -> None:
        version = wb.version
        version.writeback = None
        version.pins -= 1
        evict = version.evict_when_clean
        if evict:
            version.evict_when_clean = False
            self._evicting -= 1
            self._evicting_bytes -= wb.evicting
        self._write_behind_bytes -= wb.ahead
        counters = self.counters
        if layout is not None:
            if version.edits != wb.edits:
                # Leased exclusively while the engine read it: the copy may be torn. Drop it.
                self.free_disk(layout)
                counters.writebacks_stale += 1
                error = self._stale(version)
            else:
                version.nvme = DiskCopy(layout, edits=wb.edits,
                                        sync_failures_before=wb.sync_failures_before)
                version.dirty = False
                counters.writebacks += 1
                counters.writeback_bytes += version.nbytes
                self.write_error = None
                if self.scheduler is not None:
                    self.scheduler.written_back(version.key, version.nbytes, time.monotonic())
        if layout is None and error is not None:
            counters.writeback_failures += 1
            if not isinstance(error, LeaseError):
                self.write_error = error
            log.warning("write-back of %r in %r failed: %s", version.key[1], version.key[0], error)
        if (evict and not version.dirty and version.cpu is not None and not version.shared
                and not version.exclusive and not version.pins
                and self.resident.get(version.key) is version):
            self._evict(version)
        for waiter in wb.waiters:
            waiter(error)
        self._catalog.unpinned(version)
        # Space waiters retry: the victim is gone, or they must pick another (this one failed).
        if self._space_waiters and not self._wake_scheduled:
            self._wake_scheduled = True
            self.loop.call_soon_threadsafe(self._run_space_waiters)

    # --- NVMe space ---------------------------------------------------------------------

    def _grow_disk(self, index: int, nbytes: int, then: Callback) -> None:
        """Grow directory `index`'s extent file on a worker thread; `then(error)` afterwards."""
        waiting = self._disk_growth.get(index)
        if waiting is not None:
            waiting.append(then)
            return
        self._disk_growth[index] = [then]
        nvme = self.nvme
        assert nvme is not None
        self.loop.run_in_worker(lambda: nvme.grow(index, nbytes),
                                lambda done: self._disk_grown(index, done))

    def _disk_grown(self, index: int, done: Future[bool]) -> None:
        waiters = self._disk_growth.pop(index, [])
        error: InfinityError | None = None
        try:
            done.result()
            self.counters.disk_growths += 1
            self.write_error = None
        except InfinityError as exc:
            error = exc
        except Exception as exc:
            error = StoreDirectoryError(f"growing the store file failed ({type(exc).__name__}: "
                                        f"{exc}); check the directory and the device")
        for waiter in waiters:
            waiter(error)

    def allocate_disk(self, nbytes: int, then: Callable[[TensorLayout | None, InfinityError | None], None]
                      ) -> None:
        """Extents for `nbytes` (growing the files off the loop when needed); `then(layout,
        None)` or `then(None, error)`, possibly at once."""
        nvme = self.nvme
        assert nvme is not None
        try:
            layout = nvme.allocate(nbytes, grow=False)
        except GrowthNeeded as need:
            self._grow_disk(need.index, need.nbytes, lambda error: (
                self.allocate_disk(nbytes, then) if error is None else then(None, error)))
            return
        except InfinityError as exc:
            then(None, exc)
            return
        then(layout, None)

    def free_disk(self, layout: TensorLayout) -> None:
        assert self.nvme is not None
        self.nvme.free(layout)
        self.write_error = None
        self._wake_space()

    def _release_copy(self, copy: DiskCopy) -> None:
        if copy.owned or copy.indexed or copy.publishing:
            return
        if copy.layout.extents:
            self.free_disk(copy.layout)

    # --- loads ---------------------------------------------------------------------------

    def ensure_resident(self, version: Version, callback: Callback, *,
                        stream: tuple[str, str] | None = None) -> bool:
        """True when the version's bytes are in the CPU tier now. Otherwise start (or join) its
        load from NVMe and return False; `callback(None or error)` runs when it is done.
        `stream`: the scheduler's stream whose access needs it (for its accounting).

        Raises TooLargeError at once for a tensor larger than the whole CPU tier.
        """
        if version.cpu is not None or not version.nbytes:
            return True
        self._check_fits(version)
        load = version.loading
        if load is not None:
            self.counters.load_waits += 1
            load.waiters.append(callback)
            load.prefetch = False  # somebody waits for it now: it may make room like any get
            return False
        load = self._new_load(version, prefetch=False, stream=stream)
        load.waiters.append(callback)
        self._continue_load(load)
        return False

    def prefetch(self, version: Version) -> bool:
        """Start loading a tensor that is only on NVMe, if it could fit; True if a load runs.

        The room comes only from tensors needed later than this one (with no trace, the
        least recently used of the untraced); without such room the prefetch is dropped.
        """
        if (self.nvme is None or version.cpu is not None or not version.nbytes
                or version.nbytes > self.arena.budget_bytes or version.nvme is None
                or self._closing):
            return False
        if version.loading is None:
            if self.scheduler is not None and not self._room_for_prefetch(version):
                self.counters.prefetches_skipped += 1
                return False
            self.counters.prefetches += 1
            self.counters.prefetch_bytes += version.nbytes
            self._continue_load(self._new_load(version, prefetch=True))
        return True

    def _room_for_prefetch(self, version: Version) -> bool:
        """Free space, or tensors needed later than this one to evict, and room in the tensor's
        namespace quota: checked before a load starts, so that a prefetch without room costs
        nothing and is not retried every turn.

        Where free space covers the load, the victims its quota asks for go now: the load's
        allocation will not evict (it finds the space), and the namespace would grow past its
        quota with every prefetch. A dirty one goes once written back, as in `_evict_for`, and
        the load starts meanwhile: until that write-back ends, the namespace counts both, over
        its quota by the victim (waiting instead cost more victims at every retry and dropped
        clients' prefetch hints)."""
        assert self.scheduler is not None
        free = self.arena.budget_bytes - self.arena.used_bytes
        short = max(0, version.nbytes - free)
        if not short and self.config.scheduler.quota_bytes(version.key[0]) is None:
            return True
        victims = self.scheduler.victims_for_prefetch(version.key, self.candidates, short,
                                                      nbytes=version.nbytes)
        if victims is None:
            return False
        if not short:
            for key in victims:
                victim = self.resident.get(key)
                if victim is not None and key in self.candidates:
                    self._let_go(victim)
        return True

    def _check_fits(self, version: Version) -> None:
        if version.nbytes > self.arena.budget_bytes:
            namespace, name = version.key
            raise TooLargeError(
                f"tensor {name!r} in namespace {namespace!r} has {version.nbytes} bytes, more than "
                f"the whole CPU tier (cpu.budget_bytes={self.arena.budget_bytes}), so it cannot be "
                f"leased whole; read it in pieces with client.read_into(name, out) (and write it "
                f"with client.write_from(name, src)), or raise cpu.budget_bytes")

    def _new_load(self, version: Version, *, prefetch: bool,
                  stream: tuple[str, str] | None = None) -> _Load:
        load = version.loading = _Load(version, [], prefetch=prefetch)
        version.pins += 1
        if self.scheduler is not None:
            self.scheduler.load_started(version.key, version.nbytes, time.monotonic(),
                                        prefetch=prefetch, stream=stream, reading=False)
        return load

    def _continue_load(self, load: _Load) -> None:
        version = load.version
        nvme = self.nvme
        if load.prefetch and not load.waiters and not version.current:
            # Replaced or deleted while it waited for space: nobody will read it.
            self._loaded(load, IOEngineError("prefetch of a replaced version"), skipped=True)
            return
        if self._closing or nvme is None or version.nvme is None:
            self._loaded(load, IOEngineError(
                "infinityd is stopping" if self._closing else
                f"tensor {version.key[1]!r} has no copy on NVMe to load (internal error)"))
            return
        if load.piece is None:
            prefetch_of = version.key if load.prefetch and not load.waiters else None
            try:
                load.piece = self.allocate_slice(
                    version.nbytes, what=f"tensor {version.key[1]!r}", prefetch_of=prefetch_of,
                    segment_class=self._catalog.segment_class_of(version.key[0]))
            except SpaceShortage:
                self.when_space(lambda error: (
                    self._continue_load(load) if error is None else self._loaded(load, error)))
                return
            except TierFullError as exc:
                if prefetch_of is not None:
                    self.counters.prefetches_skipped += 1
                    self._loaded(load, exc, skipped=True)
                else:
                    self._loaded(load, exc)
                return
            except InfinityError as exc:
                self._loaded(load, exc)
                return
        try:
            future = nvme.read_into(version.nvme.layout, self.arena.address_of(load.piece))
        except InfinityError as exc:
            self._loaded(load, exc)
            return
        if self.scheduler is not None:
            self.scheduler.read_started(version.key, time.monotonic())
        future.add_done_callback(lambda done: self._read_done(load, done))

    def _read_done(self, load: _Load, future: IOFuture) -> None:
        error: InfinityError | None = future.exception()
        if isinstance(error, ChecksumError):
            namespace, name = load.version.key
            self.counters.checksum_errors += 1
            error = ChecksumError(f"tensor {name!r} in namespace {namespace!r} is corrupted on "
                                  f"NVMe, so it is not served: {error}")
            log.error("%s", error)
        self._loaded(load, error)

    def _loaded(self, load: _Load, error: InfinityError | None, *, skipped: bool = False) -> None:
        version = load.version
        version.loading = None
        version.pins -= 1
        scheduler = self.scheduler
        if scheduler is not None:
            # Before the policy's touched() below: the scheduler must see the load end first.
            if skipped:
                scheduler.load_cancelled(version.key, time.monotonic())
            else:
                scheduler.load_finished(version.key, time.monotonic(),
                                        ok=error is None and version.current)
            current = self.resident.get(version.key)
            if current is not None and current is not version:
                # A newer version was published while this one loaded; the scheduler could not
                # take it as resident then (the key was loading).
                self.policy.touched(current.key, current.nbytes)
        if not skipped:
            self.on_change()  # a dropped prefetch changes nothing: no new plan for it
        if error is None:
            assert load.piece is not None
            version.cpu = load.piece
            set_placement(version)
            self.counters.reloads += 1
            self.counters.reload_bytes += version.nbytes
            if version.current and self.nvme is not None:
                self.resident[version.key] = version
                self.policy.touched(version.key, version.nbytes)
        else:
            if load.piece is not None:
                self.free_slice(load.piece)
            if not skipped:
                self.counters.reload_failures += 1
        for waiter in load.waiters:
            waiter(error)
        self._catalog.unpinned(version)

    # --- durability ----------------------------------------------------------------------

    def make_durable(self, versions: Sequence[Version],
                     done: Callable[[list[InfinityError | None]], None]) -> None:
        """Write back what is dirty, then point every version's name at its NVMe copy in one
        index transaction (after fdatasync). `done(errors)` has one entry per version (None:
        durable), and runs only once the transaction committed (possibly at once)."""
        self.require_durable()
        job = _Flush(list(versions), [None] * len(versions), done)
        job.waiting = 1  # this loop: a write-back failing at once must not publish early
        for version in job.versions:  # a delete meanwhile must know a flush is coming
            self._flushing[version.key] = self._flushing.get(version.key, 0) + 1
        for i, version in enumerate(job.versions):
            self._renew_unsynced(version)
            if version.nbytes == 0:
                if version.nvme is None:
                    empty = TensorLayout(0, self.config.nvme.stripe_bytes, (), ())
                    version.nvme = DiskCopy(empty, edits=version.edits)
                self._flush_ready(job, i, version)
            elif version.exclusive:
                job.errors[i] = LeaseError(
                    f"tensor {version.key[1]!r} in namespace {version.key[0]!r} is leased "
                    f"exclusively (being written in place), so its bytes are not settled; flush "
                    f"after the lease is released")
            elif version.nvme is not None and not version.dirty:
                if self._unsynced(version.nvme):
                    job.errors[i] = IOEngineError(
                        f"tensor {version.key[1]!r} in namespace {version.key[0]!r} was written "
                        f"to NVMe before an fdatasync of the store failed, so its bytes may not "
                        f"be on the disk, and " + (
                            "it is not in memory to be written again; get it (that reads it "
                            "back into the CPU tier), release it, and flush again"
                            if version.cpu is None else
                            "it is being read (a lease or a stream holds it), so it cannot be "
                            "written anew yet; flush again once it is released"))
                else:
                    self._flush_ready(job, i, version)
            elif version.cpu is not None:
                job.waiting += 1
                self._write_back(version, evict=False,
                                 waiter=functools.partial(self._flush_written, job, i, version))
            else:
                job.errors[i] = InfinityError(f"tensor {version.key[1]!r} has no bytes anywhere "
                                              f"(internal error); see infinityd's log")
        self._flush_written(job, -1, None, None)

    def _renew_unsynced(self, version: Version) -> None:
        """If the version's clean NVMe copy may not be on the disk (`_unsynced`) and nothing reads
        that copy, drop it: the version is dirty again, so its bytes are written anew from
        memory, by the next flush or eviction. (While shared, a stream may be reading the copy.)"""
        if (version.nvme is not None and not version.dirty and version.cpu is not None
                and not version.exclusive and not version.shared and not version.pins
                and self._unsynced(version.nvme)):
            version.dirty = True
            self._drop_copy(version)

    def _unsynced(self, copy: DiskCopy) -> bool:
        """The copy was written before an fdatasync of the store failed and was not made durable
        before that: its bytes may never reach the disk."""
        return (not copy.indexed and bool(copy.layout.extents) and self.nvme is not None
                and copy.sync_failures_before != self.nvme.sync_failures)

    def _flush_ready(self, job: _Flush, i: int, version: Version) -> None:
        copy = version.nvme
        assert copy is not None
        if copy.indexed and self._indexed.get(version.key) is copy:
            return  # durable already: nothing to write
        copy.publishing += 1  # held for the transaction, even if the version goes meanwhile
        job.ready.append((i, version, copy))

    def _flush_written(self, job: _Flush, i: int, version: Version | None,
                       error: InfinityError | None) -> None:
        job.waiting -= 1
        if version is None:
            pass  # the end of make_durable's loop
        elif error is not None:
            job.errors[i] = error
        elif version.nvme is not None:
            self._flush_ready(job, i, version)
        if not job.waiting:
            self._flush_publish(job)

    def _flush_publish(self, job: _Flush) -> None:
        for version in job.versions:
            left = self._flushing[version.key] - 1
            if left:
                self._flushing[version.key] = left
            else:
                del self._flushing[version.key]
        records: list[DurableRecord] = []
        published: list[tuple[int, Key, DiskCopy, int, tuple[int, int]]] = []
        overtaken: list[tuple[int, Key]] = []
        for i, version, copy in job.ready:
            key = version.key
            order = (version.stamp, copy.edits)
            if self._index_issued.get(key, (0, 0)) > order:
                # A newer version's update, a copy of this version written in place since, or a
                # delete went to the index after this was asked for: writing this one now would
                # take the name back in time. This one is durable once that one is: while it is
                # still on its way to the index, the answer waits for it.
                copy.publishing -= 1
                self._release_copy(copy)
                if key in self._index_pending:
                    overtaken.append((i, key))
                else:
                    self._forget_order(key)
                continue
            self._index_issued[key] = order
            self._index_pending[key] = self._index_pending.get(key, 0) + 1
            records.append(DurableRecord(key[0], key[1], version.dtype, version.shape, copy.layout,
                                         copy.sync_failures_before))
            published.append((i, key, copy, version.nbytes, order))
        for version in job.versions:
            self._forget_order(version.key)
        left = len(overtaken) + bool(records)
        if not left:
            job.done(job.errors)
            return

        def one_done() -> None:
            nonlocal left
            left -= 1
            if not left:
                job.done(job.errors)

        for i, key in overtaken:
            def settled(error: InfinityError | None, i: int = i) -> None:
                if error is not None:
                    job.errors[i] = error
                one_done()
            self._index_waiters.setdefault(key, []).append(settled)
        if not records:
            return
        assert self.index is not None
        try:
            self.index.publish(records, on_done=lambda f: self._flush_committed(
                job, published, f, finish=one_done))
        except InfinityError as exc:
            self._flush_committed(job, published, None, exc, finish=one_done)

    def _flush_committed(self, job: _Flush,
                         published: list[tuple[int, Key, DiskCopy, int, tuple[int, int]]],
                         future: Future[None] | None, failure: InfinityError | None = None, *,
                         finish: Callable[[], None]) -> None:
        error = failure
        if future is not None:
            exc = future.exception()
            error = exc if isinstance(exc, InfinityError) or exc is None else StoreDirectoryError(
                f"the store index failed ({type(exc).__name__}: {exc}); see infinityd's log")
        for i, key, copy, nbytes, order in published:
            copy.publishing -= 1
            if error is None:
                old = self._indexed.get(key)
                self._indexed[key] = copy
                copy.indexed = True
                copy.indexed_order = order
                if old is not None and old is not copy:
                    old.indexed = False
                    self._release_copy(old)
                self.counters.flushed_tensors += 1
                self.counters.flushed_bytes += nbytes
            else:
                job.errors[i] = error
                self._release_copy(copy)
                self._index_failed(key, order)
        if error is None:
            self.counters.flushes += 1
        else:
            self.counters.flush_failures += 1
            log.error("flush failed: %s", error)
            # After a failed fdatasync, the clean copies written before it may be lost: resident
            # versions become dirty again, so that eviction does not leave only such a copy.
            for version in list(self.resident.values()):
                self._renew_unsynced(version)
        for _, key, _, _, _ in published:
            self._index_done(key, error)
        finish()

    def _index_failed(self, key: Key, order: tuple[int, int]) -> None:
        """The index update of `order` about `key` failed: the index still says what it said
        before. If no later update about the name was issued since (nor another of this order
        is pending), a flush of an older version must be measured against what the index holds
        and the name's last delete, not against this failure, or it would be skipped as
        overtaken and answered as durable while it is not."""
        if self._index_issued.get(key) != order or self._index_pending.get(key, 0) > 1:
            return  # a later update, or another of this order, is still to come: it decides
        indexed = self._indexed.get(key)
        floor = max(self._delete_marks.get(key, (0, 0)),
                    indexed.indexed_order if indexed is not None else (0, 0))
        if floor == (0, 0):
            self._index_issued.pop(key, None)
        else:
            self._index_issued[key] = floor

    def _index_done(self, key: Key, error: InfinityError | None) -> None:
        """One index transaction about `key` ended (transactions end in the order they were
        issued); once none is left, the flushes it overtook learn how the last one went."""
        left = self._index_pending[key] - 1
        if left:
            self._index_pending[key] = left
            return
        del self._index_pending[key]
        for settled in self._index_waiters.pop(key, ()):
            settled(error)

    def _forget_order(self, key: Key) -> None:
        """Drop a name's index ordering once nothing about it is indexed, pending or coming
        (only versions newer than any seen so far can start a flush after that)."""
        if key not in self._indexed and key not in self._index_pending and key not in self._flushing:
            self._index_issued.pop(key, None)
            self._delete_marks.pop(key, None)

    def remove_durable(self, key: Key, done: Callback) -> bool:
        """After a delete: take the name out of the index too. True if that is under way and
        `done(error)` will run once it committed; False if the name was never durable."""
        if self.index is None:
            return False
        if key in self._flushing:
            # A flush of a version of this name is still writing: when it gets to the index,
            # this delete must win over it.
            self._index_issued[key] = self._delete_marks[key] = (self._catalog.next_stamp(), 0)
        if key not in self._indexed and key not in self._index_pending:
            return False
        order = self._index_issued[key] = self._delete_marks[key] = (self._catalog.next_stamp(), 0)
        self._index_pending[key] = self._index_pending.get(key, 0) + 1

        def removed(future: Future[None]) -> None:
            exc = future.exception()
            error = exc if isinstance(exc, InfinityError) or exc is None else StoreDirectoryError(
                f"the store index failed ({type(exc).__name__}: {exc}); see infinityd's log")
            if error is None:
                self.counters.index_removals += 1
                old = self._indexed.pop(key, None)
                if old is not None:
                    old.indexed = False
                    self._release_copy(old)
            else:
                if self._delete_marks.get(key) == order:
                    del self._delete_marks[key]  # the index still holds the name
                self._index_failed(key, order)
            self._index_done(key, error)
            self._forget_order(key)
            done(error)

        try:
            self.index.remove([key], on_done=removed)
        except InfinityError as exc:  # not even submitted (the index closed or failed)
            self._index_done(key, exc)
            raise
        return True

    def is_durable(self, version: Version) -> bool:
        copy = version.nvme
        return copy is not None and copy.indexed and self._indexed.get(version.key) is copy

    def restore(self) -> int:
        """Publish every tensor of the durable index (at start, before serving); returns how many."""
        if self.index is None:
            return 0
        catalog = self._catalog
        records = self.index.load()
        for record in records:
            key = (record.namespace, record.name)
            nbytes = dtypes.tensor_nbytes(record.dtype, record.shape)
            if nbytes != record.layout.nbytes:
                raise StoreDirectoryError(
                    f"the store index {self.index.path} says tensor {record.name!r} in namespace "
                    f"{record.namespace!r} is {record.dtype}{list(record.shape)} ({nbytes} bytes) "
                    f"but stores {record.layout.nbytes} bytes; run `infinity verify`")
            copy = DiskCopy(record.layout, indexed=True)
            version = catalog.install(key, record.dtype, record.shape, nbytes, cpu=None,
                                      dirty=False, nvme=copy)
            self._indexed[key] = copy
            copy.indexed_order = self._index_issued[key] = (version.stamp, 0)
        return len(records)

    # --- streams' I/O ---------------------------------------------------------------------

    def read_part(self, version: Version, piece: CpuSlice, *, offset_bytes: int, nbytes: int,
                  done: Callback) -> None:
        """Read bytes [offset, offset + nbytes) of a version's NVMe copy into a slice, verified."""
        nvme, copy = self.nvme, version.nvme
        assert nvme is not None and copy is not None
        future = nvme.read_into(copy.layout, self.arena.address_of(piece),
                                offset_bytes=offset_bytes, nbytes=nbytes)

        def finished(f: IOFuture) -> None:
            error = f.exception()
            if isinstance(error, ChecksumError):
                self.counters.checksum_errors += 1
                error = ChecksumError(f"tensor {version.key[1]!r} in namespace "
                                      f"{version.key[0]!r} is corrupted on NVMe, so it is not "
                                      f"served: {error}")
            else:
                self.counters.stream_read_bytes += nbytes if error is None else 0
            done(error)

        future.add_done_callback(finished)

    def note_stream_write(self, nbytes: int) -> None:
        self.counters.stream_write_bytes += nbytes

    # --- reporting and closing ------------------------------------------------------------

    def stats(self) -> dict[str, object]:
        tiers: dict[str, object] = {}
        nvme = self.nvme
        if nvme is not None:
            dirs = nvme.describe()
            tiers["nvme"] = {
                "dirs": dirs,
                "capacity_bytes": sum(int(d["capacity_bytes"]) for d in dirs),
                "used_bytes": sum(int(d["used_bytes"]) for d in dirs),
                "bytes_read": sum(int(d["bytes_read"]) for d in dirs),
                "bytes_written": sum(int(d["bytes_written"]) for d in dirs),
                "durable_tensors": len(self._indexed),
                "index": self.index.path if self.index is not None else None,
                "engine": self.engine.backend if self.engine is not None else None,
                "write_error": str(self.write_error) if self.write_error is not None else None,
            }
        tiers["resident_tensors"] = len(self.resident)
        tiers["evictions_writing_back"] = self._evicting
        tiers["write_behind_bytes"] = self._write_behind_bytes
        return tiers

    def close(self) -> None:
        """Finish what is in flight (queued reads and writes are cancelled, their requests get
        errors; index transactions already submitted complete), then release the store."""
        self._closing = True
        if self.engine is not None:
            self.loop.remove_reader(self.engine.completion_fd)
            self.engine.close()
        if self.index is not None:
            self.loop.remove_reader(self.index.completion_fd)
            self.index.close()
        if self.nvme is not None:
            self.nvme.close()
