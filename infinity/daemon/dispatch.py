"""The dispatcher: owns the control socket, and turns each request into one handler call.

It receives each request (one ZeroMQ frame behind the client socket's
identity), decodes its envelope (`infinity.protocol.wire`), finds the sending
socket's session, serves the releases riding along, looks the op up in the
registry (one dict lookup: op -> (its schema's decoder, the handler of the
service that owns it)), and sends what the handler returns (see
`services.base`): results now, a `Deferred` once it completes, nothing for the
requests that get no reply. A request that fails as a whole gets an error
reply, and the loop goes on.

Services register their ops with `register`; the requests about the sending
socket itself (hello, attach, detach), which need its identity, with
`register_socket_ops`. A `multi` request is served here: each request it
carries (decoded with it, by its own schema) goes to its handler through the
same registry, in order, and the one reply carries each one's results or error,
once all are complete.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence, cast

import zmq

from infinity.daemon.loop import EventLoop
from infinity.daemon.services.base import (DaemonCounters, Deferred, Handler, Packed, Routes,
                                           SocketHandler)
from infinity.daemon.sessions import Session, Sessions
from infinity.errors import InfinityError, LimitExceededError, ProtocolError
from infinity.protocol import wire
from infinity.protocol.wire import ItemError

log = logging.getLogger("infinityd")

# Messages served per wake-up before the loop looks at its other fds again.
ROUTER_BATCH = 256
HWM_MESSAGES = 100_000
# pyzmq's flags are enum members, and each `&` or `|` on them builds a new one: plain ints on the
# per-message path save a few microseconds a request.
_EVENTS, _POLLIN, _RCVMORE = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVMORE)
_NOBLOCK, _SNDMORE_NOBLOCK = int(zmq.NOBLOCK), int(zmq.SNDMORE | zmq.NOBLOCK)

Decoder = Callable[[Sequence[Any]], Any]  # a schema's `from_body`
ReleaseIds = Callable[[Session, Sequence[int]], None]
Guard = Callable[[Session, Any], None]  # raises an InfinityError for a request refused


class MultiParts(list):  # type: ignore[type-arg]
    """A multi's results: one part per request it carried (`wire.encode_multi_reply`)."""


class Dispatcher:
    """The ROUTER socket, the op registry, and the sending of every reply."""

    def __init__(self, loop: EventLoop, sessions: Sessions, counters: DaemonCounters, *,
                 release: ReleaseIds, guard: Guard = lambda session, message: None,
                 max_pending_per_client: int = 4096) -> None:
        self.loop = loop
        self._max_pending = max_pending_per_client
        # Refuses a request the session may not make (a private namespace it was not granted),
        # before its handler runs; every request of a multi is checked on its own.
        self._guard = guard
        self.sessions = sessions
        self.counters = counters
        self._release = release  # serves the releases that ride along a request
        self._routes: dict[str, tuple[Decoder, Handler]] = {
            wire.Multi.OP: (wire.Multi.from_body, self._multi)}
        self._socket_routes: dict[str, tuple[Decoder, SocketHandler]] = {}
        self._openers: dict[str, tuple[Decoder, SocketHandler]] = {}
        self._context = zmq.Context(io_threads=1)
        self.context = self._context  # the daemon's one ZeroMQ context (telemetry's PUB too)
        self.router = self._context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        self.router.setsockopt(zmq.SNDHWM, HWM_MESSAGES)
        self.router.setsockopt(zmq.RCVHWM, HWM_MESSAGES)

    # --- the registry --------------------------------------------------------------

    def register(self, routes: Routes) -> None:
        """Serve each request schema's op with its handler (an op has one owner)."""
        for schema, handler in routes.items():
            self._add(self._routes, schema, handler)

    def register_socket_ops(self, *, openers: dict[type, SocketHandler],
                            socket_routes: dict[type, SocketHandler]) -> None:
        """The requests that need the sending socket's identity: `openers` from a socket
        without a session (hello, attach), `socket_routes` from one in a session."""
        for schema, handler in openers.items():
            self._add(self._openers, schema, handler)
        for schema, handler in socket_routes.items():
            self._add(self._socket_routes, schema, handler)

    def _add(self, table: dict[str, Any], schema: type, handler: Any) -> None:
        op: str = getattr(schema, "OP")
        if wire.REQUESTS.get(op) is not schema:
            raise ValueError(f"{schema.__name__} is not the request schema of op {op!r} in wire")
        # From a session's socket, an op has one handler, whichever table holds it.
        tables = (table,) if table is self._openers else (self._routes, self._socket_routes)
        if any(op in taken for taken in tables):
            raise ValueError(f"op {op!r} is registered twice")
        table[op] = (getattr(schema, "from_body"), handler)

    def check_complete(self) -> None:
        """Every op of the protocol has its handler (called once all services registered)."""
        served = self._routes.keys() | self._socket_routes.keys()
        missing = sorted(wire.REQUESTS.keys() - served)
        if missing or not wire.MULTI_OPS <= self._routes.keys():
            raise ValueError(f"ops without a handler: {missing or sorted(wire.MULTI_OPS)}")

    # --- the socket ------------------------------------------------------------------

    def bind(self, endpoint: str) -> None:
        self.router.bind(endpoint)
        self.loop.add_reader(self.router, self.drain)

    def close(self) -> None:
        self.loop.remove_reader(self.router)
        self.router.close(linger=200)  # lets a shutdown reply leave
        self._context.term()

    def drain(self) -> None:
        """Serve what the socket holds (up to ROUTER_BATCH messages)."""
        router = self.router
        recv, getsockopt = router.recv, router.getsockopt
        for _ in range(ROUTER_BATCH):
            # Asking is cheaper than the exception an empty recv raises.
            if not cast(int, getsockopt(_EVENTS)) & _POLLIN:
                return
            try:
                identity = recv(_NOBLOCK)
                payload = recv(_NOBLOCK) if getsockopt(_RCVMORE) else b""
            except zmq.Again:
                return
            if getsockopt(_RCVMORE) or not payload:
                extra = 0
                while getsockopt(_RCVMORE):
                    recv(_NOBLOCK)
                    extra += 1
                self.counters.malformed += 1
                self._error(identity, 0, ProtocolError(
                    f"a request is one non-empty ZeroMQ frame, not {extra + 1 if payload else 0}"))
                continue
            self._serve(identity, payload)

    def _serve(self, identity: bytes, payload: bytes) -> None:
        counters = self.counters
        counters.requests += 1
        request_id = 0
        try:
            envelope = wire.decode_envelope(payload)
            op, request_id, body = envelope.op, envelope.request_id, envelope.body
            counters.ops[op] = counters.ops.get(op, 0) + 1
            session = self.sessions.by_identity.get(identity)
            if session is None:
                opener = self._openers.get(op)
                if opener is None:
                    raise ProtocolError(
                        f"{op!r} on a socket without a session: it never said hello, or its "
                        f"session ended (bye, process exit, or daemon.client_timeout_s of "
                        f"silence); connect again with infinity.connect()")
                self._answer(identity, request_id, opener[1](identity, None, request_id,
                                                             opener[0](body)), None)
                return
            session.last_seen = time.monotonic()
            session.counters.requests += 1
            if envelope.releases:
                self._release(session, envelope.releases)
            if session.pending_replies >= self._max_pending:
                raise LimitExceededError(
                    f"{session.pending_replies} requests of this client are waiting for their "
                    f"replies (daemon.max_pending_requests_per_client); wait for replies before "
                    f"sending more")
            route = self._routes.get(op)
            if route is not None:
                decode, handle = route
                message = decode(body)
                self._guard(session, message)
                result = handle(session, request_id, message)
            else:
                decode, socket_handle = self._socket_routes[op]
                result = socket_handle(identity, session, request_id, decode(body))
            if result is not None:
                self._answer(identity, request_id, result, session)
        except InfinityError as exc:
            if isinstance(exc, ProtocolError):
                counters.malformed += 1
            self._error(identity, request_id, exc)
            # Answered: its traceback goes now. The frames in it may hold the error in a local
            # (a handler that raised an item's error from its results), a reference cycle per
            # failed request that only the daemon's rare full collections would free.
            exc.__traceback__ = None
        except Exception as exc:  # a bug: report it, keep serving
            log.exception("internal error while serving a request")
            self._error(identity, request_id, _internal(exc))
            exc.__traceback__ = None  # logged: as above

    # --- replies ---------------------------------------------------------------------

    def _answer(self, identity: bytes, request_id: int, result: Any,
                session: Session | None) -> None:
        """Send a handler's result (see services.base), or have a Deferred send it when done."""
        kind = type(result)
        if kind is Packed:
            data = wire.encode_packed_reply(request_id, result)
        elif kind is list:
            data = wire.encode_reply(request_id, result)
        elif kind is Deferred:
            assert session is not None
            if result.left:
                session.pending_replies += 1
                result.deliver = lambda done: self._deliver_pending(identity, request_id, done,
                                                                    session)
            else:
                self._deliver(identity, request_id, result, session)
            return
        elif kind is MultiParts:
            data = wire.encode_multi_reply(request_id, result)
        elif result is None:
            return
        else:
            raise TypeError(f"a handler returned {kind.__name__}, not a result")
        try:
            self.router.send(identity, _SNDMORE_NOBLOCK)
            self.router.send(data, _NOBLOCK)
        except zmq.ZMQError as exc:  # the peer's queue is full or it is gone: it will time out
            log.debug("reply %d not sent: %s", request_id, exc)

    def _deliver_pending(self, identity: bytes, request_id: int, done: Deferred,
                         session: Session) -> None:
        session.pending_replies -= 1
        self._deliver(identity, request_id, done, session)

    def _deliver(self, identity: bytes, request_id: int, done: Deferred, session: Session) -> None:
        if session.alive:  # a client that went away gets nothing
            self._answer(identity, request_id, done.results, session)

    def _error(self, identity: bytes, request_id: int, exc: InfinityError) -> None:
        session = self.sessions.by_identity.get(identity)
        self.counters.error(exc.code, str(exc), session.describe() if session is not None else "")
        try:
            self.router.send_multipart(
                [identity, wire.encode_error(request_id, ItemError.of(exc))], zmq.NOBLOCK)
        except zmq.ZMQError as send_exc:
            log.debug("error reply %d not sent: %s", request_id, send_exc)

    # --- multi -----------------------------------------------------------------------

    def _multi(self, session: Session, request_id: int, message: wire.Multi
               ) -> MultiParts | Deferred:
        """Serve each request of a multi in order; one part per request in the reply."""
        parts = MultiParts()
        waiting: Deferred | None = None  # the reply, while parts wait for work off the loop
        counters = self.counters
        for sub_id, sub in message.requests:
            op = sub.OP
            counters.ops[op] = counters.ops.get(op, 0) + 1
            try:
                if not session.alive:
                    raise ProtocolError(f"the session ended earlier in this multi request, so "
                                        f"its {op} was not served")
                self._guard(session, sub)
                result = self._routes[op][1](session, sub_id, sub)
            except InfinityError as exc:
                if isinstance(exc, ProtocolError):
                    counters.malformed += 1
                counters.error(exc.code, str(exc), session.describe())
                parts.append(ItemError.of(exc))
                continue
            except Exception as exc:  # a bug: report it in place, serve the rest
                log.exception("internal error while serving a request of a multi")
                error = _internal(exc)
                counters.error(error.code, str(error), session.describe())
                parts.append(ItemError.of(error))
                continue
            if type(result) is Deferred and result.left:
                if waiting is None:
                    waiting = Deferred(parts)  # one piece more: settled below
                waiting.left += 1
                result.deliver = _into_part(parts, len(parts), waiting)
                parts.append(b"")
            else:
                parts.append(_packed_part(result))
        if waiting is None:
            return parts
        waiting.settle()
        return waiting


def _packed_part(result: Any) -> bytes:
    """A request's result as one part of a multi's reply."""
    kind = type(result)
    if kind is Packed:
        return wire.encode_packed_results(result)
    if kind is Deferred:
        return wire.encode_results(result.results)
    return wire.encode_results([] if result is None else result)


def _into_part(parts: MultiParts, index: int, waiting: Deferred) -> Callable[[Deferred], None]:
    def delivered(done: Deferred) -> None:
        parts[index] = _packed_part(done)
        waiting.settle()
    return delivered


def _internal(exc: Exception) -> InfinityError:
    return InfinityError(f"infinityd failed on this request ({type(exc).__name__}: {exc}); "
                         f"see its log")
