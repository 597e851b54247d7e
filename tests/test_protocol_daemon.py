"""The protocol as a real infinityd speaks it, from raw ZeroMQ sockets: bad input gets a typed
error reply and the daemon keeps serving."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import msgpack
import psutil
import pytest
import torch
import zmq

from infinity.errors import InvalidRequestError, ProtocolError, VersionMismatchError
from infinity.protocol import wire
from infinity.protocol.paths import RuntimeLayout


class RawSocket:
    """A DEALER socket that speaks the protocol by hand (or fails to, on purpose)."""

    def __init__(self, daemon: Any) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 5000)
        self.sock.connect(RuntimeLayout(daemon.runtime_dir).control_endpoint)
        self.secret = RuntimeLayout(daemon.runtime_dir).read_secret()

    def send(self, data: bytes | list[bytes]) -> None:
        if isinstance(data, list):
            self.sock.send_multipart(data)
        else:
            self.sock.send(data)

    def recv(self) -> wire.Reply:
        return wire.decode_reply(self.sock.recv())

    def call(self, request_id: int, message: wire.Request) -> wire.Reply:
        self.send(wire.encode_request(request_id, message))
        return self.recv()

    def hello(self) -> wire.Welcome:
        reply = self.call(1, wire.Hello(wire.PROTOCOL_VERSION, "raw", os.getpid(),
                                        psutil.Process().create_time(), self.secret))
        assert reply.failure is None
        return wire.Welcome.from_wire(reply.results[0])

    def close(self) -> None:
        self.sock.close()
        self.context.term()


@pytest.fixture
def raw(daemon: Any) -> Iterator[RawSocket]:
    sock = RawSocket(daemon)
    try:
        yield sock
    finally:
        sock.close()


def _assert_daemon_serves(client: Any) -> None:
    value = torch.arange(5, dtype=torch.int16)
    client.put("alive", value)
    with client.get("alive") as view:
        assert torch.equal(view, value)


def _failure(reply: wire.Reply) -> Exception:
    assert reply.failure is not None, f"expected an error reply, got {reply}"
    return reply.failure.exception()


def test_malformed_bytes_get_a_protocol_error_and_the_daemon_keeps_serving(
        raw: RawSocket, client: Any) -> None:
    raw.send(b"\xc1 this is not msgpack")
    reply = raw.recv()
    assert reply.request_id == 0
    assert type(_failure(reply)) is ProtocolError
    _assert_daemon_serves(client)


def test_truncated_request_gets_a_protocol_error(raw: RawSocket, client: Any) -> None:
    raw.hello()
    data = wire.encode_request(9, wire.Get((wire.GetItem("default", "x"),)))
    raw.send(data[:-3])
    assert type(_failure(raw.recv())) is ProtocolError
    _assert_daemon_serves(client)


def test_request_of_the_wrong_shape_gets_a_protocol_error_naming_its_id(
        raw: RawSocket, client: Any) -> None:
    raw.hello()
    raw.send(msgpack.packb(["get", 42, [["default", "x"]]]))
    reply = raw.recv()
    assert reply.request_id == 42
    assert "get item" in str(_failure(reply))
    _assert_daemon_serves(client)


def test_a_list_request_of_several_pages_is_refused_and_the_daemon_keeps_serving(
        raw: RawSocket, client: Any) -> None:
    # One page per request: 3,000 pages of a namespace in one 18 KB request made an 82 MiB reply.
    client.put_many({f"t{i}": torch.ones(1) for i in range(50)})
    raw.hello()
    raw.send(msgpack.packb(["list", 7, [["default", "", ""]] * 3000]))
    reply = raw.recv()
    assert reply.request_id == 7 and "one request per page" in str(_failure(reply))
    assert len(client.list()) == 50
    _assert_daemon_serves(client)


def test_unknown_operation_gets_a_protocol_error(raw: RawSocket) -> None:
    raw.hello()
    raw.send(msgpack.packb(["teleport", 3, []]))
    assert "unknown operation" in str(_failure(raw.recv()))


def test_wrong_protocol_version_gets_a_version_mismatch(raw: RawSocket, client: Any) -> None:
    raw.send(msgpack.packb(["hello", 1, [wire.PROTOCOL_VERSION + 1, "future", os.getpid(), 0.0]]))
    error = _failure(raw.recv())
    assert type(error) is VersionMismatchError
    assert "restart" in str(error)
    _assert_daemon_serves(client)


def test_request_before_hello_is_refused(raw: RawSocket) -> None:
    reply = raw.call(3, wire.Get((wire.GetItem("default", "x"),)))
    assert reply.request_id == 3
    assert "hello" in str(_failure(reply))


def test_attach_with_an_unknown_token_is_refused(raw: RawSocket) -> None:
    assert "no open session" in str(_failure(raw.call(2, wire.Attach(b"\x00" * 16))))


def test_message_of_several_frames_is_refused(raw: RawSocket, client: Any) -> None:
    raw.send([b"one", b"two"])
    assert type(_failure(raw.recv())) is ProtocolError
    _assert_daemon_serves(client)


def test_many_requests_in_flight_on_one_socket_are_answered_by_id(
        raw: RawSocket, client: Any) -> None:
    client.put("inflight", torch.ones(3))
    raw.hello()
    for request_id in range(10, 30):
        raw.send(wire.encode_request(request_id, wire.Exists((wire.TensorRef("default", "inflight"),
                                                              wire.TensorRef("default", "no")))))
    replies = {reply.request_id: reply for reply in (raw.recv() for _ in range(20))}
    assert sorted(replies) == list(range(10, 30))
    assert all(reply.results == (True, False) for reply in replies.values())


def test_items_are_answered_one_by_one_with_errors_in_place(raw: RawSocket, client: Any) -> None:
    client.put("present", torch.zeros(2))
    raw.hello()
    reply = raw.call(5, wire.Get((wire.GetItem("default", "present"),
                                  wire.GetItem("default", "absent"),
                                  wire.GetItem("", "bad namespace"))))
    assert reply.failure is None and len(reply.results) == 3
    assert wire.Placement.from_wire(reply.results[0]).nbytes == 8
    assert [r.code for r in reply.results[1:]] == ["not_found", "invalid_request"]


def test_release_and_prefetch_get_no_reply(raw: RawSocket, client: Any) -> None:
    client.put("quiet", torch.zeros(2))
    raw.hello()
    raw.call(5, wire.Get((wire.GetItem("default", "quiet"),)))
    raw.send(wire.encode_request(6, wire.Release((5,))))  # a lease is named by its get's id
    raw.send(wire.encode_request(7, wire.Prefetch((wire.TensorRef("default", "quiet"),))))
    raw.send(wire.encode_request(8, wire.Heartbeat()))
    # The next reply to arrive answers request 9: nothing came back for 6, 7 and 8.
    assert raw.call(9, wire.Stats()).request_id == 9
    assert client.stats()["catalog"]["num_leases"] == 0


def test_a_storm_of_random_and_mutated_messages_never_stops_the_daemon(
        raw: RawSocket, client: Any) -> None:
    import random

    rng = random.Random(1234)
    raw.hello()
    messages: list[wire.Request] = [
        wire.Get((wire.GetItem("default", "x"),)), wire.Stats(),
        wire.Reserve((wire.ReserveItem("default", "r", "float32", (4,)),)),
        wire.Commit((wire.TensorRef("default", "r"),)), wire.ListTensors((wire.ListItem("d"),))]
    valid = [wire.encode_request(i + 10, m) for i, m in enumerate(messages)]
    sent = 0
    for _ in range(400):
        data = bytearray(rng.choice(valid))
        for _ in range(rng.randint(1, 4)):  # flip, cut or extend
            action = rng.random()
            if action < 0.5 and data:
                data[rng.randrange(len(data))] = rng.randrange(256)
            elif action < 0.75:
                del data[rng.randrange(len(data) + 1):]
            else:
                data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        raw.send(bytes(data))
        sent += 1
    # Every message gets at most one answer; draining them must not hang.
    raw.sock.setsockopt(zmq.RCVTIMEO, 200)
    answered = 0
    while True:
        try:
            raw.sock.recv()
            answered += 1
        except zmq.Again:
            break
    assert answered <= sent
    _assert_daemon_serves(client)
    assert client.stats()["counters"]["malformed"] > 0


def raw_hello(raw: RawSocket, *, pid: int, start_time_s: float, name: str = "raw") -> wire.Reply:
    raw.send(msgpack.packb(["hello", 1, [wire.PROTOCOL_VERSION, name, pid, start_time_s,
                                         raw.secret]]))
    return raw.recv()


def test_a_hello_with_a_pid_no_process_can_have_is_refused_and_opens_no_session(
        raw: RawSocket) -> None:
    reply = raw_hello(raw, pid=1 << 31, start_time_s=0.0)
    assert reply.failure is not None and reply.failure.code == ProtocolError.code
    assert "hello pid" in reply.failure.message
    raw.send(wire.encode_request(2, wire.Stats()))
    assert raw.recv().failure is not None  # still no session on this socket


@pytest.mark.parametrize("start_time_s", [float("nan"), float("inf")])
def test_a_hello_with_a_start_time_that_is_not_a_number_is_refused(
        raw: RawSocket, start_time_s: float) -> None:
    # NaN compared with the process's start time is never "too far": any pid would pass.
    reply = raw_hello(raw, pid=os.getpid(), start_time_s=start_time_s)
    assert reply.failure is not None and "not a finite number" in reply.failure.message


@pytest.mark.parametrize("message", [
    ["step", 2, ["ns", "p" * 65530]],
    [["x"] * 60000, 2, []],
    ["stream_open", 2, ["ns", "t", "m" * 65530, "", []]],
    ["reserve", 2, [["ns", "t", "d" * 65530, [1]]]],
], ids=["step phase", "operation", "stream mode", "dtype"])
def test_an_error_about_a_huge_field_quotes_it_short_enough_to_decode(
        raw: RawSocket, message: list[Any]) -> None:
    raw.hello()
    raw.send(msgpack.packb(message))
    reply = raw.recv()  # the decoder refuses strings past 64 KiB: the reply must stay under
    errors = [reply.failure] if reply.failure is not None else list(reply.results)
    assert errors and all(type(e) is wire.ItemError and len(e.message) < 1000 for e in errors)


def test_a_shape_with_a_zero_and_a_dimension_past_2_to_the_63_is_refused(
        raw: RawSocket, client: Any) -> None:
    raw.hello()
    raw.send(msgpack.packb(["reserve", 2, [["default", "evil", "float32", [0, (1 << 64) - 1]]]]))
    (result,) = raw.recv().results
    assert type(result) is wire.ItemError and "dimension of more than 2**50" in result.message
    assert not client.exists("evil")


def test_a_zero_element_shape_whose_strides_overflow_is_refused_and_the_daemon_keeps_serving(
        raw: RawSocket, client: Any) -> None:
    raw.hello()
    reply = raw.call(2, wire.Reserve((wire.ReserveItem("ns", "z", "uint8", (0, 2**40, 2**40)),)))
    (result,) = reply.results
    assert isinstance(result, wire.ItemError)
    assert isinstance(result.exception(), InvalidRequestError) and "strides" in result.message
    _assert_daemon_serves(client)
