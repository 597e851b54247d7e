"""The results' schemas: what one request item is answered with. A failure (`ItemError`, an
error code of infinity.errors and its message), and the successful values: `Welcome` (hello),
`Placement` (get, reserve), `StreamInfo` (stream_open), `TensorInfo` (list), `StepReport`
(step), `NamespaceInfo` (namespace), and the `decode_*` helpers for the plainer ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from infinity.errors import InfinityError, ProtocolError, error_from_code

from .codec import _SEQ, _bad, _bool, _bytes, _float, _int, _list, _shape, _short, _str
from .requests import NAMESPACE_MODES

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
    replayed (it followed the trace), diverged (the order changed: this step's own order is
    the trace from the next step on), no_step (an end without a begin) or untracked (this
    infinityd has no NVMe tier, so nothing is scheduled). `counters`: the step's accesses,
    hits, misses, bytes, stall."""

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
    `used_bytes`: its current tensors' bytes. `private`: created with a grant token, so only
    the clients that presented it see it (protocol version 9); `owner_uid`: the owner's uid as
    the kernel reported it on the owner's fd channel (-1: not known)."""

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
    private: bool = False
    owner_uid: int = -1

    def to_wire(self) -> list[Any]:
        return [self.namespace, self.mode, self.created, self.owner_client, self.owner_name,
                self.owner_pid, self.owner_alive, self.quota_bytes, self.used_bytes, self.sealed,
                self.private, self.owner_uid]

    @classmethod
    def from_wire(cls, value: Any) -> NamespaceInfo:
        (ns, mode, created, owner, owner_name, owner_pid, owner_alive, quota, used,
         sealed, private, owner_uid) = _list(value, "namespace info", 12)
        if mode not in NAMESPACE_MODES:
            raise ProtocolError(f"malformed namespace info: unknown mode {_short(mode)}")
        return cls(_str(ns, "namespace info namespace"), mode,
                   _bool(created, "namespace info created"), _int(owner, "namespace info owner"),
                   _str(owner_name, "namespace info owner_name"),
                   _int(owner_pid, "namespace info owner_pid"),
                   _bool(owner_alive, "namespace info owner_alive"),
                   _int(quota, "namespace info quota_bytes"), _int(used, "namespace info used_bytes"),
                   _bool(sealed, "namespace info sealed"),
                   _bool(private, "namespace info private"),
                   _int(owner_uid, "namespace info owner_uid", minimum=-1))


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


def decode_verify_summary(value: Any) -> dict[str, Any]:
    if type(value) is not dict or type(value.get("corrupted")) not in (list, tuple):
        raise _bad("verify result", "a map with a list of corrupted tensors", value)
    return value
