"""The scheduler's decisions, one behaviour per test, on a hand-driven clock (no daemon, no I/O)."""

from __future__ import annotations

import json
from typing import Any, Sequence

import msgpack
import pytest

from infinity.daemon.policy import EvictionPolicy, LruPolicy
from infinity.daemon.scheduler import AccessKind, Scheduler, SchedulerConfig, StreamKey, TensorKey
from infinity.daemon.scheduler.simulated import SimulatedScheduler
from infinity.daemon.scheduler.view import TensorResidency
from infinity.daemon.trace import Trace, TraceEntry
from infinity.errors import ConfigError

MiB = 1024 * 1024
GiB = 1024 * MiB
TRAINER: StreamKey = ("ns", "trainer")


def k(i: int, namespace: str = "ns") -> TensorKey:
    return (namespace, f"t{i}")


def keys(n: int, namespace: str = "ns") -> list[TensorKey]:
    return [k(i, namespace) for i in range(n)]


def scheduler(tier_mib: int = 64, *, pinned: Sequence[TensorKey] = (), **config: Any) -> Scheduler:
    # The tier is simulated: each event reported changes the residency view the scheduler asks.
    return SimulatedScheduler(SchedulerConfig(**config), cpu_tier_bytes=tier_mib * MiB,
                              is_pinned=lambda key: key in pinned)


def run_step(sched: Scheduler, order: Sequence[TensorKey], *, start_s: float, gap_s: float = 0.01,
             stream: StreamKey = TRAINER, nbytes: int = MiB) -> float:
    """One whole step: begin, one access every gap_s, end. Returns the end time."""
    now = start_s
    sched.step_begin(stream, now)
    for key in order:
        now += gap_s
        sched.touched(stream, key, nbytes, now)
    now += gap_s
    sched.step_end(stream, now)
    return now


def make_resident(sched: Scheduler, key: TensorKey, now_s: float, *, nbytes: int = MiB) -> None:
    """A demand load as the daemon reports it; the get that caused it refreshes recency."""
    sched.policy.touched(key, nbytes)
    sched.load_started(key, nbytes, now_s, prefetch=False)
    sched.load_finished(key, now_s)


def client(sched: Scheduler, stream: StreamKey = TRAINER) -> dict[str, Any]:
    for entry in sched.snapshot()["clients"]:
        if (entry["namespace"], entry["client"]) == stream:
            return entry
    raise AssertionError(f"no client {stream}")


# --- traces ---------------------------------------------------------------------------------


def test_recording_step_captures_order_sizes_and_gaps() -> None:
    sched = scheduler()
    sched.step_begin(TRAINER, 0.0)
    sched.touched(TRAINER, k(0), 3 * MiB, 0.01)
    sched.touched(TRAINER, k(1), 5 * MiB, 0.03)
    sched.touched(TRAINER, k(2), 7 * MiB, 0.04, write=True)
    summary = sched.step_end(TRAINER, 0.05)
    assert summary.outcome == "recorded" and summary.trace_updated
    rows = sched.export_trace(TRAINER)["entries"]  # type: ignore[index]
    assert [row[:3] + [row[4]] for row in rows] == [
        ["ns", "t0", 3 * MiB, False], ["ns", "t1", 5 * MiB, False], ["ns", "t2", 7 * MiB, True]]
    assert [row[3] for row in rows] == pytest.approx([0.01, 0.02, 0.01])


def test_time_waiting_for_data_is_kept_out_of_the_recorded_gaps() -> None:
    sched = scheduler()
    sched.step_begin(TRAINER, 0.0)
    sched.touched(TRAINER, k(0), MiB, 0.0)
    sched.wait_started(TRAINER, 0.0)
    sched.wait_finished(TRAINER, 0.05)  # the first tensor took 50 ms to arrive
    sched.touched(TRAINER, k(1), MiB, 0.06)  # then 10 ms of compute
    sched.step_end(TRAINER, 0.07)
    rows = sched.export_trace(TRAINER)["entries"]  # type: ignore[index]
    assert rows[1][3] == pytest.approx(0.01)
    assert client(sched)["totals"]["stall_s"] == pytest.approx(0.05)


def test_replayed_step_plans_the_next_tensors_in_trace_order() -> None:
    sched = scheduler(lookahead_max_fraction=1.0)
    order = keys(8)
    end = run_step(sched, order, start_s=0.0)
    sched.step_begin(TRAINER, end)
    sched.touched(TRAINER, order[0], MiB, end + 0.01)
    # Near the end of the step the lookahead runs on into the next one.
    assert sched.plan_prefetch() == order[1:] + [order[0]]


def test_lookahead_grows_with_bandwidth_and_time_between_accesses() -> None:
    def lookahead(gap_s: float, bandwidth: float) -> int:
        sched = scheduler(1024, initial_read_bandwidth_bytes_per_s=bandwidth, lookahead_min_s=0.0)
        run_step(sched, keys(16), start_s=0.0, gap_s=gap_s)
        return sched.lookahead_bytes(TRAINER)

    base = lookahead(0.01, 1 * GiB)
    assert base > 0
    assert lookahead(0.02, 1 * GiB) == pytest.approx(2 * base, rel=0.01)
    assert lookahead(0.01, 2 * GiB) == pytest.approx(2 * base, rel=0.01)


def test_lookahead_is_capped_by_a_fraction_of_the_tier() -> None:
    sched = scheduler(64, lookahead_max_fraction=0.25, initial_read_bandwidth_bytes_per_s=100 * GiB)
    run_step(sched, keys(16), start_s=0.0, gap_s=1.0)
    assert sched.lookahead_bytes(TRAINER) == 16 * MiB


def test_time_a_load_waits_for_space_is_not_counted_as_disk_time() -> None:
    sched = scheduler(initial_read_bandwidth_bytes_per_s=1 * GiB)
    sched.load_started(k(0), 100 * MiB, 1.0, prefetch=False, reading=False)
    sched.read_started(k(0), 5.0)  # four seconds waiting for room in the tier, then the read
    sched.load_finished(k(0), 5.1)
    assert sched.read_bandwidth_bytes_per_s == pytest.approx(1000 * MiB, rel=0.01)


def test_a_load_cancelled_before_its_read_leaves_the_bandwidth_alone() -> None:
    sched = scheduler(initial_read_bandwidth_bytes_per_s=1 * GiB)
    sched.load_started(k(0), 100 * MiB, 1.0, prefetch=True, reading=False)
    sched.load_cancelled(k(0), 3.0)
    assert sched.read_bandwidth_bytes_per_s == 1 * GiB
    assert sched.snapshot()["inflight_bytes"] == 0


def test_read_bandwidth_is_measured_from_completed_loads() -> None:
    sched = scheduler(initial_read_bandwidth_bytes_per_s=1 * GiB, bandwidth_ewma_alpha=0.5)
    # Two loads in flight together: 200 MiB in 0.1 s of busy time is 2000 MiB/s, whatever each took.
    sched.load_started(k(0), 100 * MiB, 1.0, prefetch=False)
    sched.load_started(k(1), 100 * MiB, 1.0, prefetch=False)
    sched.load_finished(k(0), 1.09)
    sched.load_finished(k(1), 1.1)
    assert sched.read_bandwidth_bytes_per_s == pytest.approx(2000 * MiB, rel=0.01)
    # Idle time between loads does not count; the next sample is blended in.
    sched.load_started(k(2), 100 * MiB, 5.0, prefetch=False)
    sched.load_finished(k(2), 5.1)
    assert sched.read_bandwidth_bytes_per_s == pytest.approx(1500 * MiB, rel=0.01)


def test_unexpected_access_pauses_prefetch_until_back_on_the_trace() -> None:
    sched = scheduler(lookahead_max_fraction=1.0)
    order = keys(12)
    end = run_step(sched, order, start_s=0.0)
    sched.step_begin(TRAINER, end)
    sched.touched(TRAINER, order[0], MiB, end + 0.01)
    sched.touched(TRAINER, k(99), MiB, end + 0.02)  # not in the trace
    assert sched.plan_prefetch() == []
    sched.touched(TRAINER, order[1], MiB, end + 0.03)  # back where the trace says
    assert sched.plan_prefetch()[:1] == [order[2]]


def test_changed_order_is_one_divergence_and_nothing_more_is_prefetched_in_that_step() -> None:
    sched = scheduler(lookahead_max_fraction=1.0, divergence_window=3)
    order = keys(12)
    end = run_step(sched, order, start_s=0.0)
    sched.step_begin(TRAINER, end)
    now = end
    for key in [order[0], order[11], order[10], order[9], order[8], order[1], order[2]]:
        now += 0.01
        sched.touched(TRAINER, key, MiB, now)
        if key != order[0]:
            assert sched.plan_prefetch() == []  # even once it touches the old order again
    totals = client(sched)["totals"]
    assert totals["divergences"] == 1
    assert totals["unexpected_accesses"] == 3
    summary = sched.step_end(TRAINER, now + 0.01)
    assert summary.outcome == "diverged" and summary.trace_updated
    trace = sched.export_trace(TRAINER)  # the daemon persists the step's own order instead
    assert trace is not None and len(trace["entries"]) == 7


def test_the_order_of_a_step_that_diverged_is_replayed_by_the_next_step() -> None:
    sched = scheduler(lookahead_max_fraction=1.0)
    order = keys(12)
    new_order = list(reversed(order))
    end = run_step(sched, order, start_s=0.0)
    end = run_step(sched, new_order, start_s=end)  # diverges
    assert client(sched)["totals"]["traces_recorded"] == 2
    sched.step_begin(TRAINER, end)
    assert client(sched)["state"] == "replaying"
    sched.touched(TRAINER, new_order[0], MiB, end + 0.01)
    assert sched.plan_prefetch()[:2] == new_order[1:3]
    for i, key in enumerate(new_order[1:], start=2):
        sched.touched(TRAINER, key, MiB, end + 0.01 * i)
    assert sched.step_end(TRAINER, end + 0.2).outcome == "replayed"


def test_a_new_client_that_begins_as_another_did_borrows_its_trace_and_is_prefetched_for() -> None:
    sched = scheduler(lookahead_max_fraction=1.0, divergence_window=3)
    order = keys(11)
    end = run_step(sched, order, start_s=0.0)  # the first process records
    second: StreamKey = ("ns", "second")
    sched.step_begin(second, end)
    for i, key in enumerate(order[:2]):
        sched.touched(second, key, MiB, end + 0.01 * (i + 1))
    assert client(sched, second)["state"] == "recording"  # two accesses say too little
    sched.touched(second, order[2], MiB, end + 0.03)
    assert client(sched, second)["state"] == "replaying"
    assert sched.plan_prefetch()[:2] == order[3:5]
    for i, key in enumerate(order[3:], start=4):
        sched.touched(second, key, MiB, end + 0.01 * i)
    summary = sched.step_end(second, end + 0.2)
    assert summary.outcome == "replayed" and summary.trace_updated  # the daemon saves it
    assert client(sched, second)["totals"]["traces_borrowed"] == 1
    assert sched.export_trace(second) is not None  # its own from now on


def test_a_new_client_that_begins_otherwise_records_and_borrows_nothing() -> None:
    sched = scheduler(lookahead_max_fraction=1.0, divergence_window=3)
    order = keys(11)
    end = run_step(sched, order, start_s=0.0)
    second: StreamKey = ("ns", "second")
    sched.step_begin(second, end)
    for i, key in enumerate([order[0], order[1], ("ns", "its own"), *order[3:]]):  # parts third
        sched.touched(second, key, MiB, end + 0.01 * (i + 1))
        assert client(sched, second)["state"] == "recording"
    sched.step_end(second, end + 0.2)
    totals = client(sched, second)["totals"]
    assert totals["traces_borrowed"] == 0 and totals["traces_recorded"] == 1


def test_a_client_of_another_namespace_borrows_no_trace() -> None:
    sched = scheduler(lookahead_max_fraction=1.0, divergence_window=3)
    order = keys(11)
    end = run_step(sched, order, start_s=0.0)
    elsewhere: StreamKey = ("other", "second")
    sched.step_begin(elsewhere, end)
    for i, key in enumerate(order[:4]):  # the same tensors, read from another stream's namespace
        sched.touched(elsewhere, key, MiB, end + 0.01 * (i + 1))
    assert client(sched, elsewhere)["state"] == "recording"


def test_a_borrowed_trace_the_step_then_leaves_is_replaced_by_the_steps_own_order() -> None:
    sched = scheduler(lookahead_max_fraction=1.0, divergence_window=3)
    order = keys(11)
    end = run_step(sched, order, start_s=0.0)
    second: StreamKey = ("ns", "second")
    own = order[:3] + keys(20, "ns")[11:19]  # begins alike, then reads tensors of its own
    end = run_step(sched, own, start_s=end, stream=second)
    assert client(sched, second)["totals"]["traces_borrowed"] == 1
    exported = sched.export_trace(second)
    assert exported is not None and len(exported["entries"]) == len(own)
    assert sched.export_trace(TRAINER) is not None  # the lender's trace is its own still
    assert len(sched.export_trace(TRAINER)["entries"]) == len(order)


def test_a_diverged_step_too_long_to_record_leaves_the_next_step_to_record() -> None:
    sched = scheduler(trace_max_entries=16)
    end = run_step(sched, keys(12), start_s=0.0)
    end = run_step(sched, [k(100 + i) for i in range(20)], start_s=end)  # diverges, 20 > 16
    assert client(sched)["last_step"]["outcome"] == "diverged"
    assert sched.export_trace(TRAINER) is None
    sched.step_begin(TRAINER, end)
    assert client(sched)["state"] == "recording"


def test_small_reorder_within_the_window_is_not_a_divergence() -> None:
    sched = scheduler(divergence_window=4)
    order = keys(10)
    end = run_step(sched, order, start_s=0.0)
    swapped = [order[0], order[2], order[1]] + order[3:]  # t2 before t1
    run_step(sched, swapped, start_s=end)
    totals = client(sched)["totals"]
    assert totals["divergences"] == 0 and totals["skipped_entries"] == 1
    assert client(sched)["last_step"]["outcome"] == "replayed"


def test_step_ending_well_before_the_trace_does_is_a_changed_order() -> None:
    sched = scheduler(divergence_window=2)
    order = keys(10)
    end = run_step(sched, order, start_s=0.0)
    run_step(sched, order[:5], start_s=end)
    assert client(sched)["last_step"]["outcome"] == "diverged"
    assert client(sched)["totals"]["divergences"] == 1


def test_new_tensors_read_between_traced_ones_step_after_step_are_learnt() -> None:
    # Never `window` misses in a row: only the same tensors off the trace two steps running
    # show that the order changed.
    sched = scheduler(lookahead_max_fraction=1.0, divergence_window=4)
    traced = keys(16)
    extra = [k(100 + i) for i in range(16)]
    interleaved = [key for pair in zip(extra, traced) for key in pair]
    end = run_step(sched, traced, start_s=0.0)
    end = run_step(sched, interleaved, start_s=end)
    assert client(sched)["last_step"]["outcome"] == "replayed"  # could be a one-off detour
    end = run_step(sched, interleaved, start_s=end)
    assert client(sched)["last_step"]["outcome"] == "diverged"  # its order is the trace now
    sched.step_begin(TRAINER, end)
    sched.touched(TRAINER, interleaved[0], MiB, end + 0.01)
    assert sched.plan_prefetch()[:2] == interleaved[1:3]  # the new tensors are prefetched too


def test_traced_tensors_no_longer_read_two_steps_running_make_the_trace_record_again() -> None:
    sched = scheduler(divergence_window=4)
    traced = keys(16)
    end = run_step(sched, traced, start_s=0.0)
    end = run_step(sched, traced[::2], start_s=end)  # every other one skipped, within the window
    assert client(sched)["last_step"]["outcome"] == "replayed"
    run_step(sched, traced[::2], start_s=end)
    assert client(sched)["last_step"]["outcome"] == "diverged"
    assert client(sched)["totals"]["divergences"] == 1


def test_tensors_named_anew_every_step_do_not_make_the_trace_record_again() -> None:
    sched = scheduler(divergence_window=4)
    traced = keys(16)
    end = run_step(sched, traced, start_s=0.0)
    for step in range(1, 5):
        fresh = [k(1000 * step + i) for i in range(16)]  # a batch's tensors, new names each step
        end = run_step(sched, [key for pair in zip(fresh, traced) for key in pair], start_s=end)
        assert client(sched)["last_step"]["outcome"] == "replayed"
    assert client(sched)["totals"]["divergences"] == 0


def test_neighbours_read_swapped_every_step_keep_the_trace() -> None:
    # Each skipped entry is read a moment later (several threads of one client, say): swapped
    # within the window, not off the trace, however often it recurs.
    sched = scheduler(divergence_window=4)
    traced = keys(64)
    swapped = [key for pair in zip(traced[1::2], traced[0::2]) for key in pair]
    end = run_step(sched, traced, start_s=0.0)
    for _ in range(4):
        end = run_step(sched, swapped, start_s=end)
        assert client(sched)["last_step"]["outcome"] == "replayed"


def test_a_one_step_detour_keeps_the_trace() -> None:
    sched = scheduler(divergence_window=4)
    traced = keys(16)
    extra = [k(100 + i) for i in range(16)]
    end = run_step(sched, traced, start_s=0.0)
    end = run_step(sched, [key for pair in zip(extra, traced) for key in pair], start_s=end)
    end = run_step(sched, traced, start_s=end)
    run_step(sched, [key for pair in zip(extra, traced) for key in pair], start_s=end)
    assert client(sched)["last_step"]["outcome"] == "replayed"
    assert client(sched)["totals"]["divergences"] == 0


# --- eviction -------------------------------------------------------------------------------


def _replaying_at(sched: Scheduler, order: Sequence[TensorKey], cursor: int) -> float:
    """Record `order`, then replay its first `cursor` accesses. Returns the time."""
    now = run_step(sched, order, start_s=0.0)
    sched.step_begin(TRAINER, now)
    for key in order[:cursor]:
        now += 0.01
        sched.touched(TRAINER, key, MiB, now)
    return now


def test_eviction_takes_the_farthest_next_use_first() -> None:
    sched = scheduler()
    order = keys(6)
    now = _replaying_at(sched, order, cursor=2)  # t0 and t1 used; t2 comes next
    for key in (order[2], order[4], order[0]):
        make_resident(sched, key, now)
    # t0 is next used in the next step: farther than t4, farther than t2.
    assert sched.policy.choose_victims([order[2], order[4], order[0]], MiB) == [order[0]]
    assert sched.policy.choose_victims([order[2], order[4], order[0]], 2 * MiB) == [order[0], order[4]]


def test_after_a_step_aborted_halfway_eviction_still_takes_what_is_read_last() -> None:
    sched = scheduler()
    order = keys(4)
    for key in order:
        make_resident(sched, key, 0.0)
    now = run_step(sched, order, start_s=0.0)  # recorded
    sched.step_begin(TRAINER, now)
    for key in order[:2]:  # replayed up to t1, then the step fails (Client.step() aborts it)
        now += 0.01
        sched.touched(TRAINER, key, MiB, now)
    sched.step_abort(TRAINER, now)
    sched.step_begin(TRAINER, now + 0.01)  # the next step reads t0, t1, t2, t3
    assert sched.policy.choose_victims(order, MiB) == [order[3]]
    assert sched.policy.choose_victims(order, 2 * MiB) == [order[3], order[2]]


def test_tensors_no_trace_needs_go_first_least_recently_used_first() -> None:
    sched = scheduler()
    order = keys(6)
    now = _replaying_at(sched, order, cursor=2)
    for key in (k(1, "other"), k(2, "other"), order[0]):
        make_resident(sched, key, now)  # t0 is the most recently loaded of the three
    victims = sched.policy.choose_victims([order[0], k(2, "other"), k(1, "other")], 2 * MiB)
    assert victims == [k(1, "other"), k(2, "other")]


def test_tensor_overwritten_before_its_next_read_goes_first() -> None:
    sched = scheduler()
    sched.step_begin(TRAINER, 0.0)
    sched.touched(TRAINER, k(0), MiB, 0.01)
    sched.touched(TRAINER, k(1), MiB, 0.02, write=True)  # a fresh version of t1, then read
    sched.touched(TRAINER, k(1), MiB, 0.03)
    sched.touched(TRAINER, k(2), MiB, 0.04)
    sched.step_end(TRAINER, 0.05)
    sched.step_begin(TRAINER, 0.1)
    sched.touched(TRAINER, k(0), MiB, 0.11)
    # t1's bytes are dead: the next thing that happens to t1 is a write. t2 is read soon.
    assert sched.policy.choose_victims([k(2), k(1)], MiB) == [k(1)]


def test_pinned_tensors_are_never_chosen() -> None:
    sched = scheduler(pinned=[k(0)])
    for i in range(3):
        make_resident(sched, k(i), float(i))
    assert k(0) not in sched.policy.choose_victims([k(0), k(1), k(2)], 3 * MiB)


def test_lru_order_without_any_trace() -> None:
    sched = scheduler()
    for i, key in enumerate(keys(3)):
        sched.touched(("ns", "reader"), key, MiB, float(i))
    assert sched.policy.choose_victims(keys(3), MiB) == [k(0)]
    sched.touched(("ns", "reader"), k(0), MiB, 5.0)
    assert sched.policy.choose_victims(keys(3), MiB) == [k(1)]
    assert sched.plan_prefetch() == []  # no trace: nothing to prefetch


def test_without_traces_eviction_is_exactly_lru_policy() -> None:
    import random

    rng = random.Random(11)
    sched = scheduler()
    next_use: EvictionPolicy = sched.policy
    lru: EvictionPolicy = LruPolicy()
    resident: dict[TensorKey, int] = {}
    for _ in range(2000):
        key = k(rng.randrange(30))
        roll = rng.random()
        if roll < 0.6:
            nbytes = resident.setdefault(key, rng.choice([MiB, 2 * MiB]))
            for policy in (next_use, lru):
                policy.touched(key, nbytes)
        elif roll < 0.8 and key in resident:
            del resident[key]
            for policy in (next_use, lru):
                policy.forget(key)
        elif resident:
            candidates = {c: n for c, n in resident.items() if rng.random() < 0.8}
            need = rng.randrange(8 * MiB)
            assert next_use.choose_victims(candidates, need) == lru.choose_victims(candidates, need)


def test_namespace_over_its_quota_loses_first() -> None:
    sched = scheduler(namespace_quota_bytes=(("a", 1 * MiB),))
    make_resident(sched, k(0, "b"), 0.0)  # least recently used, but its namespace has no quota
    make_resident(sched, k(0, "a"), 1.0)
    make_resident(sched, k(1, "a"), 2.0)  # "a" holds 2 MiB of its 1 MiB
    assert sched.policy.choose_victims([k(0, "b"), k(0, "a"), k(1, "a")], MiB) == [k(0, "a")]
    assert sched.policy.choose_victims([k(0, "b"), k(0, "a"), k(1, "a")], 2 * MiB) == [k(0, "a"), k(0, "b")]


# --- prefetch and room ----------------------------------------------------------------------


def test_prefetch_never_evicts_a_tensor_needed_sooner() -> None:
    sched = scheduler(2, lookahead_max_fraction=1.0)
    order = keys(5)
    now = _replaying_at(sched, order, cursor=0)
    make_resident(sched, order[0], now)
    make_resident(sched, order[1], now)  # the tier is full of what comes first
    assert sched.plan_prefetch() == []
    assert sched.victims_for_prefetch(order[2], [order[0], order[1]], MiB) is None


def test_prefetch_may_evict_a_tensor_needed_later_than_the_one_it_loads() -> None:
    sched = scheduler(2, lookahead_max_fraction=1.0)
    order = keys(5)
    now = _replaying_at(sched, order, cursor=0)
    make_resident(sched, order[0], now)
    make_resident(sched, order[4], now)
    assert sched.plan_prefetch() == [order[1]]  # t4 makes room for t1; t0 stays (needed first)
    assert sched.victims_for_prefetch(order[1], [order[0], order[4]], MiB) == [order[4]]


def test_prefetch_keeps_a_namespace_within_its_quota() -> None:
    sched = scheduler(64, lookahead_max_fraction=1.0, namespace_quota_bytes=(("ns", 3 * MiB),),
                      initial_read_bandwidth_bytes_per_s=100 * GiB)
    order = keys(10)
    now = _replaying_at(sched, order, cursor=0)
    plan = sched.plan_prefetch()
    assert plan == order[:3]
    for key in plan:
        make_resident(sched, key, now)
    sched.touched(TRAINER, order[0], MiB, now + 0.01)
    sched.touched(TRAINER, order[1], MiB, now + 0.02)
    # Room comes from t0 and t1 (next used in the next step), never from t2 (next).
    assert sched.plan_prefetch() == order[3:5]


def test_a_prefetch_under_way_does_not_count_twice_against_its_namespace_quota() -> None:
    sched = scheduler(4, lookahead_max_fraction=1.0, namespace_quota_bytes=(("ns", 3 * MiB),),
                      initial_read_bandwidth_bytes_per_s=100 * GiB)
    order = keys(5)
    now = _replaying_at(sched, order, cursor=1)  # t0 used, t1 and t2 come next
    filler = ("other", "f")
    make_resident(sched, order[1], now)
    make_resident(sched, order[2], now)
    make_resident(sched, filler, now, nbytes=2 * MiB)  # another namespace's, needed by nobody
    candidates = {order[1]: MiB, order[2]: MiB, filler: 2 * MiB}
    # "ns" holds 2 MiB of its 3: t3 fits; the tier's room comes from the filler, before the
    # load starts and after (the daemon asks again when it allocates the load's slice).
    assert sched.victims_for_prefetch(order[3], candidates, MiB) == [filler]
    sched.load_started(order[3], MiB, now, prefetch=True, reading=False)
    assert sched.victims_for_prefetch(order[3], candidates, MiB) == [filler]


def test_quota_victims_are_counted_in_tensor_bytes_not_in_the_slices_they_free() -> None:
    # 3 MiB holds two of these tensors; a slice of one is rounded up to 4 KiB, a little more
    # than the tensor, and counted at that size one victim would seem to cover the excess.
    layer = 257 * 1021 * 4
    slice_bytes = -(-layer // 4096) * 4096
    sched = scheduler(32, namespace_quota_bytes=(("ns", 3 * MiB),))
    for i in range(3):  # the quota's two and one demand load past it
        make_resident(sched, k(i), float(i), nbytes=layer)
    candidates = {k(i): slice_bytes for i in range(3)}
    victims = sched.victims_for_prefetch(k(3), candidates, 0, nbytes=layer)
    assert victims is not None and len(victims) == 2  # 4 - 2 layers; one would leave it over


def test_eviction_takes_an_over_quota_namespace_back_under_counting_tensor_bytes() -> None:
    layer = 257 * 1021 * 4  # as above: four of them are over 3 MiB by less than one slice
    slice_bytes = -(-layer // 4096) * 4096
    sched = scheduler(32, namespace_quota_bytes=(("ns", 3 * MiB),))
    make_resident(sched, k(0, "free"), 0.0, nbytes=layer)  # the least recently used
    for i in range(4):
        make_resident(sched, k(i), 1.0 + i, nbytes=layer)
    candidates = {key: slice_bytes for key in [k(0, "free"), *keys(4)]}
    # Two slices of room: both from "ns", which one victim leaves a little over its quota.
    assert sched.policy.choose_victims(candidates, 2 * slice_bytes) == [k(0), k(1)]


def test_nothing_is_planned_twice() -> None:
    sched = scheduler(lookahead_max_fraction=1.0)
    order = keys(8)
    now = _replaying_at(sched, order, cursor=1)
    first = sched.plan_prefetch()
    for key in first:
        sched.load_started(key, MiB, now, prefetch=True)
    assert not set(first) & set(sched.plan_prefetch())


def test_two_streams_are_interleaved_by_bytes_in_one_plan() -> None:
    sched = scheduler(1024, fair_quantum_bytes=2 * MiB, lookahead_max_fraction=1.0,
                      initial_read_bandwidth_bytes_per_s=100 * GiB)
    a, b = ("a", "trainer"), ("b", "trainer")
    run_step(sched, keys(8, "a"), start_s=0.0, stream=a, nbytes=1 * MiB)
    run_step(sched, keys(8, "b"), start_s=0.0, stream=b, nbytes=2 * MiB)
    plan = sched.plan_prefetch()
    # Each round gives each stream 2 MiB: two of A's 1 MiB tensors, one of B's 2 MiB ones.
    assert plan[:6] == [k(0, "a"), k(1, "a"), k(0, "b"), k(2, "a"), k(3, "a"), k(1, "b")]


# --- accounting -----------------------------------------------------------------------------


def test_access_to_a_prefetch_in_flight_is_an_inflight_hit_not_a_prefetch_hit() -> None:
    sched = scheduler()
    sched.load_started(k(0), MiB, 0.0, prefetch=True, stream=TRAINER)
    assert sched.touched(TRAINER, k(0), MiB, 0.01) is AccessKind.INFLIGHT_HIT
    sched.load_finished(k(0), 0.02)
    assert sched.touched(TRAINER, k(0), MiB, 0.03) is AccessKind.RESIDENT_HIT
    sched.evicted(k(0), 0.04)
    totals = client(sched)["totals"]
    assert (totals["inflight_hits"], totals["prefetch_hits"], totals["prefetch_wasted_bytes"]) == (1, 0, 0)


def test_prefetched_tensor_used_once_is_a_prefetch_hit_and_unused_one_is_waste() -> None:
    sched = scheduler()
    sched.attach(TRAINER, 0.0)
    for key in (k(0), k(1)):
        sched.load_started(key, MiB, 0.0, prefetch=True, stream=TRAINER)
        sched.load_finished(key, 0.01)
    assert sched.touched(TRAINER, k(0), MiB, 0.02) is AccessKind.PREFETCH_HIT
    sched.evicted(k(1), 0.03)
    totals = client(sched)["totals"]
    assert (totals["prefetch_hits"], totals["prefetch_wasted_bytes"], totals["disk_read_bytes"]) == (
        1, MiB, 2 * MiB)


def test_snapshot_is_plain_data_for_json_and_msgpack() -> None:
    sched = scheduler(namespace_quota_bytes=(("ns", 8 * MiB),))
    end = run_step(sched, keys(4), start_s=0.0)
    sched.written_back(k(0), MiB, end)
    snapshot = sched.snapshot()
    assert json.loads(json.dumps(snapshot)) == snapshot
    assert msgpack.unpackb(msgpack.packb(snapshot)) == snapshot


# --- persistence ----------------------------------------------------------------------------


def test_trace_round_trips_through_json_and_msgpack() -> None:
    trace = Trace([TraceEntry(k(0), MiB, 0.01), TraceEntry(k(1), 2 * MiB, 0.0, write=True)],
                  step_gap_s=0.5)
    for encode, decode in ((json.dumps, json.loads), (msgpack.packb, msgpack.unpackb)):
        again = Trace.from_dict(decode(encode(trace.to_dict())))  # type: ignore[operator]
        assert again.entries == trace.entries and again.step_gap_s == trace.step_gap_s


@pytest.mark.parametrize("data", [
    [], {"format": 2, "entries": [["ns", "t", 1, 0.0, False]]}, {"format": 1, "entries": []},
    {"format": 1, "entries": [["ns", "t", -1, 0.0, False]]},
    {"format": 1, "entries": [["ns", "t", 1, "soon", False]]},
    {"format": 1, "entries": [["ns", 5, 1, 0.0, False]]},
])
def test_malformed_trace_is_rejected(data: Any) -> None:
    with pytest.raises(ValueError):
        Trace.from_dict(data)


def test_restarted_client_prefetches_from_its_first_step() -> None:
    before = scheduler(lookahead_max_fraction=1.0)
    order = keys(8)
    run_step(before, order, start_s=0.0)
    saved = json.loads(json.dumps(before.export_trace(TRAINER)))

    after = scheduler(lookahead_max_fraction=1.0)  # a new daemon, or the same one later
    after.import_trace(TRAINER, saved)
    assert after.plan_prefetch() == []  # the client is not here yet
    after.attach(TRAINER, 100.0)
    plan = after.plan_prefetch()
    assert plan[:2] == order[:2]  # before its first step_begin
    after.step_begin(TRAINER, 100.1)
    assert client(after)["state"] == "replaying"


def test_client_gone_mid_step_keeps_its_trace_and_stops_its_prefetch() -> None:
    sched = scheduler(lookahead_max_fraction=1.0)
    order = keys(8)
    now = _replaying_at(sched, order, cursor=3)
    assert sched.plan_prefetch()
    sched.client_gone(TRAINER, now)
    assert sched.plan_prefetch() == []
    assert sched.export_trace(TRAINER) is not None


# --- settings -------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("lookahead_max_fraction", 0.0), ("lookahead_max_fraction", 1.5), ("divergence_window", 0),
    ("bandwidth_ewma_alpha", 0.0), ("prefetch_inflight_max_bytes", 0), ("fair_quantum_bytes", -1),
    ("initial_read_bandwidth_bytes_per_s", 0.0), ("lookahead_accesses", 0),
    ("namespace_quota_bytes", (("a", 1), ("a", 2))), ("namespace_quota_bytes", (("a", 0),)),
])
def test_invalid_settings_are_config_errors(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=f"scheduler.{field}"):
        Scheduler(SchedulerConfig(**{field: value}), cpu_tier_bytes=MiB, residency=TensorResidency())


def test_incremental_next_use_index_matches_a_full_recomputation() -> None:
    # Random but seeded: three clients replaying (with skips, strays and divergences), loads,
    # evictions, writes and step boundaries. After every event, the eviction order the index gives
    # must be the one computed from scratch: untraced first by recency, then farthest first.
    import random

    rng = random.Random(5)
    sched = scheduler(1024, divergence_window=3)
    streams = [("ns", f"c{i}") for i in range(3)]
    pool = keys(40)
    orders = {s: rng.sample(pool, 24) for s in streams}
    cursors = {s: 0 for s in streams}
    now = 0.0
    for s in streams:
        now = run_step(sched, orders[s], start_s=now)
        sched.step_begin(s, now)

    def expected() -> list[tuple[float, TensorKey]]:
        resident = list(sched._residency.resident)
        need = {key: sched.next_use_s(key) for key in resident}  # direct bisect per trace
        infinite = sorted((key for key in resident if need[key] == float("inf")),
                          key=lambda key: (sched._nextuse.recency(key), key))
        finite = sorted((key for key in resident if need[key] != float("inf")), key=lambda key: -need[key])
        return [(need[key], key) for key in infinite + finite]

    for _ in range(3000):
        now += 0.001
        s = rng.choice(streams)
        roll = rng.random()
        if roll < 0.55:
            order = orders[s]
            if cursors[s] >= len(order):
                sched.step_end(s, now)
                sched.step_begin(s, now)
                cursors[s] = 0
                if rng.random() < 0.1:
                    orders[s] = rng.sample(pool, 24)  # its order changes: the trace diverges
                continue
            index = min(len(order) - 1, cursors[s] + (1 if rng.random() < 0.1 else 0))
            key = order[index] if rng.random() > 0.03 else rng.choice(pool)
            cursors[s] = index + 1
            sched.touched(s, key, MiB, now, write=rng.random() < 0.05)
        elif roll < 0.8:
            key = rng.choice(pool)
            if key not in sched._residency.resident:
                sched.load_started(key, MiB, now, prefetch=rng.random() < 0.5)
                sched.load_finished(key, now)
        else:
            if sched._residency.resident:
                sched.evicted(rng.choice(sorted(sched._residency.resident)), now)
        got = [(use, key) for use, key, _ in sched._nextuse.eviction_order()]
        want = expected()
        assert [key for use, key in got if use == float("inf")] == [
            key for use, key in want if use == float("inf")]
        got_by_key, want_by_key = dict((key, use) for use, key in got), dict((key, use) for use, key in want)
        assert got_by_key.keys() == want_by_key.keys()
        assert [got_by_key[key] for key in sorted(got_by_key)] == pytest.approx(
            [want_by_key[key] for key in sorted(want_by_key)])
        finite = [use for use, _ in got if use != float("inf")]
        assert finite == sorted(finite, reverse=True)


# --- the residency view (infinity.daemon.scheduler.view) -----------------------------------


def test_resident_and_loading_bytes_are_counted_per_namespace_until_evicted() -> None:
    sched = scheduler(64)
    sched.load_started(k(0), 2 * MiB, 0.0, prefetch=False, stream=TRAINER)
    sched.load_started(k(1, "other"), MiB, 0.0, prefetch=False, stream=TRAINER)
    loading = sched.snapshot()
    assert (loading["inflight_bytes"], loading["resident_bytes"]) == (3 * MiB, 0)
    assert {n["namespace"]: n["bytes"] for n in loading["namespaces"]} == {"ns": 2 * MiB, "other": MiB}

    sched.load_finished(k(0), 0.1)
    sched.load_finished(k(1, "other"), 0.1)
    sched.evicted(k(1, "other"), 0.2)
    after = sched.snapshot()
    assert (after["inflight_bytes"], after["resident_bytes"], after["resident_tensors"]) == (0, 2 * MiB, 1)
    assert {n["namespace"]: n["bytes"] for n in after["namespaces"]} == {"ns": 2 * MiB}


def test_the_scheduler_asks_its_residency_view_and_never_changes_it() -> None:
    # The view's owner (the daemon's tiers) changes it; the scheduler's events only note and ask.
    view = TensorResidency()
    view.add(k(0), MiB)
    sched = Scheduler(SchedulerConfig(), cpu_tier_bytes=64 * MiB, residency=view)
    view.add(k(1), 2 * MiB)
    sched.step_begin(TRAINER, 0.0)
    assert sched.touched(TRAINER, k(0), MiB, 0.1) is AccessKind.RESIDENT_HIT
    assert sched.touched(TRAINER, k(2), MiB, 0.2) is AccessKind.MISS
    sched.load_started(k(2), MiB, 0.2, prefetch=False, stream=TRAINER)
    sched.load_finished(k(2), 0.3)
    sched.touched(TRAINER, k(3), MiB, 0.4, write=True)
    sched.policy.touched(k(4), MiB)
    sched.policy.forget(k(1))
    sched.forget(k(0))
    sched.step_end(TRAINER, 0.5)
    assert (view.resident, view.loading, view.sizes) == ({k(0): MiB, k(1): 2 * MiB}, {}, {})
    assert sched.snapshot()["resident_tensors"] == 2
    # Both are in its eviction order (the one resident before it was built too), least recent first.
    assert sched.policy.choose_victims([k(0), k(1)], 3 * MiB) == [k(1), k(0)]


def test_residency_view_tells_its_watcher_of_each_arrival_and_departure() -> None:
    # The next-use index keeps itself in step with residency through these calls only.
    view = TensorResidency()
    heard: list[tuple[str, TensorKey]] = []
    view.watch(added=lambda key: heard.append(("added", key)),
               dropped=lambda key: heard.append(("dropped", key)))
    view.add(k(0), MiB)
    view.make_resident(k(0), MiB)  # known at this size: nothing changes
    view.make_resident(k(0), 2 * MiB)  # a new size replaces it
    view.start_load(k(0), MiB)  # a reload replaces it too
    view.make_resident(k(0), MiB)  # the load in flight will say
    view.end_load(k(0), arrived=False)
    view.adopt([k(1)])  # a candidate it never heard of
    view.forget(k(1))
    assert heard == [("added", k(0)), ("dropped", k(0)), ("added", k(0)), ("dropped", k(0)),
                     ("added", k(1)), ("dropped", k(1))]
    assert (len(view), view.resident_bytes, view.loading_bytes, view.namespace_bytes("ns")) == (0, 0, 0, 0)
