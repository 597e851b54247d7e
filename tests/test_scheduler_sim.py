"""The scheduler driven by a simulated daemon: a simulated clock, engine, CPU tier and clients.

`SimDaemon` wires the scheduler the way infinityd is meant to, its tier simulated
(`SimulatedScheduler`: each event reported changes the residency view the
scheduler asks first, as the daemon's tiers do). Residency goes
through `scheduler.policy` exactly as the tier manager drives its policy
(`touched` on a get of a resident tensor and on a finished load, `forget` on
an eviction, `choose_victims` with a mapping of evictable keys to bytes).
On top of that: every client access calls `touched` on the scheduler (then a
demand load and `wait_started` on a miss), every read submitted to the engine
`load_started` and every completion `load_finished`; after each event the
daemon asks `plan_prefetch` and starts what it returns, making room with
`victims_for_prefetch`. The engine reads one tensor at a time at a fixed
bandwidth, first in first out, like a saturated disk. Everything is
deterministic.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict, deque
from typing import Callable

import pytest

from infinity.daemon.scheduler import AccessKind, SchedulerConfig, StreamKey, TensorKey
from infinity.daemon.scheduler.simulated import SimulatedScheduler
from infinity.daemon.trace import Trace, TraceEntry

MiB = 1024 * 1024
GiB = 1024 * MiB


class SimDaemon:
    def __init__(self, *, tier_bytes: int, bandwidth_bytes_per_s: float,
                 config: SchedulerConfig | None = None) -> None:
        self.now = 0.0
        self.tier_bytes = tier_bytes
        self.bandwidth = bandwidth_bytes_per_s
        self.sched = SimulatedScheduler(config, cpu_tier_bytes=tier_bytes,
                                        is_pinned=lambda key: self.leases[key] > 0)
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.sizes: dict[TensorKey, int] = {}
        self.resident: dict[TensorKey, int] = {}
        self.loading: dict[TensorKey, int] = {}
        self.allocated = 0
        self.leases: Counter[TensorKey] = Counter()
        self.waiters: dict[TensorKey, list[Callable[[], None]]] = defaultdict(list)
        self.queue: deque[TensorKey] = deque()
        self.engine_busy = False
        self.disk_bytes = 0
        self.completions: list[tuple[float, str, int]] = []  # (time, namespace, bytes) per read
        self.access_log: list[tuple[float, StreamKey, TensorKey]] = []
        self.prefetch_evictions: list[tuple[float, TensorKey, TensorKey]] = []  # (time, victim, loaded)
        self.prefetch_starts: list[tuple[float, StreamKey | None, TensorKey]] = []

    # --- the clock ---
    def at(self, time_s: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (time_s, self._seq, fn))

    def run(self) -> None:
        while self._events:
            time_s, _, fn = heapq.heappop(self._events)
            self.now = time_s
            fn()

    # --- the tier and the engine ---
    def free(self) -> int:
        return self.tier_bytes - self.allocated

    def evictable(self) -> dict[TensorKey, int]:
        """What the tier manager passes as candidates: evictable keys and the bytes each frees."""
        return {key: nbytes for key, nbytes in self.resident.items() if self.leases[key] == 0}

    def submit(self, key: TensorKey, *, prefetch: bool, stream: StreamKey | None) -> bool:
        nbytes = self.sizes[key]
        if self.free() < nbytes:
            need = nbytes - self.free()
            victims = (self.sched.victims_for_prefetch(key, self.evictable(), need) if prefetch
                       else self.sched.choose_victims(self.evictable(), need))
            if victims is None:
                return False
            for victim in victims:
                assert self.leases[victim] == 0, "a leased tensor was chosen for eviction"
                self.allocated -= self.resident.pop(victim)
                self.sched.policy.forget(victim)
                if prefetch:
                    self.prefetch_evictions.append((self.now, victim, key))
            assert self.free() >= nbytes, "the victims did not make enough room"
        self.allocated += nbytes
        self.loading[key] = nbytes
        self.sched.load_started(key, nbytes, self.now, prefetch=prefetch, stream=stream)
        if prefetch:
            self.prefetch_starts.append((self.now, stream, key))
        self.queue.append(key)
        self.kick()
        return True

    def kick(self) -> None:
        if self.engine_busy or not self.queue:
            return
        key = self.queue.popleft()
        self.engine_busy = True
        duration = self.sizes[key] / self.bandwidth
        self.at(self.now + duration, lambda: self.complete(key))

    def complete(self, key: TensorKey) -> None:
        nbytes = self.loading.pop(key)
        self.resident[key] = nbytes
        self.disk_bytes += nbytes
        self.completions.append((self.now, key[0], nbytes))
        self.engine_busy = False
        self.sched.load_finished(key, self.now)
        self.sched.policy.touched(key, nbytes)
        self.kick()
        for wake in self.waiters.pop(key, []):
            wake()
        self.plan()

    def plan(self) -> None:
        for key in self.sched.plan_prefetch(free_bytes=self.free()):
            if key not in self.resident and key not in self.loading:
                self.submit(key, prefetch=True, stream=None)


class SimClient:
    """A trainer: per step, get each tensor in `order`, compute on it for `compute_s`, release it."""

    def __init__(self, sim: SimDaemon, stream: StreamKey, orders: list[list[TensorKey]], *,
                 compute_s: float, start_s: float = 0.0) -> None:
        self.sim = sim
        self.stream = stream
        self.orders = orders  # one access order per step
        self.compute_s = compute_s
        self.step = 0
        self.index = 0
        self.kinds: list[list[AccessKind]] = [[] for _ in orders]
        self.finished_s: float | None = None
        self.step_started_s: list[float] = []
        self.lookahead_at_begin: list[int] = []  # the scheduler's lookahead as each step begins
        self.access_times_s: list[list[float]] = [[] for _ in orders]
        sim.at(start_s, self.begin_step)

    def begin_step(self) -> None:
        self.step_started_s.append(self.sim.now)
        self.lookahead_at_begin.append(self.sim.sched.lookahead_bytes(self.stream))
        self.sim.sched.step_begin(self.stream, self.sim.now)
        self.index = 0
        self.access()

    def access(self) -> None:
        sim = self.sim
        order = self.orders[self.step]
        if self.index == len(order):
            sim.sched.step_end(self.stream, sim.now)
            self.step += 1
            if self.step < len(self.orders):
                self.begin_step()
            else:
                self.finished_s = sim.now
            return
        key = order[self.index]
        sim.access_log.append((sim.now, self.stream, key))
        self.access_times_s[self.step].append(sim.now)
        self.kinds[self.step].append(sim.sched.touched(self.stream, key, sim.sizes[key], sim.now))
        if key in sim.resident:
            sim.sched.policy.touched(key, sim.sizes[key])
            self.use(key)
        else:
            if key not in sim.loading:
                assert sim.submit(key, prefetch=False, stream=self.stream)
            sim.sched.wait_started(self.stream, sim.now)

            def wake() -> None:
                sim.sched.wait_finished(self.stream, sim.now)
                self.use(key)

            sim.waiters[key].append(wake)
        sim.plan()

    def use(self, key: TensorKey) -> None:
        self.sim.leases[key] += 1
        self.sim.at(self.sim.now + self.compute_s, lambda: self.release(key))

    def release(self, key: TensorKey) -> None:
        self.sim.leases[key] -= 1
        self.index += 1
        self.access()


def layers(namespace: str, count: int, nbytes: int, sim: SimDaemon) -> list[TensorKey]:
    keys = [(namespace, f"layer{i:03d}") for i in range(count)]
    for key in keys:
        sim.sizes[key] = nbytes
    return keys


def stall_s(sim: SimDaemon, stream: StreamKey) -> float:
    for client in sim.sched.snapshot()["clients"]:
        if (client["namespace"], client["client"]) == stream:
            return float(client["totals"]["stall_s"])
    raise AssertionError(f"no client {stream}")


def test_second_step_reaches_95_percent_hits_after_the_first_lookahead_window() -> None:
    # 64 layers of 1 MiB, a tier that holds a quarter of them, a disk 4x faster than compute needs.
    sim = SimDaemon(tier_bytes=16 * MiB, bandwidth_bytes_per_s=2 * GiB)
    keys = layers("model", 64, 1 * MiB, sim)
    client = SimClient(sim, ("model", "trainer"), [keys, keys, keys], compute_s=0.002)
    sim.run()

    assert client.kinds[0].count(AccessKind.MISS) == 64  # the recording step had nothing to go on
    first_window = max(1, client.lookahead_at_begin[1] // MiB)  # in accesses of 1 MiB
    assert 1 <= first_window <= 8  # at most half the tier (lookahead_max_fraction)
    for step in (1, 2):
        after = client.kinds[step][first_window:]
        hits = sum(kind in (AccessKind.PREFETCH_HIT, AccessKind.RESIDENT_HIT) for kind in after)
        assert hits / len(after) >= 0.95, (step, Counter(after))
        # Most of them are the prefetcher's work, not data that happened to stay.
        assert after.count(AccessKind.PREFETCH_HIT) >= len(after) // 2


def test_prefetch_never_evicted_a_tensor_needed_before_the_one_it_loaded() -> None:
    # A lookahead as large as the whole tier: prefetching further would mean evicting tensors
    # of the window itself, which are needed sooner. It must stop instead.
    sim = SimDaemon(tier_bytes=16 * MiB, bandwidth_bytes_per_s=2 * GiB,
                    config=SchedulerConfig(lookahead_max_fraction=1.0, lookahead_accesses=32))
    keys = layers("model", 64, 1 * MiB, sim)
    SimClient(sim, ("model", "trainer"), [keys] * 4, compute_s=0.002)
    sim.run()

    assert sim.prefetch_evictions  # the tier is a quarter of the data: prefetching must evict
    accesses = [(time_s, key) for time_s, _, key in sim.access_log]

    def next_access(key: TensorKey, after_s: float) -> float:
        return next((t for t, k in accesses if k == key and t >= after_s), float("inf"))

    for time_s, victim, loaded in sim.prefetch_evictions:
        assert next_access(victim, time_s) >= next_access(loaded, time_s), (time_s, victim, loaded)


def test_changed_order_in_a_simulation_stops_prefetch_and_is_learnt_in_that_step() -> None:
    sim = SimDaemon(tier_bytes=16 * MiB, bandwidth_bytes_per_s=2 * GiB)
    keys = layers("model", 64, 1 * MiB, sim)
    stream = ("model", "trainer")
    shuffled = keys[:8] + list(reversed(keys[8:]))  # the order changes after 8 accesses
    client = SimClient(sim, stream, [keys, shuffled, shuffled], compute_s=0.002)
    sim.run()

    # Step 2 left the trace at its 9th access: from then on nothing is prefetched in step 2 (the
    # old order is wrong), and step 2's own order is the trace step 3 replays.
    diverged_s = client.access_times_s[1][8]
    step3_s = client.step_started_s[2]
    assert [key for t, _, key in sim.prefetch_starts if diverged_s <= t < step3_s] == []
    snapshot = sim.sched.snapshot()["clients"][0]
    assert snapshot["totals"]["divergences"] == 1
    assert snapshot["totals"]["traces_recorded"] == 2  # step 1, and step 2 as it diverged
    after = client.kinds[2][8:]
    hits = sum(kind in (AccessKind.PREFETCH_HIT, AccessKind.RESIDENT_HIT) for kind in after)
    assert hits / len(after) >= 0.95  # step 3 replays the new order


def _two_clients(*, steps: int, restarted: bool) -> tuple[SimDaemon, SimClient, SimClient]:
    """Client A: 8 tensors of 4 MiB, 2 ms of compute each; client B: 32 of 1 MiB, 0.5 ms each.

    Each asks 32 MiB per 16 ms step (2 GiB/s); together 4x the disk's 1 GiB/s. The tier holds a
    quarter of their data. `restarted`: both bring their traces (prefetch from the first step).
    """
    sim = SimDaemon(tier_bytes=16 * MiB, bandwidth_bytes_per_s=1 * GiB)
    a_keys = layers("a", 8, 4 * MiB, sim)
    b_keys = layers("b", 32, 1 * MiB, sim)
    if restarted:
        for stream, keys, compute_s in ((("a", "trainer"), a_keys, 0.002),
                                        (("b", "trainer"), b_keys, 0.0005)):
            trace = Trace([TraceEntry(key, sim.sizes[key], compute_s) for key in keys])
            sim.sched.import_trace(stream, trace.to_dict())
    a = SimClient(sim, ("a", "trainer"), [a_keys] * steps, compute_s=0.002)
    b = SimClient(sim, ("b", "trainer"), [b_keys] * steps, compute_s=0.0005)
    sim.run()
    return sim, a, b


@pytest.mark.parametrize("restarted", [False, True], ids=["recording-first", "restarted-with-traces"])
def test_two_clients_competing_for_the_disk_stall_within_2x_of_each_other(restarted: bool) -> None:
    sim, a, b = _two_clients(steps=6, restarted=restarted)
    stall_a = stall_s(sim, a.stream)
    stall_b = stall_s(sim, b.stream)
    assert stall_a > 0 and stall_b > 0  # demand exceeds the disk: both must wait
    assert max(stall_a, stall_b) <= 2 * min(stall_a, stall_b), (stall_a, stall_b)


def test_two_prefetching_clients_get_equal_disk_bytes_while_both_run() -> None:
    # Their windows are equal in bytes although A's tensors are 4x larger, and neither may lead the
    # other by more than a quantum: the engine's bytes are split evenly while both are running.
    sim, a, b = _two_clients(steps=6, restarted=True)
    assert a.finished_s is not None and b.finished_s is not None
    overlap_s = min(a.finished_s, b.finished_s)
    read = Counter[str]()
    for time_s, namespace, nbytes in sim.completions:
        if time_s <= overlap_s:
            read[namespace] += nbytes
    assert max(read.values()) <= 1.25 * min(read.values()), read


def test_two_clients_together_keep_the_engine_reading_at_80_percent() -> None:
    sim, a, b = _two_clients(steps=6, restarted=False)
    assert a.finished_s is not None and b.finished_s is not None
    elapsed = max(a.finished_s, b.finished_s)
    useful = sum(nbytes for time_s, _, nbytes in sim.completions if time_s <= elapsed)
    assert useful / elapsed >= 0.8 * sim.bandwidth, useful / elapsed / sim.bandwidth
