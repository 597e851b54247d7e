"""Streams: tensors of any size written from or read into a caller's tensor, in chunks.

`StreamCalls` holds the Client's write_from, write_pieces, read_into and read_rows (some rows
of a tensor, reading from NVMe only the checksum blocks that hold them). A stream opens on the
daemon (stream_open), moves its bytes through staging slices of the CPU tier (stream_chunk
requests kept nvme.stream_depth deep, one slot each), and closes (stream_close, committing a
write).
A small tensor, or any without an NVMe tier, goes directly through one slice.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterator, Sequence

import torch

from infinity.client.channel import Channel
from infinity.client.segments import dtype_name
from infinity.client.session import Session
from infinity.client.tensors import byte_view
from infinity.errors import InfinityError, InvalidRequestError
from infinity.io import copy_into
from infinity.protocol import wire
from infinity.protocol.wire import ItemError
from infinity.io.ops import CRC_BLOCK_BYTES


# write_pieces' source of bytes: fill(piece, offset) writes the tensor's bytes
# [offset, offset + piece.numel()) into `piece`, a flat uint8 view of shared memory.
PieceFill = Callable[[torch.Tensor, int], None]


class StreamCalls(Session):
    """The Client's stream calls."""

    def read_into(self, name: str, out: torch.Tensor, *, namespace: str = "default") -> int:
        """Copy tensor `name` into `out`, whatever its size; returns the version read.

        `out` is any contiguous tensor (any device) of exactly the tensor's byte size; its
        dtype and shape are not checked. A resident tensor is copied from its shared slice;
        one only on NVMe is read in chunks of nvme.stream_chunk_bytes through staging slices
        of the CPU tier (CRC32C verified), nvme.stream_depth of them in flight, without
        loading it into the tier. Works for tensors larger than the CPU tier, which `get`
        refuses (TooLargeError).
        """
        flat = byte_view(out, "out", written=True)
        info = self._open_stream(wire.StreamOpen(namespace, name, "read"))
        try:
            if info.nbytes != flat.numel():
                raise InvalidRequestError(
                    f"tensor {name!r} in namespace {namespace!r} has {info.nbytes} bytes but `out` "
                    f"holds {flat.numel()}; pass an output of exactly that many bytes")
            self._stream_in(info, flat)
        except BaseException:
            self._close_stream(info, commit=False, durable=False, quiet=True)
            raise
        return self._close_stream(info, commit=False, durable=False)

    def read_rows(self, name: str, rows: torch.Tensor, out: torch.Tensor, *,
                  namespace: str = "default") -> int:
        """Copy rows of tensor `name` (its first dimension) into `out`: `out[i]` gets row
        `rows[i]`; returns the version read. `rows` is a 1-D integer tensor (any order,
        repeats allowed); `out` a contiguous CPU tensor of `len(rows)` rows of the tensor's
        row size in bytes (its dtype is not checked).

        A resident tensor is copied from its shared slice; one only on NVMe is read in whole
        1 MiB checksum blocks, only those that hold a wanted row (verified, through the
        stream's staging slices, not loading the tensor into the CPU tier): an embedding's few
        rows per token cost a block each, not the table."""
        wanted = rows.reshape(-1).to(torch.int64)
        flat = byte_view(out, "out", written=True)
        info = self._open_stream(wire.StreamOpen(namespace, name, "read"))
        try:
            count = len(wanted)
            row_bytes = flat.numel() // count if count else 0
            if count and (row_bytes * count != flat.numel() or not row_bytes
                          or info.nbytes % row_bytes):
                raise InvalidRequestError(
                    f"`out` holds {flat.numel()} bytes for {count} rows, and tensor {name!r} "
                    f"in namespace {namespace!r} has {info.nbytes}: pass an output of len(rows) "
                    f"rows of the tensor's row size")
            if count and (int(wanted.min()) < 0 or int(wanted.max()) * row_bytes >= info.nbytes):
                raise InvalidRequestError(
                    f"rows {int(wanted.min())} to {int(wanted.max())} asked of tensor {name!r} "
                    f"in namespace {namespace!r}, which has {info.nbytes // max(1, row_bytes)}")
            if count:
                self._rows_in(info, wanted, row_bytes, flat.view(count, row_bytes))
        except BaseException:
            self._close_stream(info, commit=False, durable=False, quiet=True)
            raise
        return self._close_stream(info, commit=False, durable=False)

    def write_from(self, name: str, src: torch.Tensor, *, namespace: str = "default",
                   durable: bool = False) -> int:
        """Store a copy of `src` (any contiguous tensor, any size) as `name`'s new version.

        With an NVMe tier, a tensor larger than one chunk goes in chunks through staging
        slices of the CPU tier straight to fresh NVMe extents (its version then lives on NVMe
        only, until a get loads it); a smaller one, or any without an NVMe tier, is a `put`.
        Nothing is published unless every byte was written. durable=True: return once it is
        durable (see `commit`). Returns the version number.
        """
        flat = byte_view(src, "src", written=False)

        def fill(piece: torch.Tensor, offset: int) -> None:
            # Streaming stores: this process never reads the slice back.
            copy_into(piece, flat[offset:offset + piece.numel()])

        return self.write_pieces(name, src.dtype, tuple(src.shape), fill, namespace=namespace,
                                 durable=durable, expect_nbytes=flat.numel())

    def write_pieces(self, name: str, dtype: torch.dtype, shape: Sequence[int],
                     fill: PieceFill, *, namespace: str = "default", durable: bool = False,
                     expect_nbytes: int | None = None) -> int:
        """As `write_from`, for bytes the caller does not hold in one tensor (a file, say):
        `fill(piece, offset)` writes bytes [offset, offset + piece.numel()) of the new version
        into `piece`, a flat uint8 view of shared memory, and is called for consecutive pieces
        in order of offset. The pieces are the stream's chunks (nvme.stream_chunk_bytes) where
        it is staged, or one piece of the whole tensor where it is direct; so a caller that
        reads a file into them holds no more than a chunk or the tensor's own slice. An
        exception from `fill` aborts the write (nothing is published) and is raised.
        `expect_nbytes`: InvalidRequestError unless the tensor has that many bytes."""
        self._check_usable()  # before any lock: see `commit`
        if self._spares.forget(namespace, [name]):
            self._abort_quietly([name], namespace)  # the stream reserves the name itself
        info = self._open_stream(wire.StreamOpen(namespace, name, "write", dtype_name(dtype),
                                                 tuple(shape)))
        try:
            if expect_nbytes is not None and info.nbytes != expect_nbytes:
                raise InvalidRequestError(f"the stream takes {info.nbytes} bytes, not "
                                          f"{expect_nbytes}")
            self._stream_out(info, fill)
        except BaseException:
            self._close_stream(info, commit=False, durable=False, quiet=True)
            raise
        try:
            return self._close_stream(info, commit=True, durable=durable)
        except InfinityError:
            # A close refused as a whole (durable without an NVMe tier) left the stream open.
            self._close_stream(info, commit=False, durable=False, quiet=True)
            raise

    def _open_stream(self, message: wire.StreamOpen) -> wire.StreamInfo:
        (result,) = self._call(message, on_late_reply=self._late_stream_undo)
        self._raise_first([result])
        return wire.StreamInfo.from_wire(result)

    def _late_stream_undo(self, reply: wire.Reply) -> None:
        """As `_late_lease_undo`, for a stream_open given up on: the stream it opened (its
        staging slices, its extents or its read lease) is closed without committing."""
        if reply.failure is None and reply.results and type(reply.results[0]) is not ItemError:
            info = wire.StreamInfo.from_wire(reply.results[0])
            self._send(wire.StreamClose(info.stream_id, False, False))  # its answer not waited for

    def _close_stream(self, info: wire.StreamInfo, *, commit: bool, durable: bool,
                      quiet: bool = False) -> int:
        try:
            (result,) = self._call(wire.StreamClose(info.stream_id, commit, durable),
                                   patient=durable)
            self._raise_first([result])
        except InfinityError:
            if quiet:
                return 0  # already failing: the first error is the one to raise
            raise
        return int(result)

    def _slot_views(self, info: wire.StreamInfo) -> list[torch.Tensor]:
        assert self._segments is not None
        return [self._segments.view(slot) for slot in info.slots]

    def _chunk(self, channel: Channel, info: wire.StreamInfo, slot: int, offset: int,
               nbytes: int) -> int:
        request_id = next(self._request_ids)
        channel.send(request_id, wire.StreamChunk(info.stream_id, slot, offset, nbytes),
                     expect_reply=True, releases=self._take_releases())
        return request_id

    def _chunk_done(self, channel: Channel, request_id: int) -> None:
        self._raise_first(self._results(channel.wait(request_id, what="a stream chunk")))

    def _drain(self, channel: Channel, pending: deque[tuple[int, int, int, int]]) -> None:
        """After a failure: collect the replies still due, so the channel holds no strays."""
        while pending:
            request_id = pending.popleft()[0]
            try:
                channel.wait(request_id, what="a stream chunk")
            except InfinityError:
                return  # the daemon is gone: nothing more will come

    def _stream_in(self, info: wire.StreamInfo, flat: torch.Tensor) -> None:
        if info.direct:
            if info.nbytes:
                flat.copy_(self._slot_views(info)[0][:info.nbytes])
            return
        chunks = ((offset, min(info.chunk_bytes, info.nbytes - offset))
                  for offset in range(0, info.nbytes, info.chunk_bytes))

        def consume(view: torch.Tensor, offset: int, n: int) -> None:
            flat[offset:offset + n].copy_(view[:n])

        self._read_chunks(info, chunks, consume)

    def _read_chunks(self, info: wire.StreamInfo, chunks: Iterator[tuple[int, int]],
                     consume: Callable[[torch.Tensor, int, int], None]) -> None:
        """Read `chunks` ((offset, nbytes) each, in order) of a staged read stream into its
        slices, all of them in flight at once, and hand each to `consume(slice, offset,
        nbytes)` once read, in order; the slice is read into again after that."""
        self._check_usable()
        channel = self._channel()
        slots = self._slot_views(info)
        pending: deque[tuple[int, int, int, int]] = deque()  # (request id, slot, offset, n)

        def issue(slot: int) -> None:
            chunk = next(chunks, None)
            if chunk is not None:
                pending.append((self._chunk(channel, info, slot, *chunk), slot, *chunk))

        try:
            for slot in range(len(slots)):
                issue(slot)
            while pending:
                request_id, slot, offset, n = pending.popleft()
                self._chunk_done(channel, request_id)
                consume(slots[slot], offset, n)
                issue(slot)
        except BaseException:
            self._drain(channel, pending)
            raise

    def _rows_in(self, info: wire.StreamInfo, rows: torch.Tensor, row_bytes: int,
                 out: torch.Tensor) -> None:
        """Fill `out[i]` with the bytes of row `rows[i]`: from the slice of a direct stream,
        else chunk by chunk over the runs of blocks that hold wanted rows."""
        if info.direct:
            table = self._slot_views(info)[0][:info.nbytes].view(-1, row_bytes)
            torch.index_select(table, 0, rows, out=out)
            return
        starts = rows * row_bytes
        first = torch.div(starts, CRC_BLOCK_BYTES, rounding_mode="floor")
        last = torch.div(starts + row_bytes - 1, CRC_BLOCK_BYTES, rounding_mode="floor")
        blocks = torch.unique(torch.cat([torch.arange(int(a), int(b) + 1)
                                         for a, b in zip(first.tolist(), last.tolist())]))
        per_chunk = max(1, info.chunk_bytes // CRC_BLOCK_BYTES)
        chunks: list[tuple[int, int]] = []  # (offset, nbytes): runs of wanted blocks
        for block in blocks.tolist():
            offset = block * CRC_BLOCK_BYTES
            if chunks and chunks[-1][0] + chunks[-1][1] == offset and (
                    chunks[-1][1] < per_chunk * CRC_BLOCK_BYTES):
                chunks[-1] = (chunks[-1][0], chunks[-1][1] + CRC_BLOCK_BYTES)
            else:
                chunks.append((offset, CRC_BLOCK_BYTES))
        chunks = [(offset, min(n, info.nbytes - offset)) for offset, n in chunks]
        ends = starts + row_bytes

        def consume(view: torch.Tensor, offset: int, n: int) -> None:
            # Each row's bytes inside this chunk (a row may straddle two chunks).
            inside = ((starts < offset + n) & (ends > offset)).nonzero().flatten().tolist()
            for i in inside:
                begin = max(int(starts[i]), offset)
                end = min(int(ends[i]), offset + n)
                at = begin - int(starts[i])
                out[i, at:at + end - begin].copy_(view[begin - offset:end - offset])

        self._read_chunks(info, iter(chunks), consume)

    def _stream_out(self, info: wire.StreamInfo, fill: PieceFill) -> None:
        if info.direct:
            if info.nbytes:
                fill(self._slot_views(info)[0][:info.nbytes], 0)
            return
        self._check_usable()
        channel = self._channel()
        slots = self._slot_views(info)
        free = list(range(len(slots)))
        pending: deque[tuple[int, int, int, int]] = deque()
        try:
            for offset in range(0, info.nbytes, info.chunk_bytes):
                if not free:
                    request_id, slot, _, _ = pending.popleft()
                    self._chunk_done(channel, request_id)
                    free.append(slot)
                slot = free.pop()
                n = min(info.chunk_bytes, info.nbytes - offset)
                fill(slots[slot][:n], offset)
                pending.append((self._chunk(channel, info, slot, offset, n), slot, offset, n))
            while pending:
                self._chunk_done(channel, pending.popleft()[0])
        except BaseException:
            self._drain(channel, pending)
            raise
