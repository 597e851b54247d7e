"""A client's session with infinityd: the connection's lifecycle and how every call is sent.

`Session` opens the session (hello, welcome, the fd handshake that maps the shared-memory
segments), gives each thread its own channel attached to it, keeps it alive with a heartbeat
thread, and ends it (close, at exit, refused after fork). Every request goes through `_call`
or `_send`, which carry the shared leases released since the last message (a get + release
costs one message, not two). The per-client state the calls share lives here; the calls
themselves are in `leases`, `writes`, `streams`, `steps` and `queries`, which `client`
puts together as `Client`.
"""

from __future__ import annotations

import atexit
import itertools
import os
import threading
import weakref
from typing import Any, Callable, Iterable, Protocol, Sequence, TypeVar, Union

import psutil
import torch
import zmq

from infinity.client.channel import Channel, LateReply
from infinity.client.segments import SegmentMap
from infinity.client.spares import SpareReservations
from infinity.config import InfinityConfig
from infinity.errors import DaemonUnavailableError, ForkedClientError, InfinityError
from infinity.protocol import wire
from infinity.protocol.paths import RuntimeLayout
from infinity.protocol.wire import ItemError, Placement

Names = Union[str, Sequence[str]]
_SessionT = TypeVar("_SessionT", bound="Session")

# Every session not closed yet, held strongly: one dropped without close() stays open until it
# is closed at exit. Were it left to the garbage collector, a session in a reference cycle (once
# its heartbeat thread ended: the daemon went away) would be finalized together with its zmq
# context and sockets in one pass, in no set order; the collector clears the weak references
# first, so the context's destroy() no longer sees the sockets still open and its term() waits
# for them forever (seen: a later gc.collect() in transformers.Trainer hung the test suite).
_LIVE_SESSIONS: set[Session] = set()
# Released shared leases wait for the next message up to this many, then go at once.
MAX_PENDING_RELEASES = 4096
PUT_STRIPES = 64  # locks that puts of one name from several threads take in turn


def _after_fork_in_child() -> None:
    for session in list(_LIVE_SESSIONS):
        session._forked = True


def _close_all_at_exit() -> None:
    for session in list(_LIVE_SESSIONS):
        try:
            session.close()
        except Exception:
            pass


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_close_all_at_exit)


def as_names(names: Names) -> list[str]:
    """A name, or a sequence of names, as a list."""
    if isinstance(names, str):
        return [names]
    return list(names)


class DeviceFiguresSource(Protocol):
    """What reports a part of the client's GPU tier (a DeviceCache)."""

    def device_figures(self) -> wire.DeviceFigures: ...


def device_report(sources: Iterable[DeviceFiguresSource]) -> wire.DeviceReport:
    """The sources' figures, summed per device."""
    by_device: dict[str, list[int]] = {}
    for source in sources:
        figures = source.device_figures().to_wire()
        total = by_device.setdefault(figures[0], [0] * (len(figures) - 1))
        for i, value in enumerate(figures[1:]):
            total[i] += value
    return wire.DeviceReport(tuple(wire.DeviceFigures(device, *values)
                                   for device, values in sorted(by_device.items())))


class Session:
    """The session under a `Client`: see the module docstring."""

    def __init__(self, config: InfinityConfig, layout: RuntimeLayout, *, name: str) -> None:
        self.config = config
        self.layout = layout
        self.name = name
        self._pid = os.getpid()
        self._forked = False
        self._closed = False
        self._timeout_s = config.daemon.request_timeout_s
        self._context = zmq.Context(io_threads=1)
        self._local = threading.local()
        self._channels_lock = threading.Lock()
        # Weak: a thread's channel lives in its thread-local storage and ends with the thread.
        self._channels: weakref.WeakSet[Channel] = weakref.WeakSet()
        self._request_ids = itertools.count(1)
        self._pending_lock = threading.Lock()
        self._pending_releases: list[int] = []  # shared leases released but not yet told
        # Spare reservations the daemon left after this client's puts, by (namespace, name):
        # the next put or reserve of the same dtype and shape fills one instead of asking.
        self._spares = SpareReservations(
            view=self._view, abort_quietly=self._abort_quietly, timeout_s=self._timeout_s,
            max_age_s=config.daemon.client_timeout_s / 2)  # until the welcome says
        # A put reserves, fills and commits its names, and a session holds one reservation per
        # name: puts of one name from several threads take turns (names share these stripes).
        self._put_stripes = [threading.Lock() for _ in range(PUT_STRIPES)]
        self.steps_begun = 0  # step_begin calls so far (a DeviceCache asks anew at each)
        self._segments: SegmentMap | None = None
        self._heartbeat_stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        # The device caches of this client, whose figures ride with the heartbeats (weak: a
        # cache dropped unclosed leaves the report by itself).
        self._device_sources: weakref.WeakSet[DeviceFiguresSource] = weakref.WeakSet()
        self._devices_reported = False
        try:
            channel = self._new_channel()
            reply = channel.call(next(self._request_ids), wire.Hello(
                wire.PROTOCOL_VERSION, name, os.getpid(), psutil.Process().create_time(),
                layout.read_secret()))
            welcome = wire.Welcome.from_wire(self._results(reply)[0])
            self._local.channel = channel
            self.client_id = welcome.client_id
            self.daemon_pid = welcome.daemon_pid
            self.daemon_version = welcome.daemon_version
            self._token = welcome.token
            self._spares.max_age_s = welcome.client_timeout_s / 2  # see SpareReservations
            self._segments = SegmentMap(layout.fds_path, welcome.token, timeout_s=self._timeout_s)
        except BaseException:
            self._teardown(send_bye=False)
            raise
        self._heartbeat = threading.Thread(
            target=self._heartbeat_loop, args=(welcome.heartbeat_interval_s,),
            name=f"infinity-heartbeat-{self.client_id}", daemon=True)
        self._heartbeat.start()
        _LIVE_SESSIONS.add(self)

    # --- plumbing -------------------------------------------------------------------

    def _daemon_gone(self) -> str | None:
        return None if self._segments is None else self._segments.daemon_gone()

    def _new_channel(self) -> Channel:
        channel = Channel(self._context, self.layout.control_endpoint, timeout_s=self._timeout_s,
                          daemon_gone=self._daemon_gone, unsent=self._give_back_releases)
        with self._channels_lock:
            self._channels.add(channel)
        return channel

    def _check_usable(self) -> None:
        if self._forked:
            raise ForkedClientError(
                f"this infinity Client was created in process {self._pid} and cannot be used in "
                f"its forked child {os.getpid()}; call infinity.connect() again in the child")
        if self._closed:
            raise DaemonUnavailableError("this infinity Client is closed; call infinity.connect()")
        if self._segments is not None and self._segments.closed:
            raise DaemonUnavailableError(
                "this infinity Client's session ended when infinityd did not hand over "
                "shared-memory segments in time; call infinity.connect() again")

    def _channel(self) -> Channel:
        channel: Channel | None = getattr(self._local, "channel", None)
        if channel is None:
            channel = self._local.channel = self._attached_channel()
        return channel

    def _attached_channel(self) -> Channel:
        """A new socket, attached to this client's session."""
        channel = self._new_channel()
        self._results(channel.call(next(self._request_ids), wire.Attach(self._token)))
        channel.detach_when_dropped(next(self._request_ids))
        return channel

    def _call(self, message: wire.Request, *, patient: bool = False,
              on_late_reply: LateReply | None = None) -> tuple[Any, ...]:
        """patient: wait as long as the daemon lives (durable writes take as long as the data
        is large), instead of daemon.request_timeout_s. on_late_reply: see `Channel.wait`."""
        self._check_usable()
        channel = self._channel()
        return self._results(channel.call(next(self._request_ids), message,
                                          releases=self._take_releases(), patient=patient,
                                          on_late_reply=on_late_reply))

    def _send(self, message: wire.Request) -> None:
        self._check_usable()
        channel = self._channel()
        channel.send(next(self._request_ids), message, expect_reply=False,
                     releases=self._take_releases())

    def _take_releases(self) -> list[int]:
        if not self._pending_releases:  # the common case, without the lock
            return []
        with self._pending_lock:
            taken, self._pending_releases = self._pending_releases, []
        return taken

    @staticmethod
    def _results(reply: wire.Reply) -> tuple[Any, ...]:
        if reply.failure is not None:
            raise reply.failure.exception()
        return reply.results

    @staticmethod
    def _raise_first(results: Iterable[Any]) -> None:
        for result in results:
            if type(result) is ItemError:
                raise result.exception()

    def _heartbeat_loop(self, interval_s: float) -> None:
        channel: Channel | None = None
        try:
            channel = attached = self._new_channel()
            attached.call(next(self._request_ids), wire.Attach(self._token))
            beat = wire.Heartbeat()

            def call(message: wire.Request) -> tuple[Any, ...]:  # for the spares given back
                return self._results(attached.call(next(self._request_ids), message))

            while not self._heartbeat_stop.wait(interval_s):
                if self._forked:
                    return
                channel.send(next(self._request_ids), beat, expect_reply=False,
                             releases=self._take_releases())
                sources = list(self._device_sources)
                if sources or self._devices_reported:  # (an empty one once, when none is left)
                    channel.send(next(self._request_ids), device_report(sources),
                                 expect_reply=False)
                    self._devices_reported = bool(sources)
                self._spares.give_back_old(call)
        except InfinityError:
            pass  # the daemon is gone or the session ended: the next call says so
        except zmq.ZMQError:
            pass  # the context was terminated under us by close()
        finally:
            if channel is not None:
                channel.close()


    # --- released leases, told with the next message -------------------------------------

    def _release(self, lease_ids: list[int], *, exclusive: bool) -> None:
        if self._forked or self._closed:
            return  # the daemon drops the session's leases anyway
        if exclusive:  # others may be waiting to read it: say so now
            self._send(wire.Release(tuple(lease_ids)))
            return
        # A shared release rides along with this client's next message (a request from any of
        # its threads, or the next heartbeat): a get + release costs one message, not two. The
        # daemon frees the version then; another process that wants an exclusive lease on it
        # meets it at most daemon.heartbeat_interval_s later, or at once after flush().
        with self._pending_lock:
            self._pending_releases.extend(lease_ids)
            overflowing = len(self._pending_releases) >= MAX_PENDING_RELEASES
        if overflowing:
            self._send(wire.Release(()))

    def _give_back_releases(self, lease_ids: Sequence[int]) -> None:
        """Releases taken for a message that was refused before it was sent: they ride again."""
        if lease_ids:
            with self._pending_lock:
                self._pending_releases[:0] = lease_ids

    # --- what the calls share -----------------------------------------------------------

    def _abort_quietly(self, names: list[str], namespace: str) -> None:
        """Abort these reservations, ignoring a failure: for clearing up after another error."""
        try:
            self._call(wire.Abort(tuple(wire.TensorRef(namespace, n) for n in names)))
        except InfinityError:
            pass  # the first error is the one the caller sees

    # --- the shared memory ----------------------------------------------------------------

    def _view(self, placement: Placement) -> torch.Tensor:
        assert self._segments is not None
        return self._segments.view(placement)

    def report_devices(self, source: DeviceFiguresSource, *, report: bool = True) -> None:
        """Send `source`'s figures of the GPU tier with each heartbeat (for `stats` and
        infinity-top), or, with report=False, no longer."""
        if report:
            self._device_sources.add(source)
        else:
            self._device_sources.discard(source)

    def on_segment_unmap(self, callback: Callable[[int, int], None]) -> None:
        """Call `callback(start, end)` before a shared-memory segment of this client is unmapped
        (retired by the daemon, or at close), e.g. to drop a CUDA pin on it. Added once."""
        assert self._segments is not None
        self._segments.add_unmap_hook(callback)

    def segment_ranges(self) -> list[tuple[int, int, int]]:
        """(segment id, start address, end address) of each shared segment mapped here."""
        assert self._segments is not None
        return self._segments.ranges()

    # --- closing ------------------------------------------------------------------------

    def close(self) -> None:
        """End the session: the daemon drops this client's leases and reservations."""
        if self._forked:
            self._closed = True  # the parent's sockets are not ours to touch
            return
        self._teardown(send_bye=True)

    def shutdown_daemon(self) -> None:
        """Ask infinityd to stop cleanly (what `infinityd stop` does); this client is closed."""
        self._call(wire.Shutdown())
        self._teardown(send_bye=False)

    def _teardown(self, *, send_bye: bool) -> None:
        if self._closed:
            return
        self._closed = True
        _LIVE_SESSIONS.discard(self)
        self._spares.clear()  # the daemon discards them with the session
        self._heartbeat_stop.set()
        channel: Channel | None = getattr(self._local, "channel", None)
        if send_bye and channel is not None:
            try:
                channel.send(next(self._request_ids), wire.Bye(), expect_reply=False)
            except InfinityError:
                pass
        with self._channels_lock:
            others = [other for other in self._channels if other is not channel]
        for other in others:
            # The heartbeat thread may be waiting for an answer (giving spares back): its
            # request ends within a tick, not at daemon.request_timeout_s.
            other.shut()
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join(timeout=self._timeout_s)
        with self._channels_lock:
            for other in list(self._channels):
                # Another thread's request under way closes its own socket, within a tick or
                # at the context's termination below, which waits for it.
                other.shut(linger_ms=200 if other is channel else 0)
            self._channels.clear()
        if self._segments is not None:
            self._segments.close()
        self._context.term()

    def __enter__(self: _SessionT) -> _SessionT:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

