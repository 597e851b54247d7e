"""Telemetry: the rates in `stats` and the stream of snapshots that infinity-top subscribes to.

Everything a snapshot shows is a counter some part of the daemon keeps as it
works (requests, bytes, leases, dirty bytes, stalls, ...): taking a snapshot
reads those counters and walks no tensor. `RateMeter` turns counters into
rates (per second over the last interval); `TelemetryPublisher` takes a
snapshot on a loop timer every `telemetry.interval_s`, sends it on the runtime
folder's telemetry socket (ZeroMQ PUB, `wire.TelemetrySnapshot`, msgpack) and
hands it to the Prometheus exporter. Sending never blocks: a subscriber that
does not keep up loses snapshots (the socket keeps at most SNAPSHOT_HWM).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Hashable, Mapping, Protocol

import zmq

from infinity.config import TelemetryConfig
from infinity.daemon.loop import EventLoop
from infinity.protocol import wire
from infinity.protocol.paths import RuntimeLayout

log = logging.getLogger("infinityd")

# Snapshots queued per subscriber at most: a monitor that stalls gets the newest when it wakes,
# not a backlog, and the daemon's memory stays flat.
SNAPSHOT_HWM = 4


class RateMeter:
    """Rates of counters between two samples: `sample(now, counters)`, then `rate(key)`.

    A key first seen in a sample has rate 0 (no earlier value); a counter that went down
    (a session id reused? never; a restart of a part) has rate 0 rather than a negative one.
    Keys not in the latest sample are forgotten, so clients that left leave nothing behind.
    """

    def __init__(self) -> None:
        self._values: dict[Hashable, int] = {}
        self._rates: dict[Hashable, float] = {}
        self._time: float | None = None
        self.interval_s = 0.0  # the span of the last rates

    def sample(self, now: float, counters: Mapping[Hashable, int]) -> None:
        previous, then = self._values, self._time
        span = now - then if then is not None else 0.0
        rates: dict[Hashable, float] = {}
        if span > 0:
            for key, value in counters.items():
                before = previous.get(key)
                if before is not None and value >= before:
                    rates[key] = (value - before) / span
        self._values, self._rates, self._time = dict(counters), rates, now
        self.interval_s = span

    def rate(self, key: Hashable) -> float:
        return round(self._rates.get(key, 0.0), 3)


class Exporter(Protocol):
    """What the publisher hands each snapshot to (the Prometheus exporter)."""

    def update(self, stats: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class TelemetryPublisher:
    """A snapshot every `interval_s` on the loop's timer: to the PUB socket and the exporters."""

    def __init__(self, config: TelemetryConfig, loop: EventLoop, layout: RuntimeLayout,
                 context: zmq.Context[Any], *, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.config = config
        self.loop = loop
        self.layout = layout
        self._snapshot = snapshot  # takes a sample for the rates, then returns `stats`
        self.socket: zmq.Socket[Any] | None = None
        if config.interval_s > 0:
            self.socket = context.socket(zmq.PUB)
            self.socket.setsockopt(zmq.LINGER, 0)
            self.socket.setsockopt(zmq.SNDHWM, SNAPSHOT_HWM)
        self.exporters: list[Exporter] = []
        self.seq = 0
        self.published_bytes = 0
        self.cpu_s = 0.0  # the loop thread's CPU time spent taking and sending snapshots
        self._closed = False

    def bind(self) -> None:
        if self.socket is None:
            return
        try:
            os.unlink(self.layout.telemetry_path)
        except FileNotFoundError:
            pass
        self.socket.bind(self.layout.telemetry_endpoint)
        os.chmod(self.layout.telemetry_path, 0o600)
        self.loop.call_later(self.config.interval_s, self._tick)

    def describe(self) -> dict[str, Any]:
        """The `telemetry` section of `stats`."""
        return {"interval_s": self.config.interval_s,
                "endpoint": self.layout.telemetry_endpoint if self.socket is not None else None,
                "snapshots": self.seq, "published_bytes": self.published_bytes,
                "cpu_s": round(self.cpu_s, 6),
                "prometheus_port": self.config.prometheus_port or None,
                "prometheus_textfile": self.config.prometheus_textfile or None}

    def _tick(self) -> None:
        if self._closed:
            return
        began = time.monotonic()
        started = time.thread_time()
        self.seq += 1
        stats = self._snapshot()
        message = wire.TelemetrySnapshot(self.seq, time.time(), self.config.interval_s,
                                         stats).encode()
        assert self.socket is not None
        try:
            self.socket.send(message, zmq.NOBLOCK)
            self.published_bytes += len(message)
        except zmq.Again:  # PUB drops rather than blocks; Again only if it ever did not
            pass
        for exporter in self.exporters:
            try:
                exporter.update(stats)
            except Exception:  # an exporter's bug must not stop the stream
                log.exception("telemetry exporter %r failed", exporter)
        self.cpu_s += time.thread_time() - started
        # At a fixed period (a snapshot's own time does not drift the stream), but never
        # sooner than the snapshot took: the loop serves requests at least half its time.
        took = time.monotonic() - began
        self.loop.call_later(max(self.config.interval_s - took, took), self._tick)

    def close(self) -> None:
        self._closed = True
        for exporter in self.exporters:
            exporter.close()
        if self.socket is not None:
            self.socket.close(linger=0)
            try:
                os.unlink(self.layout.telemetry_path)
            except FileNotFoundError:
                pass
