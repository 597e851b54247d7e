"""Trace-driven prefetch through a real infinityd with an NVMe tier: hits in replayed steps, a
changed order, traces kept across client and daemon restarts, two clients sharing the engine,
leases under eviction, and the accounting in `stats`.

A "layer" here is a tensor of an odd size (257 x 1021 float32, a little over 1 MiB) filled with its
own index, so every access checks that the bytes are the right ones. The CPU tier (8 MiB) holds a
quarter of the 32 layers. Compute between accesses is a sleep: a stand-in for work that takes a
known time and leaves the CPU to the daemon (the benchmark, tools/bench_overlap.py, uses real
matrix multiplies).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sqlite3
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from conftest import (PREFETCH_SETTINGS, RunningDaemon, short_tmp_root, start_daemon_process,
                      wait_until)

MiB = 1024 * 1024
SPAWN = multiprocessing.get_context("spawn")
LAYER_SHAPE = (257, 1021)
NUM_LAYERS = 32
COMPUTE_S = 0.004



class PrefetchStore:
    """One NVMe directory and runtime folder; daemons are started on it one after another."""

    def __init__(self) -> None:
        self.root = short_tmp_root()
        self.dir = os.path.join(self.root, "nvme")
        os.mkdir(self.dir)
        self.daemons: list[RunningDaemon] = []

    def start(self, **overrides: Any) -> RunningDaemon:
        daemon = start_daemon_process(self.root, **{"nvme.dirs": [self.dir], **PREFETCH_SETTINGS,
                                                    **overrides})
        self.daemons.append(daemon)
        return daemon

    def close(self) -> None:
        for daemon in self.daemons:
            daemon.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def store() -> Iterator[PrefetchStore]:
    store = PrefetchStore()
    try:
        yield store
    finally:
        store.close()


def write_layers(client: Any, *, namespace: str = "default", count: int = NUM_LAYERS) -> None:
    """Layers through write_from. Each is one stream chunk, so it goes in as a put would: into
    the CPU tier, dirty, from where the tier (a quarter of them) writes most back to NVMe."""
    for i in range(count):
        client.write_from(f"layer{i}", torch.full(LAYER_SHAPE, float(i)), namespace=namespace)


def run_step(client: Any, order: list[int], *, namespace: str = "default",
             compute_s: float = COMPUTE_S, checkpoint_after: int | None = None
             ) -> tuple[Any, dict[str, Any] | None]:
    """One step over `order`, checking every layer's bytes; returns its StepResult and, with
    `checkpoint_after`, the client's scheduler totals taken after that many accesses."""
    totals = None
    with client.step(namespace=namespace) as step:
        for position, i in enumerate(order):
            if position == checkpoint_after:
                totals = scheduler_totals(client, client.name, namespace=namespace)
            with client.get(f"layer{i}", namespace=namespace) as layer:
                assert layer[0, 0].item() == i and layer[-1, -1].item() == i, f"layer{i}'s bytes"
            time.sleep(compute_s)  # the compute that consumes the layer
    return step, totals


def scheduler_client(client: Any, name: str, *, namespace: str = "default") -> dict[str, Any]:
    (entry,) = [c for c in client.stats()["scheduler"]["clients"]
                if c["client"] == name and c["namespace"] == namespace]
    return dict(entry)


def scheduler_totals(client: Any, name: str, *, namespace: str = "default") -> dict[str, Any]:
    return dict(scheduler_client(client, name, namespace=namespace)["totals"])


def difference(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    return {key: after[key] - before[key] for key in after}


def hit_rate(counters: dict[str, Any]) -> float:
    """Of the accesses whose data was not still in flight, those that found it in the CPU tier
    (prefetched, or kept because the trace said it comes back soon). In-flight hits (a prefetch
    had started: the client waited less) are counted apart: neither hits nor misses."""
    settled = counters["accesses"] - counters["inflight_hits"]
    return (counters["prefetch_hits"] + counters["resident_hits"]) / max(1, settled)


def assert_replayed_from_prefetch(client: Any, order: list[int], *, window: int = 6) -> None:
    """One step over `order` replays the trace, and after its first `window` accesses (the
    lookahead, lookahead_accesses = 4, and then some) at least 95% of accesses are hits."""
    step, before = run_step(client, order, checkpoint_after=window)
    assert step.outcome == "replayed"
    assert before is not None
    rest = difference(scheduler_totals(client, client.name), before)
    assert rest["accesses"] == len(order) - window
    assert hit_rate(rest) >= 0.95, rest
    assert rest["inflight_hits"] <= len(order) // 4, rest  # most were there before they were asked for


# --- one client ----------------------------------------------------------------------------------

def test_after_the_first_window_of_the_second_step_accesses_are_prefetch_hits(
        store: PrefetchStore) -> None:
    client = store.start().connect("trainer")
    write_layers(client)
    first, _ = run_step(client, list(range(NUM_LAYERS)))
    assert first.outcome == "recorded"
    assert first.counters["misses"] >= NUM_LAYERS - 8  # the tier holds a quarter: mostly misses

    window = 6  # lookahead_accesses (4) and then some
    second, before = run_step(client, list(range(NUM_LAYERS)), checkpoint_after=window)
    assert second.outcome == "replayed"
    assert before is not None
    rest = difference(scheduler_totals(client, "trainer"), before)
    assert rest["accesses"] == NUM_LAYERS - window
    assert hit_rate(rest) >= 0.95, rest
    assert rest["prefetch_hits"] >= (NUM_LAYERS - window) // 2, rest  # most came from prefetches
    assert second.counters["prefetch_wasted_bytes"] == 0  # nothing prefetched was evicted unused
    client.close()


def test_a_changed_order_is_detected_and_the_new_order_is_learnt(store: PrefetchStore) -> None:
    client = store.start().connect("trainer")
    write_layers(client)
    forward, backward = list(range(NUM_LAYERS)), list(reversed(range(NUM_LAYERS)))
    assert run_step(client, forward)[0].outcome == "recorded"
    assert run_step(client, forward)[0].outcome == "replayed"

    changed, _ = run_step(client, backward)  # every byte still right (run_step checks)
    assert changed.outcome == "diverged"
    assert changed.counters["divergences"] == 1
    # The step's own order replaced the trace: the next step replays it.
    assert scheduler_client(client, "trainer")["trace_entries"] == NUM_LAYERS
    assert_replayed_from_prefetch(client, backward)
    client.close()


def test_a_step_that_fails_halfway_is_dropped_and_the_trace_stays(store: PrefetchStore) -> None:
    client = store.start().connect("trainer")
    write_layers(client)
    assert run_step(client, list(range(NUM_LAYERS)))[0].outcome == "recorded"
    with pytest.raises(RuntimeError, match="out of memory"):
        with client.step():
            for i in (0, 1, 2):
                with client.get(f"layer{i}"):
                    pass
            raise RuntimeError("out of memory")  # the training step fails after three layers
    entry = scheduler_client(client, "trainer")
    assert entry["state"] == "idle" and entry["trace_entries"] == NUM_LAYERS
    assert_replayed_from_prefetch(client, list(range(NUM_LAYERS)))
    client.close()


def test_a_restarted_client_prefetches_from_its_first_step(store: PrefetchStore) -> None:
    daemon = store.start()
    client = daemon.connect("trainer")
    write_layers(client)
    assert run_step(client, list(range(NUM_LAYERS)))[0].outcome == "recorded"
    client.close()

    again = daemon.connect("trainer")
    assert_replayed_from_prefetch(again, list(range(NUM_LAYERS)))
    again.close()


def test_traces_are_kept_in_the_store_across_a_daemon_restart(store: PrefetchStore) -> None:
    daemon = store.start()
    client = daemon.connect("trainer")
    write_layers(client)
    client.flush_store()  # the layers themselves must survive the restart too
    assert run_step(client, list(range(NUM_LAYERS)))[0].outcome == "recorded"
    client.close()
    daemon.stop()

    restarted = store.start().connect("trainer")
    assert scheduler_client(restarted, "trainer")["trace_entries"] == NUM_LAYERS
    assert_replayed_from_prefetch(restarted, list(range(NUM_LAYERS)))
    restarted.close()


def test_only_the_traces_of_the_clients_that_left_last_are_kept(store: PrefetchStore) -> None:
    # Clients named anew for each job would otherwise each leave a trace, for good.
    daemon = store.start(**{"scheduler.max_kept_traces": 2})
    with daemon.connect("writer") as writer:
        write_layers(writer)
    for name in ("job-1", "job-2", "job-3"):
        client = daemon.connect(name)
        # The first records; the others begin as it did, so they replay its trace (borrowed),
        # and each keeps it as its own.
        step = run_step(client, list(range(NUM_LAYERS)))[0]
        assert step.outcome == ("recorded" if name == "job-1" else "replayed")
        client.close()

    def saved() -> set[str]:
        db = sqlite3.connect(os.path.join(store.dir, "infinity-index.sqlite"))
        try:
            return {client for (client,) in db.execute("SELECT client FROM traces")}
        finally:
            db.close()

    wait_until(lambda: saved() == {"job-2", "job-3"}, timeout_s=10,
               what="the oldest trace to leave the index")
    with daemon.connect("watcher") as watcher:
        kept = {c["client"] for c in watcher.stats()["scheduler"]["clients"]}
    assert "job-1" not in kept and {"job-2", "job-3"} <= kept


def test_two_live_clients_with_one_name_keep_separate_traces(store: PrefetchStore) -> None:
    daemon = store.start()
    first, second = daemon.connect("trainer"), daemon.connect("trainer")
    write_layers(first)
    assert run_step(first, list(range(8)))[0].outcome == "recorded"
    assert run_step(second, list(range(8, 16)))[0].outcome == "recorded"
    # Each replays its own order: one trace for both would have diverged here.
    assert run_step(first, list(range(8)))[0].outcome == "replayed"
    assert run_step(second, list(range(8, 16)))[0].outcome == "replayed"
    names = sorted(c["client"] for c in first.stats()["scheduler"]["clients"])
    assert names[0] == "trainer" and names[1].startswith("trainer#")
    first.close()
    second.close()


def test_three_live_clients_never_share_a_scheduler_stream_whatever_their_names(
        store: PrefetchStore) -> None:
    daemon = store.start()
    # The second "bob" would be keyed "bob#3", the name the first client has.
    clients = [daemon.connect(name) for name in ("bob#3", "bob", "bob")]
    clients[0].put("w", torch.ones(4))
    for client in clients:
        with client.get("w"):
            pass
    streams = {(c["namespace"], c["client"]) for c in clients[0].stats()["scheduler"]["clients"]}
    assert len(streams) == 3
    for client in clients:
        client.close()


def test_a_client_whose_name_has_a_hash_gets_its_trace_back_when_it_returns(
        store: PrefetchStore) -> None:
    daemon = store.start()
    client = daemon.connect("trainer#0")
    write_layers(client)
    assert run_step(client, list(range(8)))[0].outcome == "recorded"
    client.close()
    again = daemon.connect("trainer#0")
    assert run_step(again, list(range(8)))[0].outcome == "replayed"
    again.close()


def test_streams_of_a_client_that_left_without_a_trace_are_forgotten(
        store: PrefetchStore) -> None:
    daemon = store.start()
    watcher = daemon.connect("watcher")
    stepper = daemon.connect("stepper")
    for i in range(17):
        with stepper.step(namespace=f"ns{i}"):
            pass  # nothing read: no trace
    assert len(watcher.stats()["clients"][1]["scheduler_streams"]) == 17
    stepper.close()
    wait_until(lambda: len(watcher.stats()["clients"]) == 1, timeout_s=10,
               what="the stepper's session to end")
    assert all(c["client"] != "stepper" for c in watcher.stats()["scheduler"]["clients"])
    watcher.close()


# --- leases and eviction -------------------------------------------------------------------------

def test_a_leased_tensor_is_never_evicted_while_steps_cycle_through_the_tier(
        store: PrefetchStore) -> None:
    client = store.start().connect("trainer")
    write_layers(client)
    with client.get("layer0") as held:
        evictions = client.stats()["counters"]["tiers"]["evictions"]
        for _ in range(3):
            step, _ = run_step(client, list(range(1, NUM_LAYERS)), compute_s=0.001)
        assert client.stats()["counters"]["tiers"]["evictions"] > evictions + NUM_LAYERS
        # The view still reads its own bytes, and the daemon still has it in the CPU tier: its
        # slice was never freed or reused (poisoning or another layer's bytes would show).
        assert bool((held == 0.0).all())
        (info,) = [i for i in client.list() if i.name == "layer0"]
        assert "cpu" in info.tier
    assert step.outcome == "replayed"
    client.close()


def test_prefetch_leaves_what_is_needed_sooner_in_the_tier(store: PrefetchStore) -> None:
    # Two layers are read twice per step: early and again at the end. With a trace, eviction
    # must keep them over layers that come back only in the next step, and a prefetch must never
    # push them out (it would show as misses at their second use).
    client = store.start().connect("trainer")
    write_layers(client, count=16)
    order = [0, 1] + list(range(2, 16)) + [0, 1]
    run_step(client, order)
    for _ in range(2):
        step, before = run_step(client, order, checkpoint_after=6)
        assert step.outcome == "replayed"
        assert before is not None
        rest = difference(scheduler_totals(client, "trainer"), before)
        assert rest["misses"] == 0, rest
        assert step.counters["prefetch_wasted_bytes"] == 0
    client.close()


def test_a_tensor_over_half_a_segment_is_prefetched_into_a_segment_of_tensors_needed_later(
        store: PrefetchStore) -> None:
    # An output projection: larger than half of a 4 MiB segment, so it needs one of its own,
    # read last in every step. Its prefetch empties a segment whose layers all come back only
    # in the next step (before, it was always a miss: no prefetch emptied segments).
    client = store.start().connect("trainer")
    head = torch.arange(3 * MiB // 4 + 11, dtype=torch.float32)
    client.write_from("head", head)
    write_layers(client, count=12)
    order = list(range(12))
    for _ in range(3):
        with client.step() as step:
            for i in order:
                with client.get(f"layer{i}") as layer:
                    assert layer[0, 0].item() == i
                time.sleep(COMPUTE_S)
            before = scheduler_totals(client, "trainer")
            with client.get("head") as view:
                assert torch.equal(view, head)
            got = difference(scheduler_totals(client, "trainer"), before)
    assert step.outcome == "replayed"
    assert got["accesses"] == 1 and got["misses"] == 0, got
    client.close()


# --- several clients ------------------------------------------------------------------------------

def _steps_in_another_process(config: Any, name: str, namespace: str, num_steps: int,
                              start: Any, results: Connection) -> None:
    import infinity

    client = infinity.connect(config=config, name=name)
    try:
        write_layers(client, namespace=namespace, count=16)
        run_step(client, list(range(16)), namespace=namespace)  # record
        start.wait()
        began = time.monotonic()
        reports = [run_step(client, list(range(16)), namespace=namespace, compute_s=0.0)[0]
                   for _ in range(num_steps)]
        results.send({"seconds": time.monotonic() - began,
                      "stall_s": sum(r.counters["stall_s"] for r in reports),
                      "disk_read_bytes": sum(r.counters["disk_read_bytes"] for r in reports),
                      "outcomes": [r.outcome for r in reports]})
    finally:
        client.close()


def test_two_clients_that_want_more_than_the_disk_share_it_fairly(store: PrefetchStore) -> None:
    # No compute at all: each client asks as fast as it is served, so together they want far
    # more than the engine reads (>= 1.5x of it). Neither may stall more than twice the other.
    daemon = store.start()
    start = SPAWN.Barrier(3)
    pipes = [SPAWN.Pipe(duplex=False) for _ in range(2)]
    processes = [SPAWN.Process(target=_steps_in_another_process,
                               args=(daemon.config, f"rank{n}", f"job{n}", 8, start, pipes[n][1]))
                 for n in range(2)]
    for process in processes:
        process.start()
    start.wait(timeout=120)
    results = [pipe[0].recv() if pipe[0].poll(120) else None for pipe in pipes]
    for process in processes:
        process.join(timeout=30)
        assert process.exitcode == 0
    assert all(r is not None for r in results), results
    for result in results:
        assert result["outcomes"] == ["replayed"] * 8
        assert result["disk_read_bytes"] > 0
    stalls = sorted(r["stall_s"] for r in results)
    assert stalls[1] <= 2 * stalls[0], results


# --- accounting -----------------------------------------------------------------------------------

def test_stats_report_each_clients_stall_hits_bytes_and_bandwidth(store: PrefetchStore) -> None:
    client = store.start().connect("trainer")
    write_layers(client)
    run_step(client, list(range(NUM_LAYERS)))
    run_step(client, list(range(NUM_LAYERS)))
    scheduler = client.stats()["scheduler"]
    assert scheduler["read_bandwidth_bytes_per_s"] > 0 and scheduler["bandwidth_samples"] > 0
    entry = scheduler_client(client, "trainer")
    totals = entry["totals"]
    layer_bytes = LAYER_SHAPE[0] * LAYER_SHAPE[1] * 4
    assert totals["steps"] == 2 and totals["accesses"] == 2 * NUM_LAYERS
    assert totals["bytes_got"] == 2 * NUM_LAYERS * layer_bytes
    assert totals["prefetch_hits"] + totals["inflight_hits"] + totals["resident_hits"] \
        + totals["misses"] == totals["accesses"]
    assert totals["stall_s"] > 0 and totals["misses"] > 0  # the recorded step waited for the disk
    assert totals["disk_read_bytes"] >= totals["misses"] * layer_bytes
    assert entry["last_step"]["outcome"] == "replayed"
    assert entry["last_step"]["got_bytes_per_s"] > 0
    assert entry["state"] == "idle" and entry["trace_entries"] == NUM_LAYERS
    client.close()


def test_without_prefetch_a_replayed_step_waits_for_the_disk(store: PrefetchStore) -> None:
    client = store.start(**{"scheduler.prefetch": False}).connect("trainer")
    write_layers(client)
    run_step(client, list(range(NUM_LAYERS)))
    step, _ = run_step(client, list(range(NUM_LAYERS)))
    assert step.outcome == "replayed"
    assert step.counters["prefetch_hits"] == 0 and step.counters["prefetch_loads"] == 0
    assert step.counters["misses"] >= NUM_LAYERS - 8
    client.close()


def test_a_step_on_a_daemon_without_nvme_is_untracked(client: Any) -> None:
    client.put("w", torch.ones(3))
    with client.step() as step:
        with client.get("w"):
            pass
    assert step.outcome == "untracked"
    assert client.stats()["scheduler"] is None


def test_a_namespace_over_its_quota_is_evicted_first(store: PrefetchStore) -> None:
    client = store.start(**{"scheduler.namespace_quota_bytes": {"capped": 3 * MiB}}).connect("t")
    # The free namespace's tensors are the least recently used: without the quota, LRU would
    # evict them first when the capped namespace fills the tier.
    one_mib = torch.zeros(MiB // 4)
    for i in range(3):
        client.put(f"f{i}", one_mib + i, namespace="free")
    for i in range(7):
        client.put(f"c{i}", one_mib + i, namespace="capped")
    resident = {i.name for i in client.list(namespace="free") if "cpu" in i.tier}
    assert resident == {"f0", "f1", "f2"}  # the capped namespace made the room
    namespaces = {n["namespace"]: n for n in client.stats()["scheduler"]["namespaces"]}
    assert namespaces["capped"]["quota_bytes"] == 3 * MiB
    client.close()


def test_infinity_top_shows_each_clients_prefetch(store: PrefetchStore,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from test_monitor_top import run_top

    monkeypatch.setenv("COLUMNS", "200")  # wide enough that every column is drawn

    daemon = store.start()
    client = daemon.connect("trainer")
    write_layers(client, count=12)
    run_step(client, list(range(12)), compute_s=0.0)
    result = run_top(daemon.config, "--once", "--interval-s", "0.2")
    assert result.returncode == 0, result.stderr
    # The prefetch table's row: namespace, client, state, 1 step, a trace of 12 accesses.
    rows = [line.split() for line in result.stdout.splitlines() if "trainer" in line]
    assert any(row[:5] == ["default", "trainer", "idle", "1", "12"] for row in rows), result.stdout
    client.close()


def test_a_prefetch_keeps_its_namespace_within_its_quota_in_a_tier_with_free_room(
        store: PrefetchStore) -> None:
    # A 32 MiB tier, a quota of 3 MiB: two layers. Every layer prefetched into free room.
    client = store.start(**{"cpu.budget_bytes": 32 * MiB,
                            "scheduler.namespace_quota_bytes": {"w": 3 * MiB}}).connect("t")
    write_layers(client, namespace="w", count=8)
    run_step(client, list(range(8)), namespace="w")  # recorded with demand loads
    # Push every layer out: fill the tier with another namespace, then free it again.
    for j in range(30):
        client.put(f"f{j}", torch.zeros(MiB // 4), namespace="other")
    client.delete([f"f{j}" for j in range(30)], namespace="other")
    # What the quota kept of "w" is dirty. A dirty victim goes once written back, and until then
    # it counts in the namespace beside the prefetch it made room for: over the quota for that
    # long (a known gap). Clean, the quota holds at every moment.
    client.flush_store()
    peak = 0
    with client.step(namespace="w") as step:
        for i in range(8):
            with client.get(f"layer{i}", namespace="w") as view:
                assert view[0, 0].item() == i
            if i < 7:  # the plan runs a moment after the get: wait for it, then for its load
                wait_until(lambda: any(t.name == f"layer{i + 1}" and "cpu" in t.tier
                                       for t in client.list(namespace="w")),
                           timeout_s=10, what=f"layer{i + 1} to be prefetched")
            wait_until(lambda: client.stats()["scheduler"]["prefetch_inflight_bytes"] == 0,
                       timeout_s=10, what="the prefetches under way to land")
            (mine,) = [n for n in client.stats()["scheduler"]["namespaces"] if n["namespace"] == "w"]
            peak = max(peak, mine["bytes"])
    # No miss: each layer was prefetched, or one of the quota's two kept from the last step.
    assert step.counters["misses"] == 0 and step.counters["prefetch_hits"] >= 6, step.counters
    # Each prefetch waited for, no get loads on demand: the namespace stays within its quota's
    # two layers. Without the quota it holds all eight.
    assert peak <= 3 * MiB, f"namespace w held {peak} bytes against a 3 MiB quota"
    client.close()


def test_a_restarted_daemon_keeps_prefetch_hints_within_the_namespace_quota(
        store: PrefetchStore) -> None:
    settings = {"cpu.budget_bytes": 32 * MiB, "scheduler.namespace_quota_bytes": {"w": 3 * MiB}}
    with store.start(**settings).connect("t") as client:
        write_layers(client, namespace="w", count=8)
        client.flush_store()
    store.daemons[-1].stop()
    client = store.start(**settings).connect("t")  # a scheduler that has seen none of them
    peak = 0
    for i in range(8):
        client.prefetch([f"layer{i}"], namespace="w")
        wait_until(lambda: sum(client.stats()["counters"]["tiers"][k] for k in
                               ("prefetches", "prefetches_skipped")) >= i + 1,
                   timeout_s=10, what="the prefetch to be taken up")
        wait_until(lambda: client.stats()["scheduler"]["inflight_bytes"] == 0, timeout_s=10,
                   what="the prefetch to land")
        (mine,) = [n for n in client.stats()["scheduler"]["namespaces"] if n["namespace"] == "w"]
        peak = max(peak, mine["bytes"])
    assert peak <= 3 * MiB, f"namespace w held {peak} bytes against a 3 MiB quota"
    client.close()


def test_a_prefetched_tensor_replaced_before_it_is_read_is_no_prefetch_hit(
        store: PrefetchStore) -> None:
    daemon = store.start()
    reader, writer = daemon.connect("reader"), daemon.connect("writer")
    write_layers(reader)
    assert run_step(reader, list(range(NUM_LAYERS)))[0].outcome == "recorded"
    # Between steps the next step's start is prefetched: layer0 comes in for the reader.
    wait_until(lambda: any(i.name == "layer0" and "cpu" in i.tier for i in reader.list()),
               timeout_s=10, what="layer0 to be prefetched")
    wait_until(lambda: reader.stats()["scheduler"]["inflight_bytes"] == 0, timeout_s=10,
               what="the prefetches to land")
    before = scheduler_totals(reader, "reader")
    writer.put("layer0", torch.full(LAYER_SHAPE, 100.0))  # replaced, the prefetched bytes unread
    with reader.get("layer0") as view:
        assert view[0, 0].item() == 100.0
    after = scheduler_totals(reader, "reader")
    assert after["prefetch_hits"] == before["prefetch_hits"]
    assert after["prefetch_wasted_bytes"] > before["prefetch_wasted_bytes"]
    for client in (reader, writer):
        client.close()


def test_the_scheduler_counts_the_tensors_the_cpu_tier_holds(store: PrefetchStore) -> None:
    # The scheduler keeps no residency of its own: it asks the daemon's, which the tiers change
    # as tensors are written, evicted, reloaded, prefetched and deleted, here and after a restart.
    def settled(client: Any) -> dict[str, Any]:
        holder: dict[str, Any] = {}

        def quiet() -> bool:
            holder["stats"] = client.stats()
            return bool(holder["stats"]["scheduler"]["inflight_bytes"] == 0)

        wait_until(quiet, timeout_s=10, what="the loads to land")
        return dict(holder["stats"])

    daemon = store.start()
    client = daemon.connect("trainer")
    write_layers(client)  # four times the tier: most are evicted
    client.flush_store()  # the layers survive the restart
    for _ in range(2):
        run_step(client, list(range(NUM_LAYERS)))  # reloads, then prefetches
    for i in range(0, NUM_LAYERS, 3):
        client.delete(f"layer{i}")
    stats = settled(client)
    assert 0 < stats["scheduler"]["resident_tensors"] == stats["tiers"]["cpu"]["resident_tensors"]
    client.close()
    daemon.stop()

    client = store.start().connect("trainer")
    run_step(client, [i for i in range(NUM_LAYERS) if i % 3])
    stats = settled(client)
    assert 0 < stats["scheduler"]["resident_tensors"] == stats["tiers"]["cpu"]["resident_tensors"]
    client.close()
