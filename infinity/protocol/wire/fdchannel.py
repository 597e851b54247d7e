"""The fd channel's messages (a Unix SOCK_SEQPACKET socket, see `infinity.protocol.fdpass`):
`FdRequest` asks for the memfds of CPU-tier segments; `FdReply` lists the segments whose fds ride
along as SCM_RIGHTS ancillary data, one fd per listed segment, in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from .codec import _bool, _bytes, _int, _list, _pack, _str, _unpack
from .results import ItemError

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
