"""Streams: the stream_open, stream_chunk and stream_close requests, on `StreamTable`.

The table (`infinity.daemon.streams`) holds the streams and drives their I/O;
this service turns its callbacks into deferred results: each of these
requests is answered once its work is done (slices allocated, chunk moved,
tensor published).
"""

from __future__ import annotations

from infinity.daemon.namespaces import Namespaces
from infinity.daemon.services.base import DaemonCounters, Deferred, Routes
from infinity.daemon.sessions import Session
from infinity.daemon.streams import StreamTable
from infinity.errors import InfinityError
from infinity.protocol import wire
from infinity.protocol.wire import StreamInfo


class StreamService:
    """The stream requests of every session."""

    def __init__(self, table: StreamTable, counters: DaemonCounters,
                 namespaces: Namespaces) -> None:
        self.table = table
        self.counters = counters
        self.namespaces = namespaces

    def routes(self) -> Routes:
        return {wire.StreamOpen: self.open, wire.StreamChunk: self.chunk,
                wire.StreamClose: self.close}

    def client_gone(self, session: Session) -> str:
        """The session ends: its streams end as soon as their chunks in flight do."""
        return f"discarded {self.table.drop_client(session.id)} stream(s)"

    def open(self, session: Session, request_id: int, message: wire.StreamOpen) -> Deferred:
        self.namespaces.require_stream(session, message)  # a write stream writes
        self.namespaces.admit(session, (message.namespace,))
        self.counters.deferred_replies += 1
        deferred = Deferred([None])
        session.counters.streams += 1

        def opened(result: StreamInfo | InfinityError) -> None:
            if isinstance(result, InfinityError):
                deferred.results[0] = self.counters.item_error(session, result)
            else:
                deferred.results[0] = result.to_wire()
            deferred.settle()

        # The stream is named by the request id of its stream_open (unique per client).
        self.table.open(session.id, request_id, message.namespace, message.name, message.mode,
                        message.dtype, message.shape, opened)
        return deferred

    def chunk(self, session: Session, request_id: int, message: wire.StreamChunk) -> Deferred:
        deferred = Deferred([None])

        def moved(error: InfinityError | None) -> None:
            if error is not None:
                deferred.results[0] = self.counters.item_error(session, error)
            else:
                session.counters.stream_bytes += message.nbytes
            deferred.settle()

        self.table.chunk(session.id, message.stream_id, message.slot, message.offset,
                         message.nbytes, moved)
        return deferred

    def close(self, session: Session, request_id: int, message: wire.StreamClose) -> Deferred:
        deferred = Deferred([None])

        def closed(result: int | InfinityError) -> None:
            if isinstance(result, InfinityError):
                deferred.results[0] = self.counters.item_error(session, result)
            else:
                deferred.results[0] = result
            deferred.settle()

        self.table.close(session.id, message.stream_id, commit=message.commit,
                         durable=message.durable, done=closed)
        return deferred
