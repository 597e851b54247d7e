"""Online verify: the `verify` request reads back every flushed tensor's NVMe copy and checks it
against its checksums while the daemon serves (`infinity verify` with a daemon running).

A verify walks the current versions once (a store-wide request, like flush_store) and checks,
one tensor after another, each that has an NVMe copy: it leases the tensor as the daemon, so
that it is neither deleted nor its extents reused while they are read, reads the copy in chunks
of CHUNK_BYTES into one aligned buffer of its own with the engine (CRC32C verified in the
engine's threads, one chunk in flight, so clients' I/O goes on beside it), then releases the
lease. A copy that fails its checksums is reported and left as it is (the next get of it reports
it too). A tensor replaced or deleted since the walk is checked as it is now or skipped; one
leased exclusively (being written in place) is skipped. The work advances by the engine's
completions on the loop thread: nothing blocks. One verify at a time.
"""

from __future__ import annotations

import logging
from typing import Any

from infinity.daemon.catalog import Catalog, Version
from infinity.daemon.services.base import DaemonCounters, Deferred, Routes
from infinity.daemon.sessions import DAEMON_CLIENT_ID, Session
from infinity.errors import InfinityError, InvalidRequestError
from infinity.io.native import native
from infinity.protocol import wire
from infinity.store.nvme import NvmeTier

log = logging.getLogger("infinityd.verify")

CHUNK_BYTES = 16 << 20  # a multiple of the 1 MiB checksum block


class _Walk:
    """One verify request's progress."""

    def __init__(self, versions: list[Version], deferred: Deferred) -> None:
        self.versions = versions
        self.deferred = deferred
        self.next = 0
        self.version: Version | None = None  # the one being read, under `lease_id`
        self.lease_id = 0
        self.offset = 0
        self.summary: dict[str, Any] = {"tensors": 0, "bytes": 0, "corrupted": [],
                                        "num_corrupted": 0, "skipped": 0, "not_on_nvme": 0}


class VerifyService:
    """The `verify` request."""

    def __init__(self, catalog: Catalog, nvme: NvmeTier | None, counters: DaemonCounters) -> None:
        self.catalog = catalog
        self.nvme = nvme
        self.counters = counters
        self._walk: _Walk | None = None
        self._buffer: Any = None  # allocated at the first verify, kept

    def routes(self) -> Routes:
        return {wire.Verify: self.verify}

    def verify(self, session: Session, request_id: int, message: wire.Verify) -> Deferred:
        if self.nvme is None:
            raise InvalidRequestError("this infinityd has no NVMe tier (nvme.dirs), so there is "
                                      "no stored copy to verify")
        if self._walk is not None:
            raise InvalidRequestError("a verify is running already; wait for its answer")
        if self._buffer is None:
            self._buffer = native().AlignedBuffer(CHUNK_BYTES, 4096, False)
        self.counters.deferred_replies += 1
        walk = _Walk(list(self.catalog.current_versions()), Deferred([None]))
        self._walk = walk
        log.info("%s asked to verify %d tensor(s)", session.describe(), len(walk.versions))
        self._advance(walk)
        return walk.deferred

    def _advance(self, walk: _Walk) -> None:
        """Start the next chunk's read, or the next tensor's, or answer."""
        assert self.nvme is not None
        while walk.version is None:
            if walk.next == len(walk.versions):
                self._finish(walk)
                return
            listed = walk.versions[walk.next]
            walk.next += 1
            self._lease(walk, listed)
        version = walk.version
        assert version.nvme is not None
        nbytes = min(CHUNK_BYTES, version.nbytes - walk.offset)
        try:
            future = self.nvme.read_into(version.nvme.layout, self._buffer.address,
                                         offset_bytes=walk.offset, nbytes=nbytes)
        except InfinityError as exc:
            self._done_with(walk, exc.with_traceback(None))
            self._advance(walk)
            return
        future.add_done_callback(lambda done: self._read(walk, nbytes, done.exception()))

    def _lease(self, walk: _Walk, listed: Version) -> None:
        """Lease the tensor `listed` names, if it has an NVMe copy to read now."""
        namespace, name = listed.key
        lease_id = self.catalog.internal_lease_id()
        lease, outcomes = self.catalog.acquire(DAEMON_CLIENT_ID, lease_id,
                                               [(namespace, name, False)])
        version = outcomes[0]
        readable = (isinstance(version, Version) and version.nvme is not None
                    and version.nbytes > 0 and bool(version.nvme.layout.crcs))
        if not readable:
            if lease is not None:
                self.catalog.release(DAEMON_CLIENT_ID, lease_id)
            if isinstance(version, Version):  # not written to NVMe yet (or empty)
                walk.summary["not_on_nvme"] += 1
            else:  # deleted since the walk began, or leased exclusively
                walk.summary["skipped"] += 1
            return
        assert isinstance(version, Version)
        walk.version, walk.lease_id, walk.offset = version, lease_id, 0

    def _read(self, walk: _Walk, nbytes: int, error: InfinityError | None) -> None:
        assert walk.version is not None
        if error is not None:
            self._done_with(walk, error)
        else:
            walk.offset += nbytes
            walk.summary["bytes"] += nbytes
            if walk.offset >= walk.version.nbytes:
                self._done_with(walk, None)
        self._advance(walk)

    def _done_with(self, walk: _Walk, error: InfinityError | None) -> None:
        """The current tensor is checked: count it, report it if it failed, release it."""
        version = walk.version
        assert version is not None
        walk.summary["tensors"] += 1
        if error is not None:
            walk.summary["num_corrupted"] += 1
            log.warning("verify: tensor %r in namespace %r failed: %s", version.key[1][:200],
                        version.key[0][:200], str(error)[:300])
            if len(walk.summary["corrupted"]) < wire.VERIFY_REPORTED:
                walk.summary["corrupted"].append([version.key[0], version.key[1],
                                                  str(error)[:300]])
        walk.version = None
        self.catalog.release(DAEMON_CLIENT_ID, walk.lease_id)

    def _finish(self, walk: _Walk) -> None:
        self._walk = None
        summary = walk.summary
        log.info("verify: %d tensor(s), %d byte(s) checked, %d corrupted, %d skipped",
                 summary["tensors"], summary["bytes"], summary["num_corrupted"],
                 summary["skipped"])
        walk.deferred.results[0] = summary
        walk.deferred.settle()
