"""The `Scheduler`: the one object the daemon talks to, routing each event it reports to the parts it concerns.

It owns the event API and the accounting that spans parts (where an access
found its data, which client a load or write-back counts for), and nothing
else: the streams and their steps are `steps`, the residency it asks is a
`view.ResidencyView` it is built with (the daemon's, or a simulation's), the
next-use index and eviction order `nextuse`, victim choice `eviction`,
prefetch planning `prefetch`, the bandwidth estimate `meter` (all in
`infinity.daemon.scheduler`). `NextUsePolicy` presents it to the tier
manager as its eviction policy.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from infinity.config import SchedulerConfig
from infinity.daemon.scheduler.eviction import Eviction
from infinity.daemon.scheduler.meter import ReadMeter
from infinity.daemon.scheduler.nextuse import NextUseIndex
from infinity.daemon.scheduler.prefetch import PrefetchPlanner
from infinity.daemon.scheduler.steps import Steps
from infinity.daemon.scheduler.stream import AccessKind, LoadNote, StepSummary, Stream, StreamState
from infinity.daemon.scheduler.view import ResidencyView
from infinity.daemon.trace import StreamKey, TensorKey, Trace
from infinity.errors import ConfigError

__all__ = ["NextUsePolicy", "Scheduler"]


class Scheduler:
    """Trace-driven prefetch and eviction for the daemon's CPU tier (see the package docstring).

    `cpu_tier_bytes`: the tier's size. `residency`: what the tier holds and is
    loading, by tensor (`view.ResidencyView`): the scheduler asks it and watches
    its arrivals and departures, and never changes it; whoever owns it changes
    it before reporting the same change here (a load started or ended, a tensor
    written or gone). `is_pinned(key)`: the daemon's answer to
    "is this tensor leased (or otherwise not evictable) now?"; it is called while
    planning and choosing victims, never stored.

    Cost: an access, a load event or an eviction updates the next-use index in
    O(streams x log n). A plan walks the lookahead windows, and only when it
    needs room the eviction order, which costs O(log n) per tensor it pulls
    plus a sort of the tensors no trace needs.
    """

    def __init__(self, config: SchedulerConfig | None = None, *, cpu_tier_bytes: int,
                 residency: ResidencyView,
                 is_pinned: Callable[[TensorKey], bool] | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.config.validate()
        if cpu_tier_bytes <= 0:
            raise ConfigError("the scheduler needs the CPU tier's size in bytes (positive)")
        self.cpu_tier_bytes = cpu_tier_bytes
        self._streams: dict[StreamKey, Stream] = {}
        self._residency = residency
        # Not residency, the scheduler's own notes: per load in flight, what it is for; which
        # resident tensors a prefetch brought in and nobody used since -> the stream it was for.
        self._loads: dict[TensorKey, LoadNote] = {}
        self._prefetched: dict[TensorKey, StreamKey | None] = {}
        self._nextuse = NextUseIndex(self._streams, residency,
                                     is_pinned=is_pinned or (lambda key: False))
        residency.watch(added=self._nextuse.resident_added, dropped=self._resident_dropped)
        for key in list(residency.resident):  # what arrived before it was built (the daemon: none)
            self._nextuse.resident_added(key)
        self._steps = Steps(self.config, self._streams, self._nextuse, self._residency)
        self._meter = ReadMeter(alpha=self.config.bandwidth_ewma_alpha,
                                initial_bytes_per_s=self.config.initial_read_bandwidth_bytes_per_s,
                                sample_min_s=self.config.bandwidth_sample_min_s,
                                sample_max_s=self.config.bandwidth_sample_max_s)
        self._eviction = Eviction(self.config, self._residency, self._nextuse)
        self._planner = PrefetchPlanner(self.config, cpu_tier_bytes=cpu_tier_bytes,
                                        streams=self._streams, residency=self._residency,
                                        loads=self._loads, nextuse=self._nextuse,
                                        meter=self._meter)
        self._last_writer: dict[TensorKey, StreamKey] = {}
        self.policy = NextUsePolicy(self)

    # --- clients and steps -----------------------------------------------------------

    def attach(self, stream: StreamKey, now_s: float) -> None:
        """A client with this (namespace, name) connected: its trace (if known) is used again."""
        self._steps.attach(stream, now_s)

    def client_gone(self, stream: StreamKey, now_s: float) -> None:
        """The client left or died: its half-done step is dropped, its trace is kept."""
        self._steps.client_gone(stream, now_s)

    def step_begin(self, stream: StreamKey, now_s: float) -> StepSummary | None:
        """A step starts: replay the trace if one is known, else record one.

        A begin without an end ends the previous step first; its summary is
        returned then (persist the trace if `trace_updated`), else None.
        """
        return self._steps.step_begin(stream, now_s)

    def step_abort(self, stream: StreamKey, now_s: float) -> None:
        """The step under way failed halfway: drop it; the trace (if any) stays as it was."""
        self._steps.step_abort(stream, now_s)

    def step_end(self, stream: StreamKey, now_s: float) -> StepSummary:
        """A step ends: adopt what it recorded, or refresh / drop the trace it replayed."""
        return self._steps.step_end(stream, now_s)

    def remove_stream(self, stream: StreamKey) -> None:
        """Forget a stream altogether (one that cannot come back: its trace is not kept)."""
        if self._steps.remove(stream):
            self._planner.forget_stream(stream)

    def traces_beyond(self, kept: int) -> list[StreamKey]:
        """The streams of clients that left whose traces are past the `kept` most recent (those
        that left longest ago first): for the daemon to forget."""
        return self._steps.traces_beyond(kept)

    def trace_of(self, stream: StreamKey) -> Trace | None:
        """The stream's trace (immutable: safe to serialize on another thread)."""
        return self._steps.trace_of(stream)

    # --- accesses and waits ---------------------------------------------------------

    def touched(self, stream: StreamKey, key: TensorKey, nbytes: int, now_s: float, *,
                write: bool = False) -> AccessKind:
        """A client read (get) or wrote (commit, `write=True`) a tensor. Returns where it was.

        Call it when the request arrives, before starting a demand load, so a
        miss is classified as one. A write makes the tensor resident: its owner
        says so in the residency view first (`make_resident`), as a read's size
        goes in the view's `sizes` first.
        """
        s = self._steps.stream(stream)
        gap_s = 0.0
        if s.last_access_s is not None:
            gap_s = max(0.0, now_s - s.last_access_s - s.stall_in_gap_s)
        s.last_access_s = now_s
        s.stall_in_gap_s = 0.0
        self._nextuse.used(key)

        if write:
            kind = AccessKind.WRITE
            s.add("writes")
            s.add("bytes_put", nbytes)
            self._last_writer[key] = stream
        else:
            s.add("accesses")
            s.add("bytes_got", nbytes)
            load = self._loads.get(key)
            if load is not None:
                kind = AccessKind.INFLIGHT_HIT if load.prefetch else AccessKind.MISS
                load.used = True
            elif key in self._residency.resident:
                if key in self._prefetched:
                    kind = AccessKind.PREFETCH_HIT
                    del self._prefetched[key]
                else:
                    kind = AccessKind.RESIDENT_HIT
            else:
                kind = AccessKind.MISS
            s.add(_COUNTER_OF[kind])

        if s.recorder is not None:  # a replaying step records too (see `Steps`)
            s.recorder.observe(key, nbytes, gap_s, write=write)
        if s.state is StreamState.REPLAYING:
            self._steps.replay_access(s, key, gap_s)
        elif s.state is StreamState.RECORDING:
            self._steps.borrow_trace(s)
        return kind

    def wait_started(self, stream: StreamKey, now_s: float) -> None:
        """The client began waiting for data (a get that needs a load). Nested waits overlap."""
        self._steps.wait_started(stream, now_s)

    def wait_finished(self, stream: StreamKey, now_s: float) -> None:
        """The data the client waited for is there (the get is answered)."""
        self._steps.wait_finished(stream, now_s)

    def stalled(self, stream: StreamKey, duration_s: float) -> None:
        """Alternative to wait_started/wait_finished: the client waited this long for data."""
        self._steps.add_stall(self._steps.stream(stream), duration_s)

    # --- the tier, as the daemon reports it ------------------------------------------

    def load_started(self, key: TensorKey, nbytes: int, now_s: float, *, prefetch: bool,
                     stream: StreamKey | None = None, reading: bool = True) -> None:
        """The daemon started a load of `key` from NVMe into the tier.

        `prefetch`: it came from `plan_prefetch` (its stream is then known from
        the plan); otherwise it is a demand load for `stream`'s miss.
        `reading=False`: the read itself is not submitted yet (the load waits for
        space first); `read_started` says when it is, so that waiting for space
        does not count as disk time in the bandwidth estimate. The residency view
        has the load already (`start_load`); a second load of a tensor in flight
        is not reported (the first stands for both).
        """
        if key in self._loads:
            return
        stream = self._planner.load_started(key, nbytes, prefetch=prefetch, stream=stream)
        self._loads[key] = LoadNote(nbytes, prefetch, stream, reading=reading)
        if reading:
            self._meter.started(now_s)
        s = self._streams.get(stream) if stream is not None else None
        if s is not None and prefetch:
            s.add("prefetch_loads")
            s.add("prefetch_bytes", nbytes)

    def load_finished(self, key: TensorKey, now_s: float, *, ok: bool = True) -> None:
        """The read of `key` completed (`ok=False`: it failed; the tensor is not resident).

        The residency view has it resident already (`end_load(arrived=ok)`).
        """
        load = self._loads.pop(key, None)
        if load is None:
            return
        if load.reading:
            self._meter.finished(load.nbytes if ok else 0, now_s)
        if not ok:
            return
        if load.prefetch and not load.used:
            self._prefetched[key] = load.stream
        s = self._streams.get(load.stream) if load.stream is not None else None
        if s is not None:
            s.add("disk_read_bytes", load.nbytes)

    def read_started(self, key: TensorKey, now_s: float) -> None:
        """The read of a load started with `reading=False` was submitted to the engine."""
        load = self._loads.get(key)
        if load is not None and not load.reading:
            load.reading = True
            self._meter.started(now_s)

    def load_cancelled(self, key: TensorKey, now_s: float) -> None:
        """A load reported by `load_started` was dropped before it read anything (a prefetch
        that found no room): as if it had not started."""
        load = self._loads.pop(key, None)
        if load is None:
            return
        if load.reading:
            self._meter.cancelled(now_s)
        if load.stream is not None:
            self._planner.load_cancelled(load.stream, load.nbytes)
            s = self._streams.get(load.stream)
            if s is not None and load.prefetch:
                s.add("prefetch_loads", -1)
                s.add("prefetch_bytes", -load.nbytes)

    def evicted(self, key: TensorKey, now_s: float) -> None:
        """`key` is leaving the tier (evicted, replaced or deleted); the residency view drops it
        right after. `policy.forget` does the same."""
        self._left_tier(key)

    def _left_tier(self, key: TensorKey) -> None:
        # Still resident in the view: a prefetch nobody read was wasted, at its size.
        prefetched_for = self._prefetched.get(key)
        if prefetched_for is not None:
            s = self._streams.get(prefetched_for)
            if s is not None:
                s.add("prefetch_wasted_bytes", self._residency.resident[key])

    def _resident_dropped(self, key: TensorKey) -> None:
        # The view's departure: a prefetch mark goes with the tensor, then the index hears.
        self._prefetched.pop(key, None)
        self._nextuse.resident_dropped(key)

    def written_back(self, key: TensorKey, nbytes: int, now_s: float) -> None:
        """The daemon wrote `key` to NVMe (eviction write-back or flush): counted for its last writer."""
        writer = self._last_writer.get(key)
        s = self._streams.get(writer) if writer is not None else None
        if s is not None:
            s.add("disk_write_bytes", nbytes)

    def forget(self, key: TensorKey) -> None:
        """`key` was deleted: forget its recency (the residency view forgot it first).

        A load in flight for it stays until `load_finished` reports it.
        """
        self._nextuse.forget(key)
        self._last_writer.pop(key, None)

    def _policy_touched(self, key: TensorKey, nbytes: int) -> None:
        # The tier manager's word: resident and just used (a get, a commit or a finished load);
        # the view hears it right after (`make_resident`).
        self._nextuse.used(key)

    # --- eviction ----------------------------------------------------------------------

    def next_use_s(self, key: TensorKey) -> float:
        """Expected seconds until some client reads `key` next (infinite: unknown or never)."""
        return self._nextuse.need_s(key)

    def choose_victims(self, candidates: Iterable[TensorKey], need_bytes: int) -> list[TensorKey]:
        """Which of the (unleased, resident) candidates to evict to free `need_bytes`.

        A namespace over its quota loses first (until it is back under), then
        the farthest next use, then the least recently used. When the
        candidates cannot cover `need_bytes`, all of them are returned in that
        order and the daemon decides (TierFullError). Pinned ones never are, nor
        ones its residency view does not hold (the daemon's tiers report every
        arrival to it; a simulation may `adopt` what it offers unannounced).
        """
        return self._eviction.choose_victims(candidates, need_bytes)

    def victims_for_prefetch(self, key: TensorKey, candidates: Iterable[TensorKey],
                             need_bytes: int, *, nbytes: int | None = None
                             ) -> list[TensorKey] | None:
        """Victims to make `need_bytes` of room for prefetching `key`, or None: skip that prefetch.

        Only tensors whose next use is after `key`'s may go, and the prefetch
        must also fit its namespace's quota. The daemon calls this instead of
        `choose_victims` when the room is for a prefetch. `nbytes`: the tensor's size, where
        the caller knows it (this scheduler may not have seen the tensor yet: a restart).
        """
        return self._eviction.victims_for_prefetch(key, candidates, need_bytes, nbytes=nbytes)

    # --- prefetch planning ------------------------------------------------------------

    @property
    def read_bandwidth_bytes_per_s(self) -> float:
        return self._meter.estimate

    def upcoming(self, stream: StreamKey, *, namespace: str, max_entries: int,
                 max_bytes: int) -> list[tuple[TensorKey, int]]:
        """The stream's next reads of tensors in `namespace` by the trace it replays, soonest
        first: distinct tensors (writes skipped), at most `max_entries` and `max_bytes` (the
        first always). Empty when it replays no trace, or strayed from it. For a client's
        device cache, which brings tensors further, into device memory, ahead of their use."""
        return self._planner.upcoming(stream, namespace=namespace, max_entries=max_entries,
                                      max_bytes=max_bytes)

    def lookahead_bytes(self, stream: StreamKey) -> int:
        """The stream's current prefetch lookahead in bytes (0: not prefetching now)."""
        return self._planner.lookahead_bytes(stream)

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
        return self._planner.plan(free_bytes=free_bytes)

    # --- persistence ---------------------------------------------------------------------

    def export_trace(self, stream: StreamKey) -> dict[str, Any] | None:
        """The stream's trace in plain data (msgpack / JSON), or None if it has none."""
        return self._steps.export_trace(stream)

    def import_trace(self, stream: StreamKey, data: Any) -> None:
        """Install a persisted trace (ValueError if malformed), replayed from the client's next step.

        Meant for when the client attaches; a step under way is abandoned.
        """
        self._steps.import_trace(stream, data)

    # --- stats -----------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Plain dicts and lists for `stats` and the monitor."""
        budgets = self._planner.budgets()
        residency = self._residency
        prefetch_inflight = sum(load.nbytes for load in self._loads.values() if load.prefetch)
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
        totals = residency.namespace_totals()
        namespaces = sorted(set(totals) | {n for n, _ in self.config.namespace_quota_bytes})
        return {
            "read_bandwidth_bytes_per_s": self._meter.estimate,
            "bandwidth_samples": self._meter.samples,
            "cpu_tier_bytes": self.cpu_tier_bytes,
            "resident_bytes": residency.resident_bytes,
            "resident_tensors": len(residency.resident),
            "inflight_bytes": residency.loading_bytes,
            "prefetch_inflight_bytes": prefetch_inflight,
            "namespaces": [{"namespace": n, "bytes": totals.get(n, 0),
                            "quota_bytes": self.config.quota_bytes(n)} for n in namespaces],
            "clients": clients,
        }


# Which counter a read of each kind adds to.
_COUNTER_OF = {AccessKind.INFLIGHT_HIT: "inflight_hits", AccessKind.MISS: "misses",
               AccessKind.PREFETCH_HIT: "prefetch_hits", AccessKind.RESIDENT_HIT: "resident_hits"}


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
