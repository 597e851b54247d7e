"""Sessions as requests see them: hello, attach, detach, heartbeat, bye, and a session's end.

A session opens with `hello` on one socket, which must carry the daemon's
secret (a hello without it is refused with AuthenticationError, and logged);
`attach` adds a client thread's socket, `detach` takes one out. A session ends on `bye`, when the client
process exits (its pidfd becomes readable, or its fd channel closes), or after
`daemon.client_timeout_s` of silence (the sweep). Its end runs the other
services' `client_gone` hooks, in the order given, so each gives back what the
session held in its own state. This service also owns the fd channel
(`FdServer`), whose connections bind to sessions by token.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from typing import Any, Callable, Optional, Sequence

from infinity import __version__
from infinity.config import InfinityConfig
from infinity.daemon.arena import CpuArena
from infinity.daemon.fdserver import FdConnection, FdServer
from infinity.daemon.loop import EventLoop
from infinity.daemon.services.base import Routes, SocketHandler
from infinity.daemon.sessions import Session, Sessions, open_pidfd, shortened
from infinity.errors import AuthenticationError, LimitExceededError, ProtocolError
from infinity.protocol import wire
from infinity.protocol.paths import RuntimeLayout

log = logging.getLogger("infinityd")

# What a service gives back when a session ends; a phrase for the log, or None.
ClientGone = Callable[[Session], Optional[str]]


class SessionService:
    """Opens, watches and ends sessions."""

    def __init__(self, config: InfinityConfig, layout: RuntimeLayout, loop: EventLoop,
                 arena: CpuArena, *, sessions: Sessions, client_gone: Sequence[ClientGone],
                 may_write: Callable[[Session, str], bool], secret: bytes) -> None:
        self.config = config
        self._secret = secret  # every hello must carry it (lifecycle.daemon_secret)
        self.loop = loop
        self.sessions = sessions
        self._client_gone = tuple(client_gone)
        self._secret_path = layout.secret_path
        self.fds = FdServer(layout.fds_path, loop, arena, find_session=self.sessions.by_token,
                            on_bound=self._on_fd_bound, on_closed=self._on_fd_closed,
                            may_write=may_write)
        self._drain: Callable[[], None] = lambda: None
        self._last_sweep_s = 0.0
        self._skipped_sweep = False

    def routes(self) -> Routes:
        return {wire.Heartbeat: self.heartbeat, wire.Bye: self.bye,
                wire.DeviceReport: self.device_report}

    def openers(self) -> dict[type, SocketHandler]:
        """The requests a socket without a session may send."""
        return {wire.Hello: self.hello, wire.Attach: self.attach}

    def socket_routes(self) -> dict[type, SocketHandler]:
        """The requests about the sending socket, from a socket in a session."""
        return {wire.Hello: self.again, wire.Attach: self.again, wire.Detach: self.detach}

    # --- lifecycle -------------------------------------------------------------------

    def start(self, *, drain: Callable[[], None]) -> None:
        """Open the fd channel and start sweeping; `drain` serves the requests queued."""
        self.fds.start()
        self._drain = drain
        self._last_sweep_s = time.monotonic()
        self._skipped_sweep = False
        self.loop.call_later(self._sweep_interval_s(), self._sweep)

    def close(self) -> None:
        """The daemon stops: every session ends, the fd channel closes."""
        for session in list(self.sessions):
            self.end(session, "daemon stopped")
        self.fds.close()

    # --- requests --------------------------------------------------------------------

    def hello(self, identity: bytes, session: Session | None, request_id: int,
              hello: wire.Hello) -> list[Any]:
        if not hmac.compare_digest(hello.secret, self._secret):
            # The name and pid are the client's claims, logged shortened, as said.
            log.warning("refused a hello without the daemon's secret (%s), name %r, pid %d",
                        "none presented" if not hello.secret else "a wrong one",
                        shortened(hello.name), hello.pid)
            raise AuthenticationError(
                f"this hello did not carry the daemon's secret ("
                f"{'none presented' if not hello.secret else 'a wrong one'}); a client presents "
                f"the one in {self._secret_path}, which only the daemon's user may read: run as "
                f"that user, with the same daemon.runtime_dir as the daemon")
        limit = self.config.daemon.max_clients
        if len(self.sessions.by_id) >= limit:
            raise LimitExceededError(
                f"infinityd serves {limit} clients already (daemon.max_clients); close clients "
                f"that are done, or raise the setting")
        session = self.sessions.open(hello, identity)
        self._watch(session, hello.pid)
        log.info("%s connected%s", session.describe(),
                 "" if session.pidfd is not None else " (not watched by pidfd yet)")
        welcome = wire.Welcome(wire.PROTOCOL_VERSION, session.id, session.token, os.getpid(),
                               __version__, self.config.daemon.heartbeat_interval_s,
                               self.config.daemon.client_timeout_s)
        return [welcome.to_wire()]

    def attach(self, identity: bytes, session: Session | None, request_id: int,
               attach: wire.Attach) -> list[Any]:
        session = self.sessions.by_token(attach.token)
        if session is None:
            raise ProtocolError("attach names no open session (it may have timed out); "
                                "connect again with infinity.connect()")
        self.sessions.attach(session, identity)
        session.last_seen = time.monotonic()
        return [None]

    def again(self, identity: bytes, session: Session | None, request_id: int,
              message: Any) -> None:
        raise ProtocolError("this socket already belongs to a session; hello is sent once")

    def detach(self, identity: bytes, session: Session | None, request_id: int,
               message: wire.Detach) -> None:
        assert session is not None
        self.sessions.detach(session, identity)

    def device_report(self, session: Session, request_id: int,
                      message: wire.DeviceReport) -> None:
        session.devices = message.devices  # shown by `stats` and the telemetry
        return None

    def heartbeat(self, session: Session, request_id: int, message: wire.Heartbeat) -> None:
        session.counters.heartbeats += 1

    def bye(self, session: Session, request_id: int, message: wire.Bye) -> None:
        self.end(session, "closed")

    # --- liveness --------------------------------------------------------------------

    def _watch(self, session: Session, pid: int) -> None:
        fd = open_pidfd(pid, session.start_time_s)
        if fd is None:
            return
        if session.pidfd is not None:
            self.loop.remove_reader(session.pidfd)
            os.close(session.pidfd)
        session.pidfd = fd
        session.watched_pid = pid
        self.loop.add_reader(fd, lambda: self.end(session, "process exited"))

    def _on_fd_bound(self, session: Session, conn: FdConnection) -> None:
        session.peer_uid = conn.peer_uid  # the kernel's word (SO_PEERCRED), not the client's
        # The kernel's view of the peer beats the pid the client claimed (pid namespaces).
        if conn.peer_pid > 0 and conn.peer_pid != session.watched_pid:
            self._watch(session, conn.peer_pid)

    def _on_fd_closed(self, conn: FdConnection) -> None:
        if conn.session is not None and conn.session.alive:
            conn.session.fd_conn = None
            self.end(conn.session, "process exited")

    def end(self, session: Session, reason: str) -> None:
        """End a session: each service gives back what it held, then its watches go."""
        if not session.alive:
            return
        gone = [phrase for hook in self._client_gone
                if (phrase := hook(session)) is not None]
        self.sessions.remove(session, reason)
        if session.pidfd is not None:
            self.loop.remove_reader(session.pidfd)
            os.close(session.pidfd)
            session.pidfd = None
        if session.fd_conn is not None:
            self.fds.close_connection(session.fd_conn, notify=False)
            session.fd_conn = None
        log.info("%s gone (%s): %s", session.describe(), reason, ", ".join(gone))

    def _sweep_interval_s(self) -> float:
        return min(1.0, self.config.daemon.client_timeout_s / 5)

    def _sweep(self) -> None:
        # Serve what is queued first, so a heartbeat that waited behind other work still counts.
        self._drain()
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
            self.end(session, f"silent for {self.config.daemon.client_timeout_s:g}s")
        self.loop.call_later(self._sweep_interval_s(), self._sweep)

    def segment_retired(self, segment: int) -> None:
        """A CPU-tier segment is gone: clients that mapped it learn so on their next fd request."""
        for session in self.sessions:
            if segment in session.mapped_segments:
                session.mapped_segments.discard(segment)
                session.retired_pending.add(segment)
