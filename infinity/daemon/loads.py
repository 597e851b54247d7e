"""Loads: bringing tensors that are only on NVMe back into the CPU tier (`Loads`).

A load reads a version's NVMe copy with the engine straight into a fresh slice
of a shared segment, CRC32C verified, and places the version there. Concurrent
requests for one tensor share its load (`ensure_resident`); a prefetch
(`prefetch`) starts one ahead of need, taking room only from tensors needed
later than it, and is dropped quietly when there is none. It owns the loads in
flight (`Residency.loads`) and the streams' partial reads (`read_part`).
Loop thread only; nothing here blocks.
"""

from __future__ import annotations

import logging
import time

from infinity.config import InfinityConfig
from infinity.daemon.arena import CpuSlice, SpaceShortage
from infinity.daemon.catalog import Version, set_placement
from infinity.daemon.eviction import Eviction
from infinity.daemon.growth import TierSpace
from infinity.daemon.residency import Callback, Load, Residency, TierCounters
from infinity.daemon.scheduler import Scheduler
from infinity.errors import ChecksumError, InfinityError, IOEngineError, TierFullError, TooLargeError
from infinity.io import IOFuture

log = logging.getLogger("infinityd.tiers")


class Loads:
    """Loads and prefetches from NVMe into the CPU tier. Loop thread only."""

    def __init__(self, config: InfinityConfig, space: TierSpace, eviction: Eviction,
                 residency: Residency, counters: TierCounters, *,
                 scheduler: Scheduler | None) -> None:
        self.config = config
        self.space = space
        self.eviction = eviction
        self.arena = space.arena
        self.nvme = space.nvme
        self.residency = residency
        self.counters = counters
        self.scheduler = scheduler

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
        load = self.residency.loads.get(version)
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
                or self.space.closing):
            return False
        if version not in self.residency.loads:
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
        candidates = self.residency.candidates
        victims = self.scheduler.victims_for_prefetch(version.key, candidates, short,
                                                      nbytes=version.nbytes)
        if victims is None:
            return False
        if not short:
            for key in victims:
                victim = self.residency.resident.get(key)
                if victim is not None and key in candidates:
                    self.eviction.let_go(victim)
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
                  stream: tuple[str, str] | None = None) -> Load:
        load = self.residency.loads[version] = Load(version, [], prefetch=prefetch)
        if self.scheduler is not None:
            self.residency.tensors.start_load(version.key, version.nbytes)
            self.scheduler.load_started(version.key, version.nbytes, time.monotonic(),
                                        prefetch=prefetch, stream=stream, reading=False)
        return load

    def _continue_load(self, load: Load) -> None:
        version = load.version
        nvme = self.nvme
        closing = self.space.closing
        if load.prefetch and not load.waiters and not version.current:
            # Replaced or deleted while it waited for space: nobody will read it.
            self._loaded(load, IOEngineError("prefetch of a replaced version"), skipped=True)
            return
        if closing or nvme is None or version.nvme is None:
            self._loaded(load, IOEngineError(
                "infinityd is stopping" if closing else
                f"tensor {version.key[1]!r} has no copy on NVMe to load (internal error)"))
            return
        if load.piece is None:
            prefetch_of = version.key if load.prefetch and not load.waiters else None
            try:
                load.piece = self.eviction.allocate_slice(
                    version.nbytes, what=f"tensor {version.key[1]!r}", prefetch_of=prefetch_of,
                    segment_class=self.arena.class_for(version.key[0]))  # read-only: its own
            except SpaceShortage:
                self.space.when_space(lambda error: (
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

    def _read_done(self, load: Load, future: IOFuture) -> None:
        error: InfinityError | None = future.exception()
        if isinstance(error, ChecksumError):
            namespace, name = load.version.key
            self.counters.checksum_errors += 1
            error = ChecksumError(f"tensor {name!r} in namespace {namespace!r} is corrupted on "
                                  f"NVMe, so it is not served: {error}")
            log.error("%s", error)
        elif error is not None:
            namespace, name = load.version.key
            error = type(error)(f"tensor {name!r} in namespace {namespace!r} cannot be read "
                                f"from NVMe: {error}")
            log.error("%s", error)
        self._loaded(load, error)

    def _loaded(self, load: Load, error: InfinityError | None, *, skipped: bool = False) -> None:
        version = load.version
        residency = self.residency
        del residency.loads[version]
        policy = self.eviction.policy
        scheduler = self.scheduler
        if scheduler is not None:
            # Before the policy's touched() below: the scheduler must see the load end first.
            # The view first (the tensor arrives in it, or the load just ends), then the scheduler.
            tensors = residency.tensors
            if skipped:
                tensors.end_load(version.key, arrived=False)
                scheduler.load_cancelled(version.key, time.monotonic())
            else:
                ok = error is None and version.current
                tensors.end_load(version.key, arrived=ok)
                scheduler.load_finished(version.key, time.monotonic(), ok=ok)
            current = residency.resident.get(version.key)
            if current is not None and current is not version:
                # A newer version was published while this one loaded; the view could not take
                # it as resident then (the key was loading).
                policy.touched(current.key, current.nbytes)
                tensors.make_resident(current.key, current.nbytes)
        if not skipped:
            self.space.on_change()  # a dropped prefetch changes nothing: no new plan for it
        self.space.retry_waiters()  # its slice may go now: a waiter for room may fit
        if error is None:
            assert load.piece is not None
            version.cpu = load.piece
            set_placement(version)
            self.counters.reloads += 1
            self.counters.reload_bytes += version.nbytes
            if version.current and self.nvme is not None:
                residency.place(version)
                policy.touched(version.key, version.nbytes)
                residency.tensors.make_resident(version.key, version.nbytes)
        else:
            if load.piece is not None:
                self.space.free(load.piece)
            if not skipped:
                self.counters.reload_failures += 1
        for waiter in load.waiters:
            waiter(error)
        self.space.settle(version)

    # --- streams' reads -----------------------------------------------------------------------

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
            elif error is not None:
                error = type(error)(f"tensor {version.key[1]!r} in namespace {version.key[0]!r} "
                                    f"cannot be read from NVMe: {error}")
                log.error("%s", error)
            else:
                self.counters.stream_read_bytes += nbytes if error is None else 0
            done(error)

        future.add_done_callback(finished)

    def note_stream_write(self, nbytes: int) -> None:
        self.counters.stream_write_bytes += nbytes
