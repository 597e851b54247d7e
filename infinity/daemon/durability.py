"""Durability: flushes to the durable index, in order, and recovery from a failed fdatasync (`Durability`).

`make_durable` writes back what is dirty (joining `infinity.daemon.eviction`'s
write-backs), then one `DurableIndex` transaction (fdatasync first, on the
index's thread) points the names at their new extents; replaced extents are
freed only after that commit. Deletes remove the name from the index the same
way (`remove_durable`). It owns what the committed index says (`indexed`) and
the ordering of index updates per name:

- index updates for one name are issued in version order, and one issued for
  an older version after a newer update (or a delete) was issued is skipped,
  so the index never goes back in time; a flush so overtaken is answered with
  the outcome of the transaction that overtook it;
- a copy written before a failed fdatasync is never published (Linux reports
  such a failure once, see `DiskCopy.sync_failures_before`), nor one written
  to a store directory that failed since (`NvmeDirectory.fail`): resident
  versions are written anew instead, at once after a failed flush
  (`renew_unsynced`), and a copy a lease or stream reads is never freed under
  it. A flush that failed because a directory failed under it is made again
  at once, to the directories left (as `Eviction` does with write-backs).

Rebuilding the catalog from the index at start is `infinity.daemon.restore`.
Loop thread only; nothing here blocks.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Sequence

from infinity.config import InfinityConfig
from infinity.daemon.catalog import Key, Version
from infinity.daemon.diskcopy import DiskCopy
from infinity.daemon.eviction import Eviction
from infinity.daemon.growth import TierSpace
from infinity.daemon.residency import Callback, Residency, TierCounters
from infinity.errors import (InfinityError, InvalidRequestError, IOEngineError, LeaseError,
                             StoreDirectoryError)
from infinity.store.durable import DurableIndex, DurableRecord
from infinity.store.nvme import TensorLayout

log = logging.getLogger("infinityd.tiers")

Order = tuple[int, int]  # (version stamp, edits) of an index update; a delete takes a fresh stamp


@dataclass(eq=False, slots=True)
class _Flush:
    """A make_durable request: write-backs to wait for, then one index transaction."""

    versions: list[Version]
    errors: list[InfinityError | None]
    done: Callable[[list[InfinityError | None]], None]
    ready: list[tuple[int, Version, DiskCopy]] = field(default_factory=list)
    waiting: int = 0
    directory_failures_before: int = 0  # the tier's failed directories when it began


def _index_error(exc: BaseException | None) -> InfinityError | None:
    if isinstance(exc, InfinityError) or exc is None:
        return exc
    return StoreDirectoryError(
        f"the store index failed ({type(exc).__name__}: {exc}); see infinityd's log")


class Durability:
    """Flushes, index removals and their ordering. Loop thread only."""

    def __init__(self, config: InfinityConfig, space: TierSpace, eviction: Eviction,
                 residency: Residency, counters: TierCounters, index: DurableIndex | None, *,
                 clock: Iterator[int]) -> None:
        self.config = config
        self.space = space
        self.eviction = eviction
        self.residency = residency
        self.counters = counters
        self.index = index
        self._clock = clock  # the catalog's version stamps: a delete orders after them
        self.indexed: dict[Key, DiskCopy] = {}  # what the committed index says, name by name
        # Flushes overtaken by a newer transaction about their name, still on its way to the
        # index: each learns that transaction's outcome (`_index_done`).
        self._index_waiters: dict[Key, list[Callable[[InfinityError | None], None]]] = {}
        # The order of the last delete of each name whose ordering is still kept: no flush of
        # a version older than it may reach the index, whatever becomes of later updates.
        self._delete_marks: dict[Key, Order] = {}
        # The order of the last index update issued per name.
        self._index_issued: dict[Key, Order] = {}
        self._index_pending: dict[Key, int] = {}  # index transactions in flight, per name
        self._flushing: dict[Key, int] = {}  # make_durable jobs not yet at their transaction

    @property
    def durable(self) -> bool:
        """Whether this daemon has an NVMe tier, hence durable writes."""
        return self.index is not None

    def require_durable(self) -> None:
        if self.index is None:
            raise InvalidRequestError(
                "this infinityd has no NVMe tier (nvme.dirs is empty), so nothing can be made "
                "durable; set nvme.dirs to a directory on a local drive and restart infinityd")

    def is_durable(self, version: Version) -> bool:
        copy = version.nvme
        return copy is not None and copy.indexed and self.indexed.get(version.key) is copy

    def adopt(self, version: Version, copy: DiskCopy) -> None:
        """The index already points `version`'s name at `copy` (found at start-up)."""
        self.indexed[version.key] = copy
        copy.indexed_order = self._index_issued[version.key] = (version.stamp, 0)

    # --- flushes ------------------------------------------------------------------------------

    def make_durable(self, versions: Sequence[Version],
                     done: Callable[[list[InfinityError | None]], None]) -> None:
        """Write back what is dirty, then point every version's name at its NVMe copy in one
        index transaction (after fdatasync). `done(errors)` has one entry per version (None:
        durable), and runs only once the transaction committed (possibly at once)."""
        self.require_durable()
        job = _Flush(list(versions), [None] * len(versions), done)
        if self.space.nvme is not None:
            job.directory_failures_before = self.space.nvme.failed_directories
        job.waiting = 1  # this loop: a write-back failing at once must not publish early
        for version in job.versions:  # a delete meanwhile must know a flush is coming
            self._flushing[version.key] = self._flushing.get(version.key, 0) + 1
        for i, version in enumerate(job.versions):
            self.renew_unsynced(version)
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
                        f"to NVMe before an fdatasync of the store failed, or to a store "
                        f"directory that failed since, so its bytes may not be on the disk, "
                        f"and " + (
                            "it is not in memory to be written again; get it (that reads it "
                            "back into the CPU tier), release it, and flush again"
                            if version.cpu is None else
                            "it is being read (a lease or a stream holds it), so it cannot be "
                            "written anew yet; flush again once it is released"))
                else:
                    self._flush_ready(job, i, version)
            elif version.cpu is not None:
                job.waiting += 1
                self.eviction.write_back(
                    version, evict=False,
                    waiter=functools.partial(self._flush_written, job, i, version))
            else:
                job.errors[i] = InfinityError(f"tensor {version.key[1]!r} has no bytes anywhere "
                                              f"(internal error); see infinityd's log")
        self._flush_written(job, -1, None, None)

    def renew_unsynced(self, version: Version) -> None:
        """If the version's clean NVMe copy may not be on the disk (`_unsynced`) and nothing reads
        that copy, drop it: the version is dirty again, so its bytes are written anew from
        memory, by the next flush or eviction. (While shared, a stream may be reading the copy.)"""
        if (version.nvme is not None and not version.dirty and version.cpu is not None
                and not version.exclusive and not version.shared
                and not self.residency.busy(version) and self._unsynced(version.nvme)):
            self.residency.set_dirty(version, True)
            self.space.drop_copy(version)

    def _unsynced(self, copy: DiskCopy) -> bool:
        """The copy was not made durable before an fdatasync of the store failed, or before a
        directory it lies in failed: its bytes may never reach the disk."""
        nvme = self.space.nvme
        return (not copy.indexed and bool(copy.layout.extents) and nvme is not None
                and (copy.sync_failures_before != nvme.sync_failures
                     or nvme.on_failed_directory(copy.layout)))

    def _flush_ready(self, job: _Flush, i: int, version: Version) -> None:
        copy = version.nvme
        assert copy is not None
        if copy.indexed and self.indexed.get(version.key) is copy:
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
        published: list[tuple[int, Key, DiskCopy, int, Order]] = []
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
                self.space.release_copy(copy)
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

    def _flush_committed(self, job: _Flush, published: list[tuple[int, Key, DiskCopy, int, Order]],
                         future: Future[None] | None, failure: InfinityError | None = None, *,
                         finish: Callable[[], None]) -> None:
        error = failure
        if future is not None:
            error = _index_error(future.exception())
        nvme = self.space.nvme
        again = (error is not None and nvme is not None and not self.space.closing
                 and job.directory_failures_before < nvme.failed_directories
                 < len(nvme.directories))
        for i, key, copy, nbytes, order in published:
            copy.publishing -= 1
            if error is None:
                old = self.indexed.get(key)
                self.indexed[key] = copy
                copy.indexed = True
                copy.indexed_order = order
                if old is not None and old is not copy:
                    old.indexed = False
                    self.space.release_copy(old)
                self.counters.flushed_tensors += 1
                self.counters.flushed_bytes += nbytes
            else:
                job.errors[i] = error
                self.space.release_copy(copy)
                self._index_failed(key, order)
        if error is None:
            self.counters.flushes += 1
        elif again:
            log.warning("flush goes to the store directories left: %s", error)
        else:
            self.counters.flush_failures += 1
            log.error("flush failed: %s", error)
            # After a failed fdatasync, the clean copies written before it may be lost: resident
            # versions become dirty again, so that eviction does not leave only such a copy.
            for version in list(self.residency.resident.values()):
                self.renew_unsynced(version)
        for _, key, _, _, _ in published:
            self._index_done(key, error)
        if again:
            self._flush_again(job, [i for i, _, _, _, _ in published], finish)
        else:
            finish()

    def _flush_again(self, job: _Flush, items: list[int], finish: Callable[[], None]) -> None:
        """Flush the versions of `items` of a job anew (a directory failed under it: the copies
        there were renewed above, and are written to the directories left); their outcome
        replaces the failure. Each retry needs another directory to fail: at most one per
        directory."""

        def settled(errors: list[InfinityError | None]) -> None:
            for i, error in zip(items, errors):
                job.errors[i] = error
            finish()

        self.make_durable([job.versions[i] for i in items], settled)

    # --- the ordering of index updates --------------------------------------------------------

    def _index_failed(self, key: Key, order: Order) -> None:
        """The index update of `order` about `key` failed: the index still says what it said
        before. If no later update about the name was issued since (nor another of this order
        is pending), a flush of an older version must be measured against what the index holds
        and the name's last delete, not against this failure, or it would be skipped as
        overtaken and answered as durable while it is not."""
        if self._index_issued.get(key) != order or self._index_pending.get(key, 0) > 1:
            return  # a later update, or another of this order, is still to come: it decides
        indexed = self.indexed.get(key)
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
        if key not in self.indexed and key not in self._index_pending and key not in self._flushing:
            self._index_issued.pop(key, None)
            self._delete_marks.pop(key, None)

    # --- deletes ------------------------------------------------------------------------------

    def remove_durable(self, key: Key, done: Callback) -> bool:
        """After a delete: take the name out of the index too. True if that is under way and
        `done(error)` will run once it committed; False if the name was never durable."""
        if self.index is None:
            return False
        if key in self._flushing:
            # A flush of a version of this name is still writing: when it gets to the index,
            # this delete must win over it.
            self._index_issued[key] = self._delete_marks[key] = (next(self._clock), 0)
        if key not in self.indexed and key not in self._index_pending:
            return False
        order = self._index_issued[key] = self._delete_marks[key] = (next(self._clock), 0)
        self._index_pending[key] = self._index_pending.get(key, 0) + 1

        def removed(future: Future[None]) -> None:
            error = _index_error(future.exception())
            if error is None:
                self.counters.index_removals += 1
                old = self.indexed.pop(key, None)
                if old is not None:
                    old.indexed = False
                    self.space.release_copy(old)
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
