"""The monitor's data API: threads that receive infinityd's snapshots and keep the latest.

It never imports the UI. Drawing code reads `latest()` (and `history()`), which
return at once; when the daemon cannot be reached the snapshot says so
(`error`) instead of raising, so a monitor keeps running across daemon restarts.

`TelemetryCollector` subscribes to the daemon's telemetry stream (the runtime
folder's telemetry socket, `wire.TelemetrySnapshot`) and keeps the last minute
of bandwidth figures; where no snapshot comes (the stream is off, or the
daemon is just starting) it asks `stats` once a second instead, and where no
daemon runs it says so and subscribes again when one comes back.
`StatsCollector` only polls `stats` (what output into a pipe uses). Each poll
is one one-off `stats` request (`infinity.client.admin`), not a Client: no
torch, no shared-memory segments mapped, no fd handshake.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Self

import zmq

from infinity.client.admin import MONITOR_CLIENT_NAME, daemon_stats
from infinity.config import InfinityConfig
from infinity.errors import InfinityError, ProtocolError
from infinity.protocol import wire
from infinity.protocol.paths import RuntimeLayout


@dataclass(frozen=True)
class Snapshot:
    taken_at_s: float
    stats: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # why there are no stats, in words
    source: str = "stats"  # "stream" (a telemetry snapshot) or "stats" (a request)


@dataclass(frozen=True)
class BandwidthSample:
    """One snapshot's transfer rates, bytes per second: clients' reads (bytes leased) and writes
    (bytes committed) of the CPU tier, and the NVMe tier's reads and writes."""

    taken_at_s: float
    read: float
    write: float
    disk_read: float
    disk_write: float


def _rate(table: Any, key: str) -> float:
    value = table.get(key) if isinstance(table, dict) else None
    return float(value) if isinstance(value, (int, float)) else 0.0


def bandwidth_of(snapshot: Snapshot) -> BandwidthSample:
    tiers = snapshot.stats.get("tiers") if isinstance(snapshot.stats, dict) else None
    cpu = tiers.get("cpu") if isinstance(tiers, dict) else None
    nvme = tiers.get("nvme") if isinstance(tiers, dict) else None
    return BandwidthSample(snapshot.taken_at_s, _rate(cpu, "read_bytes_per_s"),
                           _rate(cpu, "written_bytes_per_s"), _rate(nvme, "read_bytes_per_s"),
                           _rate(nvme, "written_bytes_per_s"))


STOP_WAIT_S = 0.5  # how long `stop` waits for a poll under way


class StatsCollector:
    """Polls the daemon every `interval_s` on its own thread; `latest()` never blocks.
    (TelemetryCollector builds on it: the same thread, snapshots and stop.)"""

    def __init__(self, config: InfinityConfig, *, interval_s: float = 1.0) -> None:
        self.config = config
        self.interval_s = interval_s
        self._latest = Snapshot(time.time(), error="no snapshot yet")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._first = threading.Event()
        self._thread = threading.Thread(target=self._run, name="infinity-top-collector", daemon=True)

    def start(self) -> Self:
        self._thread.start()
        return self

    def latest(self) -> Snapshot:
        with self._lock:
            return self._latest

    def wait_first(self, timeout_s: float) -> Snapshot:
        self._first.wait(timeout_s)
        return self.latest()

    def poll_once(self) -> Snapshot:
        """One snapshot, taken on the calling thread."""
        try:
            stats = daemon_stats(self.config, name=MONITOR_CLIENT_NAME)
        except InfinityError as exc:
            return Snapshot(time.time(), error=str(exc))
        return Snapshot(time.time(), stats=stats)

    def _publish(self, snapshot: Snapshot) -> None:
        with self._lock:
            self._latest = snapshot
        self._first.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._publish(self.poll_once())
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        """Stop polling; returns at once even while a poll waits on a hung daemon (the thread is a
        daemon thread and ends with its poll)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=STOP_WAIT_S)


HISTORY_S = 60.0  # the bandwidth history kept: the last minute
POLL_S = 0.25  # how long the collector waits for a snapshot before looking at the clock again


class TelemetryCollector(StatsCollector):
    """Receives the daemon's snapshots on its own thread; `latest()` and `history()` never block.

    A snapshot is expected every `stale_after_s` at most (the daemon's interval, a second by
    default, with room to spare); past that the collector asks whether a daemon runs: none,
    and the snapshot says so (the subscription is made again, so a daemon that comes back is
    heard at once); one that is silent (its stream is off), and it asks `stats` instead.
    """

    def __init__(self, config: InfinityConfig, *, stale_after_s: float = 3.0) -> None:
        super().__init__(config)
        self.layout = RuntimeLayout(config.daemon.runtime_dir)
        self.stale_after_s = stale_after_s
        self._latest = Snapshot(time.time(), error="waiting for the first snapshot")
        self._history: collections.deque[BandwidthSample] = collections.deque()

    def history(self) -> list[BandwidthSample]:
        """The bandwidth of each snapshot of the last minute, oldest first."""
        with self._lock:
            return list(self._history)

    def _publish(self, snapshot: Snapshot) -> None:
        with self._lock:
            if snapshot.error is None:
                self._history.append(bandwidth_of(snapshot))
                while self._history and (self._history[0].taken_at_s
                                         < snapshot.taken_at_s - HISTORY_S):
                    self._history.popleft()
        super()._publish(snapshot)

    def _poll(self) -> None:
        """One `stats` request, where no stream says anything."""
        try:
            running = self.layout.daemon_running()
        except InfinityError as exc:
            self._publish(Snapshot(time.time(), error=str(exc)))
            return
        if not running:
            self._publish(Snapshot(time.time(), error=(
                f"no infinityd is running for runtime folder {self.layout.root}; waiting "
                f"for one to start")))
            return
        self._publish(self.poll_once())

    def _subscribe(self, context: zmq.Context[Any]) -> zmq.Socket[Any]:
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, 4)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(self.layout.telemetry_endpoint)
        return socket

    def _run(self) -> None:
        context = zmq.Context(io_threads=1)
        socket = self._subscribe(context)
        try:
            self._poll()  # a first frame at once, not after the stream's first interval
            heard = time.monotonic()
            while not self._stop.is_set():
                if socket.poll(int(POLL_S * 1000)):
                    data = socket.recv()
                    while socket.poll(0):  # behind: only the newest matters
                        data = socket.recv()
                    try:
                        message = wire.TelemetrySnapshot.decode(data)
                    except ProtocolError as exc:
                        self._publish(Snapshot(time.time(), error=str(exc)))
                    else:
                        self._publish(Snapshot(message.time_s, stats=message.stats,
                                               source="stream"))
                    heard = time.monotonic()
                elif time.monotonic() - heard > self.stale_after_s:
                    self._poll()
                    if self.latest().error is not None:
                        # Subscribe afresh: the next daemon binds a new socket file.
                        socket.close(linger=0)
                        socket = self._subscribe(context)
                    # Asked again after a second, unless a snapshot comes first.
                    heard = time.monotonic() - self.stale_after_s + 1.0
        finally:
            socket.close(linger=0)
            context.term()
