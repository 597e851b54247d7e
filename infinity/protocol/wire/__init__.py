"""The wire format between clients and infinityd: every message's schema and its msgpack codec.

This package is the only place that knows how a message looks in bytes. Both
sides build the dataclasses below and call `encode_*`; both sides decode with
`decode_*`, which validate the structure and raise `ProtocolError` (or
`VersionMismatchError`) for anything malformed, truncated or of the wrong shape.
No pickle: msgpack with hard limits on string, binary, array and map sizes, and
no extension types.

Control plane (ZeroMQ, one msgpack frame per message):

    request   [op: str, request_id: int > 0, body: list, (releases: [lease id, ...])]
              the optional releases are shared leases the client let go of since its
              last message: served first, exactly as a `release` request would be
    reply     ["reply", request_id, [result, ...]]     one result per request item, in order;
              a result is [None, value] or [error_code, message]
    error     ["error", request_id or 0, error_code, message]   the request as a whole failed

`multi` carries several requests in one message (a module's gets and its
gradients' puts, say): its body is a list of [op, request_id, body], each
served in order exactly as if sent alone (its own request id names its lease or
stream; one that waits, as a reserve for CPU space, does not hold back those
behind it), and answered in one reply whose results are one per request: [None,
[result, ...]] with that request's results (empty for one that gets no reply
alone), or [error_code, message] where that request as a whole failed.

`hello` is the first message of a session; its body starts with the protocol
version in every version of the protocol, so a mismatched client is told so.
`heartbeat`, `release`, `prefetch` and `bye` get no reply. Some replies come
late, when the daemon has finished work off its loop: a `get` of a tensor that
is only on NVMe (after the load), `commit_durable`, `flush_store` and a
`delete` of a flushed tensor (after the index transaction), stream chunks
(after their I/O).

Fd channel (a Unix SOCK_SEQPACKET socket, see `fdpass`): `FdRequest` asks for
the memfds of CPU-tier segments; `FdReply` carries them as SCM_RIGHTS
ancillary data, one fd per listed segment, in order.

Every caller imports this package, never its modules: `from infinity.protocol import wire`,
then `wire.Get`, `wire.encode_request`, `wire.PROTOCOL_VERSION`. Its modules, by job:

    codec       the protocol version, the hard limits, msgpack pack/unpack, the field checks
    requests    the request schemas of one operation each, and their per-item schemas
    adam        the `adam_step` request's schemas
    envelope    REQUESTS, the Request union, `multi`, encode_request / decode_envelope
    results     ItemError and the result schemas (Welcome, Placement, StreamInfo, ...)
    replies     reply encoding and decoding, a multi's reply split per request
    fdchannel   the fd channel's FdRequest and FdReply
    telemetry   the telemetry stream's TelemetrySnapshot (published, never requested), and
                DeviceReport (a client's GPU tier, sent with its heartbeats)
"""

from .adam import AdamGroup, AdamItem, AdamStep
from .codec import (LIST_PAGE, MAX_BIN_BYTES, MAX_ITEMS, MAX_MAP_ENTRIES, MAX_MESSAGE_BYTES,
                    MAX_NAME_CHARS, MAX_NAMESPACE_CHARS, MAX_PID, MAX_SECRET_BYTES, MAX_STR_BYTES,
                    MAX_TOKEN_CHARS, MIN_TOKEN_CHARS, PROTOCOL_VERSION)
from .envelope import (MAX_MULTI_REQUESTS, MULTI_OPS, NO_REPLY_OPS, REQUESTS, Envelope, Multi,
                       Request, decode_body, decode_envelope, encode_request)
from .fdchannel import FdReply, FdRequest, SegmentInfo
from .replies import (Reply, Result, decode_reply, decode_results, encode_error,
                      encode_multi_reply, encode_packed_reply, encode_packed_results, encode_reply,
                      encode_results, pack_result, split_multi_reply, split_reply)
from .requests import (MAX_UPCOMING_ENTRIES, NAMESPACE_ACTIONS, NAMESPACE_MODES, STEP_PHASES,
                       Abort, Attach, Bye, Commit, CommitDurable, CommitRenew, Delete, Detach,
                       Exists, FlushStore, Get, GetAhead, GetItem, Heartbeat, Hello, ListItem,
                       ListTensors, NamespaceOp, Prefetch, Release, Reserve, ReserveItem, Shutdown,
                       Stats, Step, StreamChunk, StreamClose, StreamOpen, TensorRef, Upcoming,
                       VERIFY_REPORTED, Verify)
from .results import (STEP_OUTCOMES, ItemError, NamespaceInfo, Placement, StepReport, StreamInfo,
                      TensorInfo, Welcome, decode_bool, decode_flush_summary, decode_infos,
                      decode_none, decode_renewed, decode_stats, decode_verify_summary,
                      decode_version)
from .telemetry import (TELEMETRY_SECTIONS, TELEMETRY_VERSION, DeviceFigures, DeviceReport,
                        TelemetrySnapshot)

__all__ = [
    "PROTOCOL_VERSION", "MAX_PID", "MAX_MESSAGE_BYTES", "MAX_ITEMS", "MAX_STR_BYTES",
    "MAX_BIN_BYTES", "MAX_MAP_ENTRIES", "MAX_NAME_CHARS", "MAX_NAMESPACE_CHARS", "LIST_PAGE",
    "MAX_SECRET_BYTES", "MIN_TOKEN_CHARS", "MAX_TOKEN_CHARS",
    "TensorRef", "GetItem", "ReserveItem", "ListItem", "Hello", "Attach", "Heartbeat", "Detach",
    "Bye", "Stats", "Shutdown", "Get", "Release", "Reserve", "Commit", "CommitRenew",
    "CommitDurable", "FlushStore", "StreamOpen", "StreamChunk", "StreamClose", "Abort", "Prefetch",
    "Delete", "Exists", "ListTensors", "Verify", "VERIFY_REPORTED", "STEP_PHASES", "Step", "GetAhead", "Upcoming",
    "MAX_UPCOMING_ENTRIES", "NAMESPACE_MODES", "NAMESPACE_ACTIONS", "NamespaceOp", "AdamGroup",
    "AdamItem", "AdamStep", "MULTI_OPS", "MAX_MULTI_REQUESTS", "Multi", "Request", "REQUESTS",
    "NO_REPLY_OPS", "encode_request", "Envelope", "decode_envelope", "decode_body", "ItemError",
    "STEP_OUTCOMES", "StepReport", "Welcome", "Placement", "StreamInfo", "TensorInfo",
    "NamespaceInfo", "decode_version", "decode_renewed", "decode_bool", "decode_none",
    "decode_infos", "decode_stats", "decode_flush_summary", "decode_verify_summary", "Result", "Reply", "encode_reply",
    "pack_result", "encode_packed_reply", "encode_results", "encode_packed_results",
    "encode_multi_reply", "split_multi_reply", "encode_error", "decode_reply", "split_reply",
    "decode_results", "SegmentInfo", "FdRequest", "FdReply", "TELEMETRY_VERSION",
    "TELEMETRY_SECTIONS", "TelemetrySnapshot", "DeviceFigures", "DeviceReport",
]
