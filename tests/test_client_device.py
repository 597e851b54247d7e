"""The client's device cache (the GPU tier) through a real infinityd with an NVMe tier.

Here the device is the CPU (`CpuCopier`): the budget, the prefetch from the daemon's trace and
the eviction order are the same code a GPU runs, only the copy differs; the CUDA copier's own
test runs where a GPU is present and is skipped otherwise. Layers are odd-sized tensors filled
with their index, so every device tensor is checked.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from conftest import PREFETCH_SETTINGS, RunningDaemon, wait_until
from infinity.client.device import CpuCopier, CudaCopier, DeviceCache
from infinity.errors import (DaemonUnavailableError, InvalidRequestError, LeaseError, TierFullError,
                             TooLargeError)

MiB = 1024 * 1024
LAYER_SHAPE = (129, 1021)  # a little over 512 KiB
LAYER_BYTES = 129 * 1021 * 4
NUM_LAYERS = 16



@pytest.fixture
def roomy_nvme_daemon(daemon_factory: Callable[..., RunningDaemon]) -> RunningDaemon:
    """An NVMe tier (so traces replay) behind a CPU tier that holds every layer: what the cache
    finds resident then depends on the cache alone, not on how far the daemon's own prefetch
    got (a device prefetch takes only what the CPU tier holds, see get_resident)."""
    return daemon_factory(nvme_tier=True, **{**PREFETCH_SETTINGS, "cpu.budget_bytes": 32 * MiB})


def write_layers(client: Any) -> None:
    for i in range(NUM_LAYERS):
        client.write_from(f"layer{i}", torch.full(LAYER_SHAPE, float(i)))


def device_step(client: Any, cache: DeviceCache, order: list[int]) -> list[int]:
    """One step through the cache, checking each tensor; the device bytes in use at each get."""
    used = []
    with client.step():
        for i in order:
            with cache.get(f"layer{i}") as t:
                assert t.shape == LAYER_SHAPE and t[0, 0].item() == i and t[-1, -1].item() == i
                used.append(cache.stats.used_bytes)
    return used


def test_a_replayed_step_finds_its_tensors_in_device_memory_and_stays_in_budget(
        roomy_nvme_daemon: RunningDaemon) -> None:
    client = roomy_nvme_daemon.connect("trainer")
    write_layers(client)
    budget = 4 * LAYER_BYTES  # a quarter of the layers
    cache = DeviceCache(client, budget_bytes=budget, copier=CpuCopier())
    order = list(range(NUM_LAYERS))
    device_step(client, cache, order)  # recorded: nothing known ahead
    first = cache.stats.as_dict()
    assert first["misses"] == NUM_LAYERS and first["prefetched"] == 0
    used = device_step(client, cache, order)  # replayed
    used += device_step(client, cache, order)
    stats = cache.stats.as_dict()
    hits = stats["hits"] + stats["inflight_hits"] - first["hits"] - first["inflight_hits"]
    accesses = 2 * NUM_LAYERS
    # After the first get of the replayed step (which asks what comes next) every one is a hit.
    assert hits >= 0.95 * (accesses - 1), stats
    assert max(used) <= budget and stats["max_used_bytes"] <= budget, stats
    assert stats["wasted_prefetches"] == 0, stats
    assert stats["upcoming_requests"] <= 2 * accesses // 3, stats  # one per window, not per get


def test_a_new_version_is_copied_again_not_served_stale(nvme_daemon: RunningDaemon) -> None:
    client = nvme_daemon.connect("trainer")
    client.put("w", torch.zeros(1000))
    cache = DeviceCache(client, budget_bytes=MiB, prefetch=False)
    with cache.get("w") as t:
        assert float(t.sum()) == 0.0
    with cache.get("w") as t:
        assert float(t.sum()) == 0.0
    assert (cache.stats.hits, cache.stats.misses) == (1, 1)
    client.put("w", torch.ones(1000))
    with cache.get("w") as t:
        assert float(t.sum()) == 1000.0
    assert cache.stats.misses == 2 and cache.stats.used_bytes == 4000


class UnfinishedCopier(CpuCopier):
    """A copier whose copies stay under way until waited for. A fake, because a CPU copy is
    done when it starts: on a GPU this is every copy that a get reaches before the copy engine
    is through it (tests/test_client_cuda.py runs the real case)."""

    def __init__(self) -> None:
        super().__init__()
        self.waited: list[int] = []

    def start(self, src: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return src.clone(), [False]

    def finished(self, ticket: Any) -> bool:
        return bool(ticket[0])

    def synchronize(self, ticket: Any) -> None:
        ticket[0] = True
        self.waited.append(id(ticket))


def test_a_get_that_must_copy_waits_for_a_copy_under_way_rather_than_refusing(
        nvme_daemon: RunningDaemon) -> None:
    client = nvme_daemon.connect("trainer")
    for name in ("a", "b", "c"):
        client.put(name, torch.full((1000,), float(ord(name))))
    copier = UnfinishedCopier()
    cache = DeviceCache(client, budget_bytes=8000, copier=copier, prefetch=False)  # two of them
    for name in ("a", "b"):
        with cache.get(name):
            pass
    with cache.get("c") as t:  # both copies still under way: "a", least recently used, goes
        assert float(t[0]) == ord("c")
    assert set(cache.cached()) == {"b", "c"} and len(copier.waited) == 1
    cache.clear()
    copier.synchronize(cache._entries["b"].ticket)
    copier.synchronize(cache._entries["c"].ticket)
    cache.clear()
    assert leases_held(client) == 0  # the CPU-tier sources went back


def test_closing_a_cache_waits_for_its_copies_and_gives_back_every_cpu_tier_lease(
        roomy_nvme_daemon: RunningDaemon) -> None:
    client = roomy_nvme_daemon.connect("trainer")
    write_layers(client)
    copier = UnfinishedCopier()
    with DeviceCache(client, budget_bytes=4 * LAYER_BYTES, copier=copier) as cache:
        for _ in range(3):
            device_step(client, cache, list(range(NUM_LAYERS)))
        held = cache.get("layer5")
    client.flush()
    # Only the DeviceLease still held keeps its device copy; no CPU-tier lease is left.
    assert client.stats()["catalog"]["num_leases"] == 0 and copier.waited
    assert set(cache.cached()) == {"layer5"}
    held.release()


def test_a_held_tensor_is_never_evicted_and_a_full_budget_is_a_typed_error(
        nvme_daemon: RunningDaemon) -> None:
    client = nvme_daemon.connect("trainer")
    for name in ("a", "b", "c"):
        client.put(name, torch.full((1000,), float(ord(name))))
    cache = DeviceCache(client, budget_bytes=8000, prefetch=False)  # two of them
    held_a, held_b = cache.get("a"), cache.get("b")
    with pytest.raises(TierFullError, match="held by tensors in use"):
        cache.get("c")
    assert set(cache.cached()) == {"a", "b"}
    assert float(held_a.tensor[0]) == ord("a") and float(held_b.tensor[0]) == ord("b")
    held_a.release()
    with cache.get("c") as t:  # a, released and least recently used, makes room
        assert float(t[0]) == ord("c")
    assert set(cache.cached()) == {"b", "c"}
    held_b.release()
    assert client.stats()["catalog"]["num_leases"] == 0  # every CPU-tier lease went back


def test_a_tensor_larger_than_the_budget_is_too_large(nvme_daemon: RunningDaemon) -> None:
    client = nvme_daemon.connect("trainer")
    client.put("big", torch.zeros(1001))
    cache = DeviceCache(client, budget_bytes=4000)
    with pytest.raises(TooLargeError, match="larger budget_bytes"):
        cache.get("big")
    assert client.stats()["catalog"]["num_leases"] == 0


def test_without_a_trace_the_cache_works_and_asks_the_daemon_rarely(
        nvme_daemon: RunningDaemon) -> None:
    client = nvme_daemon.connect("trainer")
    for i in range(5):
        client.put(f"t{i}", torch.full((100,), float(i)))
    cache = DeviceCache(client, budget_bytes=MiB)
    for _ in range(4):
        for i in range(5):
            with cache.get(f"t{i}") as t:
                assert float(t[0]) == i
    stats = cache.stats.as_dict()
    assert stats["misses"] == 5 and stats["hits"] == 15 and stats["prefetched"] == 0
    assert stats["upcoming_requests"] <= 3, stats  # no trace (no step markers): asked, then quiet


def test_prefetch_leases_are_not_accesses_of_the_trace(nvme_daemon: RunningDaemon) -> None:
    client = nvme_daemon.connect("trainer")
    write_layers(client)
    order = list(range(NUM_LAYERS))
    cache = DeviceCache(client, budget_bytes=4 * LAYER_BYTES)
    for _ in range(3):
        device_step(client, cache, order)
    (entry,) = [c for c in client.stats()["scheduler"]["clients"] if c["client"] == "trainer"]
    assert entry["last_step"]["outcome"] == "replayed", entry  # the extra gets did not divert it
    assert client.upcoming(max_entries=3) == [(f"layer{i}", LAYER_BYTES) for i in range(3)]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="positive number of bytes"):
        DeviceCache(None, budget_bytes=0)  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_copier_brings_tensors_to_the_gpu_from_pinned_shared_memory(
        nvme_daemon: RunningDaemon) -> None:
    client = nvme_daemon.connect("trainer")
    write_layers(client)
    copier = CudaCopier("cuda")
    cache = DeviceCache(client, budget_bytes=4 * LAYER_BYTES, copier=copier)
    assert cache.registration_failures == []
    for _ in range(3):
        device_step(client, cache, list(range(NUM_LAYERS)))
    with cache.get("layer3") as t:
        assert t.device.type == "cuda" and torch.equal(t.cpu(), torch.full(LAYER_SHAPE, 3.0))
    assert cache.stats.prefetched > 0


def test_without_an_nvme_tier_nothing_is_upcoming_and_the_cache_still_serves(client: Any) -> None:
    client.put("x", torch.arange(10.0))
    assert client.upcoming() == []
    cache = DeviceCache(client, budget_bytes=MiB)
    with cache.get("x") as t:
        assert torch.equal(t, torch.arange(10.0))
    assert cache.stats.misses == 1


def test_upcoming_names_only_the_namespace_asked_about(nvme_daemon: RunningDaemon) -> None:
    client = nvme_daemon.connect("trainer")
    for i in range(4):
        client.put(f"w{i}", torch.full((100,), float(i)), namespace="other")
        client.put(f"d{i}", torch.full((100,), float(i)))
    for _ in range(3):  # one step reads both namespaces, interleaved
        with client.step():
            for i in range(4):
                with client.get(f"w{i}", namespace="other"), client.get(f"d{i}"):
                    pass
    assert client.upcoming(max_entries=8) == [(f"d{i}", 400) for i in range(4)]
    assert client.upcoming(namespace="other", max_entries=2) == [("w0", 400), ("w1", 400)]


def push_out_of_the_tier(client: Any) -> None:
    """Write twice the CPU tier's budget after what came before: the least recently used goes
    to NVMe alone."""
    for i in range(2 * PREFETCH_SETTINGS["cpu.budget_bytes"] // MiB):
        client.write_from(f"filler{i}", torch.zeros(MiB // 4))


def test_get_resident_leases_what_the_cpu_tier_holds_and_loads_nothing(
        nvme_daemon: RunningDaemon) -> None:
    client = nvme_daemon.connect("trainer")
    client.write_from("cold", torch.full((333,), 1.0))
    push_out_of_the_tier(client)
    client.put("warm", torch.full((777,), 2.0))
    lease, names = client.get_resident(["cold", "warm", "absent"])
    assert names == ["warm"] and lease is not None
    with lease as (view,):
        assert torch.equal(view, torch.full((777,), 2.0))
    (me,) = [c for c in client.stats()["clients"] if c["name"] == "trainer"]
    assert me["load_bytes"] == 0  # nothing was read from NVMe for it
    with client.get("cold"):  # a get loads it
        pass
    lease, names = client.get_resident(["cold"])
    assert names == ["cold"] and lease is not None
    lease.release()


def test_get_resident_of_nothing_resident_holds_no_lease(nvme_daemon: RunningDaemon) -> None:
    client = nvme_daemon.connect("trainer")
    client.write_from("cold", torch.ones(100))
    push_out_of_the_tier(client)
    assert client.get_resident(["cold", "absent"]) == (None, [])
    client.flush()
    (me,) = [c for c in client.stats()["clients"] if c["name"] == "trainer"]
    assert me["leases"] == 0


def test_asking_what_is_upcoming_is_not_an_access(nvme_daemon: RunningDaemon) -> None:
    client = nvme_daemon.connect("asker")
    assert client.upcoming() == []
    assert not [c for c in client.stats()["scheduler"]["clients"] if c["client"] == "asker"]


def test_a_write_in_place_under_an_exclusive_lease_is_copied_again(
        nvme_daemon: RunningDaemon) -> None:
    client = nvme_daemon.connect("trainer")
    client.put("w", torch.zeros(1000))
    cache = DeviceCache(client, budget_bytes=MiB, prefetch=False)
    with cache.get("w") as t:
        assert float(t.sum()) == 0.0
    with client.get("w", exclusive=True) as t:  # the same version, its bytes changed
        t.fill_(1.0)
    with cache.get("w") as t:
        assert float(t.sum()) == 1000.0
    assert cache.stats.misses == 2


def test_a_held_copy_of_an_old_version_stays_counted_until_released(
        nvme_daemon: RunningDaemon) -> None:
    client = nvme_daemon.connect("trainer")
    client.put("w", torch.zeros(1000))
    cache = DeviceCache(client, budget_bytes=10_000, prefetch=False)
    held = cache.get("w")
    client.put("w", torch.ones(1000))
    with cache.get("w") as t:
        assert float(t.sum()) == 1000.0
        assert float(held.tensor.sum()) == 0.0  # the holder keeps its copy
        assert cache.stats.used_bytes == 8000  # both copies live
    held.release()
    assert cache.stats.used_bytes == 4000


def test_a_refused_prefetch_does_not_fail_the_get_or_keep_its_tensor_held(
        nvme_daemon: RunningDaemon, monkeypatch: pytest.MonkeyPatch) -> None:
    client = nvme_daemon.connect("trainer")
    for name in ("a", "b"):
        client.put(name, torch.ones(100))
    cache = DeviceCache(client, budget_bytes=MiB)

    class Refused:
        def result(self) -> Any:
            # Injected: the prefetch request refused as a whole, which nothing a client does
            # here causes for real (item faults only leave a tensor out; see get_resident).
            raise LeaseError("lease 7 is still held")

    class Requester:
        def send(self, *args: Any, **kwargs: Any) -> Refused:
            return Refused()

    monkeypatch.setattr(client, "resident_requester", lambda: Requester())
    monkeypatch.setattr(client, "upcoming", lambda **kwargs: [("a", 400), ("b", 400)])
    with cache.get("a") as t:  # sends the prefetch request
        assert float(t.sum()) == 100.0
    with cache.get("a") as t:  # takes its answer: refused
        assert float(t.sum()) == 100.0
    assert cache.stats.prefetch_errors == 1
    cache.clear()
    assert cache.cached() == {}  # nothing was left held


def replayed_cache(daemon: RunningDaemon, copier: CpuCopier) -> tuple[Any, DeviceCache]:
    """A client with the layers written and a cache of a quarter of them, two steps in: the
    trace is recorded and replayed, so gets now prefetch."""
    client = daemon.connect("trainer")
    write_layers(client)
    cache = DeviceCache(client, budget_bytes=4 * LAYER_BYTES, copier=copier)
    for _ in range(2):
        device_step(client, cache, list(range(NUM_LAYERS)))
    return client, cache


def leases_held(client: Any) -> int:
    """CPU-tier leases the daemon holds, once it has served every release sent so far."""
    client.flush()
    return int(client.stats()["catalog"]["num_leases"])


def cache_with_a_prefetch_sent(client: Any) -> DeviceCache:
    """A cache two steps into the layers, whose last get sent a prefetch request not yet used."""
    write_layers(client)
    cache = DeviceCache(client, budget_bytes=4 * LAYER_BYTES)
    for _ in range(2):
        device_step(client, cache, list(range(NUM_LAYERS)))
    with cache.get("layer0"):  # the replayed step's first get asks what comes next ...
        pass
    with cache.get("layer1"):  # ... and this one sends the prefetch of what follows
        pass
    assert cache._pending is not None
    return cache


def test_clear_gives_back_the_leases_of_a_prefetch_not_yet_used(
        roomy_nvme_daemon: RunningDaemon) -> None:
    client = roomy_nvme_daemon.connect("trainer")
    cache = cache_with_a_prefetch_sent(client)
    cache.clear()
    assert leases_held(client) == 0


def test_a_cache_dropped_without_close_gives_back_the_leases_of_its_prefetch(
        roomy_nvme_daemon: RunningDaemon) -> None:
    client = roomy_nvme_daemon.connect("trainer")
    cache = cache_with_a_prefetch_sent(client)
    del cache  # the last reference: CPython finalizes it here
    assert leases_held(client) == 0


def cache_with_copies_under_way(client: Any) -> tuple[DeviceCache, UnfinishedCopier]:
    """A cache that got "a" and "b" through a copier whose copies never finish by themselves."""
    for name in ("a", "b"):
        client.put(name, torch.full((1000,), float(ord(name))))
    copier = UnfinishedCopier()
    cache = DeviceCache(client, budget_bytes=8000, copier=copier, prefetch=False)
    for name in ("a", "b"):
        with cache.get(name):
            pass
    return cache, copier


def test_a_cache_dropped_with_copies_under_way_waits_for_them_before_giving_back_their_sources(
        nvme_daemon: RunningDaemon) -> None:
    client = nvme_daemon.connect("trainer")
    cache, copier = cache_with_copies_under_way(client)
    assert client.stats()["catalog"]["num_leases"] == 2  # the copies still read the CPU tier
    del cache
    client.flush()
    assert len(copier.waited) == 2 and client.stats()["catalog"]["num_leases"] == 0


def test_a_tensor_released_after_its_cache_closed_leaves_device_memory_at_once(
        nvme_daemon: RunningDaemon) -> None:
    client = nvme_daemon.connect("trainer")
    client.put("w", torch.ones(1001))
    with DeviceCache(client, budget_bytes=MiB, prefetch=False) as cache:
        held = cache.get("w")
    assert cache.cached() == {"w": 1}  # still in use
    held.release()
    assert cache.cached() == {} and cache.stats.used_bytes == 0


def test_a_closed_cache_refuses_gets(nvme_daemon: RunningDaemon) -> None:
    client = nvme_daemon.connect("trainer")
    client.put("w", torch.ones(1001))
    cache = DeviceCache(client, budget_bytes=MiB)
    cache.close()
    with pytest.raises(InvalidRequestError, match="closed; make a new DeviceCache"):
        cache.get("w")
    assert client.stats()["catalog"]["num_leases"] == 0


def test_a_lookahead_beyond_what_the_daemon_answers_is_refused_up_front(client: Any) -> None:
    with pytest.raises(InvalidRequestError, match="lookahead_entries is 4097; give 1 to 4096"):
        DeviceCache(client, budget_bytes=MiB, lookahead_entries=4097)
    DeviceCache(client, budget_bytes=MiB, lookahead_entries=4096).close()


def test_clear_after_the_client_closed_frees_the_device_memory(
        roomy_nvme_daemon: RunningDaemon) -> None:
    client = roomy_nvme_daemon.connect("trainer")
    cache = cache_with_a_prefetch_sent(client)
    client.close()
    cache.clear()  # e.g. in a finally: the session took its leases with it
    assert cache.cached() == {} and cache.stats.used_bytes == 0


def test_a_cache_handed_to_another_thread_loses_no_reply_and_no_lease(
        roomy_nvme_daemon: RunningDaemon) -> None:
    # The first half of each step on this thread, the second on a worker, while this thread
    # goes on with gets of its own (another namespace, so the cache's trace stays as it was).
    # A prefetch request sent on this thread's socket and answered on the worker would race
    # with this thread's own replies there.
    client = roomy_nvme_daemon.connect("trainer")
    write_layers(client)
    client.put("mine", torch.ones(10), namespace="other")
    cache = DeviceCache(client, budget_bytes=4 * LAYER_BYTES)
    half = NUM_LAYERS // 2
    errors: list[BaseException] = []

    def read(layers: range) -> None:
        for i in layers:
            with cache.get(f"layer{i}") as t:
                assert t[0, 0].item() == i

    def second_half() -> None:
        try:
            read(range(half, NUM_LAYERS))
        except BaseException as exc:
            errors.append(exc)

    for _ in range(4):
        with client.step():
            read(range(half))
            worker = threading.Thread(target=second_half)
            worker.start()
            while worker.is_alive():
                with client.get("mine", namespace="other"):
                    pass
            assert not errors, errors
    assert cache.stats.prefetched > 0
    cache.clear()
    assert leases_held(client) == 0


def test_unmap_hooks_run_for_every_segment_when_the_client_closes(
        nvme_daemon: RunningDaemon) -> None:
    client = nvme_daemon.connect("trainer")
    client.put("x", torch.ones(1000))
    mapped = [(start, end) for _, start, end in client.segment_ranges()]
    seen: list[tuple[int, int]] = []
    hook = lambda start, end: seen.append((start, end))  # noqa: E731
    client.on_segment_unmap(hook)
    client.on_segment_unmap(hook)  # added once
    client.close()
    assert mapped and sorted(seen) == sorted(mapped)


def test_closing_a_cache_whose_prefetch_answer_was_given_up_on_gives_its_lease_back(
        daemon_factory: Any) -> None:
    daemon = daemon_factory(nvme_tier=True, **{**PREFETCH_SETTINGS, "cpu.budget_bytes": 32 * MiB,
                                               "daemon.request_timeout_s": 0.5})
    client = daemon.connect("trainer")
    write_layers(client)
    cache = DeviceCache(client, budget_bytes=4 * LAYER_BYTES)
    for _ in range(2):  # record, then replay: the next gets send prefetch requests
        device_step(client, cache, list(range(NUM_LAYERS)))
    with cache.get("layer0"):
        pass
    send_prefetch = cache._prefetch

    def stalling_prefetch() -> None:  # the daemon stops as the prefetch request goes out
        daemon.process.send_signal(signal.SIGSTOP)
        send_prefetch()

    cache._prefetch = stalling_prefetch  # type: ignore[method-assign]
    try:
        with cache.get("layer1"):
            pass
        cache.close()  # gives up on the prefetch's answer after the request timeout
    finally:
        daemon.process.send_signal(signal.SIGCONT)
    # Nothing reads the cache's socket again: its lease must go back all the same.
    wait_until(lambda: leases_held(client) == 0, timeout_s=10,
               what="the given-up prefetch's lease to be released")
    client.close()


def leases_held(client: Any) -> int:
    client.flush()  # releases that ride with the next message reach the daemon first
    return int(client.stats()["catalog"]["num_leases"])


def test_a_prefetch_answer_given_up_on_in_a_get_gives_its_lease_back(
        daemon_factory: Callable[..., RunningDaemon]) -> None:
    daemon = daemon_factory(nvme_tier=True, **{**PREFETCH_SETTINGS, "cpu.budget_bytes": 32 * MiB,
                                               "daemon.request_timeout_s": 0.5})
    client, cache = replayed_cache(daemon, CpuCopier())
    with cache.get("layer0"):
        pass
    send_prefetch = cache._prefetch

    def prefetch_to_a_stopped_daemon() -> None:
        daemon.process.send_signal(signal.SIGSTOP)  # silent past request_timeout_s
        send_prefetch()

    cache._prefetch = prefetch_to_a_stopped_daemon  # type: ignore[method-assign]
    try:
        with cache.get("layer1"):
            pass
        cache._prefetch = send_prefetch  # type: ignore[method-assign]
        assert cache._pending is not None
        with pytest.raises(DaemonUnavailableError):
            cache.get(cache._pending[1][0])  # waits for that prefetch's answer, and gives up
    finally:
        daemon.process.send_signal(signal.SIGCONT)
    cache.close()
    wait_until(lambda: leases_held(client) == 0, timeout_s=10, what="the late answer's lease")
    client.close()


def test_a_budget_past_what_the_wire_carries_still_serves_gets(daemon: RunningDaemon) -> None:
    client = daemon.connect("trainer")
    client.put("x", torch.arange(10.0))
    cache = DeviceCache(client, budget_bytes=1 << 62, copier=CpuCopier())  # "no limit"
    with cache.get("x") as t:
        assert torch.equal(t, torch.arange(10.0))
    cache.close()
    assert leases_held(client) == 0
    client.close()


def test_a_prefetch_copy_finding_host_memory_full_is_counted_and_the_get_served(
        roomy_nvme_daemon: RunningDaemon) -> None:
    try:  # what torch's CPU allocator raises when it finds no memory
        torch.empty(1 << 60, dtype=torch.uint8)
    except RuntimeError as exc:
        no_memory = exc
    else:
        pytest.skip("this machine allocated 2**60 bytes")

    class FullWhenArmed(CpuCopier):
        """Stands in for memory running out mid-step, which a test cannot cause on its own."""
        armed = False

        def start(self, src: torch.Tensor) -> tuple[torch.Tensor, Any]:
            if self.armed:
                raise RuntimeError(str(no_memory))
            return super().start(src)

    copier = FullWhenArmed()
    client, cache = replayed_cache(roomy_nvme_daemon, copier)
    with client.step():
        for i in range(3):
            with cache.get(f"layer{i}"):
                pass
        assert "layer3" in cache.cached() and cache._pending is not None
        copier.armed = True
        with cache.get("layer3") as t:  # a hit; the prefetch it sends on cannot copy
            assert t[0, 0].item() == 3
        copier.armed = False
    assert cache.stats.prefetch_errors == 1
    cache.close()
    client.close()


def test_a_prefetched_copy_replaced_before_use_counts_as_wasted(
        roomy_nvme_daemon: RunningDaemon) -> None:
    client, cache = replayed_cache(roomy_nvme_daemon, CpuCopier())
    other = roomy_nvme_daemon.connect("writer")
    with client.step():
        for i in range(4):
            with cache.get(f"layer{i}"):
                pass
        unused = [name for name, entry in cache._entries.items() if entry.prefetched]
        assert unused
        other.write_from(unused[0], torch.full(LAYER_SHAPE, 99.0))  # a new version meanwhile
        before = cache.stats.wasted_prefetches
        with cache.get(unused[0]) as t:
            assert t[0, 0].item() == 99.0
    assert cache.stats.wasted_prefetches == before + 1
    cache.close()
    other.close()
    client.close()


def test_close_gives_the_unused_prefetch_back_even_when_waiting_for_a_copy_fails(
        roomy_nvme_daemon: RunningDaemon) -> None:
    class FaultingCopier(CpuCopier):
        """A device that faults: waiting for its copies raises, as a sticky CUDA error does
        (a fault no test can cause on a CPU)."""
        faulted = False
        slow_next = False

        def start(self, src: torch.Tensor) -> tuple[torch.Tensor, Any]:
            slow, self.slow_next = self.slow_next, False
            return src.clone(), [not slow]

        def finished(self, ticket: Any) -> bool:
            return bool(ticket[0])

        def synchronize(self, ticket: Any) -> None:
            if self.faulted:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            ticket[0] = True

    copier = FaultingCopier()
    client, cache = replayed_cache(roomy_nvme_daemon, copier)
    copier.slow_next = True
    with cache.get("layer0"):  # a miss whose copy is still under way
        pass
    with cache.get("layer1"):
        pass
    assert cache._pending is not None
    copier.faulted = True
    with pytest.raises(RuntimeError, match="illegal memory access"):
        cache.close()
    assert cache._pending is None  # given back before the wait that failed
    assert leases_held(client) == 0  # the failed copy's source went back too
    client.close()


def test_settle_gives_back_the_prefetch_not_yet_used_and_keeps_the_device_copies(
        roomy_nvme_daemon: RunningDaemon) -> None:
    client = roomy_nvme_daemon.connect("trainer")
    cache = cache_with_a_prefetch_sent(client)
    cached = cache.cached()
    cache.settle()
    assert leases_held(client) == 0  # an exclusive lease of those tensors may be granted now
    assert cache.cached() == cached
    misses = cache.stats.misses
    with cache.get("layer1") as t:
        assert t[0, 0].item() == 1
    assert cache.stats.misses == misses


def test_settle_waits_for_copies_under_way_before_giving_back_their_sources(
        nvme_daemon: RunningDaemon) -> None:
    client = nvme_daemon.connect("trainer")
    cache, copier = cache_with_copies_under_way(client)
    assert leases_held(client) == 2  # the copies still read the CPU tier
    cache.settle()
    assert len(copier.waited) == 2 and leases_held(client) == 0
    assert set(cache.cached()) == {"a", "b"}


def test_discard_drops_the_copies_nobody_holds_and_keeps_those_in_use(
        nvme_daemon: RunningDaemon) -> None:
    client = nvme_daemon.connect("trainer")
    for name in ("a", "b"):
        client.put(name, torch.full((1000,), float(ord(name))))
    cache = DeviceCache(client, budget_bytes=8000, prefetch=False)
    held = cache.get("a")
    with cache.get("b"):
        pass
    cache.discard(["a", "b", "never-cached"])
    assert set(cache.cached()) == {"a"} and cache.stats.used_bytes == 4000
    held.release()
    with cache.get("b") as t:  # copied again
        assert t[0].item() == ord("b")
    assert cache.stats.misses == 3


def test_prefetch_names_keep_other_upcoming_tensors_out_of_device_memory(
        roomy_nvme_daemon: RunningDaemon) -> None:
    client = roomy_nvme_daemon.connect("trainer")
    write_layers(client)
    wanted = {f"layer{i}" for i in range(0, NUM_LAYERS, 2)}
    cache = DeviceCache(client, budget_bytes=4 * LAYER_BYTES, copier=CpuCopier(),
                        prefetch_names=wanted)
    for _ in range(3):  # the trace reads every layer; the cache gets the even ones
        with client.step():
            for i in range(NUM_LAYERS):
                if f"layer{i}" in wanted:
                    with cache.get(f"layer{i}"):
                        pass
                else:
                    with client.get(f"layer{i}"):
                        pass
            assert set(cache.cached()) <= wanted
    assert cache.stats.prefetched > 0
