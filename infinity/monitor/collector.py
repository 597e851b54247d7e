"""The monitor's data API: a thread that polls infinityd's `stats` and publishes snapshots.

It never imports the UI. Drawing code reads `latest()`, which returns at once;
when the daemon cannot be reached the snapshot says so (`error`) instead of
raising, so a monitor keeps running across daemon restarts.

Each poll is one one-off `stats` request (`infinity.client.admin`), not a Client:
no torch, no shared-memory segments mapped, no fd handshake.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from infinity.client.admin import MONITOR_CLIENT_NAME, daemon_stats
from infinity.config import InfinityConfig
from infinity.errors import InfinityError


@dataclass(frozen=True)
class Snapshot:
    taken_at_s: float
    stats: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # why there are no stats, in words


STOP_WAIT_S = 0.5  # how long `stop` waits for a poll under way


class StatsCollector:
    """Polls the daemon every `interval_s` on its own thread; `latest()` never blocks."""

    def __init__(self, config: InfinityConfig, *, interval_s: float = 1.0) -> None:
        self.config = config
        self.interval_s = interval_s
        self._latest = Snapshot(time.time(), error="no snapshot yet")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._first = threading.Event()
        self._thread = threading.Thread(target=self._run, name="infinity-top-collector", daemon=True)

    def start(self) -> "StatsCollector":
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

    def _run(self) -> None:
        while not self._stop.is_set():
            snapshot = self.poll_once()
            with self._lock:
                self._latest = snapshot
            self._first.set()
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        """Stop polling; returns at once even while a poll waits on a hung daemon (the thread is a
        daemon thread and ends with its poll)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=STOP_WAIT_S)
