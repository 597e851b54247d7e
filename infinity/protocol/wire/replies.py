"""Replies: a request's results (each [None, value] or [error_code, message]) in its reply,
["reply", request_id, results], or the error that failed the request as a whole, ["error",
request_id, code, message]; encoded by the daemon (from values, or from results it packed once),
decoded by the client, and a `multi`'s reply split into the replies its requests would have had.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, Union, cast

from infinity.errors import ProtocolError

from .codec import _SEQ, _int, _list, _pack, _str, _unpack
from .results import ItemError

Result = Union[ItemError, Any]


@dataclass(frozen=True, slots=True)
class Reply:
    """A decoded reply: results item by item, or `failure` when the whole request failed."""

    request_id: int
    results: tuple[Result, ...]
    failure: ItemError | None = None


def encode_reply(request_id: int, results: Sequence[Result]) -> bytes:
    """`results` holds wire values (from `to_wire()` or plain scalars) and ItemErrors."""
    wire = [[r.code, r.message] if type(r) is ItemError else [None, r] for r in results]
    return _pack(["reply", request_id, wire])


_REPLY_HEAD = b"\x93" + _pack("reply")  # a reply is an array of 3 that starts with "reply"


def pack_result(value: Any) -> bytes:
    """One successful result in its reply form, packed once: `encode_packed_reply` joins them.
    The daemon keeps each resident version's placement this way, as every get answers with it."""
    return _pack([None, value])


def encode_packed_reply(request_id: int, packed: Sequence[bytes]) -> bytes:
    """The same bytes as `encode_reply(request_id, results)` for results packed by `pack_result`."""
    return b"".join((_REPLY_HEAD, _pack(request_id), _array_header(len(packed)), *packed))


def _array_header(count: int) -> bytes:
    """The msgpack header of an array of `count` values."""
    if count < 16:
        return bytes((0x90 | count,))
    if count < 1 << 16:
        return b"\xdc" + count.to_bytes(2, "big")
    return b"\xdd" + count.to_bytes(4, "big")


def encode_results(results: Sequence[Result]) -> bytes:
    """One request's results packed as a `multi` reply carries them (`encode_multi_reply`)."""
    return _pack([[r.code, r.message] if type(r) is ItemError else [None, r] for r in results])


def encode_packed_results(packed: Sequence[bytes]) -> bytes:
    """As `encode_results`, for results packed by `pack_result`."""
    return b"".join((_array_header(len(packed)), *packed))


_SERVED_HEAD = b"\x92\xc0"  # [None, ...]: a request of a multi that was served


def encode_multi_reply(request_id: int, parts: Sequence[bytes | ItemError]) -> bytes:
    """The reply to a `multi`: one part per request, in order, each its results from
    `encode_results` or `encode_packed_results`, or the ItemError that failed it as a whole."""
    chunks = [_REPLY_HEAD, _pack(request_id), _array_header(len(parts))]
    for part in parts:
        if type(part) is ItemError:
            chunks.append(_pack([part.code, part.message]))
        else:
            chunks.append(_SERVED_HEAD)
            chunks.append(cast(bytes, part))
    return b"".join(chunks)


def split_multi_reply(reply: Reply, request_ids: Sequence[int]) -> tuple[Reply, ...]:
    """A `multi`'s reply as the replies its requests (`request_ids`, in order) would have had
    alone: a multi that failed as a whole fails each of them the same way."""
    if reply.failure is not None:
        return tuple(Reply(request_id, (), reply.failure) for request_id in request_ids)
    if len(reply.results) != len(request_ids):
        raise ProtocolError(f"malformed multi reply: {len(reply.results)} results for "
                            f"{len(request_ids)} requests")
    return tuple(Reply(request_id, (), result) if type(result) is ItemError
                 else Reply(request_id, _results(result))
                 for request_id, result in zip(request_ids, reply.results))


def encode_error(request_id: int, error: ItemError) -> bytes:
    return _pack(["error", request_id, error.code, error.message])


def _item_error(code: Any, message: Any) -> ItemError:
    return ItemError(_str(code, "error code"), _str(message, "error message"))


def _results(wire: Any) -> tuple[Any, ...]:
    try:
        return tuple(payload if code is None else _item_error(code, payload)
                     for code, payload in _list(wire, "reply results"))
    except (TypeError, ValueError):
        raise ProtocolError("malformed reply: each result must be [code or None, value]") from None


def decode_reply(data: bytes) -> Reply:
    value = _unpack(data, "reply")
    if type(value) not in _SEQ or not value:
        raise ProtocolError("malformed reply: expected a list")
    kind = value[0]
    if kind == "reply":
        _, request_id, wire = _list(value, "reply", 3)
        return Reply(_int(request_id, "reply request_id"), _results(wire))
    if kind == "error":
        _, request_id, code, message = _list(value, "error reply", 4)
        return Reply(_int(request_id, "error request_id"), (),
                     ItemError(_str(code, "error code"), _str(message, "error message")))
    raise ProtocolError(f"malformed reply: unknown kind {kind!r}")


_UINT_WIDTHS = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}


def split_reply(data: bytes) -> tuple[int, bytes] | None:
    """(request id, packed results) of a successful reply, the results left packed; None for
    anything else (an error reply, something malformed: `decode_reply` says what).

    A client that gets the same reply bytes again (the same versions in the same places, as a
    model's weights every step) can keep what it made of them, keyed by the packed results."""
    head = len(_REPLY_HEAD)
    if len(data) <= head or not data.startswith(_REPLY_HEAD):
        return None
    tag = data[head]
    if tag < 0x80:  # a positive fixint
        return tag, data[head + 1:]
    width = _UINT_WIDTHS.get(tag)
    if width is None or len(data) <= head + width:
        return None
    end = head + 1 + width
    return int.from_bytes(data[head + 1:end], "big"), data[end:]


def decode_results(packed: bytes) -> tuple[Any, ...]:
    """The results of a reply from `split_reply`, as `decode_reply(...).results` gives them."""
    return _results(_unpack(packed, "reply results"))
