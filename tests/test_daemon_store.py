"""The daemon's store through one client: versions, leases, the CPU tier's budget and segments."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from conftest import RunningDaemon, wait_until
from infinity.errors import (InvalidRequestError, LeaseError, NotFoundError, TierFullError,
                             TooLargeError)
from infinity.protocol import wire

MiB = 1024 * 1024


def test_unknown_name_is_not_found(client: Any) -> None:
    with pytest.raises(NotFoundError, match="no tensor 'ghost'"):
        client.get("ghost")


def test_name_in_another_namespace_is_not_found_and_the_message_names_where_it_is(
        client: Any) -> None:
    client.put("w", torch.ones(2), namespace="model-a")
    with pytest.raises(NotFoundError, match="'model-a'"):
        client.get("w", namespace="model-b")


def test_a_name_in_many_namespaces_gives_a_short_not_found_message(client: Any) -> None:
    long_names = [f"{i:03d}" + "n" * 250 for i in range(300)]
    for namespace in long_names:
        client.put("w", torch.ones(1), namespace=namespace)
    with pytest.raises(NotFoundError, match="and others") as raised:
        client.get("w", namespace="elsewhere")  # was an undecodable 78 KB reply
    assert len(str(raised.value)) < 2000
    with pytest.raises(NotFoundError):
        client.get_many(["w"] * 2000, namespace="elsewhere")  # was a 150 MB reply


def test_the_tiers_segments_get_huge_pages_where_the_kernel_can_collapse_shared_memory(
        daemon: RunningDaemon, client: Any) -> None:
    import errno
    import os

    from infinity import _native

    fd = os.memfd_create("probe")
    try:
        os.ftruncate(fd, 2 << 20)
        os.pwrite(fd, b"x", 0)
        if _native.collapse_shared_memory(fd, 2 << 20) in (errno.EINVAL, errno.ENOMEM, errno.EAGAIN):
            pytest.skip("this kernel gives shared memory no huge pages (MADV_COLLAPSE)")
    finally:
        os.close(fd)
    client.put("w", torch.arange(1000.0))  # the first segment is made on demand
    cpu = client.stats()["tiers"]["cpu"]
    if cpu["huge_page_bytes"] < cpu["allocated_bytes"]:
        with open(daemon.log_path) as log:
            if "keeps 4 KiB pages" in log.read():  # the probe's 2 MiB were had, 8 were not
                pytest.skip("memory here is too fragmented for the segment's huge pages now")
    assert cpu["allocated_bytes"] > 0 and cpu["huge_page_bytes"] == cpu["allocated_bytes"]
    with client.get("w") as view:
        assert torch.equal(view, torch.arange(1000.0))
    views = client.reserve({"fresh": (torch.float32, (3, 1001))})
    assert not views["fresh"].any()  # zeros, as ever
    client.abort(["fresh"])


def test_a_new_segment_reads_as_zeros_whatever_pages_it_got() -> None:
    # The collapse writes a byte into each 2 MiB first: it must be a zero.
    from infinity.config import CpuTierConfig
    from infinity.daemon.arena import SegmentPlan, create_segment

    size = 6 * MiB  # three huge pages, as a dedicated segment may have
    segment = create_segment(SegmentPlan(1, size, True), CpuTierConfig(hugepages=True, prefault=True))
    try:
        assert segment.mm[:] == bytes(size)
    finally:
        segment.destroy()


def test_without_prefault_the_segments_take_no_memory_up_front_and_stay_small_pages(
        daemon_factory: Any) -> None:
    from infinity.daemon.arena import shmem_hugepages_allowed

    if shmem_hugepages_allowed():
        pytest.skip("shmem_enabled gives huge pages on request here, prefaulted or not")
    with daemon_factory(**{"cpu.prefault": False}).connect() as client:
        client.put("w", torch.arange(1000.0))
        assert client.stats()["tiers"]["cpu"]["huge_page_bytes"] == 0


def test_tensor_larger_than_the_whole_tier_is_too_large(client: Any) -> None:
    with pytest.raises(TooLargeError, match="cpu.budget_bytes"):
        client.reserve({"huge": (torch.uint8, (65 * MiB,))})
    client.put("after", torch.ones(1))  # still serving


def test_full_tier_is_tier_full_with_advice_and_frees_on_delete(client: Any) -> None:
    block = (torch.uint8, (7 * MiB,))
    for i in range(9):  # 8 MiB segments, 64 MiB budget: 8 fit one per segment
        if i == 8:
            with pytest.raises(TierFullError, match="raise cpu.budget_bytes or delete"):
                client.reserve({f"b{i}": block})
        else:
            client.reserve({f"b{i}": block})
            client.commit(f"b{i}")
    client.delete("b0")
    client.reserve({"b8": block})
    client.commit("b8")


def test_tensor_larger_than_a_segment_gets_a_dedicated_segment_left_idle_on_delete(
        client: Any) -> None:
    value = torch.arange(5 * MiB, dtype=torch.int32)  # 20 MiB > 8 MiB segments
    client.put("big", value)
    cpu = client.stats()["tiers"]["cpu"]
    assert (cpu["num_dedicated_segments"], cpu["num_idle_dedicated_segments"]) == (1, 0)
    with client.get("big") as view:
        assert torch.equal(view, value)
    client.delete("big")
    cpu = client.stats()["tiers"]["cpu"]
    assert (cpu["num_dedicated_segments"], cpu["num_idle_dedicated_segments"]) == (0, 1)


def test_an_idle_dedicated_segment_serves_the_next_tensor_of_about_its_size(client: Any) -> None:
    client.put("big", torch.zeros(5 * MiB, dtype=torch.int32))  # 20 MiB
    client.delete("big")
    created = client.stats()["counters"]["tiers"]["segments_created"]
    value = torch.arange(5 * MiB - 1_001, dtype=torch.int32)  # a little smaller: still fits
    client.put("again", value)
    assert client.stats()["counters"]["tiers"]["segments_created"] == created
    with client.get("again") as view:
        assert torch.equal(view, value)


def test_an_idle_dedicated_segment_far_larger_than_a_tensor_is_retired_for_it(
        client: Any) -> None:
    client.put("big", torch.zeros(14 * MiB, dtype=torch.int32))  # 56 MiB of a 64 MiB tier
    client.delete("big")
    value = torch.arange(3 * MiB - 7, dtype=torch.int32)  # 12 MiB: a segment of its own
    client.put("smaller", value)
    cpu = client.stats()["tiers"]["cpu"]
    assert (cpu["num_dedicated_segments"], cpu["num_idle_dedicated_segments"]) == (1, 0)
    assert cpu["allocated_bytes"] <= 64 * MiB
    with client.get("smaller") as view:
        assert torch.equal(view, value)


def test_idle_dedicated_segments_give_their_budget_to_standard_tensors(client: Any) -> None:
    client.put("big", torch.zeros(10 * MiB, dtype=torch.int32))  # 40 MiB of a 64 MiB tier
    client.delete("big")
    for i in range(15):  # 60 MiB in 4 MiB tensors: the idle segment must go for them
        client.put(f"t{i}", torch.full((MiB - 3,), i, dtype=torch.int32))
    assert client.stats()["tiers"]["cpu"]["num_idle_dedicated_segments"] == 0
    for i in range(15):
        with client.get(f"t{i}") as view:
            assert bool((view == i).all())


def test_an_idle_dedicated_segment_becomes_standard_where_the_budget_has_no_room_for_one(
        client: Any) -> None:
    client.put("big", torch.zeros(5 * MiB, dtype=torch.int32))  # 20 MiB of a 64 MiB tier
    client.delete("big")  # its segment stays, idle
    values = [torch.full((MiB - 3,), i, dtype=torch.int32) for i in range(12)]  # 4 MiB each
    for i, value in enumerate(values[:11]):  # 44 MiB: all the budget the idle segment left
        client.put(f"t{i}", value)
    before = client.stats()
    client.put("t11", values[11])  # no budget left: the idle segment takes it, as it is
    after = client.stats()
    assert (after["counters"]["tiers"]["segments_created"]
            == before["counters"]["tiers"]["segments_created"])
    cpu = after["tiers"]["cpu"]
    assert cpu["segments_converted"] == before["tiers"]["cpu"]["segments_converted"] + 1
    assert cpu["num_idle_dedicated_segments"] == 0 and cpu["allocated_bytes"] <= 64 * MiB
    for i, value in enumerate(values):
        with client.get(f"t{i}") as view:
            assert torch.equal(view, value)


def test_an_emptied_standard_segment_becomes_the_dedicated_segment_of_a_tensor_its_size(
        client: Any) -> None:
    for i in range(16):  # the whole 64 MiB tier: two 4 MiB tensors in each 8 MiB segment
        client.put(f"t{i}", torch.full((MiB - 5,), i, dtype=torch.int32))
    client.delete("t0")
    client.delete("t1")  # the first segment is empty now
    before = client.stats()
    value = torch.arange(7 * MiB // 4 + 3, dtype=torch.int32)  # 7 MiB: over half a segment
    client.put("big", value)
    after = client.stats()
    assert (after["counters"]["tiers"]["segments_created"]
            == before["counters"]["tiers"]["segments_created"])
    cpu = after["tiers"]["cpu"]
    assert cpu["segments_converted"] == before["tiers"]["cpu"]["segments_converted"] + 1
    assert cpu["num_dedicated_segments"] == 1
    with client.get("big") as view:
        assert torch.equal(view, value)
    for i in range(2, 16):
        with client.get(f"t{i}") as view:
            assert bool((view == i).all())


def test_a_dedicated_segment_made_for_a_client_that_left_meanwhile_is_retired(
        daemon: RunningDaemon, client: Any) -> None:
    leaving = daemon.connect("leaving")
    # 40 MiB in a tier of 64: the reserve waits for a dedicated segment while it is created ...
    leaving._channel().send(next(leaving._request_ids), wire.Reserve((
        wire.ReserveItem("default", "big", "uint8", (40 * MiB,)),)), expect_reply=True)
    leaving.close()  # ... and its client says goodbye before it is served
    wait_until(lambda: client.stats()["tiers"]["cpu"]["growing_bytes"] == 0, timeout_s=10,
               what="the segment's creation to end")
    cpu = client.stats()["tiers"]["cpu"]
    assert cpu["num_dedicated_segments"] == 0 and cpu["num_idle_dedicated_segments"] == 0
    for i in range(7):  # the whole tier is there for the others
        client.put(f"t{i}", torch.zeros(7 * MiB, dtype=torch.uint8))


@pytest.mark.parametrize("dtype,shape", [
    (torch.float32, ()), (torch.uint8, (1,)), (torch.int8, (4097,)), (torch.bfloat16, (3, 333)),
    (torch.float16, (0, 5)), (torch.bool, (7, 1, 3)), (torch.complex64, (11,)),
    (torch.float64, (2, 3, 5, 7)), (torch.int64, (1023,)), (torch.float8_e4m3fn, (13,)),
])
def test_odd_sizes_and_dtypes_round_trip_bit_exactly(
        client: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * dtype.itemsize,),
                        dtype=torch.uint8, generator=torch.Generator().manual_seed(len(shape)))
    if dtype == torch.bool:
        raw %= 2  # other bytes are not valid bools, and copies normalise them
    value = raw[:torch.Size(shape).numel() * dtype.itemsize].view(dtype).reshape(shape)
    client.put("odd", value)
    with client.get("odd") as view:
        assert view.dtype == dtype and tuple(view.shape) == shape
        assert torch.equal(view.reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8))


def test_offsets_are_4k_aligned(client: Any) -> None:
    for i, size in enumerate((1, 4095, 4097, 10000)):
        client.put(f"a{i}", torch.zeros(size, dtype=torch.uint8))
    bases = {segment: start for segment, start, _ in client.segment_ranges()}
    for i in range(4):
        with client.get(f"a{i}") as view:
            offsets = [view.data_ptr() - base for base in bases.values()
                       if 0 <= view.data_ptr() - base]
            assert min(offsets) % 4096 == 0


def test_commit_publishes_a_new_version_while_the_reader_keeps_the_old(client: Any) -> None:
    old = torch.full((1000,), 1.0)
    new = torch.full((1000,), 2.0)
    first = client.put("v", old)
    with client.get("v") as held:
        second = client.put("v", new)
        assert second > first
        with client.get("v") as fresh:
            assert torch.equal(fresh, new)
        assert torch.equal(held, old)  # its bytes stay until the lease ends
        assert client.stats()["catalog"]["num_versions"] == 2
    assert client.stats()["catalog"]["num_versions"] == 1


def test_exclusive_lease_excludes_shared_ones_and_the_other_way_round(client: Any) -> None:
    client.put("x", torch.zeros(4))
    with client.get("x", exclusive=True) as writable:
        writable.add_(3)
        with pytest.raises(LeaseError, match="exclusively"):
            client.get("x")
    with client.get("x") as view:
        assert torch.equal(view, torch.full((4,), 3.0))
        with pytest.raises(LeaseError, match="shared lease"):
            client.get("x", exclusive=True)


def test_delete_keeps_a_leased_version_until_release(client: Any) -> None:
    client.put("d", torch.arange(10))
    lease = client.get("d")
    client.delete("d")
    assert not client.exists("d")
    assert torch.equal(lease.tensor, torch.arange(10))
    assert client.stats()["catalog"]["num_versions"] == 1
    lease.release()
    assert client.stats()["catalog"]["num_versions"] == 0
    assert client.stats()["tiers"]["cpu"]["used_bytes"] == 0


def test_abort_frees_the_reservation(client: Any) -> None:
    client.reserve({"r": (torch.float32, (1000,))})
    assert client.stats()["catalog"]["num_reservations"] == 1
    client.abort("r")
    stats = client.stats()
    assert stats["catalog"]["num_reservations"] == 0 and stats["tiers"]["cpu"]["used_bytes"] == 0


def test_second_reservation_of_the_same_name_by_one_client_is_a_lease_error(client: Any) -> None:
    client.reserve({"twice": (torch.float32, (2,))})
    with pytest.raises(LeaseError, match="commit or abort"):
        client.reserve({"twice": (torch.float32, (2,))})


def test_commit_without_a_reservation_is_a_lease_error(client: Any) -> None:
    with pytest.raises(LeaseError, match="reserve it first"):
        client.commit("never-reserved")


def test_empty_name_is_an_invalid_request(client: Any) -> None:
    with pytest.raises(InvalidRequestError, match="tensor name"):
        client.put("", torch.zeros(1))


def test_list_and_exists_see_only_their_namespace(client: Any) -> None:
    client.put_many({"layer.1": torch.zeros(2), "layer.0": torch.zeros(3, dtype=torch.int8),
                     "head": torch.zeros(1)}, namespace="m")
    client.put("layer.9", torch.zeros(1), namespace="other")
    infos = client.list(namespace="m", prefix="layer.")
    assert [(i.name, i.dtype, i.shape, i.nbytes, i.tier) for i in infos] == [
        ("layer.0", "int8", (3,), 3, "cpu"), ("layer.1", "float32", (2,), 8, "cpu")]
    assert client.exists_many(["head", "layer.9"], namespace="m") == [True, False]


def test_counters_follow_the_work_per_client(client: Any) -> None:
    client.put("c", torch.zeros(256))  # 1 KiB
    for _ in range(3):
        with client.get("c"):
            pass
    client.prefetch(["c"])
    stats = client.stats()
    me = next(c for c in stats["clients"] if c["name"] == "pytest")
    assert me["gets"] == 3 and me["get_bytes"] == 3 * 1024
    assert me["commits"] == 1 and me["commit_bytes"] == 1024
    assert me["prefetches"] == 1 and me["releases"] == 3
    assert stats["counters"]["ops"]["get"] == 3
    assert stats["catalog"]["namespaces"] == {"default": {"tensors": 1, "bytes": 1024}}


def test_poisoned_release_overwrites_freed_slices(
        daemon_factory: Callable[..., Any]) -> None:
    daemon = daemon_factory(**{"daemon.poison_released": True})
    client = daemon.connect()
    try:
        client.put("p", torch.ones(1024))
        stale = client.get("p")
        view = stale.tensor
        client.delete("p")
        stale.release()
        client.stats()  # the release has been served once this answers
        assert torch.isnan(view).all()  # the stale view shows poison, not plausible data
    finally:
        client.close()


def test_client_lets_go_of_a_retired_dedicated_segment_at_its_next_fetch(client: Any) -> None:
    client.put("big1", torch.zeros(3 * MiB, dtype=torch.int32))  # 12 MiB: a dedicated segment
    with client.get("big1"):
        pass
    first = {s for s, _, _ in client.segment_ranges()}
    client.delete("big1")  # its segment stays, idle; this client still maps it
    # 56 MiB: the idle segment is retired for its budget. The client maps the new one and
    # hears of the old.
    client.put("big2", torch.zeros(14 * MiB, dtype=torch.int32))
    now = {s for s, _, _ in client.segment_ranges()}
    retired = first - now
    assert len(retired) == 1 and len(now - first) == 1


def test_a_namespace_longer_than_one_listing_page_is_listed_whole_and_in_order(
        client: Any) -> None:
    count = wire.LIST_PAGE + 1021
    names = [f"t{i:06d}" for i in range(count)]
    empty = torch.empty(0)
    for start in range(0, count, 10_000):  # zero-byte tensors: no tier room needed
        client.put_many({name: empty for name in names[start:start + 10_000]})
    client.put("other", torch.ones(1))
    listed = client.list(prefix="t")
    assert [info.name for info in listed] == names


# --- cpu.create_at_start: the budget's segments made ahead ----------------------------------


def _made_ahead(daemon_factory: Callable[..., RunningDaemon]) -> Any:
    """A client of a daemon that makes its 64 MiB budget (8 MiB segments) at start, once all of
    it is made."""
    client = daemon_factory(**{"cpu.create_at_start": True}).connect("pytest")
    wait_until(lambda: client.stats()["tiers"]["cpu"]["blank_bytes"] == 64 * MiB, timeout_s=30,
               what="the budget's segments to be made ahead")
    return client


def test_with_create_at_start_the_budget_is_made_before_any_put_and_no_client_maps_it(
        daemon_factory: Callable[..., RunningDaemon]) -> None:
    client = _made_ahead(daemon_factory)
    cpu = client.stats()["tiers"]["cpu"]
    assert cpu["num_segments"] == 0 and cpu["allocated_bytes"] == 0  # not live: not handed out
    assert client.stats()["counters"]["tiers"]["segments_created"] == 0
    client.close()


def test_a_put_takes_a_segment_made_ahead_and_reads_back_what_it_wrote(
        daemon_factory: Callable[..., RunningDaemon]) -> None:
    client = _made_ahead(daemon_factory)
    values = [torch.full((MiB - 7,), i, dtype=torch.int32) for i in range(3)]  # 4 MiB each
    for i, value in enumerate(values):
        client.put(f"t{i}", value)
    cpu = client.stats()["tiers"]["cpu"]
    assert cpu["num_segments"] == 2 and cpu["blank_bytes"] == 48 * MiB
    assert client.stats()["counters"]["tiers"]["segments_created"] == 2
    for i, value in enumerate(values):
        with client.get(f"t{i}") as view:
            assert torch.equal(view, value)
    client.close()


def test_a_read_only_namespace_gets_a_segment_made_ahead_of_its_own_class(
        daemon_factory: Callable[..., RunningDaemon]) -> None:
    client = _made_ahead(daemon_factory)
    client.create_namespace("weights", mode="read-only")
    value = torch.arange(3 * MiB // 4 - 5, dtype=torch.int32)
    client.put("w", value, namespace="weights")
    client.put("x", torch.ones(11), namespace="scratch")
    cpu = client.stats()["tiers"]["cpu"]
    assert cpu["num_segments"] == 2 and cpu["num_read_only_segments"] == 1
    assert cpu["blank_bytes"] == 48 * MiB
    client.close()


def test_a_tensor_needing_a_segment_of_its_own_takes_the_budget_of_segments_made_ahead(
        daemon_factory: Callable[..., RunningDaemon]) -> None:
    client = _made_ahead(daemon_factory)
    value = torch.arange(13 * MiB // 4 + 1, dtype=torch.int32)  # 13 MiB: over half a segment
    client.put("big", value)
    cpu = client.stats()["tiers"]["cpu"]
    assert cpu["num_dedicated_segments"] == 1
    assert cpu["blank_bytes"] + cpu["allocated_bytes"] <= 64 * MiB
    assert cpu["blank_bytes"] >= 64 * MiB - 14 * MiB - 8 * MiB  # no more taken than it needs
    with client.get("big") as view:
        assert torch.equal(view, value)
    client.close()
