"""One thread's ZeroMQ DEALER socket to infinityd: send a request, wait for its reply by id.

ZeroMQ sockets must not be used by two threads at once, so each client thread
gets its own channel (attached to the same session) instead of sharing one
socket behind a lock: a request costs one send and one blocking receive on
the caller's own thread, with no hand-off to another thread. Several requests
may be in flight on one channel; replies that arrive for another request are
kept by id until asked for. The blocking receive wakes every `TICK_S` to check
that the daemon is still there, so a dead daemon is reported in well under a
second and a silent one after the request timeout, never a hang. A caller
that gives up on a request whose late answer would hold something (a lease, a
reservation) leaves an undo for it: run when that answer comes, at a later
wait on the same channel, or before its next request goes out, once the socket
is free for the undo's own message.

Closing the client may happen on another thread than a channel's user, and a
ZeroMQ socket must not be closed under a thread that is using it: `shut` closes
a channel no thread is using at once, and asks the one in use to close itself,
which it does within `TICK_S` (or at once when the context is terminated).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, NoReturn, Sequence

import zmq

from infinity.errors import DaemonUnavailableError, InfinityError, InvalidRequestError
from infinity.protocol import wire

TICK_S = 0.1
FAREWELL_LINGER_MS = 200  # how long a dropped channel's socket may take to deliver its detach

LateReply = Callable[[wire.Reply], None]  # undoes what an answer given up on holds


class Channel:
    """A DEALER socket and the replies it is waiting for. Used by one thread at a time."""

    def __init__(self, context: zmq.Context, endpoint: str, *, timeout_s: float,
                 daemon_gone: Callable[[], str | None],
                 unsent: Callable[[Sequence[int]], None] | None = None) -> None:
        self.sock = context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, int(TICK_S * 1000))
        self.sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        self.sock.connect(endpoint)
        self.timeout_s = timeout_s
        self._pid = os.getpid()
        self._daemon_gone = daemon_gone
        self._unsent = unsent  # takes back the releases of a request refused before sending
        self._waiting: set[int] = set()
        self._stash: dict[int, wire.Reply] = {}
        self._abandoned: dict[int, LateReply] = {}  # request id -> undo of its late answer
        self._late: list[tuple[LateReply, wire.Reply]] = []  # answers come, undos not run yet
        self._state = threading.Lock()  # for the two flags below
        self._in_use = False  # a thread is sending or waiting on the socket
        self._shut_asked = False  # by `shut`, while another thread used the socket
        self._farewell: bytes | None = None  # sent when the channel is dropped

    def send(self, request_id: int, message: wire.Request, *, expect_reply: bool,
             releases: Sequence[int] = ()) -> None:
        if self._abandoned:
            self._collect_late()
        try:
            data = wire.encode_request(request_id, message, releases)
        except Exception:  # refused before sending: the releases it carried ride again
            if releases and self._unsent is not None:
                self._unsent(releases)
            raise
        self._begin_use(message.OP)
        if expect_reply:
            self._waiting.add(request_id)
        try:
            self.sock.send(data)
        except zmq.Again:
            self._waiting.discard(request_id)
            raise DaemonUnavailableError(
                f"infinityd did not take a {message.OP} request within {self.timeout_s:g}s "
                f"(daemon.request_timeout_s); is it running? (infinityd status)") from None
        except zmq.ContextTerminated:
            self._waiting.discard(request_id)
            self._closed_meanwhile(message.OP)
        finally:
            self._end_use()

    def wait(self, request_id: int, *, what: str, patient: bool = False,
             on_late_reply: LateReply | None = None) -> wire.Reply:
        """The reply to `request_id`. patient: no time limit while the daemon is alive (for
        work that takes as long as the data is large, like durable flushes). on_late_reply:
        if this gives up on the reply, the undo to run on it should it come later."""
        reply = self._wait(request_id, what=what, patient=patient, packed=False,
                           on_late_reply=on_late_reply)
        assert type(reply) is wire.Reply
        return reply

    def _wait(self, request_id: int, *, what: str, patient: bool, packed: bool,
              on_late_reply: LateReply | None = None) -> wire.Reply | bytes:
        if self._stash:
            reply = self._stash.pop(request_id, None)
            if reply is not None:
                return reply
        self._begin_use(what)
        try:
            return self._receive(request_id, what=what, patient=patient, packed=packed,
                                 on_late_reply=on_late_reply)
        finally:
            self._end_use()
            if self._late:
                self._undo_late()

    def forget_abandoned(self, request_id: int) -> bool:
        """Drop the undo kept for a request given up on; True if there was one (its answer has
        not been read): the caller undoes it now instead."""
        return self._abandoned.pop(request_id, None) is not None

    def _collect_late(self) -> None:
        """Take the answers already here, and run the undos of those given up on, before a new
        request goes out: a retry of the same work must not meet what the first try holds."""
        self._begin_use("a late answer")
        try:
            while True:
                try:
                    data = self.sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._keep(wire.decode_reply(data))
        except zmq.ZMQError:
            pass  # closed meanwhile: the request that follows says so
        finally:
            self._end_use()
        if self._late:
            self._undo_late()

    def _undo_late(self) -> None:
        late, self._late = self._late, []
        for undo, reply in late:
            try:
                undo(reply)
            except InfinityError:
                pass  # the daemon or the session is gone, and what the answer held with it

    def _receive(self, request_id: int, *, what: str, patient: bool, packed: bool,
                 on_late_reply: LateReply | None) -> wire.Reply | bytes:
        deadline = 0.0  # set on the first tick: a prompt reply never reads the clock
        recv = self.sock.recv
        while True:
            try:
                data = recv()
            except zmq.ContextTerminated:
                self._waiting.discard(request_id)
                self._closed_meanwhile(what)
            except zmq.Again:
                if self._shut_asked:
                    self._waiting.discard(request_id)
                    self._closed_meanwhile(what)
                if not deadline:
                    deadline = time.monotonic() + self.timeout_s - TICK_S
                gone = self._daemon_gone()
                if gone is not None:
                    self._waiting.discard(request_id)
                    raise DaemonUnavailableError(
                        f"infinityd went away during {what}: {gone}; restart it "
                        f"(infinityd start) and connect again") from None
                if not patient and time.monotonic() > deadline:
                    self._waiting.discard(request_id)
                    if on_late_reply is not None:
                        self._abandoned[request_id] = on_late_reply
                    raise DaemonUnavailableError(
                        f"infinityd did not answer {what} within {self.timeout_s:g}s "
                        f"(daemon.request_timeout_s); check `infinityd status` and its log") from None
                continue
            if packed:
                split = wire.split_reply(data)
                if split is not None and split[0] == request_id:
                    self._waiting.discard(request_id)
                    return split[1]
            reply = wire.decode_reply(data)
            rid = reply.request_id
            if rid == request_id:
                self._waiting.discard(rid)
                return reply
            self._keep(reply)

    def _keep(self, reply: wire.Reply) -> None:
        """A reply to another request than the one awaited: stashed for its waiter, or queued
        with the undo of a request given up on; anything else answers a request nobody waits
        for (a refused no-reply request)."""
        rid = reply.request_id
        if rid in self._waiting:
            self._waiting.discard(rid)
            self._stash[rid] = reply
        elif self._abandoned:
            undo = self._abandoned.pop(rid, None)
            if undo is not None:
                self._late.append((undo, reply))

    def call(self, request_id: int, message: wire.Request, *, releases: Sequence[int] = (),
             patient: bool = False, on_late_reply: LateReply | None = None) -> wire.Reply:
        self.send(request_id, message, expect_reply=True, releases=releases)
        return self.wait(request_id, what=message.OP, patient=patient,
                         on_late_reply=on_late_reply)

    def call_multi(self, request_id: int, requests: Sequence[tuple[int, wire.Request]], *,
                   releases: Sequence[int] = (), patient: bool = False,
                   on_late_reply: LateReply | None = None) -> tuple[wire.Reply, ...]:
        """Send several requests, each (its own request id, request), in one `multi` message,
        served in order; their replies, as each would have had alone, come back in one reply.
        A multi refused as a whole (malformed, say) fails each of them the same way.
        on_late_reply: the undo of the multi's whole reply, should this give up on it."""
        try:
            message = wire.Multi.of(requests)
        except Exception:  # refused before sending: the releases it carried ride again
            if releases and self._unsent is not None:
                self._unsent(releases)
            raise
        reply = self.call(request_id, message, releases=releases, patient=patient,
                          on_late_reply=on_late_reply)
        return wire.split_multi_reply(reply, [sub_id for sub_id, _ in requests])

    def call_packed(self, request_id: int, message: wire.Request, *,
                    releases: Sequence[int] = (),
                    on_late_reply: LateReply | None = None) -> wire.Reply | bytes:
        """As `call`, but a successful reply comes back as its packed results (`wire.split_reply`),
        for callers that keep what they made of identical replies; anything else decoded."""
        self.send(request_id, message, expect_reply=True, releases=releases)
        return self.call_packed_reply(request_id, what=message.OP, on_late_reply=on_late_reply)

    def call_packed_reply(self, request_id: int, *, what: str,
                          on_late_reply: LateReply | None = None) -> wire.Reply | bytes:
        """The reply to a request sent earlier with `send`, as `call_packed` returns it."""
        return self._wait(request_id, what=what, patient=False, packed=True,
                          on_late_reply=on_late_reply)

    def close(self, *, linger_ms: int = 0) -> None:
        """`linger_ms` lets a last no-reply message (bye) leave before the socket goes."""
        if os.getpid() == self._pid:  # a forked child must not touch its parent's sockets
            self.sock.close(linger=linger_ms)

    def shut(self, *, linger_ms: int = 0) -> None:
        """Close from any thread: now if no thread is sending or waiting on the socket, else
        by that thread within TICK_S (its request raises DaemonUnavailableError)."""
        with self._state:
            if self._in_use:
                self._shut_asked = True
            else:
                self.close(linger_ms=linger_ms)

    def _begin_use(self, what: str) -> None:
        with self._state:
            if self.sock.closed:
                raise DaemonUnavailableError(
                    f"this infinity Client is closed, so {what} was not sent; call "
                    f"infinity.connect()")
            self._in_use = True

    def _end_use(self) -> None:
        with self._state:
            self._in_use = False
            if self._shut_asked and not self.sock.closed:
                self.close()  # the closing thread's context.term() waits for this

    def _closed_meanwhile(self, what: str) -> NoReturn:
        self._shut_asked = True  # closed by `_end_use`, on the way out
        raise DaemonUnavailableError(
            f"this infinity Client was closed (by another thread) while {what} waited for its "
            f"reply; call infinity.connect() again") from None

    def detach_when_dropped(self, request_id: int) -> None:
        """When this channel is dropped unclosed (its thread ended), tell the daemon, so that
        a session whose client runs many short-lived threads does not collect their sockets."""
        self._farewell = wire.encode_request(request_id, wire.Detach(), ())

    def __del__(self) -> None:
        # The channel of a thread that ended goes with the thread's locals; its socket with it.
        if self.sock.closed:
            return
        if self._farewell is None or os.getpid() != self._pid:
            self.close()
            return
        try:
            self.sock.send(self._farewell, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the daemon or the context is gone: nothing to detach from
        self.close(linger_ms=FAREWELL_LINGER_MS)
