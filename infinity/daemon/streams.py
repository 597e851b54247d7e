"""Streams: tensors of any size read or written in pieces, through staging slices of the CPU tier.

`client.read_into(name, out)` and `client.write_from(name, src)` open a stream.
A stream is either

- direct: the whole tensor is one slice the client copies at once: a resident
  version, leased for the stream's life (read), or a reservation committed when
  the stream closes (write; always so without an NVMe tier, and for tensors no
  larger than one chunk); or
- staged: `nvme.stream_depth` staging slices of `nvme.stream_chunk_bytes` each
  (a multiple of the 1 MiB checksum block; at most half the CPU tier). For each chunk the client asks the
  daemon to read bytes [offset, offset + n) of the tensor's NVMe copy into a
  slice (CRC32C verified), then copies them out; or copies its bytes into a
  slice and asks the daemon to write them to the stream's fresh extents. With
  several slices in flight, the client's copies overlap the disk. A staged
  read leases the version (it is neither freed nor changed under the stream);
  a staged write allocates its extents when it opens (so a full store is
  reported before any byte moves) and publishes the new version, NVMe only,
  when it closes with commit.

A read stream's lease is the daemon's own, not the client's: it is held under
`DAEMON_CLIENT_ID` with a lease id of this table's, so no release of the client
can end it and the client's end does not drop it under chunks still in flight;
the stream's close (or discard) releases it.

This module holds the streams' state; the tier manager does the I/O. It knows
nothing of sockets: results go to callbacks, on the loop thread.
"""

from __future__ import annotations

import array
import logging
from dataclasses import dataclass, field
from typing import Callable

from infinity.config import MiB, NvmeConfig
from infinity.daemon.arena import CpuSlice, SpaceShortage
from infinity.daemon.catalog import Catalog, Key, Version, check_key
from infinity.daemon.sessions import DAEMON_CLIENT_ID
from infinity.daemon.tiers import DiskCopy, TierManager
from infinity.errors import (InfinityError, InvalidRequestError, LeaseError, LimitExceededError,
                             OutOfRangeError, TierFullError)
from infinity.protocol import dtypes
from infinity.protocol.wire import Placement, StreamInfo
from infinity.store.nvme import (CRC_BLOCK_BYTES, TensorLayout, crc_blocks, crc_buffer,
                                 finished_layout)

log = logging.getLogger("infinityd.streams")

Opened = Callable[[StreamInfo | InfinityError], None]
Done = Callable[[InfinityError | None], None]
Closed = Callable[[int | InfinityError], None]


@dataclass(eq=False, slots=True)
class Stream:
    id: int  # the request id of the stream_open: unique per client
    client: int
    mode: str  # "read" | "write"
    key: Key
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    direct: bool = False
    version: Version | None = None  # read: the version streamed (leased by the daemon)
    lease_id: int = 0  # read: the daemon's lease of `version` (under DAEMON_CLIENT_ID)
    layout: TensorLayout | None = None  # staged write: the extents being filled
    sync_failures_before: int = 0  # staged write: see `DiskCopy.sync_failures_before`
    crcs: array.array[int] | None = None  # staged write: checksums, filled by the engine
    written: bytearray = field(default_factory=bytearray)  # staged write: 1 per block done
    slots: list[CpuSlice] = field(default_factory=list)
    reservation_id: int | None = None  # direct write: the reservation this stream made
    busy: list[bool] = field(default_factory=list)
    inflight: int = 0
    closing: Callable[[], None] | None = None  # runs once the last chunk in flight ends
    dead: bool = False  # closed or its client went away
    opened: bool = False  # stream_open was answered: its slots exist

    def slot_placements(self) -> tuple[Placement, ...]:
        return tuple(Placement(s.segment, s.offset, s.length, "uint8", (s.length,), 0)
                     for s in self.slots)


class StreamTable:
    """Every open stream, by (client, stream id). Loop thread only."""

    def __init__(self, config: NvmeConfig, catalog: Catalog, tiers: TierManager, *,
                 max_per_client: int = 1024) -> None:
        # A chunk is a staging slice of the CPU tier: at most half of it (in whole MiB, the
        # checksum block), or a tier smaller than nvme.stream_chunk_bytes could not stream at all.
        self.chunk_bytes = min(config.stream_chunk_bytes,
                               max(MiB, tiers.arena.budget_bytes // 2 // MiB * MiB))
        self.depth = config.stream_depth
        self.catalog = catalog
        self.tiers = tiers
        self._streams: dict[tuple[int, int], Stream] = {}
        self._open_by_client: dict[int, int] = {}  # streams open, for daemon.max_streams_per_client
        self.max_per_client = max_per_client
        self.opened = 0

    def __len__(self) -> int:
        return len(self._streams)

    # --- open ------------------------------------------------------------------------

    def open(self, client: int, stream_id: int, namespace: str, name: str, mode: str, dtype: str,
             shape: tuple[int, ...], done: Opened) -> None:
        """Open a stream; `done(StreamInfo)` once its slices are ready (maybe at once)."""
        if (client, stream_id) in self._streams:
            raise LeaseError(f"stream {stream_id} is open already: stream ids must not be reused")
        check_key(namespace, name)
        if self._open_by_client.get(client, 0) >= self.max_per_client:
            raise LimitExceededError(
                f"this client has {self.max_per_client} streams open already "
                f"(daemon.max_streams_per_client); close streams it is done with")
        key = (namespace, name)
        if mode == "read":
            stream = self._open_read(client, stream_id, key)
        elif mode == "write":
            stream = self._open_write(client, stream_id, key, dtype, shape)
        else:
            raise InvalidRequestError(f"a stream is opened to 'read' or 'write', not "
                                      f"{mode[:80]!r}")
        self._streams[(client, stream_id)] = stream
        self._open_by_client[client] = self._open_by_client.get(client, 0) + 1
        self.opened += 1
        if stream.direct and mode == "read":
            self._opened(stream, done)  # the resident version's slice is the one slot
        else:
            self._fill_slots(stream, done)

    def _open_read(self, client: int, stream_id: int, key: Key) -> Stream:
        lease_id = self.catalog.internal_lease_id()
        lease, outcomes = self.catalog.acquire(DAEMON_CLIENT_ID, lease_id,
                                               [(key[0], key[1], False)])
        outcome = outcomes[0]
        if not isinstance(outcome, Version):
            raise outcome
        version = outcome
        stream = Stream(stream_id, client, "read", key, version.dtype, version.shape,
                        version.nbytes, version=version, lease_id=lease_id)
        if version.cpu is not None or not version.nbytes:
            stream.direct = True
            if version.cpu is not None:
                stream.slots = [version.cpu]
                if self.tiers.nvme is not None:
                    self.tiers.touched(version)
        elif version.nvme is None:
            self.catalog.release(DAEMON_CLIENT_ID, lease_id)
            raise InvalidRequestError(f"tensor {key[1]!r} has no bytes to stream (internal error)")
        return stream

    def _open_write(self, client: int, stream_id: int, key: Key, dtype: str,
                    shape: tuple[int, ...]) -> Stream:
        nbytes = dtypes.tensor_nbytes(dtype, shape)
        self.catalog.check_room_for(key)  # a direct one's reservation checks again
        stream = Stream(stream_id, client, "write", key, dtype, shape, nbytes)
        if self.tiers.nvme is None or nbytes <= self.chunk_bytes:
            stream.direct = True  # the slices are the reservation, filled by _fill_slots
        return stream

    def _fill_slots(self, stream: Stream, done: Opened) -> None:
        """Allocate what the stream needs (staging slices; a reservation; extents), waiting for
        CPU space or a growing store file when needed."""
        if stream.dead:
            return
        try:
            if stream.mode == "write" and stream.direct:
                reservation = self.catalog.reserve(stream.client, stream.key[0], stream.key[1],
                                                   stream.dtype, stream.shape)
                stream.slots = [reservation.cpu] if reservation.cpu is not None else []
                stream.reservation_id = reservation.id
            else:
                size = min(self.chunk_bytes, -(-stream.nbytes // 4096) * 4096)
                count = min(self.depth, -(-stream.nbytes // self.chunk_bytes))
                while len(stream.slots) < count:
                    try:
                        piece = self.tiers.allocate_slice(
                            size, what=f"a staging slice for tensor {stream.key[1]!r}")
                    except TierFullError:
                        if not stream.slots:
                            raise
                        break  # fewer chunks in flight: slower, but a tier this full still works
                    stream.slots.append(piece)
                    stream.busy.append(False)
        except SpaceShortage:
            self.tiers.when_space(lambda error: (
                self._fill_slots(stream, done) if error is None else self._fail_open(stream, error, done)))
            return
        except InfinityError as exc:
            self._fail_open(stream, exc, done)
            return
        if stream.mode == "write" and not stream.direct and stream.layout is None:
            self.tiers.allocate_disk(stream.nbytes, lambda layout, error: (
                self._got_extents(stream, layout, done) if error is None
                else self._fail_open(stream, error, done)))
            return
        self._opened(stream, done)

    def _got_extents(self, stream: Stream, layout: TensorLayout | None, done: Opened) -> None:
        assert layout is not None
        if stream.dead:
            self.tiers.free_disk(layout)
            return
        stream.layout = layout
        assert self.tiers.nvme is not None  # it gave the extents
        stream.sync_failures_before = self.tiers.nvme.sync_failures
        stream.crcs = crc_buffer(crc_blocks(stream.nbytes))
        stream.written = bytearray(-(-stream.nbytes // CRC_BLOCK_BYTES))
        self._opened(stream, done)

    def _fail_open(self, stream: Stream, error: InfinityError, done: Opened) -> None:
        if not stream.dead:
            self._discard(stream)
            done(error)

    def _opened(self, stream: Stream, done: Opened) -> None:
        stream.opened = True
        done(self._info(stream))

    def _info(self, stream: Stream) -> StreamInfo:
        version = stream.version.stamp if stream.version is not None else 0
        return StreamInfo(stream.id, stream.nbytes, stream.dtype, stream.shape, version,
                          stream.direct, self.chunk_bytes, stream.slot_placements())

    # --- chunks -------------------------------------------------------------------------

    def _get(self, client: int, stream_id: int) -> Stream:
        stream = self._streams.get((client, stream_id))
        if stream is None or stream.dead:
            raise LeaseError(f"stream {stream_id} is not open in this session (closed already?)")
        if not stream.opened:
            raise LeaseError(f"stream {stream_id} is still opening; wait for stream_open's answer "
                             f"before sending its chunks or closing it")
        return stream

    def chunk(self, client: int, stream_id: int, slot: int, offset: int, nbytes: int,
              done: Done) -> None:
        """Move bytes [offset, offset + nbytes) between the tensor and staging slice `slot`."""
        stream = self._get(client, stream_id)
        if stream.direct:
            raise InvalidRequestError("this stream is direct: copy the whole tensor through its "
                                      "one slice, then close it")
        if not 0 <= slot < len(stream.slots):
            raise OutOfRangeError(f"stream {stream_id} has slices 0 to {len(stream.slots) - 1}, "
                                  f"not {slot}")
        if stream.busy[slot]:
            raise LeaseError(f"staging slice {slot} of stream {stream_id} is still in use; wait "
                             f"for its last chunk's reply")
        if nbytes > self.chunk_bytes:
            raise OutOfRangeError(f"a chunk is at most the stream's chunk_bytes = "
                                  f"{self.chunk_bytes} bytes, not {nbytes}")
        piece = stream.slots[slot]
        tiers = self.tiers
        stream.busy[slot] = True
        stream.inflight += 1

        def finished(error: InfinityError | None) -> None:
            stream.busy[slot] = False
            stream.inflight -= 1
            if error is None and stream.mode == "write":
                first = offset // CRC_BLOCK_BYTES
                last = -(-(offset + nbytes) // CRC_BLOCK_BYTES)
                stream.written[first:last] = b"\x01" * (last - first)
                tiers.note_stream_write(nbytes)
            if not stream.dead:
                done(error)
            self._settle(stream)

        try:
            if stream.mode == "read":
                assert stream.version is not None
                tiers.read_part(stream.version, piece, offset_bytes=offset, nbytes=nbytes,
                                done=finished)
            else:
                assert stream.layout is not None and stream.crcs is not None
                nvme = tiers.nvme
                assert nvme is not None
                if offset + nbytes == stream.nbytes:  # the tail's 4 KiB padding goes to disk too
                    tiers.zero(piece, nbytes, -(-nbytes // 4096) * 4096)
                future = nvme.write_part(stream.layout, tiers.address_of(piece),
                                         offset_bytes=offset, nbytes=nbytes, crcs=stream.crcs)
                future.add_done_callback(lambda f: finished(f.exception()))
        except BaseException:
            stream.busy[slot] = False
            stream.inflight -= 1
            raise

    # --- close ----------------------------------------------------------------------------

    def close(self, client: int, stream_id: int, *, commit: bool, durable: bool,
              done: Closed) -> None:
        """End a stream: a write publishes its tensor (commit) or drops it; `done(version or
        error)` once that is settled (durable: once it is on NVMe and in the index)."""
        stream = self._get(client, stream_id)
        if durable:
            self.tiers.require_durable()
        stream.dead = True  # no more chunks; the close runs once those in flight end
        stream.closing = lambda: self._finish_close(stream, commit=commit, durable=durable,
                                                    done=done)
        self._settle(stream)

    def _settle(self, stream: Stream) -> None:
        if stream.inflight or not stream.dead:
            return
        closing, stream.closing = stream.closing, None
        if closing is not None:
            closing()
        else:
            self._discard(stream)

    def _finish_close(self, stream: Stream, *, commit: bool, durable: bool, done: Closed) -> None:
        key = stream.key
        if stream.mode == "read":
            version = stream.version
            self._discard(stream)
            done(version.stamp if version is not None else 0)
            return
        if not commit:
            self._discard(stream)
            done(0)
            return
        try:
            if stream.direct:
                if not self._reserved(stream):
                    raise LeaseError(
                        f"the reservation of tensor {key[1]!r} that stream {stream.id} was "
                        f"writing is gone (aborted by this client?); write the tensor again")
                stream.slots = []  # the reservation's slice becomes the version's
                self._forget(stream)
                version = self.catalog.commit(stream.client, key[0], key[1])
            else:
                missing = stream.written.find(0)
                if missing >= 0:
                    raise InvalidRequestError(
                        f"stream {stream.id} never wrote bytes from {missing * CRC_BLOCK_BYTES} of "
                        f"tensor {key[1]!r}; write every chunk before closing with commit")
                assert stream.layout is not None and stream.crcs is not None
                layout = finished_layout(stream.layout, stream.crcs)
                stream.layout = None  # now the version's
                self._discard(stream)
                copy = DiskCopy(layout, sync_failures_before=stream.sync_failures_before)
                version = self.catalog.install(key, stream.dtype, stream.shape, stream.nbytes,
                                               cpu=None, dirty=False, nvme=copy)
        except InfinityError as exc:
            self._discard(stream)
            done(exc)
            return
        if not durable:
            done(version.stamp)
            return
        self.tiers.make_durable([version], lambda errors: done(
            errors[0] if errors[0] is not None else version.stamp))

    def _forget(self, stream: Stream) -> None:
        """The stream is no longer open (once: a stream is forgotten at most once)."""
        if self._streams.pop((stream.client, stream.id), None) is not None:
            left = self._open_by_client[stream.client] - 1
            if left:
                self._open_by_client[stream.client] = left
            else:
                del self._open_by_client[stream.client]

    def _discard(self, stream: Stream) -> None:
        """Give back whatever the stream holds (nothing may be in flight)."""
        stream.dead = True
        self._forget(stream)
        if stream.mode == "read":
            if stream.version is not None:
                self.catalog.release(DAEMON_CLIENT_ID, stream.lease_id)
                stream.version = None
            if not stream.direct:
                for piece in stream.slots:
                    self.tiers.free_slice(piece)
            stream.slots = []
            return
        if stream.direct:
            if self._reserved(stream):
                try:
                    self.catalog.abort(stream.client, stream.key[0], stream.key[1])
                except InfinityError:
                    pass  # dropped with the client already
            stream.slots = []
            return
        for piece in stream.slots:
            self.tiers.free_slice(piece)
        stream.slots = []
        if stream.layout is not None:
            self.tiers.free_disk(stream.layout)
            stream.layout = None

    def _reserved(self, stream: Stream) -> bool:
        """Whether the client's reservation of the stream's name is the one the stream made:
        a reserve refused because the client held one already, or one aborted by the client
        and made afresh, is the client's own, which the stream must not abort."""
        if stream.reservation_id is None:
            return False
        reservation = self.catalog.holder_of(stream.client).reservations.get(stream.key)
        return reservation is not None and reservation.id == stream.reservation_id

    def drop_client(self, client: int) -> int:
        """A client went away: end its streams (each as soon as its chunks in flight end)."""
        mine = [s for (c, _), s in list(self._streams.items()) if c == client]
        for stream in mine:
            stream.dead = True
            stream.closing = None
            self._settle(stream)
        return len(mine)
