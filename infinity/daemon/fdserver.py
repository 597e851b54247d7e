"""The fd channel's server side: hands CPU-tier segment memfds to clients with SCM_RIGHTS.

A client connects once (SOCK_SEQPACKET, `fds.sock`), names its session by the
token from `hello`, and asks for the segments it has not mapped yet: all of
them at the handshake, then each new one the first time a reply points into
it. Every answer also lists the segments retired since the last one, so the
client can unmap them. The connection doubles as a liveness signal: it closes
when the client process dies. A segment of a read-only namespace's class
(see `arena`) goes to every client that may not write that namespace as a
read-only fd, which it can only map PROT_READ. All sockets are non-blocking and served from the
event loop; a client that does not read its answers is disconnected rather
than allowed to stall the loop.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Callable, Protocol

from infinity.daemon.loop import EventLoop
from infinity.daemon.sessions import Session
from infinity.errors import InfinityError, ProtocolError
from infinity.protocol import fdpass
from infinity.protocol.wire import FdReply, FdRequest, ItemError, SegmentInfo

log = logging.getLogger("infinityd.fds")

# A connection that has not named its session by then is closed: it holds a daemon fd.
BIND_TIMEOUT_S = 10.0
# Out of fds (EMFILE and kin), the listener stays readable: it is left unwatched this long,
# instead of being retried on every turn of the loop.
ACCEPT_PAUSE_S = 0.5


class SegmentSource(Protocol):
    """What the fd server needs of the arena: the live segments' fds, sizes and classes."""

    def segment_fds(self) -> dict[int, tuple[int, int]]: ...

    def segment_class(self, segment_id: int) -> str | None: ...

    def read_only_fd(self, segment_id: int) -> int: ...


class FdConnection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.fileno = sock.fileno()
        self.peer_pid, self.peer_uid, _ = fdpass.peer_credentials(sock)
        self.session: Session | None = None


class FdServer:
    def __init__(self, path: str, loop: EventLoop, segments: SegmentSource, *,
                 find_session: Callable[[bytes], Session | None],
                 on_bound: Callable[[Session, FdConnection], None],
                 on_closed: Callable[[FdConnection], None],
                 may_write: Callable[[Session, str], bool] = lambda session, segment_class: True
                 ) -> None:
        self.path = path
        # Whether a session may write the segments of a class (a read-only namespace's own).
        self._may_write = may_write
        self._loop = loop
        self._segments = segments
        self._find_session = find_session
        self._on_bound = on_bound
        self._on_closed = on_closed
        self._listener: socket.socket | None = None
        self._connections: dict[int, FdConnection] = {}
        self.fds_sent = 0

    def start(self) -> None:
        listener = fdpass.seqpacket_socket()
        listener.bind(self.path)
        os.chmod(self.path, 0o600)
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self._loop.add_reader(listener.fileno(), self._accept)

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                self._pause_accepting(exc)
                return
            sock.setblocking(False)
            conn = FdConnection(sock)
            if conn.peer_uid not in (os.geteuid(), 0):
                log.warning("fd channel: refused a connection from uid %d (pid %d)",
                            conn.peer_uid, conn.peer_pid)
                sock.close()
                continue
            self._connections[conn.fileno] = conn
            self._loop.add_reader(conn.fileno, lambda c=conn: self._readable(c))  # type: ignore[misc]
            self._loop.call_later(BIND_TIMEOUT_S, lambda c=conn: self._unbound_too_long(c))  # type: ignore[misc]

    def _pause_accepting(self, exc: OSError) -> None:
        listener = self._listener
        if listener is None:
            return
        log.error("fd channel: cannot accept connections (%s); trying again in %gs", exc,
                  ACCEPT_PAUSE_S)
        self._loop.remove_reader(listener.fileno())

        def resume() -> None:
            if self._listener is listener:
                self._loop.add_reader(listener.fileno(), self._accept)

        self._loop.call_later(ACCEPT_PAUSE_S, resume)

    def _unbound_too_long(self, conn: FdConnection) -> None:
        if self._connections.get(conn.fileno) is conn and conn.session is None:
            log.info("fd channel of pid %d named no session within %gs; closed", conn.peer_pid,
                     BIND_TIMEOUT_S)
            self.close_connection(conn, notify=False)

    def _readable(self, conn: FdConnection) -> None:
        try:
            data, fds = fdpass.recv_message(conn.sock, max_fds=1)
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, ProtocolError) as exc:
            log.info("fd channel of pid %d failed: %s", conn.peer_pid, exc)
            self.close_connection(conn, notify=True)
            return
        for fd in fds:  # clients have no business sending fds
            os.close(fd)
        if not data:
            self.close_connection(conn, notify=True)
            return
        try:
            request = FdRequest.decode(data)
            if conn.session is None:
                session = self._find_session(request.token)
                if session is None:
                    raise ProtocolError("the fd channel names no open session; send hello first")
                if session.fd_conn is not None:
                    # One per session: the session's end closes the one it knows of, and a
                    # second would outlive it, handing out segments to a session long gone.
                    raise ProtocolError("this session already has an fd channel; a client "
                                        "opens one per hello")
                conn.session = session
                session.fd_conn = conn
                self._on_bound(session, conn)
            elif request.token != conn.session.token:
                raise ProtocolError("the fd channel is bound to another session")
            self._answer(conn, conn.session, request.want)
        except InfinityError as exc:
            self._send(conn, FdReply((), error=ItemError.of(exc)), [])
            if conn.session is None:
                self.close_connection(conn, notify=False)

    def _answer(self, conn: FdConnection, session: Session, want: tuple[int, ...] | None) -> None:
        live = self._segments.segment_fds()
        ids = sorted(live) if want is None else [s for s in want if s in live]
        # A wanted segment that is no longer live was retired; say so.
        retired = session.retired_pending | {s for s in (want or ()) if s not in live}
        session.retired_pending = set()
        chunk = FdReply.MAX_FDS_PER_MESSAGE
        for start in range(0, max(len(ids), 1), chunk):
            part = ids[start:start + chunk]
            more = start + chunk < len(ids)
            reply = FdReply(tuple(SegmentInfo(s, live[s][1]) for s in part),
                            tuple(sorted(retired)) if start == 0 else (), more)
            if not self._send(conn, reply, [self._fd_for(session, s, live[s][0]) for s in part]):
                return
            self.fds_sent += len(part)
        session.mapped_segments.update(ids)
        session.mapped_segments.difference_update(retired)

    def _fd_for(self, session: Session, segment_id: int, fd: int) -> int:
        """The segment's read-write fd, or its read-only one for a session that may not write it."""
        segment_class = self._segments.segment_class(segment_id)
        if segment_class is None or self._may_write(session, segment_class):
            return fd
        return self._segments.read_only_fd(segment_id)

    def _send(self, conn: FdConnection, reply: FdReply, fds: list[int]) -> bool:
        try:
            fdpass.send_message(conn.sock, reply.encode(), fds)
            return True
        except OSError as exc:  # includes a full socket buffer: the client does not read
            log.warning("fd channel of pid %d: cannot send (%s); disconnecting it",
                        conn.peer_pid, exc)
            self.close_connection(conn, notify=True)
            return False

    def close_connection(self, conn: FdConnection, *, notify: bool) -> None:
        if self._connections.pop(conn.fileno, None) is None:
            return
        self._loop.remove_reader(conn.fileno)
        conn.sock.close()
        if notify:
            self._on_closed(conn)

    def close(self) -> None:
        for conn in list(self._connections.values()):
            self.close_connection(conn, notify=False)
        if self._listener is not None:
            self._loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
