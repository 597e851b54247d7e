"""Room in the tiers: growing them, handing room out and taking it back (`TierSpace`).

It owns, for the tier modules above it:

- the CPU tier's growth: a segment is created on a worker thread when an
  allocation finds the tier short and the budget allows one; requests that
  need room wait (`when_space`) and retry once it came, or room was freed.
  With `cpu.create_at_start`, blanks are made ahead on the worker thread, one
  after another until the budget is taken (`make_blanks_ahead`), and a
  shortage a blank serves takes it at once (see `infinity.daemon.arena`);
- slices handed out without evicting (`allocate_spare`: a spare reservation
  never waits nor evicts) and given back (`free`), their padding zeroed;
- the NVMe store files' growth (off the loop) and extents handed out
  (`allocate_disk`) and given back (`free_disk`, `release_copy`: a `DiskCopy`
  is freed only when no version owns it, the index does not point at it, and no
  index transaction that would point at it is in flight);
- versions' lifetimes below the catalog: the catalog lets go of a version
  (`released`), and its slice and copy are freed once no I/O is on it
  (`settle` when that I/O ends); `num_versions` and `version_bytes` count the
  versions not freed yet.

Eviction, which makes room by moving tensors out, is `infinity.daemon.eviction`.
Loop thread only.
"""

from __future__ import annotations

import ctypes
import logging
import time
from concurrent.futures import Future
from typing import Callable

from infinity.config import InfinityConfig
from infinity.daemon.arena import (ALIGNMENT_BYTES, Blank, CpuArena, CpuSlice, Segment,
                                   SegmentPlan, SpaceShortage, create_blank, create_segment)
from infinity.daemon.catalog import Version
from infinity.daemon.diskcopy import DiskCopy
from infinity.daemon.loop import EventLoop
from infinity.daemon.residency import Callback, Residency, TierCounters
from infinity.errors import InfinityError, StoreDirectoryError, TierFullError, TooLargeError
from infinity.store.nvme import GrowthNeeded, NvmeTier, TensorLayout

log = logging.getLogger("infinityd.tiers")


class TierSpace:
    """Growth of both tiers, room handed out and given back, and versions freed. Loop thread only."""

    def __init__(self, config: InfinityConfig, loop: EventLoop, arena: CpuArena,
                 residency: Residency, counters: TierCounters, nvme: NvmeTier | None, *,
                 on_change: Callable[[], None] | None = None) -> None:
        self.config = config
        self.loop = loop
        self.arena = arena
        self.residency = residency
        self.counters = counters
        self.nvme = nvme
        # Called after anything that can change what the scheduler would prefetch (a load
        # finished, a tensor left the tier, space was freed); the daemon plans on its next turn.
        self.on_change: Callable[[], None] = on_change if on_change is not None else _nothing
        self.closing = False
        self._space_waiters: list[Callback] = []
        self._wake_scheduled = False
        # Bytes of allocations that have waited for evictions since the waiters last retried:
        # what is being evicted beyond them is room nobody waits for yet (`infinity.daemon.eviction`).
        self.awaited_bytes = 0
        self._disk_growth: dict[int, list[Callback]] = {}
        # Spares paused: a tensor that needs a segment of its own found every segment that
        # could be emptied for it holding some client's spare slice (see `spares_in_the_way`).
        self.spares_paused_until = 0.0
        self._spare_wait_started: float | None = None
        # Published and not freed yet (current, held, or with I/O on it): counted up by the
        # catalog's `published` hook (`Eviction.published`), down by `_free`.
        self.num_versions = 0
        self.version_bytes = 0

    # --- CPU slices ------------------------------------------------------------------------

    def allocate_spare(self, nbytes: int, *, what: str,
                       segment_class: str | None = None) -> CpuSlice | None:
        """A fresh CPU slice from room the tier already has, or None: never by evicting or
        waiting. Where the budget allows, it starts the tier's growth for the next spare."""
        if self.arena.needs_dedicated(nbytes):
            return None  # it would need a dedicated segment of its own: growth
        if self._space_waiters:
            return None  # reserves and loads wait for room: theirs first
        if time.monotonic() < self.spares_paused_until:
            return None  # they kept a large tensor from a segment of its own lately
        arena = self.arena
        try:
            piece = arena.allocate(nbytes, what=what, segment_class=segment_class)
        except SpaceShortage as shortage:
            # Not now: a spare never waits. But where the budget allows another segment, start
            # it, so that the next put of the tensor finds room for its spare.
            self.start_growth(shortage)
            return None
        except (TierFullError, TooLargeError):
            return None  # only evicting would make room: a spare is not worth a tensor
        self.zero_padding(piece, nbytes)
        return piece

    def free(self, piece: CpuSlice) -> None:
        self.arena.free(piece)
        self.wake_space()

    def address_of(self, piece: CpuSlice) -> int:
        return self.arena.address_of(piece)

    def zero(self, piece: CpuSlice, start: int, end: int) -> None:
        """Zero bytes [start, end) of a slice (padding only: never tensor bytes)."""
        if end > start:
            ctypes.memset(self.arena.address_of(piece) + start, 0, end - start)

    def zero_padding(self, piece: CpuSlice, nbytes: int) -> None:
        # Slices are reused without clearing; what lies past the tensor goes to NVMe with it.
        end = -(-nbytes // ALIGNMENT_BYTES) * ALIGNMENT_BYTES
        self.zero(piece, nbytes, end)

    def tier_full(self, nbytes: int, what: str) -> TierFullError:
        return TierFullError(
            f"the CPU tier is full: {self.arena.used_bytes} of {self.arena.budget_bytes} bytes are "
            f"in use{', by leased or busy tensors' if self.nvme is not None else ''}, and {what} "
            f"needs {nbytes} more; raise cpu.budget_bytes or delete tensors (or release leases)")

    def spares_in_the_way(self) -> bool:
        """A tensor needs a segment of its own and no segment can be emptied for it, which the
        clients' spare slices (spread over the standard segments, renewed at each put) can
        cause. Pause new spares for a while; True while the allocation may wait for those
        given out to be used or given back (a client gives an unused one back within
        `daemon.client_timeout_s`): the waiters are woken when the wait ends, and fail then."""
        now = time.monotonic()
        window_s = self.config.daemon.client_timeout_s
        self.spares_paused_until = now + max(60.0, 4 * window_s)
        if self._spare_wait_started is None or now - self._spare_wait_started > 2 * window_s:
            self._spare_wait_started = now  # a new episode
            self.loop.call_later(window_s, self.retry_waiters)
        return now - self._spare_wait_started < window_s

    # --- waiting for room -------------------------------------------------------------------

    def when_space(self, callback: Callback) -> None:
        """Call `callback(None)` once CPU space may have been freed (retry then), or
        `callback(error)` if the tier's growth failed."""
        self.counters.space_waits += 1
        self._space_waiters.append(callback)

    @property
    def waiting_for_space(self) -> bool:
        return bool(self._space_waiters)

    def wake_space(self) -> None:
        self.on_change()
        self.retry_waiters()

    def retry_waiters(self) -> None:
        """Let the requests waiting for room retry on the next loop turn."""
        # Deferred to the next loop turn: this may run inside a catalog call, which a waiter
        # (a parked request) must not re-enter.
        if self._space_waiters and not self._wake_scheduled:
            self._wake_scheduled = True
            self.loop.call_soon_threadsafe(self._run_space_waiters)

    def _run_space_waiters(self, error: InfinityError | None = None) -> None:
        self._wake_scheduled = False
        self.awaited_bytes = 0  # each waiter that must wait again counts itself anew
        waiters, self._space_waiters = self._space_waiters, []
        for waiter in waiters:
            try:
                waiter(error)
            except Exception:
                log.exception("error in a request waiting for CPU-tier space")

    # --- CPU growth -------------------------------------------------------------------------

    def start_growth(self, shortage: SpaceShortage) -> bool:
        """Whether the tier is growing now: already, by a blank made live for `shortage` (its
        waiters retry on the loop's next turn), by a segment started for it, or soon, as
        blanks being made come back (False: the budget has no room for it)."""
        arena = self.arena
        segment = arena.install_blank(shortage)
        if segment is not None:
            self.counters.segments_created += 1
            self.on_change()
            # The caller parks its request after this returns: wake it on the next turn.
            if not self._wake_scheduled:
                self._wake_scheduled = True
                self.loop.call_soon_threadsafe(self._run_space_waiters)
            return True
        if arena.growing or arena.preparing:
            return True
        plan = arena.plan_growth(shortage)
        if plan is None:
            return False
        self._grow_arena(plan)
        return True

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
        if self.closing:
            segment.destroy()
            return
        self.arena.install(segment)
        self.counters.segments_created += 1
        self._run_space_waiters()
        if segment.dedicated:
            # Made for one tensor, whose request went with its client while the segment was
            # being created (or took another): empty, it would hold its budget forever.
            self.arena.retire_if_empty(segment.id)

    def make_blanks_ahead(self) -> None:
        """Make the budget's segments ahead, one blank at a time on the worker thread, until
        the budget is taken (`cpu.create_at_start`)."""
        if self.closing:
            return
        size = self.arena.plan_blank()
        if size is None:
            return
        config = self.config.cpu
        self.loop.run_in_worker(lambda: create_blank(size, config),
                                lambda done: self._blank_made(size, done))

    def _blank_made(self, size: int, done: Future[Blank]) -> None:
        try:
            blank = done.result()
        except Exception as exc:  # the memory is not there: segments come when needed, or fail
            self.arena.abandon_blank(size)
            log.warning("CPU tier: could not make a %d-byte segment ahead (%s: %s); segments "
                        "are made when needed", size, type(exc).__name__, exc)
            self.wake_space()
            return
        if self.closing:
            self.arena.abandon_blank(size)
            blank.destroy()
            return
        self.arena.add_blank(blank)
        self.wake_space()  # whoever waits for room may take it, or its budget
        self.make_blanks_ahead()

    # --- NVMe space -------------------------------------------------------------------------

    def grow_disk(self, index: int, nbytes: int, then: Callback) -> None:
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
            self.residency.write_error = None
        except InfinityError as exc:
            error = exc.with_traceback(None)  # handed on: no cycle through this frame
        except Exception as exc:
            error = StoreDirectoryError(f"growing the store file failed ({type(exc).__name__}: "
                                        f"{exc}); check the directory and the device")
        for waiter in waiters:
            waiter(error)

    def allocate_disk(self, nbytes: int,
                      then: Callable[[TensorLayout | None, InfinityError | None], None]) -> None:
        """Extents for `nbytes` (growing the files off the loop when needed); `then(layout,
        None)` or `then(None, error)`, possibly at once."""
        nvme = self.nvme
        assert nvme is not None
        try:
            layout = nvme.allocate(nbytes, grow=False)
        except GrowthNeeded as need:
            self.grow_disk(need.index, need.nbytes, lambda error: (
                self.allocate_disk(nbytes, then) if error is None else then(None, error)))
            return
        except InfinityError as exc:
            then(None, exc)
            return
        then(layout, None)

    def free_disk(self, layout: TensorLayout) -> None:
        assert self.nvme is not None
        self.nvme.free(layout)
        self.residency.write_error = None
        self.wake_space()

    def release_copy(self, copy: DiskCopy) -> None:
        """Free a copy's extents if nothing refers to it any more."""
        if copy.owned or copy.indexed or copy.publishing:
            return
        if copy.layout.extents:
            self.free_disk(copy.layout)

    def drop_copy(self, version: Version) -> None:
        """The version's NVMe copy no longer describes it (written in place) or is no longer
        needed (freed): it goes back to the store."""
        copy = version.nvme
        if copy is not None:
            version.nvme = None
            copy.owned = False
            self.release_copy(copy)

    # --- versions' lifetimes ----------------------------------------------------------------

    def released(self, version: Version) -> None:
        """The catalog holds `version` no more: free its CPU slice and NVMe copy, now or once
        the I/O on it ends (`settle`)."""
        if not self.residency.busy(version):
            self._free(version)

    def settle(self, version: Version) -> None:
        """I/O on `version` ended: free it if the catalog let it go and no other I/O is on it."""
        if version.released and not self.residency.busy(version):
            self._free(version)

    def _free(self, version: Version) -> None:
        self.num_versions -= 1
        self.version_bytes -= version.nbytes
        if version.cpu is not None:
            self.arena.free(version.cpu)
            version.cpu = None
            self.wake_space()
        self.drop_copy(version)


def _nothing() -> None:
    pass
