"""The request schemas, one per operation (all but `multi`, see `envelope`, and `adam_step`,
see `adam`): the session's (hello, attach, heartbeat, detach, bye), the daemon's (stats,
shutdown, flush_store), the data path's (get, get_ahead, release, reserve, commit and its
variants, abort, prefetch, delete, exists, list), streams (stream_open, stream_chunk,
stream_close), steps (step, upcoming) and namespace records (namespace), with the per-item
schemas their bodies are lists of.

Each request is a frozen value with its `OP`, `body()` (its wire form) and `from_body()` (which
validates a decoded body and raises `ProtocolError` for anything of the wrong shape).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Sequence, TypeVar, cast

from infinity.errors import ProtocolError, VersionMismatchError

from .codec import (MAX_NAMESPACE_CHARS, MAX_PID, MAX_SECRET_BYTES, MAX_TOKEN_CHARS,
                    MIN_TOKEN_CHARS, PROTOCOL_VERSION, _SEQ, _bad, _bool, _bytes, _float, _int,
                    _is_lease_id, _list, _shape, _short, _str)

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
    """Opens a session: protocol version, client name, pid, process start time, and the
    daemon's secret (`RuntimeLayout.read_secret`; protocol version 9), without which the daemon
    refuses the session (AuthenticationError)."""

    OP: ClassVar[str] = "hello"
    version: int
    name: str
    pid: int
    start_time_s: float
    secret: bytes = b""

    def body(self) -> list[Any]:
        return [self.version, self.name, self.pid, self.start_time_s, self.secret]

    @classmethod
    def from_body(cls, body: Sequence[Any]) -> Hello:
        # The version is checked before anything else so that any other version's hello,
        # whatever else it carries, gets a VersionMismatchError rather than a ProtocolError.
        if body and type(body[0]) is int and body[0] != PROTOCOL_VERSION:
            raise VersionMismatchError(
                f"the client speaks Infinity protocol {body[0]} but this infinityd speaks "
                f"{PROTOCOL_VERSION}; install the same Infinity version for both and restart "
                f"the daemon (infinityd stop; infinityd start)")
        version, name, pid, start, secret = _list(body, "hello", 5)
        secret = _bytes(secret, "hello secret")
        if len(secret) > MAX_SECRET_BYTES:
            raise ProtocolError(f"malformed hello: a secret has at most {MAX_SECRET_BYTES} bytes")
        return cls(_int(version, "hello version"), _str(name, "hello name"),
                   _int(pid, "hello pid", minimum=1, maximum=MAX_PID),
                   _float(start, "hello start_time_s"), secret)


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


VERIFY_REPORTED = 1000  # corrupted tensors a verify result names at most (it counts them all)


@dataclass(frozen=True, slots=True)
class Verify:
    """Reads back every flushed tensor's NVMe copy and checks it against its checksums, while
    the daemon serves (`infinity verify` with a daemon running); answered with one result, a
    map: `tensors` and `bytes` checked, `corrupted` ([namespace, name, what failed], at most
    VERIFY_REPORTED), `num_corrupted`, `skipped` (changed, deleted or leased exclusively
    meanwhile), `not_on_nvme` (never written back)."""

    OP: ClassVar[str] = "verify"

    def body(self) -> list[Any]:
        return []

    @classmethod
    def from_body(cls, body: Sequence[Any]) -> Verify:
        _list(body, "verify", 0)
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
NAMESPACE_ACTIONS = ("create", "info", "seal", "grant")


@dataclass(frozen=True, slots=True)
class NamespaceOp:
    """Creates, describes, seals or opens a namespace record. `create` gives `namespace` a
    `mode` ("read-write", or "read-only": only the creating client writes it, every other
    client reads it through read-only mappings), a byte quota (0: none) and, with a `token`, a
    grant: the namespace is then private, seen and touched only by clients that presented the
    token (protocol version 9); `info` describes it (a namespace never created is read-write,
    with no owner and no quota); `seal`, by the owner of a read-only namespace, stops its
    writes too, for good; `grant` presents `token` for a private namespace, granting it to the
    session. One result, a NamespaceInfo."""

    OP: ClassVar[str] = "namespace"
    action: str
    namespace: str
    mode: str = "read-write"
    quota_bytes: int = 0
    token: str = ""

    def body(self) -> list[Any]:
        return [self.action, self.namespace, self.mode, self.quota_bytes, self.token]

    @classmethod
    def from_body(cls, body: Sequence[Any]) -> NamespaceOp:
        action, namespace, mode, quota, token = _list(body, "namespace", 5)
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
        token = _str(token, "namespace token")
        if token and not MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS:
            raise ProtocolError(f"malformed namespace request: a grant token has "
                                f"{MIN_TOKEN_CHARS} to {MAX_TOKEN_CHARS} characters")
        if action == "grant" and not token:
            raise ProtocolError("malformed namespace request: a grant presents a token")
        return cls(action, namespace, mode, _int(quota, "namespace quota_bytes"), token)
