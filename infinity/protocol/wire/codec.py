"""The wire's bytes and its building blocks: the protocol version, the hard size limits, the
msgpack codec that enforces them, and the structural checks every schema decodes with.

The package's other modules pack and unpack only through `_pack` and `_unpack` here (msgpack,
binary as bytes, arrays decoded as tuples, no extension types), and check each decoded field
with `_list`, `_str`, `_int`, ..., which raise `ProtocolError` naming the field. Nothing here
knows a message: only what any message may be made of.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import msgpack

from infinity.errors import ProtocolError

PROTOCOL_VERSION = 10  # 2: placements carry `edits`; ops get_ahead and upcoming; 3: commit_renew;
# 4: get_ahead answers nil for what is not in the CPU tier; 5: `list` is paged (ListItem.after);
# 6: op detach; 7: ops namespace (records with a mode, an owner and a quota), multi
# (several requests in one message, answered in one reply) and adam_step (the optimizer's step);
# 8: adam_step's steps of several parts, applied all or none, and their records; 9: access
# control: hello carries the daemon's secret, namespaces may be private (a grant token, the
# namespace op's `grant`), and namespace info says so and names the owner's uid; op verify;
# op device_report (a client's GPU tier, for the telemetry); 10: adam_step's `speculative`

MAX_PID = 1 << 22  # Linux's largest pid_max

# Hard limits, enforced while decoding, so a hostile or broken peer cannot make
# either side allocate without bound. The daemon also caps whole frames
# (ZeroMQ MAXMSGSIZE) at MAX_MESSAGE_BYTES.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_ITEMS = 1 << 16
MAX_STR_BYTES = 64 * 1024
MAX_BIN_BYTES = 64 * 1024
MAX_MAP_ENTRIES = 1 << 16
MAX_NAME_CHARS = 1024
MAX_NAMESPACE_CHARS = 255
LIST_PAGE = 16384  # entries of one `list` result at most
MAX_SECRET_BYTES = 64  # a hello's secret (the daemon's is 32 bytes)
MIN_TOKEN_CHARS = 16  # a namespace's grant token: long enough not to be guessed by trying
MAX_TOKEN_CHARS = 1024

_UNPACK_LIMITS: dict[str, Any] = {
    "raw": False,
    "use_list": False,  # arrays decode as tuples: cheaper, and hashable (a shape is a dict key)
    "strict_map_key": True,
    "max_str_len": MAX_STR_BYTES,
    "max_bin_len": MAX_BIN_BYTES,
    "max_array_len": MAX_ITEMS,
    "max_map_len": MAX_MAP_ENTRIES,
    "max_ext_len": 0,
}


def _unpack(data: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(data, **_UNPACK_LIMITS)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(
            f"{what} of {len(data)} bytes is not a complete msgpack value ({type(exc).__name__}: "
            f"{exc}); messages must come from infinity.protocol.wire") from None


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


# --- structural checks, each raising ProtocolError naming the field ------------------

def _short(value: Any) -> str:
    """A value quoted in an error message, cut short: the reply must stay far below the
    decoder's limits, whatever the request carried."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _bad(where: str, expected: str, value: Any) -> ProtocolError:
    return ProtocolError(f"malformed {where}: expected {expected}, got {type(value).__name__}")


_SEQ = (tuple, list)  # decoded arrays are tuples; schema objects built by hand may hold lists


def _list(value: Any, where: str, length: int | None = None) -> Sequence[Any]:
    if type(value) not in _SEQ:
        raise _bad(where, "a list", value)
    if length is not None and len(value) != length:
        raise ProtocolError(f"malformed {where}: expected {length} fields, got {len(value)}")
    return value


def _str(value: Any, where: str) -> str:
    if type(value) is not str:
        raise _bad(where, "a string", value)
    return value


def _int(value: Any, where: str, *, minimum: int = 0, maximum: int | None = None) -> int:
    if type(value) is not int:
        raise _bad(where, "an integer", value)
    if value < minimum:
        raise ProtocolError(f"malformed {where}: {value} is below {minimum}")
    if maximum is not None and value > maximum:
        raise ProtocolError(f"malformed {where}: {value} is above {maximum}")
    return value


def _float(value: Any, where: str) -> float:
    if type(value) is float or type(value) is int:
        number = float(value)
        if math.isfinite(number):
            return number
        raise ProtocolError(f"malformed {where}: {value} is not a finite number")
    raise _bad(where, "a number", value)


def _bool(value: Any, where: str) -> bool:
    if type(value) is not bool:
        raise _bad(where, "true or false", value)
    return value


def _bytes(value: Any, where: str) -> bytes:
    if type(value) is not bytes:
        raise _bad(where, "binary", value)
    return value


def _shape(value: Any, where: str) -> tuple[int, ...]:
    dims = _list(value, where)
    for dim in dims:
        if type(dim) is not int:
            raise _bad(where, "a list of integers", dim)
    return tuple(dims)


def _is_lease_id(value: Any) -> bool:
    """A lease is named by the request id of the get that took it, in [1, 2**63). (The daemon's
    own leases, a read stream's, are held under its own identity, which no release names.)"""
    return type(value) is int and 0 < value < 2**63
