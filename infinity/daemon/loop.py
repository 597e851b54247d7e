"""The daemon's one event-loop thread: a poller over ZeroMQ sockets and plain fds, with callbacks.

Everything infinityd reacts to arrives here: the ROUTER socket, the fd-channel
listener and its connections, each client's pidfd, and (with the NVMe tier)
the native engine's completion eventfd. Anything slow (creating and
prefaulting a segment; later SQLite) runs on a worker thread via
`run_in_worker`, whose result comes back through an eventfd as a callback on
this thread. Timers serve liveness checks. Signal handlers call `wake()`.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import select
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, TypeVar, cast

import zmq

log = logging.getLogger("infinityd.loop")

T = TypeVar("T")
Pollable = Any  # a zmq.Socket or an int fd
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # ints: see infinity/daemon/dispatch.py


class EventLoop:
    """Poll, dispatch, repeat. Only `call_soon_threadsafe`, `wake` and `stop` may be called
    from other threads.

    One epoll set holds plain fds and the ZMQ_FD of each ZeroMQ socket. ZMQ_FD
    only signals that the socket's state may have changed (an edge), so before
    every wait the loop asks each ZeroMQ socket whether it holds messages and
    serves it first if so; its callback drains it (the dispatcher, which owns the
    ROUTER socket in infinity/daemon/dispatch.py, reads a batch of messages, and
    the loop comes back to the socket after looking at its other fds).
    """

    def __init__(self, *, num_workers: int = 1) -> None:
        self._epoll = select.epoll()
        # fd -> its registration: a 1-tuple made afresh by each add_reader, so that an fd closed
        # and its number reused within one batch of events is told from the one that fired.
        self._callbacks: dict[int, tuple[Callable[[], None]]] = {}
        self._zmq_sources: dict[zmq.Socket[Any], Callable[[], None]] = {}
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._timer_seq = itertools.count()
        self._ready: deque[Callable[[], None]] = deque()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.add_reader(self._wake_fd, self._on_wake)
        self._workers = ThreadPoolExecutor(max_workers=num_workers,
                                           thread_name_prefix="infinityd-worker")
        self._before_wait: list[Callable[[], None]] = []
        self._running = False
        self._stopping = False
        self.thread_id: int | None = None

    # --- registration -------------------------------------------------------------

    def add_reader(self, source: Pollable, callback: Callable[[], None]) -> None:
        """Call `callback` on this thread whenever `source` (ZeroMQ socket or fd) is readable."""
        if isinstance(source, zmq.Socket):
            fd = int(source.getsockopt(zmq.FD))
            self._zmq_sources[source] = callback
        else:
            fd = int(source)
        self._callbacks[fd] = (callback,)
        self._epoll.register(fd, select.EPOLLIN)

    def remove_reader(self, source: Pollable) -> None:
        """Stop watching `source`; call it before closing the fd or socket."""
        if isinstance(source, zmq.Socket):
            if self._zmq_sources.pop(source, None) is None:
                return
            fd = int(source.getsockopt(zmq.FD))
        else:
            fd = int(source)
        if self._callbacks.pop(fd, None) is not None:
            self._epoll.unregister(fd)

    def before_wait(self, callback: Callable[[], None]) -> None:
        """Call `callback` on every turn, after the turn's events and before the loop waits: the
        place for decisions that should see all of a turn's events at once (prefetch planning)."""
        self._before_wait.append(callback)

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (time.monotonic() + delay_s, next(self._timer_seq), callback))

    def call_soon_threadsafe(self, callback: Callable[[], None]) -> None:
        self._ready.append(callback)
        self.wake()

    def wake(self) -> None:
        try:
            os.eventfd_write(self._wake_fd, 1)
        except OSError:
            pass  # counter saturated: the loop is already due to wake

    def run_in_worker(self, work: Callable[[], T],
                      on_done: Callable[[Future[T]], None]) -> None:
        """Run `work` off the loop; `on_done(future)` then runs on the loop thread."""
        future = self._workers.submit(work)
        future.add_done_callback(lambda f: self.call_soon_threadsafe(lambda: on_done(f)))

    # --- running ------------------------------------------------------------------

    def _on_wake(self) -> None:
        try:
            os.eventfd_read(self._wake_fd)
        except BlockingIOError:
            pass
        while self._ready:
            callback = self._ready.popleft()
            try:
                callback()
            except Exception:
                log.exception("error in a worker completion callback")

    def _run_due_timers(self) -> float | None:
        """Run due timers; return ms until the next one (None if none)."""
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, callback = heapq.heappop(self._timers)
            try:
                callback()
            except Exception:
                log.exception("error in a timer callback")
        if not self._timers:
            return None
        # Rounded up, so the wait does not end just before the timer is due.
        return max(0.0, (self._timers[0][0] - time.monotonic()) * 1000.0 + 0.5)

    def run(self) -> None:
        self._running = True
        self.thread_id = threading.get_ident()
        callbacks = self._callbacks
        zmq_sources = self._zmq_sources
        poll = self._epoll.poll
        try:
            while not self._stopping:
                timeout_ms = self._run_due_timers()
                for sock, drain in list(zmq_sources.items()):
                    if cast(int, sock.getsockopt(_EVENTS)) & _POLLIN:
                        self._dispatch(drain, sock)
                        timeout_ms = 0.0  # look at the other fds, then come back
                if self._stopping:
                    break
                for hook in self._before_wait:
                    self._dispatch(hook, "before-wait hook")
                events = poll(-1 if timeout_ms is None else timeout_ms / 1000.0)
                fired = [(fd, callbacks.get(fd)) for fd, _ in events]
                for fd, registration in fired:
                    # Not if an earlier callback of this batch removed it, nor if it then
                    # registered another fd that the kernel gave the same number (the event
                    # was the old one's: a new session's pidfd taken for an exit, say).
                    if registration is not None and callbacks.get(fd) is registration:
                        self._dispatch(registration[0], fd)
        finally:
            self._running = False

    @staticmethod
    def _dispatch(callback: Callable[[], None], source: Pollable) -> None:
        try:
            callback()
        except Exception:  # a bug in one handler must not stop the daemon
            log.exception("error in the event loop while serving %r", source)

    def stop(self) -> None:
        self._stopping = True
        self.wake()

    def close(self) -> None:
        self._workers.shutdown(wait=True)
        self._epoll.close()
        os.close(self._wake_fd)
