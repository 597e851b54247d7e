"""The request envelope: every operation by name (`REQUESTS`, the `Request` union), the
`multi` that carries several requests in one message, and the envelope itself,
[op, request_id, body, (releases)], encoded by `encode_request` and split again by
`decode_envelope` and `decode_body`. Which operations go unanswered (`NO_REPLY_OPS`) and which a
multi may carry (`MULTI_OPS`) are said here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence, Union

from infinity.errors import InvalidRequestError, ProtocolError

from .adam import AdamStep
from .telemetry import DeviceReport
from .codec import (MAX_ITEMS, MAX_MESSAGE_BYTES, _SEQ, _bad, _is_lease_id, _list, _pack, _short,
                    _unpack)
from .requests import (Abort, Attach, Bye, Commit, CommitDurable, CommitRenew, Delete, Detach,
                       Exists, FlushStore, Get, GetAhead, Heartbeat, Hello, ListTensors, Verify,
                       NamespaceOp, Prefetch, Release, Reserve, Shutdown, Stats, Step, StreamChunk,
                       StreamClose, StreamOpen, Upcoming)

# The requests a `multi` may carry: those of the data path. Not those about the session or the
# socket (hello, attach, detach, bye), the daemon (stats, shutdown, flush_store), nor those whose
# answer may be much larger than their request (list, upcoming): one small message must not
# make a reply of many megabytes.
MULTI_OPS = frozenset({"get", "get_ahead", "release", "reserve", "commit", "commit_renew",
                       "commit_durable", "abort", "prefetch", "delete", "exists", "heartbeat",
                       "step", "stream_open", "stream_chunk", "stream_close"})
MAX_MULTI_REQUESTS = 256


@dataclass(frozen=True, slots=True)
class Multi:
    """Several requests in one message, served in order, answered in one reply: one result per
    request, the list of its results (empty for a request that gets no reply alone), or the
    error that failed it as a whole. Each request has its own request id, as if sent alone (a
    get's names its lease), distinct within the message. They start in order, and each goes
    on as it would alone: a reserve that waits for CPU space makes its reservation when the
    room comes, maybe after the requests behind it were served. On the wire, each is [op, request_id,
    body]; decoding decodes each body by its own schema, so a malformed one fails the whole
    message. Build one with `Multi.of`; split its reply with `split_multi_reply`."""

    OP: ClassVar[str] = "multi"
    requests: tuple[tuple[int, Request], ...]  # (request id, request), in order

    def body(self) -> list[Any]:
        return [[message.OP, request_id, message.body()] for request_id, message in self.requests]

    @classmethod
    def of(cls, requests: Sequence[tuple[int, Request]]) -> Multi:
        """A multi of (request id, request) pairs; InvalidRequestError for one it may not carry."""
        if not 0 < len(requests) <= MAX_MULTI_REQUESTS:
            raise InvalidRequestError(
                f"a multi request carries 1 to {MAX_MULTI_REQUESTS} requests, not {len(requests)}; "
                f"split it")
        if len({request_id for request_id, _ in requests}) != len(requests):
            raise InvalidRequestError("the requests of a multi need distinct request ids")
        for request_id, message in requests:
            if message.OP not in MULTI_OPS:
                raise InvalidRequestError(
                    f"a multi request cannot carry a {message.OP} request; send it alone")
            if not _is_lease_id(request_id):
                raise InvalidRequestError(f"a request id is an integer in [1, 2**63), not "
                                          f"{_short(request_id)}")
            items = len(message.body())
            if items > MAX_ITEMS:
                raise InvalidRequestError(
                    f"a {message.OP} request carries {items} items, more than the {MAX_ITEMS} "
                    f"one request may; split the batch")
        return cls(tuple(requests))

    @classmethod
    def from_body(cls, body: Sequence[Any]) -> Multi:
        if not 0 < len(body) <= MAX_MULTI_REQUESTS:
            raise ProtocolError(f"malformed multi: it carries 1 to {MAX_MULTI_REQUESTS} requests, "
                                f"not {len(body)}")
        requests: list[tuple[int, Request]] = []
        seen: set[int] = set()
        for value in body:
            op, request_id, sub_body = _list(value, "multi request", 3)
            if type(op) is not str or op not in MULTI_OPS:
                raise ProtocolError(f"malformed multi: it cannot carry the operation {_short(op)}; "
                                    f"it carries {', '.join(sorted(MULTI_OPS))}")
            if not _is_lease_id(request_id) or request_id in seen:
                raise ProtocolError("malformed multi: each request's id must be an integer in "
                                    "[1, 2**63), distinct within the message")
            seen.add(request_id)
            requests.append((request_id, REQUESTS[op].from_body(
                _list(sub_body, f"multi {op} request body"))))
        return cls(tuple(requests))


Request = Union[Hello, Attach, Detach, Heartbeat, Bye, Stats, Shutdown, Get, Release, Reserve, Commit,
                CommitRenew, CommitDurable, FlushStore, StreamOpen, StreamChunk, StreamClose, Abort, Prefetch,
                Delete, Exists, ListTensors, Step, GetAhead, Upcoming, NamespaceOp, Multi, AdamStep,
                Verify, DeviceReport]

REQUESTS: dict[str, Any] = {cls.OP: cls for cls in (
    Hello, Attach, Detach, Heartbeat, Bye, Stats, Shutdown, Get, Release, Reserve, Commit, CommitRenew,
    CommitDurable, FlushStore, StreamOpen, StreamChunk, StreamClose, Abort, Prefetch, Delete, Exists,
    ListTensors, Step, GetAhead, Upcoming, NamespaceOp, Multi, AdamStep, Verify, DeviceReport)}

# Operations the daemon never answers (a client must not wait for them).
NO_REPLY_OPS = frozenset({"heartbeat", "release", "prefetch", "bye", "detach", "device_report"})


def encode_request(request_id: int, message: Request, releases: Sequence[int] = ()) -> bytes:
    """`releases`: shared-lease ids whose release rides along, served before the request.
    InvalidRequestError for a request the daemon would refuse to decode (too many items, too
    many bytes, a name that is not text): said here, before it costs a round trip or a
    connection."""
    body = message.body()
    if len(body) > MAX_ITEMS:
        raise InvalidRequestError(
            f"a {message.OP} request carries {len(body)} items, more than the {MAX_ITEMS} one "
            f"request may; split the batch")
    try:
        data = _pack([message.OP, request_id, body, list(releases)] if releases
                     else [message.OP, request_id, body])
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"a {message.OP} request holds a string that is not valid text ({exc.reason}: "
            f"{exc.object[exc.start:exc.end]!r}); use names without lone surrogates") from None
    if len(data) > MAX_MESSAGE_BYTES:
        raise InvalidRequestError(
            f"a {message.OP} request of {len(data)} bytes is larger than the {MAX_MESSAGE_BYTES} "
            f"one message may be; split the batch")
    return data


@dataclass(frozen=True, slots=True)
class Envelope:
    """A request split from its body: op, request id, body, and lease ids released with it."""

    op: str
    request_id: int
    body: Sequence[Any]
    releases: Sequence[int]


def decode_envelope(data: bytes) -> Envelope:
    """Split a request into its envelope; ProtocolError if it is not one."""
    value = _unpack(data, "request")
    if type(value) not in _SEQ or not 3 <= len(value) <= 4:
        raise ProtocolError("malformed request: expected [op, request_id, body, (releases)]")
    op, request_id, body = value[0], value[1], value[2]
    if type(request_id) is not int or not 0 < request_id < 1 << 63:
        raise ProtocolError("malformed request: request_id must be an integer in [1, 2**63)")
    if type(op) is not str or op not in REQUESTS:
        raise ProtocolError(f"unknown operation {_short(op)}; known: "
                            f"{', '.join(sorted(REQUESTS))}")
    if type(body) not in _SEQ:
        raise _bad(f"{op} request body", "a list", body)
    releases: Sequence[int] = ()
    if len(value) == 4:
        releases = _list(value[3], "piggybacked releases")
        for lease_id in releases:
            if not _is_lease_id(lease_id):
                raise _bad("piggybacked release", "a lease id (a get's request id)", lease_id)
    return Envelope(op, request_id, body, releases)


def decode_body(op: str, body: Sequence[Any]) -> Request:
    """The schema object for an envelope's body (op from `decode_envelope`)."""
    message: Request = REQUESTS[op].from_body(body)
    return message
