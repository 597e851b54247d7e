"""The wire format between clients and infinityd: every message's schema and its msgpack codec.

This module is the only place that knows how a message looks in bytes. Both
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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Sequence, TypeVar, Union, cast

import msgpack

from infinity.errors import (InfinityError, InvalidRequestError, ProtocolError, VersionMismatchError,
                             error_from_code)

PROTOCOL_VERSION = 7  # 2: placements carry `edits`; ops get_ahead and upcoming; 3: commit_renew;
# 4: get_ahead answers nil for what is not in the CPU tier; 5: `list` is paged (ListItem.after);
# 6: op detach; 7: ops namespace (records with a mode, an owner and a quota), multi
# (several requests in one message, answered in one reply) and adam_step (the optimizer's step)

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


# --- per-item schemas ------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor named in a request: [namespace, name]."""

    namespace: str
    name: str

    def to_wire(self) -> list[Any]:
        return [self.namespace, self.name]

    @classmethod
    def from_wire(cls, value: Any, where: str) -> TensorRef:
        ns, name = _list(value, where, 2)
        return cls(_str(ns, where + " namespace"), _str(name, where + " name"))


class GetItem(NamedTuple):
    """One tensor of a `get`: [namespace, name, exclusive].

    A NamedTuple rather than a dataclass: a batched get decodes dozens per request.
    """

    namespace: str
    name: str
    exclusive: bool = False

    def to_wire(self) -> list[Any]:
        return [self.namespace, self.name, self.exclusive]

    @classmethod
    def from_wire(cls, value: Any, where: str) -> GetItem:
        if type(value) not in _SEQ or len(value) != 3:
            _list(value, where, 3)
        ns, name, exclusive = value
        if type(ns) is not str or type(name) is not str or type(exclusive) is not bool:
            _str(ns, where + " namespace")
            _str(name, where + " name")
            _bool(exclusive, where + " exclusive")
        return cls(ns, name, exclusive)


@dataclass(frozen=True, slots=True)
class ReserveItem:
    """One fresh slice asked of `reserve`: [namespace, name, dtype, shape]."""

    namespace: str
    name: str
    dtype: str
    shape: tuple[int, ...]

    def to_wire(self) -> list[Any]:
        return [self.namespace, self.name, self.dtype, list(self.shape)]

    @classmethod
    def from_wire(cls, value: Any, where: str) -> ReserveItem:
        ns, name, dtype, shape = _list(value, where, 4)
        return cls(_str(ns, where + " namespace"), _str(name, where + " name"),
                   _str(dtype, where + " dtype"), _shape(shape, where + " shape"))


@dataclass(frozen=True, slots=True)
class ListItem:
    """One listing asked of `list`: [namespace, name prefix, after]: the names after `after`
    (all when empty), in name order, at most LIST_PAGE of them (a reply array's limit is
    MAX_ITEMS): a result of LIST_PAGE entries says to ask again after its last name."""

    namespace: str
    prefix: str = ""
    after: str = ""

    def to_wire(self) -> list[Any]:
        return [self.namespace, self.prefix, self.after]

    @classmethod
    def from_wire(cls, value: Any, where: str) -> ListItem:
        ns, prefix, after = _list(value, where, 3)
        return cls(_str(ns, where + " namespace"), _str(prefix, where + " prefix"),
                   _str(after, where + " after"))


_Item = TypeVar("_Item", TensorRef, GetItem, ReserveItem, ListItem)


def _items(body: Sequence[Any], op: str, kind: type[_Item]) -> tuple[_Item, ...]:
    where = f"{op} item"
    return tuple(kind.from_wire(value, where) for value in body)


# --- requests ---------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Hello:
    """Opens a session: protocol version, client name, pid and process start time."""

    OP: ClassVar[str] = "hello"
    version: int
    name: str
    pid: int
    start_time_s: float

    def body(self) -> list[Any]:
        return [self.version, self.name, self.pid, self.start_time_s]

    @classmethod
    def from_body(cls, body: Sequence[Any]) -> Hello:
        # The version is checked before anything else so that any other version's hello,
        # whatever else it carries, gets a VersionMismatchError rather than a ProtocolError.
        if body and type(body[0]) is int and body[0] != PROTOCOL_VERSION:
            raise VersionMismatchError(
                f"the client speaks Infinity protocol {body[0]} but this infinityd speaks "
                f"{PROTOCOL_VERSION}; install the same Infinity version for both and restart "
                f"the daemon (infinityd stop; infinityd start)")
        version, name, pid, start = _list(body, "hello", 4)
        return cls(_int(version, "hello version"), _str(name, "hello name"),
                   _int(pid, "hello pid", minimum=1, maximum=MAX_PID),
                   _float(start, "hello start_time_s"))


@dataclass(frozen=True, slots=True)
class Attach:
    """Adds another socket (one per client thread) to an open session."""

    OP: ClassVar[str] = "attach"
    token: bytes

    def body(self) -> list[Any]:
        return [self.token]

    @classmethod
    def from_body(cls, body: Sequence[Any]) -> Attach:
        (token,) = _list(body, "attach", 1)
        return cls(_bytes(token, "attach token"))


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Says the client is alive; no reply."""

    OP: ClassVar[str] = "heartbeat"

    def body(self) -> list[Any]:
        return []

    @classmethod
    def from_body(cls, body: Sequence[Any]) -> Heartbeat:
        _list(body, "heartbeat", 0)
        return cls()


@dataclass(frozen=True, slots=True)
class Detach:
    """Takes the sending socket out of its session (the client thread that owned it ended);
    the session, and what it holds, stay; no reply."""

    OP: ClassVar[str] = "detach"

    def body(self) -> list[Any]:
        return []

    @classmethod
    def from_body(cls, body: Sequence[Any]) -> Detach:
        _list(body, "detach", 0)
        return cls()


@dataclass(frozen=True, slots=True)
class Bye:
    """Ends the session: every lease and reservation of the client is dropped; no reply."""

    OP: ClassVar[str] = "bye"

    def body(self) -> list[Any]:
        return []

    @classmethod
    def from_body(cls, body: Sequence[Any]) -> Bye:
        _list(body, "bye", 0)
        return cls()


@dataclass(frozen=True, slots=True)
class Stats:
    """Asks for the daemon's counters; answered with one result, a map."""

    OP: ClassVar[str] = "stats"

    def body(self) -> list[Any]:
        return []

    @classmethod
    def from_body(cls, body: Sequence[Any]) -> Stats:
        _list(body, "stats", 0)
        return cls()


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Asks the daemon to stop cleanly; answered with one result (None) before it stops."""

    OP: ClassVar[str] = "shutdown"

    def body(self) -> list[Any]:
        return []

    @classmethod
    def from_body(cls, body: Sequence[Any]) -> Shutdown:
        _list(body, "shutdown", 0)
        return cls()


@dataclass(frozen=True, slots=True)
class Get:
    """Leases tensors (shared or exclusive) under one lease named by this request's id;
    each result is a Placement."""

    OP: ClassVar[str] = "get"
    items: tuple[GetItem, ...]

    def body(self) -> list[Any]:
        return list(self.items)  # msgpack writes a (named) tuple as an array: no copies needed

    @classmethod
    def from_body(cls, body: Sequence[Any]) -> Get:
        for value in body:  # decoded items are tuples already: check them, build nothing
            if not (type(value) is tuple and len(value) == 3 and type(value[0]) is str
                    and type(value[1]) is str and type(value[2]) is bool):
                return cls(_items(body, "get", GetItem))  # the slow path names the fault
        return cls(cast("tuple[GetItem, ...]", body))

    @classmethod
    def for_names(cls, namespace: str, names: Sequence[str], exclusive: bool) -> Get:
        """A get of several names of one namespace (plain triples are GetItems on the wire)."""
        return cls(cast("tuple[GetItem, ...]", tuple((namespace, n, exclusive) for n in names)))


@dataclass(frozen=True, slots=True)
class Release:
    """Ends leases, each named by the request id of the get that took it; no reply."""

    OP: ClassVar[str] = "release"
    lease_ids: tuple[int, ...]

    def body(self) -> list[Any]:
        return list(self.lease_ids)

    @classmethod
    def from_body(cls, body: Sequence[Any]) -> Release:
        for value in body:
            if not _is_lease_id(value):
                raise _bad("release item", "a lease id (a get's request id)", value)
        return cls(tuple(body))


def _is_lease_id(value: Any) -> bool:
    """A lease is named by the request id of the get that took it, in [1, 2**63). (The daemon's
    own leases, a read stream's, are held under its own identity, which no release names.)"""
    return type(value) is int and 0 < value < 2**63


@dataclass(frozen=True, slots=True)
class Reserve:
    """Allocates fresh slices to fill before `commit`; each result is a Placement."""

    OP: ClassVar[str] = "reserve"
    items: tuple[ReserveItem, ...]

    def body(self) -> list[Any]:
        return [item.to_wire() for item in self.items]

    @classmethod
    def from_body(cls, body: Sequence[Any]) -> Reserve:
        return cls(_items(body, "reserve", ReserveItem))


@dataclass(frozen=True, slots=True)
class _NamedItems:
    """Base of the requests whose items are just tensor names."""

    OP: ClassVar[str] = ""
    items: tuple[TensorRef, ...]

    def body(self) -> list[Any]:
        return [item.to_wire() for item in self.items]

    @classmethod
    def from_body(cls, body: Sequence[Any]) -> Any:
        return cls(_items(body, cls.OP, TensorRef))


@dataclass(frozen=True, slots=True)
class Commit(_NamedItems):
    """Publishes this client's reservations as the new versions; each result is a version."""

    OP: ClassVar[str] = "commit"


@dataclass(frozen=True, slots=True)
class CommitRenew(_NamedItems):
    """Publishes reservations like `commit`, and leaves the client a spare reservation of each
    name, dtype and shape for its next put of it, where the daemon has free room for one.
    Each result is [version, placement of the spare or nil]. `put` sends it: its next put of
    the same tensor then needs this one round trip and no `reserve`."""

    OP: ClassVar[str] = "commit_renew"


@dataclass(frozen=True, slots=True)
class CommitDurable(_NamedItems):
    """Publishes reservations like `commit`, then makes them durable: each is written to NVMe,
    fdatasync'ed and recorded in the store's index before the reply. Each result is a version
    (published even when making it durable failed: the item's error says so)."""

    OP: ClassVar[str] = "commit_durable"


@dataclass(frozen=True, slots=True)
class FlushStore:
    """Makes every tensor of the store durable (what `commit_durable` does for one); answered
    with one result, a map of counts (`tensors`, `bytes`), once the index committed."""

    OP: ClassVar[str] = "flush_store"

    def body(self) -> list[Any]:
        return []

    @classmethod
    def from_body(cls, body: Sequence[Any]) -> FlushStore:
        _list(body, "flush_store", 0)
        return cls()


@dataclass(frozen=True, slots=True)
class StreamOpen:
    """Opens a stream to read a tensor (`mode` "read"; dtype "" and shape () are ignored) or to
    write one of `dtype` and `shape` (`mode` "write"), in pieces. One result, a StreamInfo;
    the stream is named by this request's id."""

    OP: ClassVar[str] = "stream_open"
    namespace: str
    name: str
    mode: str
    dtype: str = ""
    shape: tuple[int, ...] = ()

    def body(self) -> list[Any]:
        return [self.namespace, self.name, self.mode, self.dtype, list(self.shape)]

    @classmethod
    def from_body(cls, body: Sequence[Any]) -> StreamOpen:
        ns, name, mode, dtype, shape = _list(body, "stream_open", 5)
        return cls(_str(ns, "stream_open namespace"), _str(name, "stream_open name"),
                   _str(mode, "stream_open mode"), _str(dtype, "stream_open dtype"),
                   _shape(shape, "stream_open shape"))


@dataclass(frozen=True, slots=True)
class StreamChunk:
    """Moves bytes [offset, offset + nbytes) of a staged stream's tensor between NVMe and its
    staging slice `slot`: read into the slice, or written from it. One result, None, once the
    I/O is done (the slice may then be reused)."""

    OP: ClassVar[str] = "stream_chunk"
    stream_id: int
    slot: int
    offset: int
    nbytes: int

    def body(self) -> list[Any]:
        return [self.stream_id, self.slot, self.offset, self.nbytes]

    @classmethod
    def from_body(cls, body: Sequence[Any]) -> StreamChunk:
        stream_id, slot, offset, nbytes = _list(body, "stream_chunk", 4)
        return cls(_int(stream_id, "stream_chunk stream_id", minimum=1),
                   _int(slot, "stream_chunk slot"), _int(offset, "stream_chunk offset"),
                   _int(nbytes, "stream_chunk nbytes", minimum=1))


@dataclass(frozen=True, slots=True)
class StreamClose:
    """Ends a stream. A write stream publishes its tensor when `commit` (durably when
    `durable`) and drops it otherwise. One result: the version written or read (0: none)."""

    OP: ClassVar[str] = "stream_close"
    stream_id: int
    commit: bool = False
    durable: bool = False

    def body(self) -> list[Any]:
        return [self.stream_id, self.commit, self.durable]

    @classmethod
    def from_body(cls, body: Sequence[Any]) -> StreamClose:
        stream_id, commit, durable = _list(body, "stream_close", 3)
        return cls(_int(stream_id, "stream_close stream_id", minimum=1),
                   _bool(commit, "stream_close commit"), _bool(durable, "stream_close durable"))


@dataclass(frozen=True, slots=True)
class Abort(_NamedItems):
    """Discards this client's reservations; each result is None."""

    OP: ClassVar[str] = "abort"


@dataclass(frozen=True, slots=True)
class Prefetch(_NamedItems):
    """Hints that these tensors are needed soon; no reply."""

    OP: ClassVar[str] = "prefetch"


@dataclass(frozen=True, slots=True)
class Delete(_NamedItems):
    """Removes names; readers keep their versions until they release. Each result is None."""

    OP: ClassVar[str] = "delete"


@dataclass(frozen=True, slots=True)
class Exists(_NamedItems):
    """Asks whether names exist; each result is a bool."""

    OP: ClassVar[str] = "exists"


@dataclass(frozen=True, slots=True)
class ListTensors:
    """Lists a namespace: one item, whose result is a list of TensorInfo (one page).

    One item only: each page costs a walk of its namespace and up to LIST_PAGE entries, so a
    request of many items (an 18 KB one made an 82 MiB reply) would let one message stall the
    daemon and blow up its memory."""

    OP: ClassVar[str] = "list"
    items: tuple[ListItem, ...]

    def body(self) -> list[Any]:
        return [item.to_wire() for item in self.items]

    @classmethod
    def from_body(cls, body: Sequence[Any]) -> ListTensors:
        if len(body) != 1:
            raise ProtocolError(f"malformed list request: it lists one namespace page, not "
                                f"{len(body)}; send one request per page")
        return cls(_items(body, "list", ListItem))


STEP_PHASES = ("begin", "end", "abort")


@dataclass(frozen=True, slots=True)
class Step:
    """Marks where a step of the client's work begins or ends, for the scheduler's traces.

    The client's accesses between a begin and an end, in this namespace's trace
    for this client name, are the step that later steps are expected to repeat.
    Answered with one result: a StepReport of the step that ended (an end, or a
    begin that ended a step left open), else None. An abort drops the step under
    way (it failed halfway) and keeps the trace; its result is None.
    """

    OP: ClassVar[str] = "step"
    namespace: str
    phase: str  # "begin" | "end" | "abort"

    def body(self) -> list[Any]:
        return [self.namespace, self.phase]

    @classmethod
    def from_body(cls, body: Sequence[Any]) -> Step:
        namespace, phase = _list(body, "step", 2)
        namespace = _str(namespace, "step namespace")
        if not namespace or len(namespace) > MAX_NAMESPACE_CHARS or "\x00" in namespace:
            # As a tensor's namespace: the trace is saved under it (SQLite text ends at a NUL).
            raise ProtocolError(f"malformed step: the namespace must have 1 to "
                                f"{MAX_NAMESPACE_CHARS} characters, without NUL")
        if phase not in STEP_PHASES:
            raise ProtocolError(f"malformed step: the phase must be 'begin', 'end' or 'abort', "
                                f"not {_short(phase)}")
        return cls(namespace, phase)


@dataclass(frozen=True, slots=True)
class GetAhead(Get):
    """A get that is not one of the client's accesses, for bringing tensors ahead of their use
    (into a device cache): the scheduler does not see it, so it does not disturb the trace the
    client replays, and it leases only what the CPU tier holds now. Same items and results as
    `get`, except that an item on NVMe alone is answered nil: not leased, not loaded."""

    OP: ClassVar[str] = "get_ahead"


@dataclass(frozen=True, slots=True)
class Upcoming:
    """What this client will read next in `namespace`, by the trace its current step replays:
    one result, a list of [name, nbytes], soonest first, distinct names, at most `max_entries`
    of them and `max_bytes` in all (the first always). Empty when no trace is replaying, or
    without an NVMe tier (no scheduler)."""

    OP: ClassVar[str] = "upcoming"
    namespace: str
    max_entries: int
    max_bytes: int

    def body(self) -> list[Any]:
        return [self.namespace, self.max_entries, self.max_bytes]

    @classmethod
    def from_body(cls, body: Sequence[Any]) -> Upcoming:
        namespace, max_entries, max_bytes = _list(body, "upcoming", 3)
        namespace = _str(namespace, "upcoming namespace")
        if not namespace or len(namespace) > MAX_NAMESPACE_CHARS:
            raise ProtocolError(f"malformed upcoming: the namespace must have 1 to "
                                f"{MAX_NAMESPACE_CHARS} characters")
        max_entries = _int(max_entries, "upcoming max_entries")
        max_bytes = _int(max_bytes, "upcoming max_bytes")
        if not 1 <= max_entries <= MAX_UPCOMING_ENTRIES or max_bytes < 1:
            raise ProtocolError(f"malformed upcoming: max_entries must be 1 to "
                                f"{MAX_UPCOMING_ENTRIES} and max_bytes positive")
        return cls(namespace, max_entries, max_bytes)


MAX_UPCOMING_ENTRIES = 4096

NAMESPACE_MODES = ("read-write", "read-only")
NAMESPACE_ACTIONS = ("create", "info", "seal")


@dataclass(frozen=True, slots=True)
class NamespaceOp:
    """Creates, describes or seals a namespace record. `create` gives `namespace` a `mode`
    ("read-write", or "read-only": only the creating client writes it, every other client reads
    it through read-only mappings) and a byte quota (0: none); `info` describes it (a namespace
    never created is read-write, with no owner and no quota); `seal`, by the owner of a
    read-only namespace, stops its writes too, for good. One result, a NamespaceInfo."""

    OP: ClassVar[str] = "namespace"
    action: str
    namespace: str
    mode: str = "read-write"
    quota_bytes: int = 0

    def body(self) -> list[Any]:
        return [self.action, self.namespace, self.mode, self.quota_bytes]

    @classmethod
    def from_body(cls, body: Sequence[Any]) -> NamespaceOp:
        action, namespace, mode, quota = _list(body, "namespace", 4)
        if action not in NAMESPACE_ACTIONS:
            raise ProtocolError(f"malformed namespace request: the action must be one of "
                                f"{', '.join(NAMESPACE_ACTIONS)}, not {_short(action)}")
        namespace = _str(namespace, "namespace name")
        if not namespace or len(namespace) > MAX_NAMESPACE_CHARS or "\x00" in namespace:
            raise ProtocolError(f"malformed namespace request: the namespace must have 1 to "
                                f"{MAX_NAMESPACE_CHARS} characters, without NUL")
        if mode not in NAMESPACE_MODES:
            raise ProtocolError(f"malformed namespace request: the mode must be 'read-write' or "
                                f"'read-only', not {_short(mode)}")
        return cls(action, namespace, mode, _int(quota, "namespace quota_bytes"))


@dataclass(frozen=True, slots=True)
class AdamGroup:
    """One parameter group's hyperparameters for an `adam_step` (torch.optim.Adam / AdamW's)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool      # AdamW (decay applied to the parameter) or Adam (L2 added to the gradient)
    grad_scale: float    # every gradient is multiplied by this first (1 / loss scale, clipping)

    def to_wire(self) -> list[Any]:
        return [self.lr, self.beta1, self.beta2, self.eps, self.weight_decay, self.decoupled,
                self.grad_scale]

    @classmethod
    def from_wire(cls, value: Any) -> AdamGroup:
        lr, beta1, beta2, eps, decay, decoupled, scale = _list(value, "adam group", 7)
        return cls(_float(lr, "lr"), _float(beta1, "beta1"), _float(beta2, "beta2"),
                   _float(eps, "eps"), _float(decay, "weight_decay"),
                   _bool(decoupled, "decoupled"), _float(scale, "grad_scale"))


@dataclass(frozen=True, slots=True)
class AdamItem:
    """One parameter's step: the names of its tensors in the request's namespace. `master` is
    the fp32 master copy ("" when the parameter itself is fp32 and is the master); `param` is
    then written in the same pass, rounded to its own dtype. `step` counts from 1."""

    param: str
    grad: str
    master: str
    exp_avg: str
    exp_avg_sq: str
    group: int
    step: int

    def to_wire(self) -> list[Any]:
        return [self.param, self.grad, self.master, self.exp_avg, self.exp_avg_sq, self.group,
                self.step]

    @classmethod
    def from_wire(cls, value: Any) -> AdamItem:
        param, grad, master, avg, avg_sq, group, step = _list(value, "adam item", 7)
        return cls(_name(param, "param"), _name(grad, "grad"),
                   _str(master, "master") and _name(master, "master"),
                   _name(avg, "exp_avg"), _name(avg_sq, "exp_avg_sq"),
                   _int(group, "group", maximum=MAX_ITEMS), _int(step, "step", minimum=1))


def _name(value: Any, where: str) -> str:
    name = _str(value, where)
    if not name or len(name) > MAX_NAME_CHARS or "\x00" in name:
        raise ProtocolError(f"malformed adam item: {where} must be a tensor name of 1 to "
                            f"{MAX_NAME_CHARS} characters, without NUL")
    return name


@dataclass(frozen=True, slots=True)
class AdamStep:
    """One optimizer step of Adam / AdamW, run by the daemon next to the data: for each item,
    the parameter (and its master copy) and both moments are updated in place from the gradient,
    under the daemon's own exclusive leases; answered once every item is done, one result per
    item (None, or the error that item met). Items of one request share `namespace`."""

    OP: ClassVar[str] = "adam_step"
    namespace: str
    groups: tuple[AdamGroup, ...]
    items: tuple[AdamItem, ...]

    def body(self) -> list[Any]:
        return [self.namespace, [g.to_wire() for g in self.groups],
                [i.to_wire() for i in self.items]]

    @classmethod
    def from_body(cls, body: Sequence[Any]) -> AdamStep:
        namespace, groups, items = _list(body, "adam_step", 3)
        namespace = _str(namespace, "namespace")
        if not namespace or len(namespace) > MAX_NAMESPACE_CHARS:
            raise ProtocolError(f"malformed adam_step: the namespace must have 1 to "
                                f"{MAX_NAMESPACE_CHARS} characters")
        decoded_groups = tuple(AdamGroup.from_wire(g) for g in _list(groups, "adam groups"))
        decoded_items = tuple(AdamItem.from_wire(i) for i in _list(items, "adam items"))
        if len(decoded_items) > MAX_ITEMS:
            raise ProtocolError(f"malformed adam_step: more than {MAX_ITEMS} items")
        for item in decoded_items:
            if item.group >= len(decoded_groups):
                raise ProtocolError(f"malformed adam_step: item {item.param!r} names group "
                                    f"{item.group} of {len(decoded_groups)}")
        return cls(namespace, decoded_groups, decoded_items)


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
                Delete, Exists, ListTensors, Step, GetAhead, Upcoming, NamespaceOp, Multi, AdamStep]

REQUESTS: dict[str, Any] = {cls.OP: cls for cls in (
    Hello, Attach, Detach, Heartbeat, Bye, Stats, Shutdown, Get, Release, Reserve, Commit, CommitRenew,
    CommitDurable, FlushStore, StreamOpen, StreamChunk, StreamClose, Abort, Prefetch, Delete, Exists,
    ListTensors, Step, GetAhead, Upcoming, NamespaceOp, Multi, AdamStep)}

# Operations the daemon never answers (a client must not wait for them).
NO_REPLY_OPS = frozenset({"heartbeat", "release", "prefetch", "bye", "detach"})


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


# --- results ----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ItemError:
    """A failed item (or request): an error code from infinity.errors and a message."""

    code: str
    message: str

    @classmethod
    def of(cls, exc: InfinityError) -> ItemError:
        return cls(exc.code, str(exc))

    def exception(self) -> InfinityError:
        return error_from_code(self.code, self.message)


STEP_OUTCOMES = ("recorded", "not_recorded", "replayed", "diverged", "no_step", "untracked")


@dataclass(frozen=True, slots=True)
class StepReport:
    """How a step went: `outcome` is recorded (a new trace), not_recorded (too long or empty),
    replayed (it followed the trace), diverged (the order changed: the next step records
    again), no_step (an end without a begin) or untracked (this infinityd has no NVMe tier, so
    nothing is scheduled). `counters`: the step's accesses, hits, misses, bytes, stall."""

    outcome: str
    trace_entries: int
    counters: dict[str, Any]

    def to_wire(self) -> list[Any]:
        return [self.outcome, self.trace_entries, self.counters]

    @classmethod
    def from_wire(cls, value: Any) -> StepReport:
        outcome, entries, counters = _list(value, "step report", 3)
        if outcome not in STEP_OUTCOMES:
            raise ProtocolError(f"malformed step report: unknown outcome {outcome!r}")
        if type(counters) is not dict:
            raise _bad("step report counters", "a map", counters)
        return cls(outcome, _int(entries, "step report trace_entries"), dict(counters))


@dataclass(frozen=True, slots=True)
class Welcome:
    """The answer to `hello`: the session's identity and the daemon's liveness rules."""

    version: int
    client_id: int
    token: bytes
    daemon_pid: int
    daemon_version: str
    heartbeat_interval_s: float
    client_timeout_s: float

    def to_wire(self) -> list[Any]:
        return [self.version, self.client_id, self.token, self.daemon_pid, self.daemon_version,
                self.heartbeat_interval_s, self.client_timeout_s]

    @classmethod
    def from_wire(cls, value: Any) -> Welcome:
        v, cid, token, pid, dver, hb, timeout = _list(value, "welcome", 7)
        return cls(_int(v, "welcome version"), _int(cid, "welcome client_id"),
                   _bytes(token, "welcome token"), _int(pid, "welcome daemon_pid"),
                   _str(dver, "welcome daemon_version"), _float(hb, "welcome heartbeat_interval_s"),
                   _float(timeout, "welcome client_timeout_s"))


class Placement(NamedTuple):
    """Where a leased or reserved tensor lies: segment -1 for a tensor of zero bytes.

    `version` is 0 for a reservation. `edits` counts the exclusive leases granted on the
    version so far: its bytes may have changed in place since a placement with fewer (a
    client that keeps copies, as a device cache does, copies again). A get's lease has no
    id of its own: it is the get's request id, and `release` names it so. That keeps a
    version's placement identical from one get to the next, so the daemon sends the same
    value every time and the client can key its cached views by it. A NamedTuple: a
    batched get decodes dozens per reply.
    """

    segment: int
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    version: int
    edits: int = 0

    def to_wire(self) -> list[Any]:
        return [self.segment, self.offset, self.nbytes, self.dtype, list(self.shape),
                self.version, self.edits]

    @classmethod
    def from_wire(cls, value: Any) -> Placement:
        if type(value) not in _SEQ or len(value) != 7:
            _list(value, "placement", 7)
        segment, offset, nbytes, dtype, shape, version, edits = value
        if not (type(segment) is int and type(offset) is int and type(nbytes) is int
                and type(dtype) is str and type(version) is int and type(shape) in _SEQ
                and type(edits) is int and segment >= -1 and offset >= 0 and nbytes >= 0
                and edits >= 0):
            raise ProtocolError(f"malformed placement {value!r}")
        for dim in shape:
            if type(dim) is not int:
                raise ProtocolError(f"malformed placement shape {shape!r}")
        return cls(segment, offset, nbytes, dtype, tuple(shape), version, edits)


class StreamInfo(NamedTuple):
    """The answer to `stream_open`.

    `direct`: the one slice in `slots` holds (read) or receives (write) the whole tensor, and
    the client copies it at once, then closes. Otherwise `slots` are staging slices of at most
    `chunk_bytes` each, filled and emptied with `stream_chunk`. Slots are placements of
    uint8 ranges. `version` is the version being read (0 for a write).
    """

    stream_id: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    version: int
    direct: bool
    chunk_bytes: int
    slots: tuple[Placement, ...]

    def to_wire(self) -> list[Any]:
        return [self.stream_id, self.nbytes, self.dtype, list(self.shape), self.version,
                self.direct, self.chunk_bytes, [slot.to_wire() for slot in self.slots]]

    @classmethod
    def from_wire(cls, value: Any) -> StreamInfo:
        sid, nbytes, dtype, shape, version, direct, chunk, slots = _list(value, "stream info", 8)
        return cls(_int(sid, "stream info id", minimum=1), _int(nbytes, "stream info nbytes"),
                   _str(dtype, "stream info dtype"), _shape(shape, "stream info shape"),
                   _int(version, "stream info version"), _bool(direct, "stream info direct"),
                   _int(chunk, "stream info chunk_bytes", minimum=1),
                   tuple(Placement.from_wire(p) for p in _list(slots, "stream info slots")))


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One entry of a `list` result."""

    namespace: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    version: int
    tier: str  # "cpu", "nvme" (only on NVMe) or "cpu+nvme" (resident, with a clean NVMe copy)

    def to_wire(self) -> list[Any]:
        return [self.namespace, self.name, self.dtype, list(self.shape), self.nbytes,
                self.version, self.tier]

    @classmethod
    def from_wire(cls, value: Any) -> TensorInfo:
        ns, name, dtype, shape, nbytes, version, tier = _list(value, "tensor info", 7)
        return cls(_str(ns, "tensor info namespace"), _str(name, "tensor info name"),
                   _str(dtype, "tensor info dtype"), _shape(shape, "tensor info shape"),
                   _int(nbytes, "tensor info nbytes"), _int(version, "tensor info version"),
                   _str(tier, "tensor info tier"))


@dataclass(frozen=True, slots=True)
class NamespaceInfo:
    """The answer to `namespace`: the record. `created`: False for a namespace only used (it
    is then read-write, with no owner and no quota). `owner_client` is the owner's session id
    (0: none), `owner_name` and `owner_pid` as the owner said at hello; `owner_alive`: whether
    that session is still open (when it ends, a read-only namespace has no writer left).
    `used_bytes`: its current tensors' bytes."""

    namespace: str
    mode: str
    created: bool
    owner_client: int
    owner_name: str
    owner_pid: int
    owner_alive: bool
    quota_bytes: int
    used_bytes: int
    sealed: bool

    def to_wire(self) -> list[Any]:
        return [self.namespace, self.mode, self.created, self.owner_client, self.owner_name,
                self.owner_pid, self.owner_alive, self.quota_bytes, self.used_bytes, self.sealed]

    @classmethod
    def from_wire(cls, value: Any) -> NamespaceInfo:
        (ns, mode, created, owner, owner_name, owner_pid, owner_alive, quota, used,
         sealed) = _list(value, "namespace info", 10)
        if mode not in NAMESPACE_MODES:
            raise ProtocolError(f"malformed namespace info: unknown mode {_short(mode)}")
        return cls(_str(ns, "namespace info namespace"), mode,
                   _bool(created, "namespace info created"), _int(owner, "namespace info owner"),
                   _str(owner_name, "namespace info owner_name"),
                   _int(owner_pid, "namespace info owner_pid"),
                   _bool(owner_alive, "namespace info owner_alive"),
                   _int(quota, "namespace info quota_bytes"), _int(used, "namespace info used_bytes"),
                   _bool(sealed, "namespace info sealed"))


def decode_version(value: Any) -> int:
    return _int(value, "commit result")


def decode_renewed(value: Any) -> tuple[int, Placement | None]:
    """A `commit_renew` result: the version published and the spare reservation, if any."""
    version, spare = _list(value, "commit_renew result", 2)
    return (_int(version, "commit_renew version"),
            None if spare is None else Placement.from_wire(spare))


def decode_bool(value: Any) -> bool:
    return _bool(value, "exists result")


def decode_none(value: Any) -> None:
    if value is not None:
        raise _bad("result", "nothing", value)


def decode_infos(value: Any) -> list[TensorInfo]:
    return [TensorInfo.from_wire(entry) for entry in _list(value, "list result")]


def decode_stats(value: Any) -> dict[str, Any]:
    if type(value) is not dict:
        raise _bad("stats result", "a map", value)
    return value


def decode_flush_summary(value: Any) -> dict[str, Any]:
    if type(value) is not dict:
        raise _bad("flush_store result", "a map", value)
    return value


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


# --- the fd channel -----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """A CPU-tier segment handed over the fd channel: its id and size."""

    segment: int
    size_bytes: int

    def to_wire(self) -> list[Any]:
        return [self.segment, self.size_bytes]

    @classmethod
    def from_wire(cls, value: Any) -> SegmentInfo:
        segment, size = _list(value, "segment info", 2)
        return cls(_int(segment, "segment id"), _int(size, "segment size", minimum=1))


@dataclass(frozen=True, slots=True)
class FdRequest:
    """Asks for segment fds: `want` lists ids, or None for every live segment.

    The first request on a connection binds it to the session named by `token`.
    """

    token: bytes
    want: tuple[int, ...] | None

    def encode(self) -> bytes:
        return _pack([self.token, None if self.want is None else list(self.want)])

    @classmethod
    def decode(cls, data: bytes) -> FdRequest:
        token, want = _list(_unpack(data, "fd request"), "fd request", 2)
        wanted = None if want is None else tuple(
            _int(s, "fd request segment") for s in _list(want, "fd request want"))
        return cls(_bytes(token, "fd request token"), wanted)


@dataclass(frozen=True, slots=True)
class FdReply:
    """Segments whose fds ride along (same order), segments retired since the last reply,
    whether more replies follow (at most `MAX_FDS_PER_MESSAGE` fds per message), or an error."""

    segments: tuple[SegmentInfo, ...]
    retired: tuple[int, ...] = ()
    more: bool = False
    error: ItemError | None = None

    MAX_FDS_PER_MESSAGE: ClassVar[int] = 200  # below the kernel's SCM_MAX_FD of 253

    def encode(self) -> bytes:
        error = None if self.error is None else [self.error.code, self.error.message]
        return _pack([[s.to_wire() for s in self.segments], list(self.retired), self.more, error])

    @classmethod
    def decode(cls, data: bytes) -> FdReply:
        segments, retired, more, error = _list(_unpack(data, "fd reply"), "fd reply", 4)
        item_error = None
        if error is not None:
            code, message = _list(error, "fd reply error", 2)
            item_error = ItemError(_str(code, "fd error code"), _str(message, "fd error message"))
        return cls(tuple(SegmentInfo.from_wire(s) for s in _list(segments, "fd reply segments")),
                   tuple(_int(r, "retired segment") for r in _list(retired, "fd reply retired")),
                   _bool(more, "fd reply more"), item_error)
