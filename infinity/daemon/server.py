"""The server: binds the control socket and the fd channel, and turns requests into catalog calls.

This is the only daemon module that knows both the wire format and the
catalog. It runs entirely on the event loop's thread: decode a request
(`infinity.protocol.wire`), act on the catalog, the tiers and the streams,
encode the reply. Every request is answered item by item; a malformed request
gets a typed error reply and the loop goes on.

With an NVMe tier it also owns the scheduler (`infinity.daemon.scheduler`): it
maps each client's accesses and `step` markers to the scheduler's streams, saves
their traces in the store's index, and once per loop turn with news starts the
loads the scheduler plans.

Requests that need work off the loop are answered later, never waited for: a
`reserve` that needs CPU space (a new segment, or victims being written back)
is parked and resumes where it stopped; a `get` of tensors that are only on
NVMe is answered once their loads completed (concurrent gets share a load);
`commit_durable`, `flush_store` and the `delete` of a flushed tensor once the
index committed; stream chunks once their I/O is done.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, cast

import zmq

from infinity import __version__
from infinity.config import InfinityConfig
from infinity.daemon.arena import CpuArena, SpaceShortage
from infinity.daemon.catalog import Catalog, Reservation, Version, version_clock
from infinity.daemon.fdserver import FdConnection, FdServer
from infinity.daemon.loop import EventLoop
from infinity.daemon.scheduler import AccessKind, Scheduler, StreamKey
from infinity.daemon.trace import Trace
from infinity.daemon.sessions import Session, Sessions, counters_dict, open_pidfd
from infinity.daemon.streams import StreamTable
from infinity.daemon.residency import Residency
from infinity.daemon.restore import restore_catalog
from infinity.daemon.tiers import TierManager
from infinity.errors import InfinityError, ProtocolError
from infinity.protocol import wire
from infinity.protocol.paths import RuntimeLayout
from infinity.protocol.wire import ItemError, Placement, ReserveItem, StreamInfo

log = logging.getLogger("infinityd")

# How long gets that found everything resident may wait for the next prefetch plan.
LAZY_PLAN_DELAY_S = 0.002
# Messages served per wake-up before the loop looks at its other fds again.
ROUTER_BATCH = 256
HWM_MESSAGES = 100_000
# pyzmq's flags are enum members, and each `&` or `|` on them builds a new one: plain ints on the
# per-message path save a few microseconds a request.
_EVENTS, _POLLIN, _RCVMORE = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVMORE)
_NOBLOCK, _SNDMORE_NOBLOCK = int(zmq.NOBLOCK), int(zmq.SNDMORE | zmq.NOBLOCK)


@dataclass(slots=True)
class DaemonCounters:
    """Daemon-wide counters, kept as work happens (the monitor reads them through `stats`)."""

    requests: int = 0
    items: int = 0
    malformed: int = 0
    ops: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    bytes_leased: int = 0
    bytes_reserved: int = 0
    bytes_committed: int = 0
    parked_requests: int = 0
    deferred_replies: int = 0  # answered after work off the loop (loads, flushes, index)

    def error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1


@dataclass(eq=False, slots=True)
class _ParkedReserve:
    """A reserve request waiting for the tier to grow; `index` is the item to resume at."""

    session: Session
    identity: bytes
    request_id: int
    items: tuple[ReserveItem, ...]
    results: list[Any]
    index: int = 0


@dataclass(eq=False, slots=True)
class _Deferred:
    """A request whose reply waits for work off the loop: `left` items still to come."""

    session: Session
    identity: bytes
    request_id: int
    results: list[Any]
    left: int = 0
    stream: StreamKey | None = None  # a get the client waits on: its stall ends with the reply


Handler = Callable[[Session, bytes, int, Sequence[Any]], None]


def _reserved_placement(reservation: Reservation) -> list[Any]:
    """A reservation's slice on the wire (version 0: not published)."""
    cpu = reservation.cpu
    return Placement(-1 if cpu is None else cpu.segment, 0 if cpu is None else cpu.offset,
                     reservation.nbytes, reservation.dtype, reservation.shape, 0).to_wire()


class Daemon:
    """infinityd's state and its request handlers, all on one loop thread."""

    def __init__(self, config: InfinityConfig, layout: RuntimeLayout) -> None:
        self.config = config
        self.layout = layout
        self.loop = EventLoop()
        self.arena = CpuArena(config.cpu, poison=config.daemon.poison_released,
                              on_retire=self._on_segment_retired)
        # Built in one pass, each from what is built before it: residency (the one owner of
        # what is in the CPU tier, which the scheduler and the tiers ask), the scheduler, the
        # tiers, then the catalog on top of them; both stamp from one clock.
        self.residency = Residency()
        # The scheduler decides what the CPU tier keeps and loads ahead; with no NVMe tier
        # everything is resident and there is nothing to decide.
        self.scheduler: Scheduler | None = None
        if config.nvme.dirs:
            self.scheduler = Scheduler(config.scheduler, cpu_tier_bytes=config.cpu.budget_bytes,
                                       is_pinned=self.residency.is_pinned)
        clock = version_clock()
        self.tiers = TierManager(config, self.loop, self.arena, self.residency, clock=clock,
                                 scheduler=self.scheduler,
                                 on_change=self._plan_soon if self.scheduler is not None else None)
        self.catalog = Catalog(self.tiers, clock=clock,
                               spare_budget_bytes=config.cpu.spare_budget_bytes)
        restored = restore_catalog(self.catalog, self.tiers.durability)
        if self.tiers.durable:
            log.info("NVMe tier: %d flushed tensor(s) restored from the index", restored)
        self._stream_owners: dict[StreamKey, int] = {}  # stream -> the live session that holds it
        # Streams of a client whose name another live client had: keyed "<name>#<session id>",
        # kept only as long as their session (one trace cannot describe two processes).
        self._session_streams: set[StreamKey] = set()
        self._saved_traces: dict[StreamKey, Trace | None] = {}  # what the index holds, by stream
        self._plan_due = False
        self._plan_timer = False  # a lazy plan is scheduled (see _get)
        if self.scheduler is not None:
            self._restore_traces()
            self.loop.before_wait(self._plan_prefetch)
        self.streams = StreamTable(config.nvme, self.catalog, self.tiers)
        self.sessions = Sessions()
        self.counters = DaemonCounters()
        self._started = time.monotonic()
        self._closing = False
        self._context = zmq.Context(io_threads=1)
        self.router = self._context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        self.router.setsockopt(zmq.SNDHWM, HWM_MESSAGES)
        self.router.setsockopt(zmq.RCVHWM, HWM_MESSAGES)
        self.fds = FdServer(layout.fds_path, self.loop, self.arena,
                            find_session=self.sessions.by_token, on_bound=self._on_fd_bound,
                            on_closed=self._on_fd_closed)
        self._handlers: dict[str, Handler] = {
            "heartbeat": self._heartbeat,
            "get": self._get,
            "release": self._release,
            "reserve": self._reserve,
            "commit": self._commit,
            "commit_renew": self._commit_renew,
            "commit_durable": self._commit_durable,
            "flush_store": self._flush_store,
            "stream_open": self._stream_open,
            "stream_chunk": self._stream_chunk,
            "stream_close": self._stream_close,
            "abort": self._abort,
            "prefetch": self._prefetch,
            "delete": self._delete,
            "exists": self._exists,
            "list": self._list,
            "stats": self._stats,
            "bye": self._bye,
            "detach": self._detach,
            "shutdown": self._shutdown,
            "attach": self._attach_again,
            "hello": self._hello_again,
            "step": self._step,
            "get_ahead": self._get_ahead,
            "upcoming": self._upcoming,
        }

    # --- lifecycle ----------------------------------------------------------------

    def bind(self) -> None:
        """Open the control socket and the fd channel (stale socket files are removed first)."""
        for path in (self.layout.control_path, self.layout.fds_path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.router.bind(self.layout.control_endpoint)
        os.chmod(self.layout.control_path, 0o600)
        self.fds.start()
        self.loop.add_reader(self.router, self._on_router)
        self._last_sweep_s = time.monotonic()
        self._skipped_sweep = False
        self.loop.call_later(self._sweep_interval_s(), self._sweep)

    def run(self) -> None:
        log.info("infinityd %s serving %s (CPU tier budget %d bytes in segments of %d, "
                 "client timeout %.1fs)", __version__, self.layout.root, self.config.cpu.budget_bytes,
                 self.config.cpu.segment_bytes, self.config.daemon.client_timeout_s)
        self.loop.run()

    def stop(self) -> None:
        """Ask the loop to end (thread-safe, signal-safe)."""
        self.loop.stop()

    def close(self) -> None:
        for session in list(self.sessions):
            self._streams_gone(session)  # traces refined since they were last saved
        self._closing = True
        # First let the I/O and index work in flight finish: flushes that complete are still
        # answered, and nothing is freed under the engine.
        self.tiers.close()
        for session in list(self.sessions):
            self._end(session, "daemon stopped")
        self.fds.close()
        self.loop.remove_reader(self.router)
        self.router.close(linger=200)  # lets a shutdown reply leave
        self._context.term()
        self.loop.close()
        self.arena.close()
        for path in (self.layout.control_path, self.layout.fds_path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    # --- the control socket -----------------------------------------------------

    def _on_router(self) -> None:
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
                if op == "hello":
                    self._hello(identity, request_id, body)
                elif op == "attach":
                    self._attach(identity, request_id, body)
                else:
                    raise ProtocolError(
                        f"{op!r} on a socket without a session: it never said hello, or its "
                        f"session ended (bye, process exit, or daemon.client_timeout_s of "
                        f"silence); connect again with infinity.connect()")
                return
            session.last_seen = time.monotonic()
            session.counters.requests += 1
            if envelope.releases:
                self._release_ids(session, envelope.releases)
            self._handlers[op](session, identity, request_id, body)
        except InfinityError as exc:
            if isinstance(exc, ProtocolError):
                counters.malformed += 1
            self._error(identity, request_id, exc)
        except Exception as exc:  # a bug: report it, keep serving
            log.exception("internal error while serving a request")
            self._error(identity, request_id, InfinityError(
                f"infinityd failed on this request ({type(exc).__name__}: {exc}); see its log"))

    def _reply(self, identity: bytes, request_id: int, results: list[Any]) -> None:
        self._send_reply(identity, request_id, wire.encode_reply(request_id, results))

    def _send_reply(self, identity: bytes, request_id: int, data: bytes) -> None:
        try:
            self.router.send(identity, _SNDMORE_NOBLOCK)
            self.router.send(data, _NOBLOCK)
        except zmq.ZMQError as exc:  # the peer's queue is full or it is gone: it will time out
            log.debug("reply %d not sent: %s", request_id, exc)

    def _error(self, identity: bytes, request_id: int, exc: InfinityError) -> None:
        self.counters.error(exc.code)
        try:
            self.router.send_multipart(
                [identity, wire.encode_error(request_id, ItemError.of(exc))], zmq.NOBLOCK)
        except zmq.ZMQError as send_exc:
            log.debug("error reply %d not sent: %s", request_id, send_exc)

    def _item_error(self, session: Session, exc: InfinityError) -> ItemError:
        session.counters.errors += 1
        self.counters.error(exc.code)
        return ItemError.of(exc)

    def _defer(self, session: Session, identity: bytes, request_id: int,
               results: list[Any]) -> _Deferred:
        self.counters.deferred_replies += 1
        return _Deferred(session, identity, request_id, results)

    def _settle(self, deferred: _Deferred) -> None:
        """One deferred item is done; reply once all are (unless the client went away)."""
        deferred.left -= 1
        if not deferred.left and deferred.session.alive:
            if deferred.stream is not None and self.scheduler is not None:
                self.scheduler.wait_finished(deferred.stream, time.monotonic())
            self._reply(deferred.identity, deferred.request_id, deferred.results)

    # --- sessions -----------------------------------------------------------------

    def _hello(self, identity: bytes, request_id: int, body: Sequence[Any]) -> None:
        hello = wire.Hello.from_body(body)
        session = self.sessions.open(hello, identity)
        self._watch(session, hello.pid)
        log.info("%s connected%s", session.describe(),
                 "" if session.pidfd is not None else " (not watched by pidfd yet)")
        welcome = wire.Welcome(wire.PROTOCOL_VERSION, session.id, session.token, os.getpid(),
                               __version__, self.config.daemon.heartbeat_interval_s,
                               self.config.daemon.client_timeout_s)
        self._reply(identity, request_id, [welcome.to_wire()])

    def _attach(self, identity: bytes, request_id: int, body: Sequence[Any]) -> None:
        attach = wire.Attach.from_body(body)
        session = self.sessions.by_token(attach.token)
        if session is None:
            raise ProtocolError("attach names no open session (it may have timed out); "
                                "connect again with infinity.connect()")
        self.sessions.attach(session, identity)
        session.last_seen = time.monotonic()
        self._reply(identity, request_id, [None])

    def _hello_again(self, session: Session, identity: bytes, request_id: int,
                     body: Sequence[Any]) -> None:
        raise ProtocolError("this socket already belongs to a session; hello is sent once")

    _attach_again = _hello_again

    def _watch(self, session: Session, pid: int) -> None:
        fd = open_pidfd(pid, session.start_time_s)
        if fd is None:
            return
        if session.pidfd is not None:
            self.loop.remove_reader(session.pidfd)
            os.close(session.pidfd)
        session.pidfd = fd
        session.watched_pid = pid
        self.loop.add_reader(fd, lambda: self._end(session, "process exited"))

    def _on_fd_bound(self, session: Session, conn: FdConnection) -> None:
        # The kernel's view of the peer beats the pid the client claimed (pid namespaces).
        if conn.peer_pid > 0 and conn.peer_pid != session.watched_pid:
            self._watch(session, conn.peer_pid)

    def _on_fd_closed(self, conn: FdConnection) -> None:
        if conn.session is not None and conn.session.alive:
            conn.session.fd_conn = None
            self._end(conn.session, "process exited")

    def _end(self, session: Session, reason: str) -> None:
        if not session.alive:
            return
        self._streams_gone(session)
        streams = self.streams.drop_client(session.id)
        leases, reservations = self.catalog.drop_client(session.id)
        self.sessions.remove(session, reason)
        if session.pidfd is not None:
            self.loop.remove_reader(session.pidfd)
            os.close(session.pidfd)
            session.pidfd = None
        if session.fd_conn is not None:
            self.fds.close_connection(session.fd_conn, notify=False)
            session.fd_conn = None
        log.info("%s gone (%s): released %d lease(s), discarded %d reservation(s) and %d "
                 "stream(s)", session.describe(), reason, leases, reservations, streams)

    def _sweep_interval_s(self) -> float:
        return min(1.0, self.config.daemon.client_timeout_s / 5)

    def _sweep(self) -> None:
        # Serve what is queued first, so a heartbeat that waited behind other work still counts.
        self._on_router()
        now = time.monotonic()
        interval_s = self._sweep_interval_s()
        # One sweep at most: a loop that is merely busy also sweeps late, and must still expire.
        stalled = now - self._last_sweep_s > 2 * interval_s + 0.5 and not self._skipped_sweep
        self._skipped_sweep = stalled
        self._last_sweep_s = now
        # After a stall of the daemon itself (stopped, frozen, swapped out), the clients' heartbeats
        # may still sit in the sockets' buffers, unread: a silence it caused is not theirs, so
        # nobody expires until the next sweep, by when they have been read.
        for session in ([] if stalled else
                        self.sessions.expired(now, self.config.daemon.client_timeout_s)):
            self._end(session, f"silent for {self.config.daemon.client_timeout_s:g}s")
        self.loop.call_later(self._sweep_interval_s(), self._sweep)

    def _on_segment_retired(self, segment: int) -> None:
        for session in self.sessions:
            if segment in session.mapped_segments:
                session.mapped_segments.discard(segment)
                session.retired_pending.add(segment)

    # --- requests -----------------------------------------------------------------

    def _heartbeat(self, session: Session, identity: bytes, request_id: int,
                   body: Sequence[Any]) -> None:
        wire.Heartbeat.from_body(body)
        session.counters.heartbeats += 1

    def _detach(self, session: Session, identity: bytes, request_id: int,
                body: Sequence[Any]) -> None:
        wire.Detach.from_body(body)
        self.sessions.detach(session, identity)

    def _bye(self, session: Session, identity: bytes, request_id: int, body: Sequence[Any]) -> None:
        wire.Bye.from_body(body)
        self._end(session, "closed")

    def _get_ahead(self, session: Session, identity: bytes, request_id: int,
                   body: Sequence[Any]) -> None:
        self._get(session, identity, request_id, body, track=False)

    def _get(self, session: Session, identity: bytes, request_id: int,
             body: Sequence[Any], *, track: bool = True) -> None:
        """track=False (get_ahead): unseen by the scheduler, and only what the CPU tier holds
        now is leased; an item on NVMe alone is answered nil, neither loaded nor waited for
        (the client would block on a load the scheduler did not plan)."""
        items = (wire.Get if track else wire.GetAhead).from_body(body).items
        _, outcomes = self.catalog.acquire(session.id, request_id, items)
        results: list[Any] = []
        nbytes = 0
        missing: list[int] | None = None  # items only on NVMe: the reply waits for their loads
        scheduler = self.scheduler if track else None
        stream: StreamKey | None = None
        now = 0.0
        plan_now = failed = False
        if scheduler is not None:
            now = time.monotonic()
        for outcome in outcomes:
            if type(outcome) is Version:
                if scheduler is not None:
                    # Before any load starts, so that a miss counts as one.
                    stream = self._stream_of(session, outcome.key[0])
                    kind = scheduler.touched(stream, outcome.key, outcome.nbytes, now)
                    plan_now = plan_now or kind is not AccessKind.RESIDENT_HIT
                if outcome.cpu is None and outcome.nbytes and not track:
                    self.catalog.drop_hold(session.id, request_id, outcome)
                    results.append(None)
                    failed = True  # not all leased: the plain reply, which carries the nils
                    continue
                if outcome.cpu is None and outcome.nbytes:
                    if missing is None:
                        missing = []
                    missing.append(len(results))
                    results.append(None)
                else:
                    results.append(outcome.wire)
                nbytes += outcome.nbytes
            else:
                results.append(self._item_error(session, outcome))  # type: ignore[arg-type]
                failed = True
        if plan_now:
            self._plan_due = True
        elif scheduler is not None:
            self._plan_lazily()
        counters = session.counters
        counters.gets += len(outcomes)
        counters.items += len(outcomes)
        counters.get_bytes += nbytes
        self.counters.items += len(outcomes)
        self.counters.bytes_leased += nbytes
        if missing is None:
            if not failed:  # every item resident and leased: join their packed placements
                self._send_reply(identity, request_id, wire.encode_packed_reply(
                    request_id, [cast(Version, o).packed for o in outcomes]))
            else:
                self._reply(identity, request_id, results)
            return
        deferred = self._defer(session, identity, request_id, results)
        deferred.left = len(missing) + 1  # + 1: settled below, once every load is started
        if scheduler is not None and stream is not None:
            deferred.stream = stream
            scheduler.wait_started(stream, now)
        for i in missing:
            version = cast(Version, outcomes[i])
            try:
                if self.tiers.ensure_resident(version, lambda error, i=i, v=version: (  # type: ignore[misc]
                        self._get_loaded(deferred, i, v, error, loaded=True)),
                        stream=stream):
                    self._get_loaded(deferred, i, version, None)  # an earlier item loaded it
                else:
                    counters.load_waits += 1
            except InfinityError as exc:
                self._get_loaded(deferred, i, version, exc)
        self._settle(deferred)

    def _get_loaded(self, deferred: _Deferred, i: int, version: Version,
                    error: InfinityError | None, *, loaded: bool = False) -> None:
        session = deferred.session
        if error is None:
            deferred.results[i] = version.wire
            self.catalog.handed_out(session.id, version)
            if loaded:
                session.counters.load_bytes += version.nbytes
        else:
            # The item fails; what the lease holds of it goes back now.
            self.catalog.drop_hold(session.id, deferred.request_id, version)
            deferred.results[i] = self._item_error(session, error)
        self._settle(deferred)

    def _release(self, session: Session, identity: bytes, request_id: int,
                 body: Sequence[Any]) -> None:
        self._release_ids(session, wire.Release.from_body(body).lease_ids)

    def _release_ids(self, session: Session, lease_ids: Sequence[int]) -> None:
        for lease_id in lease_ids:
            try:
                self.catalog.release(session.id, lease_id)
            except InfinityError as exc:  # no reply to carry it: count it
                self._item_error(session, exc)
                log.debug("%s: %s", session.describe(), exc)
        session.counters.releases += len(lease_ids)

    def _reserve(self, session: Session, identity: bytes, request_id: int,
                 body: Sequence[Any]) -> None:
        message = wire.Reserve.from_body(body)
        self._continue_reserve(_ParkedReserve(session, identity, request_id, message.items, []))

    def _continue_reserve(self, request: _ParkedReserve) -> None:
        session = request.session
        while request.index < len(request.items):
            item = request.items[request.index]
            try:
                reservation = self.catalog.reserve(session.id, item.namespace, item.name,
                                                   item.dtype, item.shape)
            except SpaceShortage:
                # A segment is being created or victims are being written back: resume then.
                self.counters.parked_requests += 1
                self.tiers.when_space(lambda error: self._resume_reserve(request, error))
                return
            except InfinityError as exc:
                request.results.append(self._item_error(session, exc))
            else:
                request.results.append(_reserved_placement(reservation))
                session.counters.reserve_bytes += reservation.nbytes
                self.counters.bytes_reserved += reservation.nbytes
            request.index += 1
        session.counters.reserves += len(request.items)
        session.counters.items += len(request.items)
        self.counters.items += len(request.items)
        self._reply(request.identity, request.request_id, request.results)

    def _resume_reserve(self, request: _ParkedReserve, error: InfinityError | None) -> None:
        if not request.session.alive or self._closing:
            return  # a dead client's earlier items were already dropped with it
        if error is not None:
            request.results.append(self._item_error(request.session, error))
            request.index += 1
        self._continue_reserve(request)

    def _commit(self, session: Session, identity: bytes, request_id: int,
                body: Sequence[Any]) -> None:
        message = wire.Commit.from_body(body)
        results, _ = self._publish(session, message.items)
        self._reply(identity, request_id, results)

    def _commit_renew(self, session: Session, identity: bytes, request_id: int,
                      body: Sequence[Any]) -> None:
        message = wire.CommitRenew.from_body(body)
        # Only a name put again gets a spare: a put of a new name (loading a checkpoint, say)
        # may well be its only one, and its spare would sit in the tier until the client left.
        again = [self._exists_quietly(item) for item in message.items]
        results, committed = self._publish(session, message.items)
        for i, version in committed:
            spare = self.catalog.renew(session.id, version) if again[i] else None
            placement = None
            if spare is not None:
                placement = _reserved_placement(spare)
                session.counters.spares += 1
            results[i] = [version.stamp, placement]
        self._reply(identity, request_id, results)

    def _exists_quietly(self, item: wire.TensorRef) -> bool:
        try:
            return self.catalog.exists(item.namespace, item.name)
        except InfinityError:
            return False  # a bad name: the commit reports it

    def _publish(self, session: Session, items: Sequence[wire.TensorRef]
                 ) -> tuple[list[Any], list[tuple[int, Version]]]:
        """Commit each item of a commit request: the results (version or error, item by item)
        and the (result index, version) of those that were published."""
        results: list[Any] = []
        committed: list[tuple[int, Version]] = []
        for item in items:
            try:
                version = self.catalog.commit(session.id, item.namespace, item.name)
            except InfinityError as exc:
                results.append(self._item_error(session, exc))
                continue
            self._wrote(session, version)
            committed.append((len(results), version))
            results.append(version.stamp)
            session.counters.commit_bytes += version.nbytes
            self.counters.bytes_committed += version.nbytes
        session.counters.commits += len(items)
        return results, committed

    def _commit_durable(self, session: Session, identity: bytes, request_id: int,
                        body: Sequence[Any]) -> None:
        message = wire.CommitDurable.from_body(body)
        self.tiers.require_durable()  # before anything is published
        results, committed = self._publish(session, message.items)
        if not committed:
            self._reply(identity, request_id, results)
            return
        deferred = self._defer(session, identity, request_id, results)
        deferred.left = 1

        def durable(errors: list[InfinityError | None]) -> None:
            for (i, version), error in zip(committed, errors):
                if error is not None:
                    results[i] = self._item_error(session, error)
                else:
                    session.counters.durable_bytes += version.nbytes
            self._settle(deferred)

        self.tiers.make_durable([v for _, v in committed], durable)

    def _flush_store(self, session: Session, identity: bytes, request_id: int,
                     body: Sequence[Any]) -> None:
        wire.FlushStore.from_body(body)
        self.tiers.require_durable()
        versions = list(self.catalog.current_versions())
        deferred = self._defer(session, identity, request_id, [None])
        deferred.left = 1
        session.counters.flushes += 1

        def durable(errors: list[InfinityError | None]) -> None:
            failed = [(v, e) for v, e in zip(versions, errors) if e is not None]
            if failed:
                version, error = failed[0]
                deferred.results[0] = self._item_error(session, type(error)(
                    f"{len(failed)} of {len(versions)} tensor(s) were not made durable; the first, "
                    f"{version.key[1]!r} in namespace {version.key[0]!r}: {error}"))
            else:
                total = sum(v.nbytes for v in versions)
                session.counters.durable_bytes += total
                deferred.results[0] = {"tensors": len(versions), "bytes": total}
            self._settle(deferred)

        self.tiers.make_durable(versions, durable)

    def _stream_open(self, session: Session, identity: bytes, request_id: int,
                     body: Sequence[Any]) -> None:
        message = wire.StreamOpen.from_body(body)
        deferred = self._defer(session, identity, request_id, [None])
        deferred.left = 1
        session.counters.streams += 1

        def opened(result: StreamInfo | InfinityError) -> None:
            if isinstance(result, InfinityError):
                deferred.results[0] = self._item_error(session, result)
            else:
                deferred.results[0] = result.to_wire()
            self._settle(deferred)

        self.streams.open(session.id, request_id, message.namespace, message.name, message.mode,
                          message.dtype, message.shape, opened)

    def _stream_chunk(self, session: Session, identity: bytes, request_id: int,
                      body: Sequence[Any]) -> None:
        message = wire.StreamChunk.from_body(body)
        deferred = _Deferred(session, identity, request_id, [None], 1)

        def moved(error: InfinityError | None) -> None:
            if error is not None:
                deferred.results[0] = self._item_error(session, error)
            else:
                session.counters.stream_bytes += message.nbytes
            self._settle(deferred)

        self.streams.chunk(session.id, message.stream_id, message.slot, message.offset,
                           message.nbytes, moved)

    def _stream_close(self, session: Session, identity: bytes, request_id: int,
                      body: Sequence[Any]) -> None:
        message = wire.StreamClose.from_body(body)
        deferred = _Deferred(session, identity, request_id, [None], 1)

        def closed(result: int | InfinityError) -> None:
            if isinstance(result, InfinityError):
                deferred.results[0] = self._item_error(session, result)
            else:
                deferred.results[0] = result
            self._settle(deferred)

        self.streams.close(session.id, message.stream_id, commit=message.commit,
                           durable=message.durable, done=closed)

    def _abort(self, session: Session, identity: bytes, request_id: int, body: Sequence[Any]) -> None:
        message = wire.Abort.from_body(body)
        results: list[Any] = []
        for item in message.items:
            try:
                self.catalog.abort(session.id, item.namespace, item.name)
                results.append(None)
            except InfinityError as exc:
                results.append(self._item_error(session, exc))
        self._reply(identity, request_id, results)

    def _prefetch(self, session: Session, identity: bytes, request_id: int,
                  body: Sequence[Any]) -> None:
        # A hint: tensors only on NVMe start loading now (within the tier, by the policy).
        message = wire.Prefetch.from_body(body)
        session.counters.prefetches += len(message.items)
        if self.tiers.nvme is None:
            return
        for item in message.items:
            try:
                self.tiers.prefetch(self.catalog.current(item.namespace, item.name))
            except InfinityError as exc:  # no reply to carry it: count it
                self._item_error(session, exc)

    def _delete(self, session: Session, identity: bytes, request_id: int,
                body: Sequence[Any]) -> None:
        message = wire.Delete.from_body(body)
        results: list[Any] = []
        deferred = _Deferred(session, identity, request_id, results, 1)
        for item in message.items:
            try:
                version = self.catalog.delete(item.namespace, item.name)
            except InfinityError as exc:
                results.append(self._item_error(session, exc))
                continue
            if self.scheduler is not None:
                self.scheduler.forget(version.key)
            results.append(None)
            # A flushed tensor leaves the index too; the reply waits for that commit.
            i = len(results) - 1
            if self.tiers.remove_durable(version.key, lambda error, i=i: (  # type: ignore[misc]
                    self._deleted(deferred, i, error))):
                deferred.left += 1
        session.counters.deletes += len(message.items)
        if deferred.left > 1:
            self.counters.deferred_replies += 1
        self._settle(deferred)

    def _deleted(self, deferred: _Deferred, i: int, error: InfinityError | None) -> None:
        if error is not None:
            deferred.results[i] = self._item_error(deferred.session, error)
        self._settle(deferred)

    def _exists(self, session: Session, identity: bytes, request_id: int,
                body: Sequence[Any]) -> None:
        message = wire.Exists.from_body(body)
        results: list[Any] = []
        for item in message.items:
            try:
                results.append(self.catalog.exists(item.namespace, item.name))
            except InfinityError as exc:
                results.append(self._item_error(session, exc))
        self._reply(identity, request_id, results)

    def _list(self, session: Session, identity: bytes, request_id: int, body: Sequence[Any]) -> None:
        message = wire.ListTensors.from_body(body)
        results: list[Any] = []
        for item in message.items:
            results.append([
                wire.TensorInfo(v.key[0], v.key[1], v.dtype, v.shape, v.nbytes, v.stamp,
                                v.tier).to_wire()
                for v in self.catalog.listing(item.namespace, item.prefix, after=item.after,
                                              limit=wire.LIST_PAGE)])
        self._reply(identity, request_id, results)

    def _stats(self, session: Session, identity: bytes, request_id: int, body: Sequence[Any]) -> None:
        wire.Stats.from_body(body)
        self._reply(identity, request_id, [self.stats()])

    def _shutdown(self, session: Session, identity: bytes, request_id: int,
                  body: Sequence[Any]) -> None:
        wire.Shutdown.from_body(body)
        log.info("shutdown requested by %s", session.describe())
        self._reply(identity, request_id, [None])
        self.stop()

    # --- the scheduler ----------------------------------------------------------

    def _stream_of(self, session: Session, namespace: str) -> StreamKey:
        """The scheduler stream a client's access in `namespace` belongs to (see Session)."""
        if session.step_namespace is not None:
            namespace = session.step_namespace
        stream = session.streams.get(namespace)
        if stream is None:
            stream = (namespace, session.name)
            if self._stream_owners.get(stream, session.id) != session.id:
                # Another live client has this name: one trace cannot describe two processes.
                # (A client may be named like such a key itself: take one nobody holds.)
                suffix = f"#{session.id}"
                while (namespace, session.name + suffix) in self._stream_owners:
                    suffix += f"#{session.id}"
                stream = (namespace, session.name + suffix)
                self._session_streams.add(stream)
            self._stream_owners[stream] = session.id
            session.streams[namespace] = stream
            assert self.scheduler is not None
            self.scheduler.attach(stream, time.monotonic())
        return stream

    def _wrote(self, session: Session, version: Version) -> None:
        if self.scheduler is not None:
            stream = self._stream_of(session, version.key[0])
            self.scheduler.touched(stream, version.key, version.nbytes, time.monotonic(), write=True)
            self._plan_due = True

    def _upcoming(self, session: Session, identity: bytes, request_id: int,
                  body: Sequence[Any]) -> None:
        message = wire.Upcoming.from_body(body)
        upcoming: list[list[Any]] = []
        # The stream this client's accesses in the namespace go to, if it has one yet (asking
        # makes none: it is not an access).
        stream = session.streams.get(session.step_namespace or message.namespace)
        if self.scheduler is not None and stream is not None:
            upcoming = [[key[1], nbytes] for key, nbytes in self.scheduler.upcoming(
                stream, namespace=message.namespace, max_entries=message.max_entries,
                max_bytes=message.max_bytes)]
        self._reply(identity, request_id, [upcoming])

    def _step(self, session: Session, identity: bytes, request_id: int,
              body: Sequence[Any]) -> None:
        message = wire.Step.from_body(body)
        if message.phase == "begin":
            session.counters.steps += 1
        scheduler = self.scheduler
        if scheduler is None:
            report = wire.StepReport("untracked", 0, {})
            self._reply(identity, request_id, [report.to_wire() if message.phase == "end" else None])
            return
        now = time.monotonic()
        if message.phase == "abort":
            scheduler.step_abort(self._stream_of(session, message.namespace), now)
            self._plan_due = True
            self._reply(identity, request_id, [None])
            return
        if message.phase == "begin":
            if session.step_namespace not in (None, message.namespace):
                # A step in another namespace was left open: it ends here.
                self._end_step(session, now)
            session.step_namespace = message.namespace
            stream = self._stream_of(session, message.namespace)
            summary = scheduler.step_begin(stream, now)
        else:
            session.step_namespace = message.namespace
            stream = self._stream_of(session, message.namespace)
            summary = scheduler.step_end(stream, now)
        self._plan_due = True
        result = None
        if summary is not None:
            if summary.trace_updated:
                self._save_trace(stream)
            result = wire.StepReport(summary.outcome, summary.trace_entries,
                                     summary.counters).to_wire()
        self._reply(identity, request_id, [result])

    def _end_step(self, session: Session, now: float) -> None:
        assert self.scheduler is not None and session.step_namespace is not None
        stream = self._stream_of(session, session.step_namespace)
        if self.scheduler.step_end(stream, now).trace_updated:
            self._save_trace(stream)

    def _streams_gone(self, session: Session) -> None:
        scheduler = self.scheduler
        if scheduler is None:
            return
        now = time.monotonic()
        for stream in session.streams.values():
            scheduler.client_gone(stream, now)
            if self._stream_owners.get(stream) == session.id:
                del self._stream_owners[stream]
            if stream in self._session_streams:
                self._session_streams.discard(stream)
                scheduler.remove_stream(stream)  # never saved: nobody can come back to it
            elif scheduler.trace_of(stream) is None:
                # Nothing to come back to: a stream per namespace ever stepped in would
                # otherwise stay for the daemon's life (and every plan would walk them).
                scheduler.remove_stream(stream)
            else:
                self._save_trace(stream)  # with the timing its replayed steps refined
        session.streams.clear()
        # Clients named anew for each job would otherwise leave a trace each, for good.
        for stream in scheduler.traces_beyond(self.config.scheduler.max_kept_traces):
            scheduler.remove_stream(stream)
            self._save_trace(stream)  # no trace now: deleted from the index
            self._saved_traces.pop(stream, None)
        self._plan_due = True

    def _save_trace(self, stream: StreamKey) -> None:
        """Persist a stream's trace in the store's index (None: forget it), in the background,
        unless the index already holds this very trace."""
        index = self.tiers.index
        if (index is None or self.scheduler is None or stream in self._session_streams
                or self._closing):
            return  # a "#<id>" stream lives only as long as its session
        trace = self.scheduler.trace_of(stream)
        if self._saved_traces.get(stream) is trace:
            return  # unchanged (or never had one): no index transaction
        self._saved_traces[stream] = trace

        def saved(future: Future[None]) -> None:
            if future.exception() is not None:
                log.warning("the trace of client %r in %r was not saved: %s", stream[1], stream[0],
                            future.exception())

        try:
            index.save_trace(stream[0], stream[1], None if trace is None else trace.to_dict,
                             on_done=saved)
        except InfinityError as exc:
            log.warning("the trace of client %r in %r was not saved: %s", stream[1], stream[0], exc)

    def _restore_traces(self) -> None:
        index = self.tiers.index
        if index is None or self.scheduler is None:
            return
        restored = 0
        for namespace, client, data in index.load_traces():
            try:
                self.scheduler.import_trace((namespace, client), data)
                self._saved_traces[(namespace, client)] = self.scheduler.trace_of((namespace, client))
                restored += 1
            except ValueError as exc:
                log.warning("the stored trace of client %r in %r is not used: %s", client,
                            namespace, exc)
        if restored:
            log.info("scheduler: %d step trace(s) restored from the index", restored)

    def _plan_soon(self) -> None:
        self._plan_due = True

    def _plan_lazily(self) -> None:
        """After gets that all found their data resident: the plan may have moved on by an entry,
        but it is not urgent. Plan within a few milliseconds, not after every such get (a
        client reading resident tensors in a loop would otherwise pay for a plan each time)."""
        if self._plan_timer or self._plan_due:
            return
        self._plan_timer = True

        def due() -> None:
            self._plan_timer = False
            self._plan_due = True

        self.loop.call_later(LAZY_PLAN_DELAY_S, due)

    def _plan_prefetch(self) -> None:
        """Once per loop turn with news: start the loads the scheduler plans (before waiting)."""
        if not self._plan_due:
            return
        self._plan_due = False
        scheduler = self.scheduler
        if scheduler is None or not self.config.scheduler.prefetch or self._closing:
            return
        arena = self.arena
        free_bytes = max(0, arena.budget_bytes - arena.used_bytes)
        for key in scheduler.plan_prefetch(free_bytes=free_bytes):
            try:
                version = self.catalog.current(key[0], key[1])
            except InfinityError:
                scheduler.forget(key)  # deleted since the trace saw it
                continue
            self.tiers.prefetch(version)

    # --- reporting ----------------------------------------------------------------

    def _tier_stats(self) -> dict[str, Any]:
        extra = self.tiers.stats()
        tiers: dict[str, Any] = {"cpu": {
            **self.arena.stats(), "hugepages": self.config.cpu.hugepages,
            "lock": self.config.cpu.lock, "resident_tensors": extra.pop("resident_tensors"),
            "evictions_writing_back": extra.pop("evictions_writing_back"),
            "write_behind_bytes": extra.pop("write_behind_bytes")}}
        if "nvme" in extra:
            tiers["nvme"] = extra["nvme"]
        return tiers

    def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        clients = []
        for session in self.sessions:
            leases, reservations = self.catalog.client_counts(session.id)
            clients.append({
                "id": session.id, "name": session.name, "pid": session.pid,
                "scheduler_streams": [list(key) for key in session.streams.values()],
                "watched_by_pidfd": session.pidfd is not None,
                "connected_at_s": session.connected_at_s,
                "idle_s": round(now - session.last_seen, 3),
                "sockets": len(session.identities), "mapped_segments": len(session.mapped_segments),
                "leases": leases, "reservations": reservations,
                **counters_dict(session.counters),
            })
        counters = self.counters
        return {
            "daemon": {
                "version": __version__, "protocol": wire.PROTOCOL_VERSION, "pid": os.getpid(),
                "uptime_s": round(now - self._started, 3), "runtime_dir": self.layout.root,
                "client_timeout_s": self.config.daemon.client_timeout_s,
                "poison_released": self.config.daemon.poison_released,
            },
            "tiers": self._tier_stats(),
            "catalog": self.catalog.stats(),
            "clients": clients,
            "scheduler": self.scheduler.snapshot() if self.scheduler is not None else None,
            "counters": {
                "requests": counters.requests, "items": counters.items,
                "malformed": counters.malformed, "ops": dict(counters.ops),
                "errors": dict(counters.errors), "bytes_leased": counters.bytes_leased,
                "bytes_reserved": counters.bytes_reserved,
                "bytes_committed": counters.bytes_committed,
                "segments_created": self.tiers.counters.segments_created,
                "segment_failures": self.tiers.counters.segment_failures,
                "parked_requests": counters.parked_requests,
                "deferred_replies": counters.deferred_replies,
                "open_streams": len(self.streams),
                "tiers": dataclasses.asdict(self.tiers.counters),
                "fds_sent": self.fds.fds_sent,
                "clients_opened": self.sessions.opened_total,
                "clients_ended": dict(self.sessions.ended_total),
            },
        }
