"""The wire format on its own: every schema round-trips, and bad bytes become typed errors."""

from __future__ import annotations

import msgpack
import pytest

from infinity import errors
from infinity.errors import (InvalidRequestError, NotFoundError, ProtocolError,
                             VersionMismatchError)
from infinity.protocol import dtypes, wire

REQUESTS: list[wire.Request] = [
    wire.Hello(wire.PROTOCOL_VERSION, "trainer", 1234, 1700000000.25, bytes(range(32))),
    wire.Attach(b"\x01" * 16),
    wire.Detach(),
    wire.Heartbeat(),
    wire.Bye(),
    wire.Stats(),
    wire.Shutdown(),
    wire.Get((wire.GetItem("ns", "a"), wire.GetItem("ns", "b", True))),
    wire.Release((3, 4, 5)),
    wire.Reserve((wire.ReserveItem("ns", "g", "bfloat16", (3, 0, 7)),
                  wire.ReserveItem("ns", "s", "float32", ()))),
    wire.Commit((wire.TensorRef("ns", "g"),)),
    wire.CommitRenew((wire.TensorRef("ns", "g"), wire.TensorRef("ns", "h"))),
    wire.CommitDurable((wire.TensorRef("ns", "g"), wire.TensorRef("ns", "h"))),
    wire.FlushStore(),
    wire.Verify(),
    wire.StreamOpen("ns", "big", "write", "float16", (1 << 20, 4096)),
    wire.StreamOpen("ns", "big", "read"),
    wire.StreamChunk(9, 1, 8 << 20, 3 << 20),
    wire.StreamClose(9, True, True),
    wire.Abort((wire.TensorRef("ns", "g"),)),
    wire.Prefetch((wire.TensorRef("ns", "x"), wire.TensorRef("ns", "y"))),
    wire.Delete((wire.TensorRef("ns", "x"),)),
    wire.Exists((wire.TensorRef("ns", "x"),)),
    wire.ListTensors((wire.ListItem("ns", "layer."),)),
    wire.Step("ns", "begin"),
    wire.GetAhead((wire.GetItem("ns", "next"),)),
    wire.Upcoming("ns", 16, 1 << 30),
    wire.NamespaceOp("create", "model", "read-only", 1 << 30),
    wire.NamespaceOp("create", "job", "read-write", 0, "t" * 32),
    wire.NamespaceOp("grant", "job", token="t" * 32),
    wire.AdamStep("model", (wire.AdamGroup(1e-3, 0.9, 0.999, 1e-8, 0.01, True, 1.0),),
                  (wire.AdamItem("w", "w.grad", "w.master", "w.exp_avg", "w.exp_avg_sq", 0, 3),)),
    wire.AdamStep("model", (wire.AdamGroup(1e-3, 0.9, 0.999, 1e-8, 0.01, True, 1.0),),
                  (wire.AdamItem("w", "w.grad", "", "w.exp_avg", "w.exp_avg_sq", 0, 4),),
                  speculative=True),
    wire.DeviceReport((wire.DeviceFigures("cuda:0", 8 << 30, 1 << 30, 2 << 30, 5, 1, 2, 3, 0,
                                          3 << 30), wire.DeviceFigures("cpu"))),
    wire.Multi.of([(78, wire.Get((wire.GetItem("ns", "w"),))),
                   (79, wire.Reserve((wire.ReserveItem("ns", "w.grad", "float32", (4,)),))),
                   (80, wire.Release((3,)))]),
]


def _decode(data: bytes) -> tuple[int, wire.Request]:
    envelope = wire.decode_envelope(data)
    return envelope.request_id, wire.decode_body(envelope.op, envelope.body)


@pytest.mark.parametrize("message", REQUESTS, ids=lambda m: m.OP)
def test_every_request_round_trips_through_its_schema(message: wire.Request) -> None:
    assert _decode(wire.encode_request(77, message)) == (77, message)


def test_releases_ride_along_with_any_request() -> None:
    envelope = wire.decode_envelope(wire.encode_request(3, wire.Stats(), [7, 8]))
    assert (envelope.op, envelope.request_id, envelope.releases) == ("stats", 3, (7, 8))
    assert not wire.decode_envelope(wire.encode_request(3, wire.Stats())).releases
    with pytest.raises(ProtocolError):
        wire.decode_envelope(msgpack.packb(["stats", 3, [], ["x"]]))


def test_a_commit_renew_result_is_a_version_and_a_spare_placement_or_none() -> None:
    spare = wire.Placement(2, 8192, 44, "float32", (11,), 0)
    assert wire.decode_renewed([7, spare.to_wire()]) == (7, spare)
    assert wire.decode_renewed([8, None]) == (8, None)
    for bad in ([7], [7, [1, 2]], ["7", None], 7):
        with pytest.raises(ProtocolError):
            wire.decode_renewed(bad)


def test_every_operation_has_exactly_one_schema() -> None:
    assert sorted(wire.REQUESTS) == sorted({m.OP for m in REQUESTS})
    assert wire.NO_REPLY_OPS <= set(wire.REQUESTS)


def test_hello_of_another_version_is_a_version_mismatch_whatever_else_it_carries() -> None:
    data = msgpack.packb(["hello", 1, [wire.PROTOCOL_VERSION + 1, "x", "not a pid", None, 5]])
    with pytest.raises(VersionMismatchError, match="protocol"):
        _decode(data)


def test_truncated_request_is_a_protocol_error() -> None:
    data = wire.encode_request(5, REQUESTS[6])
    for cut in (1, len(data) // 2, len(data) - 1):
        with pytest.raises(ProtocolError):
            _decode(data[:cut])


def test_bytes_that_are_not_msgpack_are_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="msgpack"):
        _decode(b"\xc1\xc1\xc1")


def test_trailing_bytes_after_a_message_are_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        _decode(wire.encode_request(5, wire.Stats()) + b"\x00")


@pytest.mark.parametrize("value", [
    ["get", 1],                                  # too few fields
    ["get", 0, []],                              # request id must be positive
    ["get", "1", []],                            # request id must be an integer
    ["fly", 1, []],                              # unknown operation
    ["get", 1, {"a": 1}],                        # body must be a list
    ["get", 1, [["ns", "a"]]],                   # get item needs three fields
    ["get", 1, [["ns", 7, False]]],              # name must be a string
    ["get", 1, [["ns", "a", 1]]],                # exclusive must be a bool
    ["reserve", 1, [["ns", "a", "float32", [2, "3"]]]],
    ["release", 1, ["seven"]],
    ["stats", 1, [1]],
    ["step", 1, ["ns", "middle"]],               # a step begins or ends
    ["step", 1, ["", "begin"]],                  # the namespace must not be empty
    ["hello", 1, [wire.PROTOCOL_VERSION, "x", 0, 1.0, b""]],  # pid must be positive
    ["hello", 1, [wire.PROTOCOL_VERSION, "x", 1, 1.0, b"s" * 65]],  # a secret is short
    ["hello", 1, [wire.PROTOCOL_VERSION, "x", 1, 1.0]],  # version 9 carries a secret
])
def test_wrong_structure_is_a_protocol_error(value: list[object]) -> None:
    with pytest.raises(ProtocolError):
        _decode(msgpack.packb(value))


def test_step_report_round_trips_and_refuses_an_unknown_outcome() -> None:
    report = wire.StepReport("replayed", 12, {"prefetch_hits": 11, "stall_s": 0.25})
    assert wire.StepReport.from_wire(msgpack.unpackb(msgpack.packb(report.to_wire()))) == report
    with pytest.raises(ProtocolError, match="outcome"):
        wire.StepReport.from_wire(["guessed", 1, {}])


def test_extension_types_are_refused() -> None:
    data = msgpack.packb(["get", 1, [msgpack.ExtType(5, b"abc")]])
    with pytest.raises(ProtocolError):
        _decode(data)


def test_arrays_beyond_the_item_limit_are_refused() -> None:
    data = msgpack.packb(["release", 1, list(range(wire.MAX_ITEMS + 1))])
    with pytest.raises(ProtocolError):
        _decode(data)


def test_reply_results_decode_to_values_and_typed_errors() -> None:
    placement = wire.Placement(2, 8192, 12, "float32", (3,), 4)
    data = wire.encode_reply(11, [placement.to_wire(),
                                  wire.ItemError.of(NotFoundError("no tensor 'x'"))])
    reply = wire.decode_reply(data)
    assert reply.request_id == 11 and reply.failure is None
    assert wire.Placement.from_wire(reply.results[0]) == placement
    error = reply.results[1]
    assert isinstance(error, wire.ItemError)
    raised = error.exception()
    assert type(raised) is NotFoundError and "no tensor" in str(raised)


def test_error_reply_carries_the_request_id_and_the_code() -> None:
    reply = wire.decode_reply(wire.encode_error(12, wire.ItemError("version", "upgrade")))
    assert reply.request_id == 12 and reply.results == ()
    assert reply.failure is not None and type(reply.failure.exception()) is VersionMismatchError


@pytest.mark.parametrize("value", [
    wire.Welcome(1, 2, b"t", 3, "0.1.0", 1.0, 5.0),
    wire.Placement(-1, 0, 0, "bool", (0, 4), 1),
    wire.TensorInfo("ns", "a", "int8", (5,), 5, 3, "cpu"),
    wire.StreamInfo(7, 5 << 20, "uint8", (5 << 20,), 0, False, 4 << 20,
                    (wire.Placement(2, 4096, 4 << 20, "uint8", (4 << 20,), 0),
                     wire.Placement(3, 0, 4 << 20, "uint8", (4 << 20,), 0))),
])
def test_result_schemas_round_trip(value: object) -> None:
    decoded = msgpack.unpackb(msgpack.packb(value.to_wire()))  # type: ignore[attr-defined]
    assert type(value).from_wire(decoded) == value  # type: ignore[attr-defined]


def test_fd_channel_messages_round_trip() -> None:
    request = wire.FdRequest(b"token", (1, 5))
    assert wire.FdRequest.decode(request.encode()) == request
    assert wire.FdRequest.decode(wire.FdRequest(b"t", None).encode()).want is None
    reply = wire.FdReply((wire.SegmentInfo(1, 4096), wire.SegmentInfo(2, 8192)), (7,), True,
                         wire.ItemError("lease", "no"))
    assert wire.FdReply.decode(reply.encode()) == reply


def test_every_error_code_names_exactly_one_class() -> None:
    codes = errors.all_codes()
    assert len(set(codes.values())) == len(codes)
    for code, cls in codes.items():
        assert cls.code == code
        assert type(errors.error_from_code(code, "m")) is cls


def test_nbytes_follow_dtype_and_shape() -> None:
    assert dtypes.tensor_nbytes("bfloat16", (3, 5)) == 30
    assert dtypes.tensor_nbytes("complex128", ()) == 16
    assert dtypes.tensor_nbytes("float32", (7, 0)) == 0
    assert dtypes.contiguous_strides((2, 3, 4)) == (12, 4, 1)


@pytest.mark.parametrize("dtype,shape", [("float33", (1,)), ("float32", (-1,)),
                                         ("float32", (1,) * 33), ("uint8", (1 << 40, 1 << 20))])
def test_bad_dtype_or_shape_is_an_invalid_request(dtype: str, shape: tuple[int, ...]) -> None:
    with pytest.raises(InvalidRequestError):
        dtypes.tensor_nbytes(dtype, shape)


@pytest.mark.parametrize("count", [0, 1, 15, 16, 33, 65_536])
def test_a_reply_joined_from_packed_results_is_the_same_bytes(count: int) -> None:
    placements = [wire.Placement(i % 3, 4096 * i, 4 * i + 1, "float32", (i + 1,), 7 + i).to_wire()
                  for i in range(count)]
    joined = wire.encode_packed_reply(2**40 + 3, [wire.pack_result(p) for p in placements])
    assert joined == wire.encode_reply(2**40 + 3, placements)
    reply = wire.decode_reply(joined)
    assert reply.request_id == 2**40 + 3
    assert [wire.Placement.from_wire(r) for r in reply.results] == [wire.Placement.from_wire(p) for p in placements]


@pytest.mark.parametrize("request_id", [1, 127, 128, 255, 65_535, 65_536, 2**32, 2**63 - 1])
def test_split_reply_reads_the_request_id_and_leaves_the_results_packed(request_id: int) -> None:
    results = [wire.Placement(1, 4096, 8, "int64", (1,), 5).to_wire(), 7]
    data = wire.encode_reply(request_id, results)
    split = wire.split_reply(data)
    assert split is not None and split[0] == request_id
    assert wire.decode_results(split[1]) == wire.decode_reply(data).results


def test_split_reply_declines_error_replies_and_malformed_bytes() -> None:
    error = wire.encode_error(9, wire.ItemError("not_found", "no tensor 'w'"))
    assert wire.split_reply(error) is None
    assert wire.split_reply(b"") is None
    assert wire.split_reply(wire.encode_reply(5, [])[:6]) is None
    with pytest.raises(ProtocolError):
        wire.decode_results(b"\xc1")


@pytest.mark.parametrize("body", [["", 4, 100], ["ns", 0, 100], ["ns", 5000, 100], ["ns", 4, 0],
                                  ["ns", "4", 100], ["ns", 4]])
def test_a_malformed_upcoming_is_a_protocol_error(body: list) -> None:
    with pytest.raises(ProtocolError):
        _decode(msgpack.packb(["upcoming", 5, body]))


def test_a_placement_carries_its_count_of_edits_and_a_short_or_negative_one_is_refused() -> None:
    placement = wire.Placement(3, 8192, 40, "float32", (10,), 9, 4)
    assert wire.Placement.from_wire(placement.to_wire()) == placement
    with pytest.raises(ProtocolError):
        wire.Placement.from_wire([3, 8192, 40, "float32", [10], 9])  # the first protocol's six
    with pytest.raises(ProtocolError):
        wire.Placement.from_wire([3, 8192, 40, "float32", [10], 9, -1])


def test_releases_of_ids_no_get_could_have_are_malformed() -> None:
    for bad in (0, -3, 2**63):
        with pytest.raises(ProtocolError):
            wire.Release.from_body([bad])
        with pytest.raises(ProtocolError):
            wire.decode_envelope(msgpack.packb(["exists", 1, [], [bad]]))


def test_a_step_namespace_with_a_nul_is_malformed_as_a_tensors_would_be() -> None:
    with pytest.raises(ProtocolError, match="without NUL"):
        wire.Step.from_body(["model\x00a", "begin"])


def test_a_multi_reply_splits_into_the_replies_each_request_would_have_had_alone() -> None:
    placement = wire.Placement(1, 4096, 8, "float32", (2,), 3).to_wire()
    parts = [wire.encode_packed_results([wire.pack_result(placement)]),
             wire.encode_results([True, wire.ItemError("not_found", "no such tensor")]),
             wire.ItemError("invalid_request", "no NVMe tier"),
             wire.encode_results([])]
    reply = wire.decode_reply(wire.encode_multi_reply(40, parts))
    got, seen, durable, released = wire.split_multi_reply(reply, [41, 42, 43, 44])
    assert (got.request_id, wire.Placement.from_wire(got.results[0]).version) == (41, 3)
    assert seen.results == (True, wire.ItemError("not_found", "no such tensor"))
    assert durable.failure == wire.ItemError("invalid_request", "no NVMe tier")
    assert released == wire.Reply(44, ())


def test_a_multi_that_failed_as_a_whole_fails_each_of_its_requests() -> None:
    failure = wire.ItemError("protocol", "malformed multi")
    replies = wire.split_multi_reply(wire.Reply(40, (), failure), [41, 42])
    assert [r.failure for r in replies] == [failure, failure]


@pytest.mark.parametrize("body", [
    [],
    [["list", 5, [["ns", "", ""]]]],
    [["multi", 5, []]],
    [["hello", 5, [wire.PROTOCOL_VERSION, "x", 1, 0.0]]],
    [["exists", 5, [["ns", "a"]]], ["exists", 5, [["ns", "b"]]]],
    [["exists", 0, [["ns", "a"]]]],
    [["exists", 5]],
    [["step", 5, ["ns", "sideways"]]],
], ids=["empty", "list", "nested", "hello", "same ids", "id 0", "no body", "bad body"])
def test_a_malformed_multi_is_refused_whole(body: list[object]) -> None:
    with pytest.raises(ProtocolError):
        _decode(msgpack.packb(["multi", 4, body]))


def test_a_multi_the_daemon_would_refuse_is_refused_before_sending() -> None:
    exists = wire.Exists((wire.TensorRef("ns", "a"),))
    for requests in ([], [(5, exists), (5, exists)], [(5, wire.Stats())], [(0, exists)]):
        with pytest.raises(InvalidRequestError):
            wire.Multi.of(requests)


def test_an_adam_item_naming_a_group_the_request_lacks_is_malformed() -> None:
    body = wire.AdamStep("ns", (wire.AdamGroup(1e-3, 0.9, 0.999, 1e-8, 0.0, True, 1.0),),
                         (wire.AdamItem("w", "w.grad", "", "m", "v", 1, 1),)).body()
    with pytest.raises(ProtocolError, match="names group 1 of 1; send every group"):
        wire.AdamStep.from_body(body)


def test_an_adam_step_counts_from_one() -> None:
    body = wire.AdamStep("ns", (wire.AdamGroup(1e-3, 0.9, 0.999, 1e-8, 0.0, True, 1.0),),
                         (wire.AdamItem("w", "w.grad", "", "m", "v", 0, 0),)).body()
    with pytest.raises(ProtocolError, match="below 1"):
        wire.AdamStep.from_body(body)
