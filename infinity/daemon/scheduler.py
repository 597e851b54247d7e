"""The scheduler: trace-driven prefetch, next-use eviction, fair sharing and per-client accounting.

It owns the decisions the daemon makes about the CPU tier, and none of the
mechanics: it never allocates, reads, writes or sleeps. The daemon's loop
feeds it events with the time it read from its own clock (`now_s`), asks it
what to load next (`plan_prefetch`) and what to evict (`policy`, an
`infinity.daemon.policy.EvictionPolicy` like LruPolicy), and acts. That makes
every decision here deterministic and testable with a simulated clock.

What it keeps:

- one `_Stream` per (namespace, client name): the step trace
  (`infinity.daemon.trace`), the cursor in it while a step replays, the
  recording while a step records, the client's counters, and a next-use
  index of the resident tensors its trace reads;
- what is resident in the CPU tier and what is being loaded (as the daemon
  reports it), with sizes, per-namespace byte counts and recency;
- the engine's read bandwidth, an EWMA over busy time, and the bytes loaded
  for each stream (fair queueing).

Rules it enforces:

- A prefetch never needs the eviction of a tensor whose next use comes
  sooner than the prefetched tensor's own (`plan_prefetch`,
  `victims_for_prefetch`).
- Eviction takes the resident tensor used farthest in the future first; a
  tensor no trace reads next (unknown, or overwritten before it is read) is
  infinitely far, and among those the least recently used goes first, so
  without traces it is exactly LRU. A namespace over its quota loses first.
  Pinned (leased) tensors are never chosen.
- After an access that breaks the trace's order, nothing more is prefetched
  for that client until it is back on the trace; a step that left the trace
  drops it, and the next step records a new one.
- Streams share the engine and the tier: every stream that is loading,
  waiting or has something to prefetch competes; none may get more than one
  quantum of bytes ahead of the least served of them (unless the engine
  would idle); each plan interleaves their prefetches by deficit round robin
  over bytes; they share the prefetch bytes in flight and the tier's
  prefetch window evenly, with the same lookahead.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque
from collections.abc import Mapping, Set as AbstractSet
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Iterable, Iterator, TypeVar

from infinity.config import SchedulerConfig
from infinity.daemon.trace import (
    INFINITE_S,
    Match,
    Recorder,
    Replay,
    StreamKey,
    TensorKey,
    Trace,
)
from infinity.errors import ConfigError

__all__ = [
    "AccessKind",
    "NextUsePolicy",
    "Scheduler",
    "SchedulerConfig",
    "StepSummary",
    "StreamKey",
    "TensorKey",
]


class AccessKind(str, Enum):
    """Where a client's access found its data (what `touched` returns)."""

    PREFETCH_HIT = "prefetch_hit"  # resident, brought in by a prefetch not yet used
    INFLIGHT_HIT = "inflight_hit"  # a prefetch had started but not finished: the client waits less
    RESIDENT_HIT = "resident_hit"  # resident for another reason: kept from earlier use, or written
    MISS = "miss"  # not resident and no prefetch under way: a demand load
    WRITE = "write"  # a commit: nothing was read


@dataclass(slots=True)
class _Counters:
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

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _State(str, Enum):
    IDLE = "idle"  # between steps (or never marked one)
    RECORDING = "recording"
    REPLAYING = "replaying"


@dataclass(slots=True)
class _Stream:
    key: StreamKey
    active: bool = True
    state: _State = _State.IDLE
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
    totals: _Counters = field(default_factory=_Counters)
    step: _Counters = field(default_factory=_Counters)
    last_step: dict[str, Any] | None = None
    # The next-use index (see Scheduler._index_key): for each resident tensor whose next access in
    # this trace is a read, that access's absolute position, epoch * len(trace) + position, where
    # the epoch counts replayed steps. Absolute positions do not move as the cursor advances, so
    # only the tensors the cursor passes need new entries. `heap` orders them farthest first
    # (negated), with stale entries skipped lazily.
    indexed: bool = False
    epoch: int = 0
    next_pos: dict[TensorKey, int] = field(default_factory=dict)
    heap: list[tuple[int, TensorKey]] = field(default_factory=list)

    def add(self, name: str, amount: float = 1) -> None:
        setattr(self.totals, name, getattr(self.totals, name) + amount)
        setattr(self.step, name, getattr(self.step, name) + amount)


@dataclass(slots=True)
class _Resident:
    nbytes: int
    prefetched: bool = False  # loaded by a prefetch and not used since
    prefetched_for: StreamKey | None = None


@dataclass(slots=True)
class _Load:
    nbytes: int
    prefetch: bool
    stream: StreamKey | None
    used: bool = False  # accessed while in flight (an in-flight hit): not a prefetch hit later
    reading: bool = True  # its read was submitted (the bandwidth meter counts its time)


@dataclass(frozen=True, slots=True)
class StepSummary:
    """What `step_end` reports. `trace_updated`: persist `export_trace(stream)` (None: delete)."""

    stream: StreamKey
    outcome: str  # "recorded" | "not_recorded" | "replayed" | "diverged" | "no_step"
    trace_updated: bool
    trace_entries: int
    counters: dict[str, Any]


@dataclass(slots=True)
class _Candidate:
    stream: StreamKey
    key: TensorKey
    nbytes: int
    need_s: float  # expected seconds until the stream reads it


class _ReadMeter:
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


class _VictimPool:
    """Evictable resident tensors in eviction order, pulled lazily, for one planning pass.

    Most plans fit in free space and never build it; one that needs room
    pulls only as many tensors from the eviction order as it takes.
    """

    __slots__ = ("_order", "_seen", "_taken")

    def __init__(self, order: Iterator[tuple[float, TensorKey, int]]) -> None:
        self._order = order
        self._seen: list[tuple[float, TensorKey, int]] = []
        self._taken: set[TensorKey] = set()

    def _items(self) -> Iterator[tuple[float, TensorKey, int]]:
        index = 0
        while True:
            if index == len(self._seen):
                item = next(self._order, None)
                if item is None:
                    return
                self._seen.append(item)
            yield self._seen[index]
            index += 1

    def pick(self, need_bytes: int, *, later_than_s: float, namespace: str | None = None,
             exclude: frozenset[TensorKey] = frozenset()) -> list[tuple[TensorKey, int]] | None:
        """Victims covering `need_bytes` whose next use is after `later_than_s`; None if impossible."""
        if need_bytes <= 0:
            return []
        picked: list[tuple[TensorKey, int]] = []
        got = 0
        for next_use_s, key, nbytes in self._items():
            if not _later(next_use_s, later_than_s):
                break  # farthest first: nothing after this one qualifies either
            if key in self._taken or key in exclude or (namespace is not None and key[0] != namespace):
                continue
            picked.append((key, nbytes))
            got += nbytes
            if got >= need_bytes:
                return picked
        return None

    def take(self, victims: Iterable[tuple[TensorKey, int]]) -> None:
        self._taken.update(key for key, _ in victims)


_T = TypeVar("_T")


def _heap_in_order(heap: list[_T]) -> Iterator[_T]:
    """The items of a binary heap, smallest first, without changing it: O(log k) per item taken.

    A frontier of slots ordered by their items: a slot's children can only
    follow it. The heap must not change while this runs.
    """
    if not heap:
        return
    frontier: list[tuple[_T, int]] = [(heap[0], 0)]
    size = len(heap)
    while frontier:
        item, slot = heapq.heappop(frontier)
        for child in (2 * slot + 1, 2 * slot + 2):
            if child < size:
                heapq.heappush(frontier, (heap[child], child))
        yield item


def _later(next_use_s: float, need_s: float) -> bool:
    """May a tensor next used at `next_use_s` make room for one needed at `need_s`?

    Strictly later only. A tensor no trace needs (infinite) may make room for
    anything, including a tensor whose need is unknown (infinite too): that is
    plain LRU among the untraced.
    """
    if math.isinf(next_use_s):
        return True
    return next_use_s > need_s


class Scheduler:
    """Trace-driven prefetch and eviction for the daemon's CPU tier. See the module docstring.

    `cpu_tier_bytes`: the tier's size. `is_pinned(key)`: the daemon's answer to
    "is this tensor leased (or otherwise not evictable) now?"; it is called while
    planning and choosing victims, never stored.

    Cost: an access, a load event or an eviction updates the next-use index in
    O(streams x log n). A plan walks the lookahead windows, and only when it
    needs room the eviction order, which costs O(log n) per tensor it pulls
    plus a sort of the tensors no trace needs.
    """

    def __init__(self, config: SchedulerConfig | None = None, *, cpu_tier_bytes: int,
                 is_pinned: Callable[[TensorKey], bool] | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.config.validate()
        if cpu_tier_bytes <= 0:
            raise ConfigError("the scheduler needs the CPU tier's size in bytes (positive)")
        self.cpu_tier_bytes = cpu_tier_bytes
        self._is_pinned: Callable[[TensorKey], bool] = is_pinned or (lambda key: False)
        self._streams: dict[StreamKey, _Stream] = {}
        self._resident: dict[TensorKey, _Resident] = {}
        self._inflight: dict[TensorKey, _Load] = {}
        self._resident_bytes = 0
        self._inflight_bytes = 0
        self._namespace_bytes: dict[str, int] = {}  # resident + in flight, per tensor namespace
        # Resident tensors that no indexed trace reads next ("infinitely far"), and for the others
        # how many indexed traces read them next: kept as residency and indexes change.
        self._infinite: set[TensorKey] = set()
        self._live: dict[TensorKey, int] = {}
        # The infinite ones by recency, least recent on top: (recency, key), stale entries (touched
        # again, or no longer infinite) skipped lazily.
        self._lru_heap: list[tuple[int, TensorKey]] = []
        self._sizes: dict[TensorKey, int] = {}  # last size seen in any event
        self._recency: dict[TensorKey, int] = {}  # higher: used more recently
        self._use_seq = 0
        self._last_writer: dict[TensorKey, StreamKey] = {}
        self._planned: dict[TensorKey, StreamKey] = {}  # the last plan, for load_started's attribution
        self._round_robin = 0  # which stream a plan serves first, rotating
        self._served: dict[StreamKey, int] = {}  # bytes loaded for each stream (fair queueing)
        self._fair_before: frozenset[StreamKey] = frozenset()
        self._meter = _ReadMeter(alpha=self.config.bandwidth_ewma_alpha,
                                 initial_bytes_per_s=self.config.initial_read_bandwidth_bytes_per_s,
                                 sample_min_s=self.config.bandwidth_sample_min_s,
                                 sample_max_s=self.config.bandwidth_sample_max_s)
        self.policy = NextUsePolicy(self)

    # --- clients and steps -----------------------------------------------------------

    def attach(self, stream: StreamKey, now_s: float) -> None:
        """A client with this (namespace, name) connected: its trace (if known) is used again."""
        s = self._stream(stream)
        s.last_access_s = now_s

    def client_gone(self, stream: StreamKey, now_s: float) -> None:
        """The client left or died: its half-done step is dropped, its trace is kept."""
        s = self._streams.get(stream)
        if s is None:
            return
        if s.open_waits:
            self._add_stall(s, now_s - s.wait_since_s)
        s.active = False
        s.left_s = now_s
        s.state = _State.IDLE
        s.replay = None
        s.recorder = None
        s.open_waits = 0
        s.step_ended_s = None
        self._sync_index(s)

    def step_begin(self, stream: StreamKey, now_s: float) -> StepSummary | None:
        """A step starts: replay the trace if one is known, else record one.

        A begin without an end ends the previous step first; its summary is
        returned then (persist the trace if `trace_updated`), else None.
        """
        s = self._stream(stream)
        ended = self._finish_step(s, now_s) if s.state is not _State.IDLE else None
        s.step_gap_s = None if s.step_ended_s is None else max(0.0, now_s - s.step_ended_s)
        s.step = _Counters()
        s.step_started_s = now_s
        s.last_access_s = now_s
        s.stall_in_gap_s = 0.0
        s.add("steps")
        if s.trace is not None:
            s.state = _State.REPLAYING
            s.replay = Replay(s.trace, window=self.config.divergence_window)
            s.epoch += 1  # absolute positions run on: the index stays valid
        else:
            s.state = _State.RECORDING
            s.recorder = Recorder(max_entries=self.config.trace_max_entries)
        self._sync_index(s)
        return ended

    def step_abort(self, stream: StreamKey, now_s: float) -> None:
        """The step under way failed halfway: drop it; the trace (if any) stays as it was."""
        s = self._streams.get(stream)
        if s is None or s.state is _State.IDLE:
            return
        replay = s.replay
        # What the step did not get to is read next in the next step, not in this one: its
        # next-use positions move on as _finish_step moves them.
        unconsumed = ([e.key for e in replay.trace.entries[replay.position:]]
                      if replay is not None and not replay.diverged else [])
        s.state = _State.IDLE
        s.replay = None
        s.recorder = None
        s.step_ended_s = now_s
        self._sync_index(s)
        if s.indexed:
            for key in unconsumed:
                if key in self._resident:
                    self._index_key(s, key)

    def remove_stream(self, stream: StreamKey) -> None:
        """Forget a stream altogether (one that cannot come back: its trace is not kept)."""
        s = self._streams.pop(stream, None)
        if s is None:
            return
        self._drop_index(s)
        self._served.pop(stream, None)
        self._planned = {key: owner for key, owner in self._planned.items() if owner != stream}

    def traces_beyond(self, kept: int) -> list[StreamKey]:
        """The streams of clients that left whose traces are past the `kept` most recent (those
        that left longest ago first): for the daemon to forget."""
        gone = [s for s in self._streams.values() if not s.active and s.trace is not None]
        if len(gone) <= kept:
            return []
        gone.sort(key=lambda s: s.left_s)
        return [s.key for s in gone[:len(gone) - kept]]

    def trace_of(self, stream: StreamKey) -> Trace | None:
        """The stream's trace (immutable: safe to serialize on another thread)."""
        s = self._streams.get(stream)
        return None if s is None else s.trace

    def step_end(self, stream: StreamKey, now_s: float) -> StepSummary:
        """A step ends: adopt what it recorded, or refresh / drop the trace it replayed."""
        s = self._stream(stream)
        if s.state is _State.IDLE:
            return StepSummary(stream, "no_step", False, len(s.trace or ()), s.step.as_dict())
        return self._finish_step(s, now_s)

    def _finish_step(self, s: _Stream, now_s: float) -> StepSummary:
        updated = False
        unconsumed: list[TensorKey] = []
        if s.state is _State.RECORDING:
            assert s.recorder is not None
            trace = s.recorder.finish(step_gap_s=s.step_gap_s or 0.0)
            if trace is not None:
                self._drop_index(s)
                s.trace = trace
                s.off_trace_before = frozenset()
                s.epoch = 0
                s.add("traces_recorded")
                updated = True
                outcome = "recorded"
            else:
                outcome = "not_recorded"
        else:
            replay = s.replay
            assert replay is not None
            off_trace_before, s.off_trace_before = s.off_trace_before, frozenset(replay.off_trace)
            if replay.followed(off_trace_before=off_trace_before):
                # Same order: keep it, and let its timing follow this step's (same entries, so the
                # index stays valid but for the few entries the step ended without touching).
                s.trace = replay.trace.refreshed(replay.measured_gaps_s,
                                                 alpha=self.config.trace_timing_ewma_alpha,
                                                 step_gap_s=s.step_gap_s)
                unconsumed = [e.key for e in replay.trace.entries[replay.position:]]
                outcome = "replayed"
            else:
                if not replay.diverged:
                    s.add("divergences")  # left the trace at the very end (too short, or extra accesses)
                # The order changed: the next step records a new trace.
                s.trace = None
                updated = True
                outcome = "diverged"
        started = s.step_started_s if s.step_started_s is not None else now_s
        duration_s = max(0.0, now_s - started)
        counters = s.step.as_dict()
        counters["duration_s"] = duration_s
        counters["got_bytes_per_s"] = s.step.bytes_got / duration_s if duration_s > 0 else 0.0
        counters["outcome"] = outcome
        s.last_step = counters
        s.state = _State.IDLE
        s.replay = None
        s.recorder = None
        s.step_ended_s = now_s
        self._sync_index(s)
        if s.indexed:
            for key in unconsumed:
                if key in self._resident:
                    self._index_key(s, key)
        return StepSummary(s.key, outcome, updated, len(s.trace or ()), counters)

    # --- accesses and waits ---------------------------------------------------------

    def touched(self, stream: StreamKey, key: TensorKey, nbytes: int, now_s: float, *,
                write: bool = False) -> AccessKind:
        """A client read (get) or wrote (commit, `write=True`) a tensor. Returns where it was.

        Call it when the request arrives, before starting a demand load, so a
        miss is classified as one. A write makes the tensor resident.
        """
        s = self._stream(stream)
        gap_s = 0.0
        if s.last_access_s is not None:
            gap_s = max(0.0, now_s - s.last_access_s - s.stall_in_gap_s)
        s.last_access_s = now_s
        s.stall_in_gap_s = 0.0
        self._note_use(key, nbytes)

        if write:
            kind = AccessKind.WRITE
            s.add("writes")
            s.add("bytes_put", nbytes)
            self._last_writer[key] = stream
            self._make_resident(key, nbytes)
        else:
            s.add("accesses")
            s.add("bytes_got", nbytes)
            load = self._inflight.get(key)
            resident = self._resident.get(key)
            if load is not None:
                kind = AccessKind.INFLIGHT_HIT if load.prefetch else AccessKind.MISS
                load.used = True
            elif resident is not None:
                if resident.prefetched:
                    kind = AccessKind.PREFETCH_HIT
                    resident.prefetched = False
                    resident.prefetched_for = None
                else:
                    kind = AccessKind.RESIDENT_HIT
            else:
                kind = AccessKind.MISS
            s.add({AccessKind.INFLIGHT_HIT: "inflight_hits", AccessKind.MISS: "misses",
                   AccessKind.PREFETCH_HIT: "prefetch_hits",
                   AccessKind.RESIDENT_HIT: "resident_hits"}[kind])

        if s.state is _State.RECORDING:
            assert s.recorder is not None
            s.recorder.observe(key, nbytes, gap_s, write=write)
        elif s.state is _State.REPLAYING:
            self._replay_access(s, key, gap_s)
        return kind

    def _replay_access(self, s: _Stream, key: TensorKey, gap_s: float) -> None:
        replay = s.replay
        assert replay is not None
        was_diverged = replay.diverged
        before = replay.position
        skipped_before = replay.skipped
        match = replay.observe(key, gap_s)
        if replay.skipped > skipped_before:
            s.add("skipped_entries", replay.skipped - skipped_before)
        if match in (Match.UNEXPECTED, Match.DIVERGED) and not was_diverged:
            s.add("unexpected_accesses")
        if match is Match.DIVERGED and not was_diverged:
            s.add("divergences")
            self._sync_index(s)  # the trace no longer says anything about this step
        elif s.indexed:
            # The cursor passed these entries: their tensors' next accesses are further on now.
            for entry in replay.trace.entries[before:replay.position]:
                if entry.key in self._resident:
                    self._index_key(s, entry.key)

    def wait_started(self, stream: StreamKey, now_s: float) -> None:
        """The client began waiting for data (a get that needs a load). Nested waits overlap."""
        s = self._stream(stream)
        s.open_waits += 1
        if s.open_waits == 1:
            s.wait_since_s = now_s

    def wait_finished(self, stream: StreamKey, now_s: float) -> None:
        """The data the client waited for is there (the get is answered)."""
        s = self._streams.get(stream)
        if s is None or s.open_waits == 0:
            return
        s.open_waits -= 1
        if s.open_waits == 0:
            self._add_stall(s, now_s - s.wait_since_s)

    def stalled(self, stream: StreamKey, duration_s: float) -> None:
        """Alternative to wait_started/wait_finished: the client waited this long for data."""
        self._add_stall(self._stream(stream), duration_s)

    def _add_stall(self, s: _Stream, duration_s: float) -> None:
        duration_s = max(0.0, duration_s)
        s.add("stall_s", duration_s)
        s.add("stalls")
        s.stall_in_gap_s += duration_s  # waiting is not compute: keep it out of the trace's timing

    # --- the tier, as the daemon reports it ------------------------------------------

    def load_started(self, key: TensorKey, nbytes: int, now_s: float, *, prefetch: bool,
                     stream: StreamKey | None = None, reading: bool = True) -> None:
        """The daemon started a load of `key` from NVMe into the tier.

        `prefetch`: it came from `plan_prefetch` (its stream is then known from
        the plan); otherwise it is a demand load for `stream`'s miss.
        `reading=False`: the read itself is not submitted yet (the load waits for
        space first); `read_started` says when it is, so that waiting for space
        does not count as disk time in the bandwidth estimate.
        """
        if key in self._inflight:
            return
        if prefetch and stream is None:
            stream = self._planned.get(key)
        self._planned.pop(key, None)
        self._drop_resident(key)  # a reload replaces whatever the tier had
        self._inflight[key] = _Load(nbytes, prefetch, stream, reading=reading)
        self._inflight_bytes += nbytes
        self._add_namespace_bytes(key, nbytes)
        self._sizes[key] = nbytes
        if reading:
            self._meter.started(now_s)
        if stream is not None:
            self._served[stream] = self._served.get(stream, 0) + nbytes
        s = self._streams.get(stream) if stream is not None else None
        if s is not None and prefetch:
            s.add("prefetch_loads")
            s.add("prefetch_bytes", nbytes)

    def load_finished(self, key: TensorKey, now_s: float, *, ok: bool = True) -> None:
        """The read of `key` completed (`ok=False`: it failed; the tensor is not resident)."""
        load = self._end_load(key)
        if load is None:
            return
        if load.reading:
            self._meter.finished(load.nbytes if ok else 0, now_s)
        if not ok:
            return
        unused_prefetch = load.prefetch and not load.used
        self._add_resident(key, _Resident(load.nbytes, prefetched=unused_prefetch,
                                          prefetched_for=load.stream if unused_prefetch else None))
        s = self._streams.get(load.stream) if load.stream is not None else None
        if s is not None:
            s.add("disk_read_bytes", load.nbytes)

    def read_started(self, key: TensorKey, now_s: float) -> None:
        """The read of a load started with `reading=False` was submitted to the engine."""
        load = self._inflight.get(key)
        if load is not None and not load.reading:
            load.reading = True
            self._meter.started(now_s)

    def load_cancelled(self, key: TensorKey, now_s: float) -> None:
        """A load reported by `load_started` was dropped before it read anything (a prefetch
        that found no room): as if it had not started."""
        load = self._end_load(key)
        if load is None:
            return
        if load.reading:
            self._meter.cancelled(now_s)
        if load.stream is not None:
            self._served[load.stream] = self._served.get(load.stream, 0) - load.nbytes
            s = self._streams.get(load.stream)
            if s is not None and load.prefetch:
                s.add("prefetch_loads", -1)
                s.add("prefetch_bytes", -load.nbytes)

    def _end_load(self, key: TensorKey) -> _Load | None:
        load = self._inflight.pop(key, None)
        if load is not None:
            self._inflight_bytes -= load.nbytes
            self._add_namespace_bytes(key, -load.nbytes)
        return load

    def evicted(self, key: TensorKey, now_s: float) -> None:
        """`key` left the tier (evicted, replaced or deleted). `policy.forget` does the same."""
        self._left_tier(key)

    def _left_tier(self, key: TensorKey) -> None:
        resident = self._resident.get(key)
        if resident is not None and resident.prefetched and resident.prefetched_for is not None:
            s = self._streams.get(resident.prefetched_for)
            if s is not None:
                s.add("prefetch_wasted_bytes", resident.nbytes)
        self._drop_resident(key)

    def written_back(self, key: TensorKey, nbytes: int, now_s: float) -> None:
        """The daemon wrote `key` to NVMe (eviction write-back or flush): counted for its last writer."""
        writer = self._last_writer.get(key)
        s = self._streams.get(writer) if writer is not None else None
        if s is not None:
            s.add("disk_write_bytes", nbytes)

    def forget(self, key: TensorKey) -> None:
        """`key` was deleted: forget its residency, size and recency.

        A load in flight for it stays until `load_finished` reports it.
        """
        self._drop_resident(key)
        self._sizes.pop(key, None)
        self._recency.pop(key, None)
        self._last_writer.pop(key, None)

    def _make_resident(self, key: TensorKey, nbytes: int) -> None:
        if key in self._inflight:
            return  # the load's completion will say
        resident = self._resident.get(key)
        if resident is not None and resident.nbytes == nbytes:
            return  # already known: keep its prefetch mark
        self._add_resident(key, _Resident(nbytes))

    def _policy_touched(self, key: TensorKey, nbytes: int) -> None:
        # The tier manager's word: resident and just used (a get, a commit or a finished load).
        self._note_use(key, nbytes)
        self._make_resident(key, nbytes)

    def _add_resident(self, key: TensorKey, resident: _Resident) -> None:
        self._drop_resident(key)
        self._resident[key] = resident
        self._resident_bytes += resident.nbytes
        self._add_namespace_bytes(key, resident.nbytes)
        self._mark_infinite(key)  # until an index says a trace reads it
        for s in self._streams.values():
            if s.indexed and s.trace is not None and key in s.trace:
                self._index_key(s, key)

    def _drop_resident(self, key: TensorKey) -> None:
        resident = self._resident.pop(key, None)
        if resident is None:
            return
        self._resident_bytes -= resident.nbytes
        self._add_namespace_bytes(key, -resident.nbytes)
        self._infinite.discard(key)
        for s in self._streams.values():
            if s.indexed:
                self._unindex_key(s, key)

    def _add_namespace_bytes(self, key: TensorKey, delta: int) -> None:
        value = self._namespace_bytes.get(key[0], 0) + delta
        if value:
            self._namespace_bytes[key[0]] = value
        else:
            self._namespace_bytes.pop(key[0], None)

    def _note_use(self, key: TensorKey, nbytes: int) -> None:
        self._use_seq += 1
        self._recency[key] = self._use_seq
        self._sizes[key] = nbytes
        if key in self._infinite:
            self._push_lru(key)

    def _mark_infinite(self, key: TensorKey) -> None:
        if key not in self._infinite:
            self._infinite.add(key)
            self._push_lru(key)

    def _push_lru(self, key: TensorKey) -> None:
        heapq.heappush(self._lru_heap, (self._recency.get(key, 0), key))
        if len(self._lru_heap) > 2 * len(self._infinite) + 64:
            self._lru_heap = [(self._recency.get(k, 0), k) for k in self._infinite]
            heapq.heapify(self._lru_heap)

    def _lru_valid(self, entry: tuple[int, TensorKey]) -> bool:
        recency, key = entry
        return key in self._infinite and self._recency.get(key, 0) == recency

    # --- the next-use index ------------------------------------------------------------
    #
    # Belady's rule needs, for every resident tensor, when it is read next. Recomputing that for
    # the whole tier at every decision costs O(resident) each time; instead each stream whose
    # trace is trusted keeps the absolute position of every resident tensor's next read, which
    # changes only when the cursor passes that tensor or its residency changes.

    @staticmethod
    def _indexable(s: _Stream) -> bool:
        if not s.active or s.trace is None or s.state is _State.RECORDING:
            return False
        return s.replay is None or not s.replay.diverged

    @staticmethod
    def _position(s: _Stream) -> int:
        """Index of the stream's next expected access in its trace (len: the next step's start)."""
        assert s.trace is not None
        if s.state is _State.REPLAYING and s.replay is not None:
            return s.replay.position
        return len(s.trace)

    def _sync_index(self, s: _Stream) -> None:
        want = self._indexable(s)
        if s.indexed and not want:
            self._drop_index(s)
        elif want and not s.indexed:
            assert s.trace is not None
            s.indexed = True
            trace = s.trace
            if len(self._resident) <= len(trace):
                keys = [key for key in self._resident if key in trace]
            else:
                keys = [key for key in trace.keys if key in self._resident]
            for key in keys:
                self._index_key(s, key)

    def _drop_index(self, s: _Stream) -> None:
        for key in s.next_pos:
            self._live_changed(key, -1)
        s.next_pos.clear()
        s.heap.clear()
        s.indexed = False

    def _index_key(self, s: _Stream, key: TensorKey) -> None:
        """(Re)compute where `s` next reads the resident `key`, from its cursor."""
        trace = s.trace
        assert trace is not None
        n = len(trace)
        cursor = self._position(s)
        position = trace.next_access(key, cursor)
        had = s.next_pos.pop(key, None) is not None
        if position is None or trace.entries[position].write:
            if had:
                self._live_changed(key, -1)  # not read next: its bytes are dead to this stream
            return
        absolute = s.epoch * n + (position if position >= cursor else n + position)
        s.next_pos[key] = absolute
        if not had:
            self._live_changed(key, +1)
        heapq.heappush(s.heap, (-absolute, key))
        if len(s.heap) > 2 * len(s.next_pos) + 64:
            s.heap = [(-pos, k) for k, pos in s.next_pos.items()]  # shed stale entries
            heapq.heapify(s.heap)

    def _unindex_key(self, s: _Stream, key: TensorKey) -> None:
        if s.next_pos.pop(key, None) is not None:
            self._live_changed(key, -1)

    def _live_changed(self, key: TensorKey, delta: int) -> None:
        count = self._live.get(key, 0) + delta
        if count > 0:
            self._live[key] = count
            self._infinite.discard(key)
        else:
            self._live.pop(key, None)
            if key in self._resident:
                self._mark_infinite(key)

    def _seconds_until(self, s: _Stream, absolute: int) -> float:
        trace = s.trace
        assert trace is not None
        n = len(trace)
        relative = absolute - s.epoch * n
        return trace.time_until(self._position(s), relative if relative < n else relative - n)

    def _need_s(self, key: TensorKey) -> float:
        """Seconds until some indexed stream reads `key` (resident or not); infinite if none."""
        need = INFINITE_S
        for s in self._streams.values():
            if s.indexed and s.trace is not None:
                need = min(need, s.trace.next_use_s(key, self._position(s)))
        return need

    def next_use_s(self, key: TensorKey) -> float:
        """Expected seconds until some client reads `key` next (infinite: unknown or never)."""
        return self._need_s(key)

    def _eviction_order(self) -> Iterator[tuple[float, TensorKey, int]]:
        """Resident unpinned tensors as (next_use_s, key, nbytes), in the order they should go.

        First those no trace reads next, least recently used first; then the
        rest, farthest next use first, by a lazy merge of the streams' heaps
        (a tensor several streams read counts at its soonest use).
        """
        lru = self._lru_heap
        while lru and not self._lru_valid(lru[0]):
            heapq.heappop(lru)  # touched again since, or no longer infinite: gone for good
        emitted: set[TensorKey] = set()
        for entry in _heap_in_order(lru):
            key = entry[1]
            if self._lru_valid(entry) and key not in emitted:
                emitted.add(key)
                if not self._is_pinned(key):
                    yield INFINITE_S, key, self._resident[key].nbytes
        streams = [s for s in self._streams.values() if s.indexed]
        for s in streams:
            # Evicted tensors were the farthest, so their stale entries gather at the top: drop
            # them for good, or every walk would step over them again.
            while s.heap and s.next_pos.get(s.heap[0][1]) != -s.heap[0][0]:
                heapq.heappop(s.heap)
        walkers = [_heap_in_order(s.heap) for s in streams]
        merge: list[tuple[float, int, TensorKey]] = []

        def advance(index: int) -> None:
            s = streams[index]
            for negated, key in walkers[index]:
                if s.next_pos.get(key) == -negated:  # else stale
                    heapq.heappush(merge, (-self._seconds_until(s, -negated), index, key))
                    return

        for index in range(len(streams)):
            advance(index)
        while merge:
            negated_s, index, key = heapq.heappop(merge)
            advance(index)
            if key in emitted:
                continue
            soonest = min(self._seconds_until(s, s.next_pos[key]) for s in streams if key in s.next_pos)
            if soonest < -negated_s:
                continue  # another stream reads it sooner: it comes again from that stream's heap
            emitted.add(key)
            if not self._is_pinned(key):
                yield soonest, key, self._resident[key].nbytes

    # --- eviction ----------------------------------------------------------------------

    @staticmethod
    def _as_set(candidates: Iterable[TensorKey]) -> AbstractSet[TensorKey] | Mapping[TensorKey, Any]:
        # A set, a dict or a keys view is used as it is: no copy of a large candidate list.
        if isinstance(candidates, (AbstractSet, Mapping)):
            return candidates
        return set(candidates)

    def _adopt(self, allowed: AbstractSet[TensorKey] | Mapping[TensorKey, Any]) -> bool:
        """The daemon's candidates are resident by definition: learn any it never reported.

        Only done when the known tensors did not suffice (it walks every
        candidate). Returns whether it learnt any.
        """
        learnt = False
        for key in allowed:
            if key not in self._resident and key not in self._inflight:
                self._add_resident(key, _Resident(self._sizes.get(key, 0)))
                learnt = True
        return learnt

    def _over_quota(self) -> dict[str, int]:
        over: dict[str, int] = {}
        for namespace, quota in self.config.namespace_quota_bytes:
            excess = self._namespace_bytes.get(namespace, 0) - quota
            if excess > 0:
                over[namespace] = excess
        return over

    def choose_victims(self, candidates: Iterable[TensorKey], need_bytes: int) -> list[TensorKey]:
        """Which of the (unleased, resident) candidates to evict to free `need_bytes`.

        A namespace over its quota loses first (until it is back under), then
        the farthest next use, then the least recently used. When the
        candidates cannot cover `need_bytes`, all of them are returned in that
        order and the daemon decides (TierFullError). Pinned ones never are.
        """
        allowed = self._as_set(candidates)
        chosen, got = self._choose(allowed, need_bytes)
        if got < need_bytes and self._adopt(allowed):
            chosen, got = self._choose(allowed, need_bytes)  # candidates it had never heard of
        return chosen

    def _allowed_order(self, allowed: AbstractSet[TensorKey] | Mapping[TensorKey, Any]
                       ) -> Iterator[tuple[float, TensorKey, int]]:
        """The eviction order restricted to the candidates, with the bytes each frees."""
        freed = allowed if isinstance(allowed, Mapping) else None
        for next_use_s, key, nbytes in self._eviction_order():
            if key in allowed:
                yield next_use_s, key, (int(freed[key]) if freed is not None else nbytes)

    def _choose(self, allowed: AbstractSet[TensorKey] | Mapping[TensorKey, Any],
                need_bytes: int) -> tuple[list[TensorKey], int]:
        chosen: list[TensorKey] = []
        picked: set[TensorKey] = set()
        got = 0
        over = self._over_quota()
        if over:
            for _, key, nbytes in self._allowed_order(allowed):
                if got >= need_bytes or not any(excess > 0 for excess in over.values()):
                    break
                if over.get(key[0], 0) > 0:
                    chosen.append(key)
                    picked.add(key)
                    got += nbytes
                    over[key[0]] -= self._resident[key].nbytes  # the namespace's unit, not the slice's
        if got < need_bytes:
            for _, key, nbytes in self._allowed_order(allowed):
                if got >= need_bytes:
                    break
                if key not in picked:
                    chosen.append(key)
                    got += nbytes
        return chosen, got

    def victims_for_prefetch(self, key: TensorKey, candidates: Iterable[TensorKey],
                             need_bytes: int, *, nbytes: int | None = None
                             ) -> list[TensorKey] | None:
        """Victims to make `need_bytes` of room for prefetching `key`, or None: skip that prefetch.

        Only tensors whose next use is after `key`'s may go, and the prefetch
        must also fit its namespace's quota. The daemon calls this instead of
        `choose_victims` when the room is for a prefetch. `nbytes`: the tensor's size, where
        the caller knows it (this scheduler may not have seen the tensor yet: a restart).
        """
        allowed = self._as_set(candidates)
        victims = self._prefetch_victims(key, allowed, need_bytes, nbytes)
        if victims is None and self._adopt(allowed):
            victims = self._prefetch_victims(key, allowed, need_bytes, nbytes)
        return victims

    def _prefetch_victims(self, key: TensorKey, allowed: AbstractSet[TensorKey] | Mapping[TensorKey, Any],
                          need_bytes: int, nbytes: int | None) -> list[TensorKey] | None:
        need_s = self._need_s(key)
        victims: list[tuple[TensorKey, int]] = []
        quota = self.config.quota_bytes(key[0])
        if quota is not None:
            # A load under way counts in its namespace already (load_started): not twice.
            own = 0 if key in self._inflight else (
                nbytes if nbytes is not None else self._sizes.get(key, 0))
            excess = self._namespace_bytes.get(key[0], 0) + own - quota
            # In tensor bytes, as the namespace counts them: the candidates' values are the CPU
            # bytes each frees, its slice rounded up to the arena's alignment, and victims counted
            # at that size could leave the namespace over its quota by the difference.
            in_tensor_bytes = (item for item in self._eviction_order() if item[1] in allowed)
            picked = _VictimPool(in_tensor_bytes).pick(excess, later_than_s=need_s,
                                                       namespace=key[0])
            if picked is None:
                return None
            victims += picked
        freed = allowed if isinstance(allowed, Mapping) else None  # CPU bytes, for the room
        short = need_bytes - sum(int(freed[k]) if freed is not None else n for k, n in victims)
        # A walk of its own; the one above is left half-way and never resumed, so the heaps
        # this one prunes at its start cannot change under it.
        pool = _VictimPool(self._allowed_order(allowed))
        picked = pool.pick(short, later_than_s=need_s, exclude=frozenset(k for k, _ in victims))
        if picked is None:
            return None
        return [k for k, _ in victims + picked]

    # --- prefetch planning ------------------------------------------------------------

    @property
    def read_bandwidth_bytes_per_s(self) -> float:
        return self._meter.estimate

    def _plan_cursor(self, s: _Stream) -> int | None:
        """Where the stream's lookahead starts, or None when it must not prefetch now."""
        if not s.indexed:
            return None
        if s.state is _State.REPLAYING:
            assert s.replay is not None
            return s.replay.position if s.replay.on_track else None
        if not self.config.prefetch_across_steps:
            return None
        return self._position(s)  # between steps: the next step's start

    def upcoming(self, stream: StreamKey, *, namespace: str, max_entries: int,
                 max_bytes: int) -> list[tuple[TensorKey, int]]:
        """The stream's next reads of tensors in `namespace` by the trace it replays, soonest
        first: distinct tensors (writes skipped), at most `max_entries` and `max_bytes` (the
        first always). Empty when it replays no trace, or strayed from it. For a client's
        device cache, which brings tensors further, into device memory, ahead of their use."""
        s = self._streams.get(stream)
        cursor = self._plan_cursor(s) if s is not None else None
        if s is None or cursor is None or s.trace is None:
            return []
        entries = s.trace.entries
        n = len(entries)
        steps = n if self.config.prefetch_across_steps else n - cursor
        out: list[tuple[TensorKey, int]] = []
        seen: set[TensorKey] = set()
        total = 0
        for i in range(steps):
            entry = entries[(cursor + i) % n]
            if entry.write or entry.key in seen or entry.key[0] != namespace:
                continue
            seen.add(entry.key)
            nbytes = self._sizes.get(entry.key, entry.nbytes)
            if out and total + nbytes > max_bytes:
                break
            out.append((entry.key, nbytes))
            total += nbytes
            if len(out) == max_entries:
                break
        return out

    def _planning_streams(self) -> list[tuple[_Stream, int]]:
        out: list[tuple[_Stream, int]] = []
        for key in sorted(self._streams):
            s = self._streams[key]
            cursor = self._plan_cursor(s)
            if cursor is not None:
                out.append((s, cursor))
        return out

    def _window_cap_bytes(self, n_streams: int) -> int:
        return int(self.config.lookahead_max_fraction * self.cpu_tier_bytes / max(1, n_streams))

    def _own_budget_bytes(self, trace: Trace, cursor: int, n_streams: int) -> int:
        """Disk bytes to have under way ahead of the cursor: bandwidth share x lookahead time."""
        n = len(trace)
        ahead = min(self.config.lookahead_accesses, n - 1)
        horizon_s = trace.time_until(cursor, (cursor + ahead) % n)
        horizon_s = max(self.config.lookahead_min_s, horizon_s)
        return int(self._meter.estimate / max(1, n_streams) * horizon_s)

    def _budgets(self, planning: list[tuple[_Stream, int]]) -> dict[StreamKey, int]:
        """Each planning stream's lookahead in bytes.

        Streams that prefetch at the same time all get the largest of their
        own budgets (within the tier share): the engine serves requests in
        order, so a stream's share of the disk follows its share of the bytes
        queued, and a loaded engine delays everyone's data by the queue ahead
        of it, which a longer lookahead covers.
        """
        n_streams = len(planning)
        cap = self._window_cap_bytes(n_streams)
        own = {s.key: self._own_budget_bytes(s.trace, cursor, n_streams)
               for s, cursor in planning if s.trace is not None}
        widest = max(own.values(), default=0)
        return {key: min(widest, cap) for key in own}

    def lookahead_bytes(self, stream: StreamKey) -> int:
        """The stream's current prefetch lookahead in bytes (0: not prefetching now)."""
        return self._budgets(self._planning_streams()).get(stream, 0)

    def _candidates(self, s: _Stream, cursor: int, n_streams: int, budget: int) -> list[_Candidate]:
        """Upcoming reads of one stream that should be brought in, soonest first."""
        trace = s.trace
        assert trace is not None
        entries = trace.entries
        n = len(entries)
        cap = self._window_cap_bytes(n_streams)
        sizes, resident, inflight = self._sizes, self._resident, self._inflight  # hot loop: locals
        steps = min(n if self.config.prefetch_across_steps else n - cursor,
                    self.config.lookahead_max_entries)
        seen: set[TensorKey] = set()
        window = 0  # upcoming distinct reads, resident or not: what the stream holds in the tier
        loading = 0  # of which not resident: disk work ahead of the cursor
        out: list[_Candidate] = []
        position = cursor - 1
        for _ in range(steps):
            position += 1
            if position == n:
                position = 0
            entry = entries[position]
            key = entry.key
            if key in seen:
                continue
            seen.add(key)
            if entry.write:
                continue  # written before read: the client makes the bytes, nothing to load
            nbytes = sizes.get(key, entry.nbytes)
            window += nbytes
            if window > cap:
                break
            if key in resident:
                continue
            loading += nbytes
            if loading > budget and loading > nbytes:
                break  # past the lookahead (the first missing one is always allowed)
            if key not in inflight:
                out.append(_Candidate(s.key, key, nbytes, trace.time_until(cursor, position)))
        return out

    def plan_prefetch(self, *, free_bytes: int | None = None) -> list[TensorKey]:
        """Tensors to start loading into the tier now, in order. Call after every event that can change it.

        `free_bytes`: the tier's free space as the daemon sees it (default: the
        tier's size minus what is resident or in flight). Each planned tensor
        fits in free space or in the room of evictable tensors whose next use
        is later than its own; when the daemon starts it, it calls
        `load_started(..., prefetch=True)` and, if it must make room,
        `victims_for_prefetch`. Nothing is planned twice: planned tensors are
        in flight once started, and a plan only holds tensors not in flight.
        """
        self._planned = {}
        planning = self._planning_streams()
        if not planning:
            return []
        n_streams = len(planning)
        budgets = self._budgets(planning)
        queues: dict[StreamKey, deque[_Candidate]] = {}
        for s, cursor in planning:
            candidates = self._candidates(s, cursor, n_streams, budgets[s.key])
            if candidates:
                queues[s.key] = deque(candidates)
        if not queues:
            return []

        stream_inflight: dict[StreamKey, int] = {}  # prefetch bytes in flight per stream
        total_inflight = 0
        loading: set[StreamKey] = set()  # streams with any load in flight (demand or prefetch)
        for load in self._inflight.values():
            if load.stream is not None and load.stream in self._streams:
                loading.add(load.stream)
            if load.prefetch:
                total_inflight += load.nbytes
                if load.stream is not None:
                    stream_inflight[load.stream] = stream_inflight.get(load.stream, 0) + load.nbytes
        # Backlogged streams share the engine: those with something to prefetch, with loads in
        # flight, or waiting for data (a waiting client's demand loads must not queue behind
        # another client's whole lookahead).
        waiting = {s.key for s in self._streams.values() if s.active and s.open_waits > 0}
        busy = waiting | loading
        sharing = set(queues) | busy
        inflight_share = self.config.prefetch_inflight_max_bytes / max(1, len(sharing))
        fair = set(sharing)  # streams whose served bytes bound the others' lead
        quantum_bytes = self.config.fair_quantum_bytes
        for key in fair - self._fair_before:
            # A stream that comes back after a pause gets no banked credit: it starts level
            # with the others (less one quantum), not with what it was owed while away.
            others = [self._served.get(k, 0) for k in fair if k != key]
            if others:
                self._served[key] = max(self._served.get(key, 0), min(others) - quantum_bytes)
        self._fair_before = frozenset(fair)

        free = (self.cpu_tier_bytes - self._resident_bytes - self._inflight_bytes
                if free_bytes is None else free_bytes)
        namespace_used = dict(self._namespace_bytes)
        pool: _VictimPool | None = None
        plan: list[TensorKey] = []
        planned_bytes = 0
        stream_planned: dict[StreamKey, int] = {}

        def victim_pool() -> _VictimPool:
            nonlocal pool
            if pool is None:
                pool = _VictimPool(self._eviction_order())
            return pool

        def served(key: StreamKey) -> int:
            return self._served.get(key, 0) + stream_planned.get(key, 0)

        def try_plan(c: _Candidate) -> str:
            """"planned" | "skip" (already handled) | "wait_turn" | "stop_stream" | "stop_all"."""
            nonlocal free, planned_bytes
            if c.key in self._planned or c.key in self._resident or c.key in self._inflight:
                return "skip"  # another stream's plan took it: shared read-only data
            # Fair queueing over bytes loaded (demand and prefetch): a stream may lead the least
            # served competing stream by at most one quantum, unless the engine would idle.
            behind = [served(k) for k in fair if k != c.stream]
            if (behind and served(c.stream) - min(behind) >= quantum_bytes
                    and self._inflight_bytes + planned_bytes > 0):
                return "wait_turn"
            out_total = total_inflight + planned_bytes
            if out_total > 0 and out_total + c.nbytes > self.config.prefetch_inflight_max_bytes:
                return "stop_all"
            out_stream = stream_inflight.get(c.stream, 0) + stream_planned.get(c.stream, 0)
            if out_stream > 0 and out_stream + c.nbytes > inflight_share:
                return "stop_stream"
            victims: list[tuple[TensorKey, int]] = []
            namespace = c.key[0]
            quota = self.config.quota_bytes(namespace)
            if quota is not None:
                if c.nbytes > quota:
                    return "stop_stream"
                excess = namespace_used.get(namespace, 0) + c.nbytes - quota
                if excess > 0:
                    picked = victim_pool().pick(excess, later_than_s=c.need_s, namespace=namespace)
                    if picked is None:
                        return "stop_stream"  # later entries are needed later still: no better
                    victims += picked
            short = c.nbytes - free - sum(n for _, n in victims)
            if short > 0:
                picked = victim_pool().pick(short, later_than_s=c.need_s,
                                            exclude=frozenset(k for k, _ in victims))
                if picked is None:
                    return "stop_stream"
                victims += picked
            if victims:
                victim_pool().take(victims)
            for key, nbytes in victims:
                free += nbytes
                namespace_used[key[0]] = namespace_used.get(key[0], 0) - nbytes
            free -= c.nbytes
            namespace_used[namespace] = namespace_used.get(namespace, 0) + c.nbytes
            planned_bytes += c.nbytes
            stream_planned[c.stream] = stream_planned.get(c.stream, 0) + c.nbytes
            self._planned[c.key] = c.stream
            plan.append(c.key)
            return "planned"

        # Deficit round robin over bytes; the first stream served rotates from plan to plan.
        order = sorted(queues)
        start = self._round_robin % len(order)
        self._round_robin += 1
        active = order[start:] + order[:start]
        deficit = {key: 0 for key in active}
        while active:
            quantum = max(quantum_bytes, min(queues[k][0].nbytes for k in active))
            still: list[StreamKey] = []
            changed = False
            waiting_turn = 0
            for key in active:
                queue = queues[key]
                deficit[key] += quantum
                while queue and queue[0].nbytes <= deficit[key]:
                    verdict = try_plan(queue[0])
                    if verdict == "stop_all":
                        return plan
                    if verdict == "wait_turn":
                        waiting_turn += 1
                        break
                    changed = True
                    if verdict == "stop_stream":
                        queue.clear()
                        break
                    candidate = queue.popleft()
                    if verdict == "planned":
                        deficit[key] -= candidate.nbytes
                if queue:
                    still.append(key)
                elif key not in busy:
                    fair.discard(key)  # nothing more to load now: it must not hold the others back
            active = still
            if not changed and waiting_turn == len(active):
                break  # everyone left is ahead of a stream that cannot load more in this plan
        return plan

    # --- persistence ---------------------------------------------------------------------

    def export_trace(self, stream: StreamKey) -> dict[str, Any] | None:
        """The stream's trace in plain data (msgpack / JSON), or None if it has none."""
        s = self._streams.get(stream)
        return None if s is None or s.trace is None else s.trace.to_dict()

    def import_trace(self, stream: StreamKey, data: Any) -> None:
        """Install a persisted trace (ValueError if malformed), replayed from the client's next step.

        Meant for when the client attaches; a step under way is abandoned.
        """
        trace = Trace.from_dict(data)
        s = self._streams.get(stream)
        if s is None:
            s = self._streams[stream] = _Stream(stream, active=False)
        self._drop_index(s)
        s.state = _State.IDLE
        s.replay = None
        s.recorder = None
        s.trace = trace
        s.epoch = 0
        self._sync_index(s)

    # --- stats -----------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Plain dicts and lists for `stats` and the monitor."""
        budgets = self._budgets(self._planning_streams())
        prefetch_inflight = sum(load.nbytes for load in self._inflight.values() if load.prefetch)
        clients = []
        for key in sorted(self._streams):
            s = self._streams[key]
            clients.append({
                "namespace": key[0],
                "client": key[1],
                "active": s.active,
                "state": s.state.value,
                "trace_entries": len(s.trace or ()),
                "trace_compute_s": s.trace.duration_s if s.trace is not None else None,
                "cursor": s.replay.position if s.replay is not None else None,
                "lookahead_bytes": budgets.get(key, 0),
                "totals": s.totals.as_dict(),
                "last_step": dict(s.last_step) if s.last_step is not None else None,
            })
        namespaces = sorted(set(self._namespace_bytes) | {n for n, _ in self.config.namespace_quota_bytes})
        return {
            "read_bandwidth_bytes_per_s": self._meter.estimate,
            "bandwidth_samples": self._meter.samples,
            "cpu_tier_bytes": self.cpu_tier_bytes,
            "resident_bytes": self._resident_bytes,
            "resident_tensors": len(self._resident),
            "inflight_bytes": self._inflight_bytes,
            "prefetch_inflight_bytes": prefetch_inflight,
            "namespaces": [{"namespace": n, "bytes": self._namespace_bytes.get(n, 0),
                            "quota_bytes": self.config.quota_bytes(n)} for n in namespaces],
            "clients": clients,
        }

    # --- helpers ---------------------------------------------------------------------------

    def _stream(self, stream: StreamKey) -> _Stream:
        s = self._streams.get(stream)
        if s is None:
            s = self._streams[stream] = _Stream(stream)
        if not s.active:
            s.active = True  # any event from a client means it is here
            self._sync_index(s)
        return s


class NextUsePolicy:
    """The scheduler as an eviction policy: `infinity.daemon.policy.EvictionPolicy`, like LruPolicy.

    The tier manager is built with `scheduler=` and uses this as its policy, calling
    what it calls on LruPolicy: `touched` when a tensor is resident and used
    (published, leased, loaded), `forget` when it leaves the tier,
    `choose_victims` when it needs room. Each is O(log n) or better but for
    `choose_victims`, which pulls from the eviction order only what it returns.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler

    def touched(self, key: TensorKey, nbytes: int) -> None:
        self._scheduler._policy_touched(key, nbytes)

    def forget(self, key: TensorKey) -> None:
        self._scheduler._left_tier(key)

    def choose_victims(self, candidates: Iterable[TensorKey], need_bytes: int) -> list[TensorKey]:
        return self._scheduler.choose_victims(candidates, need_bytes)
