"""The read-bandwidth meter: how fast the I/O engine reads from NVMe, as an EWMA over busy time.

The scheduler sizes each stream's prefetch lookahead from this estimate
(`infinity.daemon.scheduler.prefetch`). The meter hears when loads start,
finish and are dropped, with the daemon's clock; it knows nothing of tensors.
"""

from __future__ import annotations

__all__ = ["ReadMeter"]


class ReadMeter:
    """Engine read bandwidth: bytes completed per second of time with at least one load in flight.

    Loads that run together complete in bursts, so a per-load rate means
    nothing, and a sample cut at an arbitrary completion misses the bytes of
    the loads still running. A sample is exact when the engine goes idle
    (everything it started has been counted); during a long busy stretch one
    is cut every `sample_max_s`, long enough for the loads running across the
    cut to matter little.
    """

    __slots__ = ("estimate", "samples", "_alpha", "_sample_min_s", "_sample_max_s", "_busy",
                 "_mark_s", "_bytes", "_busy_s")

    def __init__(self, *, alpha: float, initial_bytes_per_s: float, sample_min_s: float,
                 sample_max_s: float) -> None:
        self.estimate = initial_bytes_per_s
        self.samples = 0
        self._alpha = alpha
        self._sample_min_s = sample_min_s
        self._sample_max_s = sample_max_s
        self._busy = 0
        self._mark_s = 0.0
        self._bytes = 0
        self._busy_s = 0.0

    def started(self, now_s: float) -> None:
        if self._busy == 0:
            self._mark_s = now_s  # idle time is not the disk's slowness
        self._busy += 1

    def cancelled(self, now_s: float) -> None:
        """A load that never read (dropped before its I/O): its time counts only while other
        loads were running."""
        if self._busy == 0:
            return
        if self._busy > 1:
            self._busy_s += max(0.0, now_s - self._mark_s)
        self._mark_s = now_s
        self._busy -= 1

    def finished(self, nbytes: int, now_s: float) -> None:
        if self._busy == 0:
            return
        self._busy_s += max(0.0, now_s - self._mark_s)
        self._mark_s = now_s
        self._bytes += nbytes
        self._busy -= 1
        idle_now = self._busy == 0 and self._busy_s >= self._sample_min_s
        if (idle_now or self._busy_s >= self._sample_max_s) and self._busy_s > 0 and self._bytes > 0:
            sample = self._bytes / self._busy_s
            # The first sample replaces the configured guess outright.
            self.estimate = sample if self.samples == 0 else (
                (1.0 - self._alpha) * self.estimate + self._alpha * sample)
            self.samples += 1
            self._bytes = 0
            self._busy_s = 0.0
