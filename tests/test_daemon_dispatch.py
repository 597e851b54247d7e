"""Requests as the dispatcher serves them, against a real infinityd: several requests in one
message (`multi`), served in order, each as if sent alone, answered in one reply; and work the
daemon does for itself (a read stream's lease) held under its own identity, not a client's."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import msgpack
import psutil
import pytest
import torch
import zmq

from conftest import RunningDaemon, wait_until
from infinity.client.channel import Channel
from infinity.errors import InvalidRequestError, ProtocolError
from infinity.protocol import wire
from infinity.protocol.paths import RuntimeLayout

MiB = 1024 * 1024


class Session:
    """A bare session on one channel: hello, then whatever the test sends."""

    def __init__(self, daemon: RunningDaemon) -> None:
        self.context = zmq.Context()
        self.channel = Channel(self.context, RuntimeLayout(daemon.runtime_dir).control_endpoint,
                               timeout_s=10.0, daemon_gone=lambda: None)
        hello = self.channel.call(1, wire.Hello(
            wire.PROTOCOL_VERSION, "multi", os.getpid(), psutil.Process().create_time(),
            RuntimeLayout(daemon.runtime_dir).read_secret()))
        assert hello.failure is None
        self._ids = iter(range(2, 1 << 62))

    def next_id(self) -> int:
        return next(self._ids)

    def multi(self, *requests: wire.Request, releases: tuple[int, ...] = ()
              ) -> tuple[wire.Reply, ...]:
        ids = [(self.next_id(), message) for message in requests]
        return self.channel.call_multi(self.next_id(), ids, releases=releases)

    def close(self) -> None:
        self.channel.close()
        self.context.term()


@pytest.fixture
def bare(daemon: RunningDaemon) -> Iterator[Session]:
    session = Session(daemon)
    try:
        yield session
    finally:
        session.close()


def _get(*names: str) -> wire.Get:
    return wire.Get.for_names("default", names, False)


def _placement(result: Any) -> wire.Placement:
    return wire.Placement.from_wire(result)


def test_gets_and_a_reserve_in_one_message_are_answered_in_one_reply_as_each_alone(
        bare: Session, client: Any) -> None:
    client.put("w1", torch.ones(4))
    client.put("w2", torch.ones(8, dtype=torch.float64))
    get_w1, get_w2, reserve = bare.multi(
        _get("w1"), _get("w2", "absent"),
        wire.Reserve((wire.ReserveItem("default", "w1.grad", "float32", (4,)),)))
    assert get_w1.failure is None and _placement(get_w1.results[0]).nbytes == 16
    assert _placement(get_w2.results[0]).nbytes == 64
    assert type(get_w2.results[1]) is wire.ItemError and get_w2.results[1].code == "not_found"
    spare = _placement(reserve.results[0])
    assert spare.nbytes == 16 and spare.version == 0
    assert client.stats()["catalog"]["num_leases"] == 2


def test_each_get_of_a_multi_holds_a_lease_named_by_its_own_request_id(
        bare: Session, client: Any) -> None:
    client.put("w", torch.ones(2))
    first, second = bare.multi(_get("w"), _get("w"))
    assert client.stats()["catalog"]["num_leases"] == 2
    (released,) = bare.multi(wire.Release((first.request_id,)))
    assert released.failure is None and released.results == ()  # a release gets no results
    assert client.stats()["catalog"]["num_leases"] == 1
    bare.multi(wire.Exists((wire.TensorRef("default", "w"),)), releases=(second.request_id,))
    assert client.stats()["catalog"]["num_leases"] == 0


def test_requests_of_a_multi_are_served_in_order(bare: Session, client: Any) -> None:
    (reserved,) = bare.multi(wire.Reserve((wire.ReserveItem("default", "fresh", "int16", (3,)),)))
    unseen, committed, seen = bare.multi(
        wire.Exists((wire.TensorRef("default", "fresh"),)),
        wire.Commit((wire.TensorRef("default", "fresh"),)),
        wire.Exists((wire.TensorRef("default", "fresh"),)))
    assert reserved.failure is None and type(committed.results[0]) is int
    assert unseen.results == (False,) and seen.results == (True,)
    assert client.exists("fresh")


def test_a_request_of_a_multi_that_fails_as_a_whole_fails_alone(
        bare: Session, client: Any) -> None:
    client.put("kept", torch.ones(1))
    before, durable, after = bare.multi(
        wire.Exists((wire.TensorRef("default", "kept"),)),
        wire.CommitDurable((wire.TensorRef("default", "kept"),)),  # this daemon has no NVMe tier
        wire.Exists((wire.TensorRef("default", "kept"),)))
    assert before.results == after.results == (True,)
    assert durable.failure is not None and type(durable.failure.exception()) is InvalidRequestError
    assert "no NVMe tier" in durable.failure.message


def test_a_multi_waits_for_a_request_answered_after_work_off_the_loop(
        nvme_daemon: RunningDaemon) -> None:
    session = Session(nvme_daemon)
    client = nvme_daemon.connect("writer")
    try:
        value = torch.arange(MiB // 4, dtype=torch.int32)
        client.put("cold", value)
        for i in range(12):  # an 8 MiB CPU tier: "cold" goes to NVMe
            client.put(f"filler{i}", torch.full((MiB // 4,), i, dtype=torch.int32))
        wait_until(lambda: client.stats()["tiers"]["cpu"]["evictions_writing_back"] == 0,
                   timeout_s=10, what="the evictions' write-backs to end")
        assert [i.tier for i in client.list() if i.name == "cold"] == ["nvme"]
        loads = client.stats()["counters"]["tiers"]["reloads"]
        got, seen = session.multi(_get("cold"), wire.Exists((wire.TensorRef("default", "cold"),)))
        assert got.failure is None and _placement(got.results[0]).nbytes == MiB
        assert seen.results == (True,)
        assert client.stats()["counters"]["tiers"]["reloads"] == loads + 1
    finally:
        client.close()
        session.close()


def test_a_multi_that_carries_a_request_it_may_not_is_refused_whole(
        bare: Session, client: Any) -> None:
    with pytest.raises(InvalidRequestError, match="cannot carry a list request"):
        wire.Multi.of([(5, wire.ListTensors((wire.ListItem("default"),)))])
    bare.channel.sock.send(msgpack.packb(["multi", 9, [["exists", 10, [["default", "x"]]],
                                                       ["list", 11, [["default", "", ""]]]]]))
    reply = bare.channel.wait(9, what="multi")
    assert reply.failure is not None and type(reply.failure.exception()) is ProtocolError
    assert "cannot carry the operation 'list'" in reply.failure.message
    client.put("still", torch.ones(1))
    assert client.exists("still")


def _my_leases(client: Any, name: str) -> int:
    (me,) = [c for c in client.stats()["clients"] if c["name"] == name]
    return int(me["leases"])


def test_a_read_streams_lease_is_the_daemons_own_and_no_release_of_the_client_ends_it(
        bare: Session, client: Any) -> None:
    client.put("streamed", torch.ones(16))
    stream_id = bare.next_id()
    opened = bare.channel.call(stream_id, wire.StreamOpen("default", "streamed", "read"))
    info = wire.StreamInfo.from_wire(opened.results[0])
    assert client.stats()["catalog"]["num_leases"] == 1 and _my_leases(client, "multi") == 0
    bare.channel.send(bare.next_id(), wire.Release((stream_id,)), expect_reply=False)
    assert client.stats()["catalog"]["num_leases"] == 1  # the release named no lease of the client
    closed = bare.channel.call(bare.next_id(), wire.StreamClose(info.stream_id))
    assert closed.results == (info.version,)
    assert client.stats()["catalog"]["num_leases"] == 0


def test_a_read_stream_left_open_by_a_client_that_ends_gives_its_lease_back(
        daemon: RunningDaemon, client: Any) -> None:
    client.put("streamed", torch.ones(16))
    session = Session(daemon)
    session.channel.call(session.next_id(), wire.StreamOpen("default", "streamed", "read"))
    assert client.stats()["catalog"]["num_leases"] == 1
    session.channel.send(session.next_id(), wire.Bye(), expect_reply=False)
    wait_until(lambda: client.stats()["catalog"]["num_leases"] == 0, timeout_s=10,
               what="the stream's lease to go with its client")
    session.close()
