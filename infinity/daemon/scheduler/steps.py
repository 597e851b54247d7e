"""Client streams and their steps: record a trace, replay it, decide whether it still holds.

It owns the scheduler's streams, one per (namespace, client name), and
everything that happens to one between the daemon's step markers:

- a step with no trace records one (`infinity.daemon.trace.Recorder`); a
  step with a trace replays it (`Replay`), its timing refreshed at the end;
- after an access that breaks the trace's order the stream stops being
  indexed (so nothing is prefetched for it) until it is back on the trace; a
  replaying step records its accesses too, so a step that left the trace
  replaces it with its own order, which the next step replays (not records:
  a model that changes for good, such as another quantized form under the
  same client name, costs one step without prefetch, not two);
- a stream with no trace of its own (a client name new to the namespace, or a
  second process under a name a live client holds) borrows, once its step's
  first `divergence_window` accesses are recorded, the trace of another stream
  of its namespace that began with the same accesses (`borrow_trace`): a
  process generating from a model another process already streamed is
  prefetched for from its first step, not its second. (Traces are immutable,
  so the two streams share it until one refreshes its own.)
- waits and stalls, so that waiting for data stays out of the trace's timing;
- clients leaving and coming back, and traces kept for clients gone.

Each change of a stream's state tells the next-use index (`NextUseIndex.sync`).
An access itself (`Scheduler.touched`) is classified by the scheduler, which
hands a replaying stream's access to `replay_access`.
"""

from __future__ import annotations

from typing import Any

from infinity.config import SchedulerConfig
from infinity.daemon.scheduler.nextuse import NextUseIndex
from infinity.daemon.scheduler.view import ResidencyView
from infinity.daemon.scheduler.stream import Counters, StepSummary, Stream, StreamState
from infinity.daemon.trace import Match, Recorder, Replay, StreamKey, TensorKey, Trace

__all__ = ["Steps"]


class Steps:
    """The streams and their step lifecycle; `Scheduler` documents each event's meaning.

    `streams` is shared with the next-use index and the planner, which read
    it; streams are created, changed in state and removed only here.
    """

    def __init__(self, config: SchedulerConfig, streams: dict[StreamKey, Stream],
                 nextuse: NextUseIndex, residency: ResidencyView) -> None:
        self._config = config
        self.streams = streams
        self._nextuse = nextuse
        self._residency = residency

    def stream(self, stream: StreamKey) -> Stream:
        """The stream, created if new; any event from a client means it is here (active)."""
        s = self.streams.get(stream)
        if s is None:
            s = self.streams[stream] = Stream(stream)
        if not s.active:
            s.active = True
            self._nextuse.sync(s)
        return s

    # --- clients -----------------------------------------------------------------------

    def attach(self, stream: StreamKey, now_s: float) -> None:
        s = self.stream(stream)
        s.last_access_s = now_s

    def client_gone(self, stream: StreamKey, now_s: float) -> None:
        s = self.streams.get(stream)
        if s is None:
            return
        if s.open_waits:
            self.add_stall(s, now_s - s.wait_since_s)
        s.active = False
        s.left_s = now_s
        s.state = StreamState.IDLE
        s.replay = None
        s.recorder = None
        s.open_waits = 0
        s.step_ended_s = None
        self._nextuse.sync(s)

    def remove(self, stream: StreamKey) -> bool:
        """Forget the stream and its trace; False if there was none."""
        s = self.streams.pop(stream, None)
        if s is None:
            return False
        self._nextuse.drop(s)
        return True

    def traces_beyond(self, kept: int) -> list[StreamKey]:
        gone = [s for s in self.streams.values() if not s.active and s.trace is not None]
        if len(gone) <= kept:
            return []
        gone.sort(key=lambda s: s.left_s)
        return [s.key for s in gone[:len(gone) - kept]]

    def trace_of(self, stream: StreamKey) -> Trace | None:
        s = self.streams.get(stream)
        return None if s is None else s.trace

    def export_trace(self, stream: StreamKey) -> dict[str, Any] | None:
        s = self.streams.get(stream)
        return None if s is None or s.trace is None else s.trace.to_dict()

    def import_trace(self, stream: StreamKey, data: Any) -> None:
        trace = Trace.from_dict(data)
        s = self.streams.get(stream)
        if s is None:
            s = self.streams[stream] = Stream(stream, active=False)
        self._nextuse.drop(s)
        s.state = StreamState.IDLE
        s.replay = None
        s.recorder = None
        s.trace = trace
        s.epoch = 0
        self._nextuse.sync(s)

    # --- steps -------------------------------------------------------------------------

    def step_begin(self, stream: StreamKey, now_s: float) -> StepSummary | None:
        s = self.stream(stream)
        ended = self._finish_step(s, now_s) if s.state is not StreamState.IDLE else None
        s.step_gap_s = None if s.step_ended_s is None else max(0.0, now_s - s.step_ended_s)
        s.step = Counters()
        s.step_started_s = now_s
        s.last_access_s = now_s
        s.stall_in_gap_s = 0.0
        s.add("steps")
        # A replaying step records as well: should it leave the trace, its order replaces it.
        s.recorder = Recorder(max_entries=self._config.trace_max_entries)
        if s.trace is not None:
            s.state = StreamState.REPLAYING
            s.replay = Replay(s.trace, window=self._config.divergence_window)
            s.epoch += 1  # absolute positions run on: the index stays valid
        else:
            s.state = StreamState.RECORDING
        self._nextuse.sync(s)
        return ended

    def step_abort(self, stream: StreamKey, now_s: float) -> None:
        s = self.streams.get(stream)
        if s is None or s.state is StreamState.IDLE:
            return
        replay = s.replay
        # What the step did not get to is read next in the next step, not in this one: its
        # next-use positions move on as _finish_step moves them.
        unconsumed = ([e.key for e in replay.trace.entries[replay.position:]]
                      if replay is not None and not replay.diverged else [])
        s.state = StreamState.IDLE
        s.replay = None
        s.recorder = None
        s.step_ended_s = now_s
        self._nextuse.sync(s)
        self._nextuse.reindex_resident(s, unconsumed)

    def step_end(self, stream: StreamKey, now_s: float) -> StepSummary:
        s = self.stream(stream)
        if s.state is StreamState.IDLE:
            return StepSummary(stream, "no_step", False, len(s.trace or ()), s.step.as_dict())
        return self._finish_step(s, now_s)

    def _finish_step(self, s: Stream, now_s: float) -> StepSummary:
        updated = False
        unconsumed: list[TensorKey] = []
        if s.state is StreamState.RECORDING:
            outcome = "recorded" if self._adopt_recording(s) else "not_recorded"
            updated = outcome == "recorded"
        else:
            replay = s.replay
            assert replay is not None
            off_trace_before, s.off_trace_before = s.off_trace_before, frozenset(replay.off_trace)
            if replay.followed(off_trace_before=off_trace_before):
                # Same order: keep it, and let its timing follow this step's (same entries, so the
                # index stays valid but for the few entries the step ended without touching).
                s.trace = replay.trace.refreshed(replay.measured_gaps_s,
                                                 alpha=self._config.trace_timing_ewma_alpha,
                                                 step_gap_s=s.step_gap_s)
                unconsumed = [e.key for e in replay.trace.entries[replay.position:]]
                outcome = "replayed"
                updated = s.step.traces_borrowed > 0  # the stream's own trace now: to be kept
            else:
                if not replay.diverged:
                    s.add("divergences")  # left the trace at the very end (too short, or extra accesses)
                # The order changed: this step's own order is the trace from the next step on
                # (none where it was too long to record: the next step records then).
                if not self._adopt_recording(s):
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
        s.state = StreamState.IDLE
        s.replay = None
        s.recorder = None
        s.step_ended_s = now_s
        self._nextuse.sync(s)
        self._nextuse.reindex_resident(s, unconsumed)
        return StepSummary(s.key, outcome, updated, len(s.trace or ()), counters)

    def _adopt_recording(self, s: Stream) -> bool:
        """Make what the step recorded the stream's trace; False if it recorded none."""
        recorder = s.recorder
        trace = recorder.finish(step_gap_s=s.step_gap_s or 0.0) if recorder is not None else None
        if trace is None:
            return False
        self._nextuse.drop(s)
        s.trace = trace
        s.off_trace_before = frozenset()
        s.epoch = 0
        s.add("traces_recorded")
        return True

    def borrow_trace(self, s: Stream) -> None:
        """After a recording step's access: where the step's first `divergence_window`
        accesses are exactly how another stream of the namespace's trace begins, replay that
        trace from there (see the module docstring); the step goes on recording."""
        recorder = s.recorder
        window = self._config.divergence_window
        if (s.state is not StreamState.RECORDING or recorder is None
                or len(recorder.entries) != window):
            return
        begun = [entry.key for entry in recorder.entries]
        lenders = [o for o in self.streams.values()
                   if o is not s and o.key[0] == s.key[0] and o.trace is not None
                   and len(o.trace) > window
                   and [entry.key for entry in o.trace.entries[:window]] == begun]
        if not lenders:
            return
        # The most recently stepping one: its trace says most about the model as it is now.
        lender = max(lenders, key=lambda o: (o.active, o.step_ended_s or 0.0, o.left_s or 0.0))
        assert lender.trace is not None
        s.trace = lender.trace
        s.off_trace_before = frozenset()
        s.epoch = 0
        s.replay = replay = Replay(lender.trace, window=window)
        for entry in recorder.entries:
            replay.observe(entry.key, entry.gap_s)
        s.state = StreamState.REPLAYING
        s.add("traces_borrowed")
        self._nextuse.sync(s)

    def replay_access(self, s: Stream, key: TensorKey, gap_s: float) -> None:
        """A replaying stream's access: move its cursor, count skips and strays, and keep its
        index (dropped when the access diverges)."""
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
            self._nextuse.sync(s)  # the trace no longer says anything about this step
        elif s.indexed:
            # The cursor passed these entries: their tensors' next accesses are further on now.
            resident = self._residency.resident
            for entry in replay.trace.entries[before:replay.position]:
                if entry.key in resident:
                    self._nextuse.index_key(s, entry.key)

    # --- waits -------------------------------------------------------------------------

    def wait_started(self, stream: StreamKey, now_s: float) -> None:
        s = self.stream(stream)
        s.open_waits += 1
        if s.open_waits == 1:
            s.wait_since_s = now_s

    def wait_finished(self, stream: StreamKey, now_s: float) -> None:
        s = self.streams.get(stream)
        if s is None or s.open_waits == 0:
            return
        s.open_waits -= 1
        if s.open_waits == 0:
            self.add_stall(s, now_s - s.wait_since_s)

    def add_stall(self, s: Stream, duration_s: float) -> None:
        duration_s = max(0.0, duration_s)
        s.add("stall_s", duration_s)
        s.add("stalls")
        s.stall_in_gap_s += duration_s  # waiting is not compute: keep it out of the trace's timing
