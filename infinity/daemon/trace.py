"""Step traces: what one client touches during a step, in order, and where it is in that order now.

This module owns the per-client data of the scheduler, and nothing that spans
clients (residency, bandwidth, fairness live in `infinity.daemon.scheduler`):

- `TraceEntry` / `Trace`: the accesses of one recorded step (tensor, size,
  compute time before it, read or write), an index from tensor to positions,
  next-use estimates in seconds, and a plain-data form (`to_dict` /
  `from_dict`) the daemon can persist with msgpack or JSON, so that a
  restarted client prefetches from its first step.
- `Recorder`: collects the accesses of a recording step into a `Trace`.
- `Replay`: the cursor of a replaying step. It matches each live access
  against the trace with a small tolerance window and says when the order
  has changed.

Pure Python: no clock (times come in as arguments), no I/O, no threads.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass
from enum import Enum
from typing import Any, Sequence

TensorKey = tuple[str, str]  # (namespace, tensor name), as in the catalog
StreamKey = tuple[str, str]  # (namespace, client name): whose steps a trace describes

TRACE_FORMAT_VERSION = 1

# Every access is assumed to take at least this long. It keeps a trace's time
# offsets strictly increasing, so next-use estimates order positions correctly
# even when a client touches tensors in one burst and every measured gap is 0.
MIN_GAP_S = 1e-6

INFINITE_S = math.inf


@dataclass(frozen=True, slots=True)
class TraceEntry:
    """One access of a recorded step."""

    key: TensorKey
    nbytes: int
    # Compute time between the previous access (or the step's start, for the
    # first entry) and this one, with the time spent waiting for data taken
    # out: what the client needs regardless of the disk.
    gap_s: float
    # A write publishes a new version: the old bytes are dead from here on,
    # and there is nothing to prefetch.
    write: bool = False


class Trace:
    """The accesses of one step, with a tensor -> positions index and time offsets.

    Immutable: a refreshed timing is a new `Trace` (`refreshed`). Positions
    are cyclic: the step after this one is expected to repeat it, so from
    cursor `c` a position `p < c` means "p in the next step".
    """

    __slots__ = ("entries", "step_gap_s", "_offsets", "_positions")

    def __init__(self, entries: Sequence[TraceEntry], *, step_gap_s: float = 0.0) -> None:
        if not entries:
            raise ValueError("a trace needs at least one access")
        self.entries: tuple[TraceEntry, ...] = tuple(entries)
        # Time from one step's end to the next one's start (data loading, logging).
        self.step_gap_s = max(0.0, float(step_gap_s))
        offsets: list[float] = []
        positions: dict[TensorKey, list[int]] = {}
        elapsed = 0.0
        for index, entry in enumerate(self.entries):
            elapsed += max(entry.gap_s, MIN_GAP_S)
            offsets.append(elapsed)
            positions.setdefault(entry.key, []).append(index)
        self._offsets = offsets  # _offsets[i]: expected time of access i after the step's start
        self._positions = positions  # sorted, since built in order

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self._positions

    @property
    def duration_s(self) -> float:
        """The step's expected compute time (waits for data excluded)."""
        return self._offsets[-1]

    @property
    def keys(self) -> frozenset[TensorKey]:
        return frozenset(self._positions)

    def time_until(self, cursor: int, position: int) -> float:
        """Expected seconds from "accesses [0, cursor) are done" until access `position`.

        `cursor` is in [0, len]; a `position` before the cursor is the one in the next step.
        """
        base = self._offsets[cursor - 1] if cursor > 0 else 0.0
        if position >= cursor:
            return self._offsets[position] - base
        return (self._offsets[-1] - base) + self.step_gap_s + self._offsets[position]

    def next_access(self, key: TensorKey, cursor: int) -> int | None:
        """Position of the next access to `key` at or after `cursor`, cyclic; None if never."""
        positions = self._positions.get(key)
        if positions is None:
            return None
        index = bisect_left(positions, cursor)
        return positions[index] if index < len(positions) else positions[0]

    def next_use_s(self, key: TensorKey, cursor: int) -> float:
        """Seconds until `key`'s current bytes are next read; infinite if never in this trace.

        A tensor whose next access is a write is dead (the write replaces it
        without reading it), so it is infinitely far too.
        """
        position = self.next_access(key, cursor)
        if position is None or self.entries[position].write:
            return INFINITE_S
        return self.time_until(cursor, position)

    def refreshed(self, measured_gaps_s: Sequence[float | None], *, alpha: float,
                  step_gap_s: float | None) -> Trace:
        """A copy whose gaps move towards the ones measured in a step that followed this trace.

        An EWMA, so that one slow step (a checkpoint, a page fault storm)
        does not rewrite the timing; `None` means "not measured" (skipped).
        """
        if len(measured_gaps_s) != len(self.entries):
            raise ValueError("one measured gap per trace entry is needed")
        entries = [
            entry if gap is None else TraceEntry(entry.key, entry.nbytes,
                                                 (1.0 - alpha) * entry.gap_s + alpha * gap, entry.write)
            for entry, gap in zip(self.entries, measured_gaps_s)
        ]
        new_step_gap = self.step_gap_s if step_gap_s is None else (
            (1.0 - alpha) * self.step_gap_s + alpha * step_gap_s)
        return Trace(entries, step_gap_s=new_step_gap)

    # --- plain-data form (msgpack / JSON) ------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts, lists, strings and numbers only: msgpack and JSON take it as is."""
        return {
            "format": TRACE_FORMAT_VERSION,
            "step_gap_s": self.step_gap_s,
            # One row per access: [namespace, name, nbytes, gap_s, write].
            "entries": [[e.key[0], e.key[1], e.nbytes, e.gap_s, e.write] for e in self.entries],
        }

    @classmethod
    def from_dict(cls, data: Any) -> Trace:
        """Rebuild a trace from `to_dict`'s form; ValueError (saying what is wrong) otherwise."""
        if not isinstance(data, dict):
            raise ValueError(f"a trace is a dict, not {type(data).__name__}")
        if data.get("format") != TRACE_FORMAT_VERSION:
            raise ValueError(f"trace format {data.get('format')!r} is not {TRACE_FORMAT_VERSION}; "
                             f"the trace will be recorded again")
        step_gap_s = data.get("step_gap_s", 0.0)
        if not _is_number(step_gap_s) or step_gap_s < 0 or not math.isfinite(step_gap_s):
            raise ValueError("trace step_gap_s must be a finite number >= 0")
        rows = data.get("entries")
        if not isinstance(rows, list) or not rows:
            raise ValueError("trace entries must be a non-empty list")
        entries: list[TraceEntry] = []
        for index, row in enumerate(rows):
            if not (isinstance(row, (list, tuple)) and len(row) == 5):
                raise ValueError(f"trace entry {index} must be [namespace, name, nbytes, gap_s, write]")
            namespace, name, nbytes, gap_s, write = row
            if not (isinstance(namespace, str) and isinstance(name, str)):
                raise ValueError(f"trace entry {index}: namespace and name must be strings")
            if not (isinstance(nbytes, int) and not isinstance(nbytes, bool) and nbytes >= 0):
                raise ValueError(f"trace entry {index}: nbytes must be an integer >= 0")
            if not (_is_number(gap_s) and gap_s >= 0 and math.isfinite(gap_s)):
                raise ValueError(f"trace entry {index}: gap_s must be a finite number >= 0")
            if not isinstance(write, bool):
                raise ValueError(f"trace entry {index}: write must be true or false")
            entries.append(TraceEntry((namespace, name), nbytes, float(gap_s), write))
        return cls(entries, step_gap_s=float(step_gap_s))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Recorder:
    """Collects one step's accesses. Past `max_entries` it gives up (the step is not traced)."""

    __slots__ = ("entries", "max_entries", "overflowed")

    def __init__(self, *, max_entries: int) -> None:
        self.entries: list[TraceEntry] = []
        self.max_entries = max_entries
        self.overflowed = False

    def observe(self, key: TensorKey, nbytes: int, gap_s: float, *, write: bool) -> None:
        if len(self.entries) >= self.max_entries:
            # A step this long is probably not a step (markers missing); a huge
            # trace would cost memory and persistence time for no good prediction.
            self.overflowed = True
            return
        self.entries.append(TraceEntry(key, nbytes, max(0.0, gap_s), write))

    def finish(self, *, step_gap_s: float) -> Trace | None:
        if self.overflowed or not self.entries:
            return None
        return Trace(self.entries, step_gap_s=step_gap_s)


class Match(Enum):
    """How one live access relates to the trace being replayed."""

    IN_ORDER = "in_order"  # the expected next access
    SKIPPED = "skipped"  # a little further ahead (within the window): the ones before it are skipped
    RETOUCH = "retouch"  # a tensor consumed just before, touched again: harmless
    UNEXPECTED = "unexpected"  # not where the trace says; prefetch pauses until an access matches again
    DIVERGED = "diverged"  # the order has changed: no more trace for this step


class Replay:
    """The cursor of one replaying step.

    `position` is the index of the next expected access. An access matching
    one of the next `window` entries moves the cursor past it; `window`
    unexpected accesses in a row mean the order changed (diverged) and the
    trace is not used for the rest of the step.

    A change that never makes `window` misses in a row (a new tensor read
    between every two traced ones, every other traced tensor no longer read)
    shows as the same tensors off the trace step after step: `off_trace`
    collects the keys of this step's unexpected accesses and skipped entries,
    and `followed` compares them with the step before's. A skipped entry read
    a moment later (a swap within the window) is taken back out.
    """

    __slots__ = ("trace", "window", "position", "unexpected_run", "diverged", "skipped",
                 "unexpected", "measured_gaps_s", "off_trace")

    def __init__(self, trace: Trace, *, window: int) -> None:
        self.trace = trace
        self.window = window
        self.position = 0
        self.unexpected_run = 0
        self.diverged = False
        self.skipped = 0
        self.unexpected = 0
        self.measured_gaps_s: list[float | None] = [None] * len(trace)
        self.off_trace: set[TensorKey] = set()

    def _off_trace(self, key: TensorKey) -> None:
        # Bounded: past this many, the step is far enough off for any comparison.
        if len(self.off_trace) < 2 * len(self.trace) + self.window:
            self.off_trace.add(key)

    @property
    def on_track(self) -> bool:
        """True when the cursor can be trusted for prefetching."""
        return not self.diverged and self.unexpected_run == 0

    def observe(self, key: TensorKey, gap_s: float) -> Match:
        if self.diverged:
            return Match.DIVERGED
        entries = self.trace.entries
        end = min(len(entries), self.position + self.window)
        for index in range(self.position, end):
            if entries[index].key == key:
                skipped = index - self.position
                self.skipped += skipped
                for passed in range(self.position, index):
                    self._off_trace(entries[passed].key)
                self.off_trace.discard(key)  # read early or late: swapped, not off the trace
                # After a skip or an unexpected access the gap measures more than this entry's compute.
                if skipped == 0 and self.unexpected_run == 0:
                    self.measured_gaps_s[index] = max(0.0, gap_s)
                self.position = index + 1
                self.unexpected_run = 0
                return Match.IN_ORDER if skipped == 0 else Match.SKIPPED
        for index in range(max(0, self.position - self.window), self.position):
            if entries[index].key == key:
                self.off_trace.discard(key)  # skipped a moment ago, read now: only swapped
                return Match.RETOUCH
        self.unexpected += 1
        self.unexpected_run += 1
        self._off_trace(key)
        if self.unexpected_run >= self.window:
            self.diverged = True
            return Match.DIVERGED
        return Match.UNEXPECTED

    def followed(self, *, off_trace_before: frozenset[TensorKey] = frozenset()) -> bool:
        """At the step's end: did the step follow the trace (up to the tolerance)?

        Ending with more than the window's worth of the trace left, or on
        unmatched accesses, is a changed order too; so is a step in which
        `recurring_off_trace_limit()` or more of the tensors off the trace were
        off it in the step before too (`off_trace_before`, that step's
        `off_trace`): a change that lasts, not a one-off detour or tensors
        named anew every step, which recording again would not help.
        """
        remaining = len(self.trace) - self.position
        if self.diverged or self.unexpected_run or remaining >= self.window:
            return False
        return len(self.off_trace & off_trace_before) < self.recurring_off_trace_limit()

    def recurring_off_trace_limit(self) -> int:
        """How many tensors off the trace in two steps running mean its order changed: an
        eighth of the trace, and at least the window."""
        return max(self.window, len(self.trace) // 8)
