"""Spare reservations: after a put of a name that was there before, the daemon leaves the client
a fresh slice of the same name, dtype and shape, so the next put of that tensor is one round
trip (no reserve)."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable

import pytest
import torch

from infinity.errors import InfinityError, LeaseError
from infinity.protocol import wire
from conftest import RunningDaemon, outcome_in_forked_child, wait_until

MiB = 1024 * 1024


def ops(client: Any) -> dict[str, int]:
    return dict(client.stats()["counters"]["ops"])


def spares(client: Any) -> tuple[int, int]:
    catalog = client.stats()["catalog"]
    return catalog["num_spare_reservations"], catalog["spare_bytes"]


def heartbeats(client: Any) -> int:
    (mine,) = [c for c in client.stats()["clients"] if c["id"] == client.client_id]
    return int(mine["heartbeats"])


def put_twice(client: Any, name: str, tensor: torch.Tensor) -> None:
    """The second put replaces a version: it leaves a spare."""
    client.put(name, tensor)
    client.put(name, tensor)


def test_a_put_of_a_new_name_leaves_no_spare(client: Any) -> None:
    client.put("once", torch.ones(5))
    assert spares(client) == (0, 0)


def test_a_put_after_a_put_that_replaced_a_version_sends_no_reserve(client: Any) -> None:
    first = torch.arange(1001.0)
    put_twice(client, "w", first)
    before = ops(client)
    client.put("w", first * 2)
    after = ops(client)
    assert after.get("reserve", 0) == before.get("reserve", 0)
    assert after["commit_renew"] - before["commit_renew"] == 1
    with client.get("w") as view:
        assert torch.equal(view, first * 2)


def test_the_spare_is_held_by_the_daemon_and_invisible_to_other_clients(
        daemon: RunningDaemon, client: Any) -> None:
    put_twice(client, "w", torch.ones(3, 5))
    assert spares(client) == (1, 4096)  # a slice is at least 4 KiB
    other = daemon.connect("reader")
    try:
        assert [info.name for info in other.list()] == ["w"]
        with other.get("w") as view:
            assert torch.equal(view, torch.ones(3, 5))
    finally:
        other.close()


def test_a_commit_without_a_reserve_does_not_publish_the_spare(client: Any) -> None:
    put_twice(client, "w", torch.full((7,), 3.0))
    with pytest.raises(LeaseError, match="no reservation"):
        client.commit("w")
    with client.get("w") as view:
        assert torch.equal(view, torch.full((7,), 3.0))
    assert spares(client) == (0, 0)


def test_reserve_hands_out_the_spare_and_commit_publishes_what_was_written(client: Any) -> None:
    put_twice(client, "g", torch.zeros(11))
    before = ops(client)
    views = client.reserve({"g": (torch.float32, (11,))})
    views["g"].fill_(5.0)
    client.commit("g")
    assert ops(client).get("reserve", 0) == before.get("reserve", 0)
    with client.get("g") as view:
        assert torch.equal(view, torch.full((11,), 5.0))


def test_a_put_of_another_shape_drops_the_spare_and_stores_the_new_tensor(client: Any) -> None:
    put_twice(client, "w", torch.ones(4))
    new = torch.arange(6.0).reshape(2, 3)
    client.put("w", new)
    with client.get("w") as view:
        assert torch.equal(view, new)
    assert spares(client) == (1, 4096)  # the spare now has the new shape


def test_abort_frees_the_spare(client: Any) -> None:
    put_twice(client, "w", torch.ones(9))
    client.abort("w")
    assert spares(client) == (0, 0)
    assert client.stats()["catalog"]["num_reservations"] == 0


def test_delete_frees_the_deleting_clients_spare(client: Any) -> None:
    put_twice(client, "w", torch.ones(9))
    client.delete("w")
    assert spares(client) == (0, 0)
    assert client.stats()["tiers"]["cpu"]["used_bytes"] == 0


def test_write_from_after_a_put_of_the_same_name_replaces_the_spare(client: Any) -> None:
    put_twice(client, "w", torch.ones(5))
    client.write_from("w", torch.full((5,), 2.0))
    with client.get("w") as view:
        assert torch.equal(view, torch.full((5,), 2.0))


def test_closing_the_client_frees_its_spares(daemon: RunningDaemon) -> None:
    writer = daemon.connect("writer")
    for _ in range(2):
        writer.put_many({"a": torch.ones(100), "b": torch.ones(3)})
    assert spares(writer) == (2, 2 * 4096)
    writer.close()
    observer = daemon.connect("observer")
    try:
        assert spares(observer) == (0, 0)
    finally:
        observer.close()


def test_spare_fraction_zero_turns_spares_off(daemon_factory: Callable[..., RunningDaemon]) -> None:
    client = daemon_factory(**{"cpu.spare_fraction": 0.0}).connect("t")
    try:
        put_twice(client, "w", torch.ones(13))
        before = ops(client)
        client.put("w", torch.ones(13))
        assert ops(client)["reserve"] - before["reserve"] == 1
        assert spares(client) == (0, 0)
    finally:
        client.close()


def test_spares_stay_within_their_share_of_the_tier(daemon_factory: Callable[..., RunningDaemon]) -> None:
    # 64 MiB tier in 8 MiB segments, an eighth for spares: two spares of 3 MiB fit, a third not.
    client = daemon_factory(**{"cpu.spare_fraction": 0.125}).connect("t")
    try:
        for i in range(4):
            put_twice(client, f"t{i}", torch.zeros(3 * MiB // 4 + 5))
        count, held = spares(client)
        assert count == 2 and held <= 8 * MiB
    finally:
        client.close()


def test_a_full_tier_takes_back_the_clients_spares_before_refusing_a_reserve(
        daemon_factory: Callable[..., RunningDaemon]) -> None:
    # 32 MiB in 8 MiB segments, up to 16 MiB of spares: each tensor of 3 MiB put twice gets a
    # segment and leaves its spare beside it; four fill the budget, 2 MiB free in each segment.
    client = daemon_factory(**{"cpu.budget_bytes": 32 * MiB, "cpu.spare_fraction": 0.5}).connect("t")
    try:
        block = 3 * MiB // 4
        for i in range(4):
            put_twice(client, f"k{i}", torch.full((block,), float(i)))
        assert spares(client) == (4, 12 * MiB)
        client.put("extra", torch.ones(block))  # fits only where a spare was
        with client.get("extra") as view:
            assert torch.equal(view, torch.ones(block))
        for i in range(4):
            with client.get(f"k{i}") as view:
                assert torch.equal(view, torch.full((block,), float(i)))
    finally:
        client.close()


def test_a_get_of_a_tensor_larger_than_a_segment_takes_back_the_clients_spares_first(
        daemon_factory: Callable[..., RunningDaemon]) -> None:
    # 48 MiB in 16 MiB segments behind NVMe: "big" (34 MiB) needs a segment of its own, made by
    # emptying standard ones, and the spares of s1 and s2 sit in those; nothing is leased.
    daemon = daemon_factory(nvme_tier=True, **{"cpu.budget_bytes": 48 * MiB,
                                                "cpu.segment_bytes": 16 * MiB,
                                                "cpu.spare_fraction": 0.5})
    with daemon.connect("t") as client:
        big = torch.full((34 * MiB,), 7, dtype=torch.uint8)
        client.put("big", big)
        for name in ("s1", "s2"):
            put_twice(client, name, torch.full((6 * MiB,), 3, dtype=torch.uint8))
        assert spares(client)[0] == 2
        assert {i.name: i.tier for i in client.list()}["big"] == "nvme"
        with client.get("big") as view:
            assert torch.equal(view, big)


def test_small_spares_are_charged_whole_4kib_slices(daemon_factory: Callable[..., RunningDaemon]) -> None:
    # 64 MiB x 0.001 = 67,108 bytes of spares: sixteen 4 KiB slices, whatever the tensors' size.
    client = daemon_factory(**{"cpu.spare_fraction": 0.001}).connect("t")
    try:
        for i in range(20):
            put_twice(client, f"s{i}", torch.ones(16))  # 64 bytes each
        assert spares(client) == (16, 16 * 4096)
    finally:
        client.close()


def test_a_put_many_whose_commit_fails_for_one_item_forgets_the_spares_it_was_left(
        daemon: RunningDaemon, client: Any) -> None:
    n = 4096
    put_twice(client, "a", torch.zeros(n))  # "a" has a spare
    client.put("b", torch.zeros(n))
    # The fault: "b"'s reservation gone when the commit arrives, as when another thread of the
    # client aborts it at that moment. The abort is a real request; only its timing is forced.
    real_call = client._call

    def call(message: Any, **kwargs: Any) -> Any:
        if isinstance(message, wire.CommitRenew):
            real_call(wire.Abort((wire.TensorRef("default", "b"),)))
        return real_call(message, **kwargs)

    client._call = call
    try:
        with pytest.raises(LeaseError):
            client.put_many({"a": torch.full((n,), 1.0), "b": torch.full((n,), 2.0)})
    finally:
        client._call = real_call
    assert spares(client) == (0, 0) and not client._spares
    other = daemon.connect("other")
    try:
        other.put("victim", torch.full((n,), 7.0))  # may get the slice the spare had
        client.put("a", torch.full((n,), 9.0))
        with other.get("victim") as view:
            assert torch.equal(view, torch.full((n,), 7.0))
        with client.get("a") as view:
            assert torch.equal(view, torch.full((n,), 9.0))
    finally:
        other.close()


def test_a_spare_older_than_half_the_client_timeout_is_not_written_into(
        daemon_factory: Callable[..., RunningDaemon]) -> None:
    daemon = daemon_factory(**{"daemon.client_timeout_s": 1.0, "daemon.heartbeat_interval_s": 0.25})
    frozen, other = daemon.connect("frozen"), daemon.connect("other")
    try:
        n = 4096
        put_twice(frozen, "a", torch.zeros(n))
        # A process stopped for longer than the timeout (no heartbeats) loses its session and
        # the daemon frees its spare; stopping the heartbeat thread stands in for the stop.
        frozen._heartbeat_stop.set()
        wait_until(lambda: all(c["name"] != "frozen" for c in other.stats()["clients"]),
                   timeout_s=10, what="the silent client's session to end")
        other.put("victim", torch.full((n,), 7.0))  # may get the slice the spare had
        with pytest.raises(InfinityError):
            frozen.put("a", torch.full((n,), 9.0))
        with other.get("victim") as view:
            assert torch.equal(view, torch.full((n,), 7.0))
    finally:
        frozen.close()
        other.close()


def test_a_spare_too_old_to_take_goes_back_to_the_daemon_while_the_client_lives(
        daemon_factory: Callable[..., RunningDaemon]) -> None:
    # A name put for the last time: nothing will ever take its spare.
    daemon = daemon_factory(**{"daemon.client_timeout_s": 1.0, "daemon.heartbeat_interval_s": 0.25})
    client = daemon.connect("t")
    try:
        put_twice(client, "last", torch.ones(4097))
        assert spares(client)[0] == 1
        wait_until(lambda: spares(client) == (0, 0), timeout_s=10,
                   what="the spare older than half the client timeout to be aborted")
        assert not client._spares
        client.put("last", torch.full((4097,), 3.0))  # reserves afresh
        with client.get("last") as view:
            assert torch.equal(view, torch.full((4097,), 3.0))
    finally:
        client.close()


def test_a_spare_young_enough_to_take_is_kept(daemon_factory: Callable[..., RunningDaemon]) -> None:
    # Half of a 60 s timeout: the spare outlives many heartbeats.
    daemon = daemon_factory(**{"daemon.client_timeout_s": 60.0, "daemon.heartbeat_interval_s": 0.05})
    client = daemon.connect("t")
    try:
        put_twice(client, "w", torch.ones(4097))
        wait_until(lambda: heartbeats(client) >= 5, timeout_s=10, what="five heartbeats")
        assert spares(client)[0] == 1
        before = ops(client)
        client.put("w", torch.full((4097,), 2.0))
        assert ops(client).get("reserve", 0) == before.get("reserve", 0)
    finally:
        client.close()


@contextlib.contextmanager
def giving_back_to_a_stopped_daemon(daemon: RunningDaemon, client: Any) -> Iterator[None]:
    """The heartbeat thread has taken a spare too old to keep and waits for the daemon, which
    is stopped (SIGSTOP), to answer its abort."""
    put_twice(client, "last", torch.ones(4097))
    daemon.process.send_signal(signal.SIGSTOP)
    try:
        wait_until(lambda: client._spares.returning, timeout_s=10,
                   what="the heartbeat thread to give the old spare back")
        yield
    finally:
        daemon.process.send_signal(signal.SIGCONT)


SLOW_DAEMON = {"daemon.client_timeout_s": 1.0, "daemon.heartbeat_interval_s": 0.25,
               "daemon.request_timeout_s": 30.0}


def test_close_does_not_wait_for_a_spare_given_back_to_a_stopped_daemon(
        daemon_factory: Callable[..., RunningDaemon]) -> None:
    daemon = daemon_factory(**SLOW_DAEMON)
    client = daemon.connect("t")
    with giving_back_to_a_stopped_daemon(daemon, client):
        started = time.monotonic()
        client.close()
        # The heartbeat's request ends within a tick, not at the 30 s request timeout.
        assert time.monotonic() - started < 10


def test_a_forked_child_is_refused_at_once_while_spares_are_given_back(
        daemon_factory: Callable[..., RunningDaemon]) -> None:
    daemon = daemon_factory(**SLOW_DAEMON)
    client = daemon.connect("t")
    with giving_back_to_a_stopped_daemon(daemon, client):
        outcome = outcome_in_forked_child(lambda: client.delete("last"))
    client.close()
    assert outcome == b"forked"


def test_a_put_of_a_name_whose_spare_is_being_given_back_waits_for_it_then_stores(
        daemon_factory: Callable[..., RunningDaemon]) -> None:
    daemon = daemon_factory(**SLOW_DAEMON)
    client = daemon.connect("t")
    with giving_back_to_a_stopped_daemon(daemon, client):
        putter = threading.Thread(target=client.put, args=("last", torch.full((4097,), 5.0)))
        putter.start()
    putter.join(30)  # the daemon runs again: the abort is answered, then the put reserves
    assert not putter.is_alive()
    with client.get("last") as view:
        assert torch.equal(view, torch.full((4097,), 5.0))
    client.close()
