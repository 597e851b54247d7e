"""What the scheduler keeps per client stream, and what it reports about accesses and steps.

A stream is one (namespace, client name): the client's step trace, where a
replaying step is in it, what a recording step has seen, its wait and stall
bookkeeping and its counters; and per load in flight, what the scheduler
notes of it (`LoadNote`). This module holds the records only: the step
lifecycle that changes them is `infinity.daemon.scheduler.steps`, the
scheduler's access and load accounting adds to the counters
(`infinity.daemon.scheduler.core`), and the next-use index keeps its
per-stream part here too (the fields it writes are marked below).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from infinity.daemon.trace import Recorder, Replay, StreamKey, TensorKey, Trace

__all__ = ["AccessKind", "Counters", "LoadNote", "StepSummary", "Stream", "StreamState"]


@dataclass(slots=True)
class LoadNote:
    """What the scheduler notes of a load in flight (the load itself is residency's)."""

    nbytes: int
    prefetch: bool
    stream: StreamKey | None
    used: bool = False  # accessed while in flight (an in-flight hit): not a prefetch hit later
    reading: bool = True  # its read was submitted (the bandwidth meter counts its time)


class AccessKind(str, Enum):
    """Where a client's access found its data (what `touched` returns)."""

    PREFETCH_HIT = "prefetch_hit"  # resident, brought in by a prefetch not yet used
    INFLIGHT_HIT = "inflight_hit"  # a prefetch had started but not finished: the client waits less
    RESIDENT_HIT = "resident_hit"  # resident for another reason: kept from earlier use, or written
    MISS = "miss"  # not resident and no prefetch under way: a demand load
    WRITE = "write"  # a commit: nothing was read


@dataclass(slots=True)
class Counters:
    """Per-client counters, for the whole session and for one step (same fields)."""

    steps: int = 0
    accesses: int = 0  # reads
    prefetch_hits: int = 0
    inflight_hits: int = 0
    resident_hits: int = 0
    misses: int = 0
    writes: int = 0
    bytes_got: int = 0  # bytes the client read through the tier
    bytes_put: int = 0  # bytes the client committed
    disk_read_bytes: int = 0  # loads from NVMe done for this client (prefetch or demand)
    disk_write_bytes: int = 0  # write-backs of tensors this client wrote last
    prefetch_loads: int = 0
    prefetch_bytes: int = 0
    prefetch_wasted_bytes: int = 0  # prefetched, then evicted before any use
    stall_s: float = 0.0  # time the client waited for data
    stalls: int = 0
    divergences: int = 0
    skipped_entries: int = 0
    unexpected_accesses: int = 0
    traces_recorded: int = 0
    traces_borrowed: int = 0  # steps that replayed another stream's trace (`Steps.borrow_trace`)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class StreamState(str, Enum):
    """Where a stream is in its steps."""

    IDLE = "idle"  # between steps (or never marked one)
    RECORDING = "recording"
    REPLAYING = "replaying"


@dataclass(slots=True)
class Stream:
    """One client's stream: its trace, its step under way, its waits and its counters."""

    key: StreamKey
    active: bool = True
    state: StreamState = StreamState.IDLE
    trace: Trace | None = None
    replay: Replay | None = None
    recorder: Recorder | None = None
    off_trace_before: frozenset[TensorKey] = frozenset()  # the last replayed step's (`Replay`)
    step_started_s: float | None = None
    step_ended_s: float | None = None
    step_gap_s: float | None = None  # measured between the last step's end and this step's start
    last_access_s: float | None = None
    left_s: float = 0.0  # when its client left (0: never seen here, e.g. a trace restored)
    stall_in_gap_s: float = 0.0  # stall since the last access: taken out of the next gap
    open_waits: int = 0
    wait_since_s: float = 0.0
    totals: Counters = field(default_factory=Counters)
    step: Counters = field(default_factory=Counters)
    last_step: dict[str, Any] | None = None
    # The stream's part of the next-use index, written only by `NextUseIndex`
    # (infinity.daemon.scheduler.nextuse): for each resident tensor whose next access in this
    # trace is a read, that access's absolute position, epoch * len(trace) + position, where the
    # epoch counts replayed steps. Absolute positions do not move as the cursor advances, so only
    # the tensors the cursor passes need new entries. `heap` orders them farthest first
    # (negated), with stale entries skipped lazily.
    indexed: bool = False
    epoch: int = 0
    next_pos: dict[TensorKey, int] = field(default_factory=dict)
    heap: list[tuple[int, TensorKey]] = field(default_factory=list)

    def add(self, name: str, amount: float = 1) -> None:
        setattr(self.totals, name, getattr(self.totals, name) + amount)
        setattr(self.step, name, getattr(self.step, name) + amount)


@dataclass(frozen=True, slots=True)
class StepSummary:
    """What `step_end` reports. `trace_updated`: persist `export_trace(stream)` (None: delete)."""

    stream: StreamKey
    outcome: str  # "recorded" | "not_recorded" | "replayed" | "diverged" | "no_step"
    trace_updated: bool
    trace_entries: int
    counters: dict[str, Any]
