"""What the dispatcher and every service share: handler results, deferred results, counters.

A handler takes the session, the request id and the decoded request (its
schema object from `infinity.protocol.wire`) and returns

- a list: the request's results, item by item (wire values or `ItemError`s);
- `Packed`: results already packed by `wire.pack_result` (a get of resident
  tensors answers with the placements the catalog keeps packed);
- `Deferred`: results that complete later (loads, index transactions, stream
  I/O); the dispatcher sends them once the last piece is settled;
- None: the request gets no reply (heartbeat, release, prefetch, bye, detach).

A failure of the request as a whole is raised (an `InfinityError`); a failed
item is an `ItemError` in its place, made by `DaemonCounters.item_error` so
that it is counted. Handlers never see the socket.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Union

from infinity.daemon.sessions import Session
from infinity.errors import InfinityError
from infinity.protocol.wire import ItemError


class Packed(list):  # type: ignore[type-arg]
    """Results packed one by one (`wire.pack_result`), sent as they are. (A list of its own
    type, not a wrapper: no Python-level constructor on the path of every get.)"""


class Deferred:
    """Results that complete later: `left` pieces are still to settle.

    The handler makes it with one piece more than it waits for, starts the work
    (whose completions call `settle`), settles that extra piece itself, and returns
    it: a reply never goes before every piece was started, and one whose pieces all
    completed at once goes out at once. `when_done` runs as the last piece settles,
    before the results are sent (a get's stall ends there); `deliver` is the
    dispatcher's, which sends them.
    """

    __slots__ = ("results", "left", "when_done", "deliver")

    def __init__(self, results: list[Any], left: int = 1) -> None:
        self.results = results
        self.left = left
        self.when_done: Callable[[], Any] | None = None
        self.deliver: Callable[[Deferred], None] | None = None

    def settle(self) -> None:
        """One piece is done; after the last, the results go out."""
        self.left -= 1
        if self.left:
            return
        if self.when_done is not None:
            self.when_done()
        if self.deliver is not None:
            self.deliver(self)


RECENT_ERRORS = 32  # errors kept for `stats` and the monitor
RECENT_ERROR_CHARS = 300  # of each one's message

Result = Union[list[Any], Packed, Deferred, None]
# (session, request id, decoded request) -> Result
Handler = Callable[[Session, int, Any], Result]
# What a service serves: request schema (a class of infinity.protocol.wire) -> its handler.
Routes = dict[type, Handler]
# (socket identity, session or None, request id, decoded request): a request about the sending
# socket itself (hello, attach, detach), which only these need to name.
SocketHandler = Callable[[bytes, Union[Session, None], int, Any], Union[list[Any], None]]


@dataclass(slots=True)
class DaemonCounters:
    """Daemon-wide counters, kept as work happens (the monitor reads them through `stats`)."""

    requests: int = 0
    items: int = 0
    malformed: int = 0
    ops: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    bytes_leased: int = 0
    bytes_reserved: int = 0
    bytes_committed: int = 0
    parked_requests: int = 0
    deferred_replies: int = 0  # answered after work off the loop (loads, flushes, index)
    # The last RECENT_ERRORS errors answered, newest last: {time_s, code, message, client}.
    recent_errors: deque[dict[str, Any]] = field(
        default_factory=lambda: deque(maxlen=RECENT_ERRORS))

    def error(self, code: str, message: str = "", client: str = "") -> None:
        self.errors[code] = self.errors.get(code, 0) + 1
        self.recent_errors.append({"time_s": round(time.time(), 3), "code": code,
                                   "message": message[:RECENT_ERROR_CHARS], "client": client})

    def item_error(self, session: Session, exc: InfinityError) -> ItemError:
        """A failed item's result, counted for the session and the daemon."""
        session.counters.errors += 1
        self.error(exc.code, str(exc), session.describe())
        return ItemError.of(exc)
