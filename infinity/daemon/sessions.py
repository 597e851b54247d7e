"""Client sessions: who is attached, through which sockets, whether they are alive, what they did.

A session starts with `hello` on one ZeroMQ socket; each further client thread
attaches its own socket with the session token, and the fd channel binds to
it the same way. A session ends on `bye`, when the client process exits (its
pidfd becomes readable, or its fd channel closes), or when nothing, heartbeats
included, arrived for `daemon.client_timeout_s`. Per-client counters are kept
here as work happens, for `stats` and the monitor.

Sessions are numbered from 1. What the daemon holds in the catalog for work of
its own (a read stream's lease) is held as `DAEMON_CLIENT_ID`, an identity no
session has: it is neither counted as a client's nor dropped with one.
"""

from __future__ import annotations

import itertools
import os
import secrets
import time
from dataclasses import dataclass, field, fields
from typing import Any

import psutil

from infinity.daemon.trace import StreamKey
from infinity.protocol.wire import DeviceFigures, Hello

# psutil computes a start time from the same boot time and tick count in every process,
# so the client's own figure and ours agree to the bit; the slack covers float printing only.
START_TIME_SLACK_S = 0.005
# The catalog's client id for the daemon's own work: below every session's (and not 0, which
# the catalog uses for "nobody").
DAEMON_CLIENT_ID = -1


@dataclass(slots=True)
class ClientCounters:
    """What one client has done, counted as it happens."""

    requests: int = 0
    items: int = 0
    errors: int = 0
    gets: int = 0
    get_bytes: int = 0
    reserves: int = 0
    reserve_bytes: int = 0
    commits: int = 0
    commit_bytes: int = 0
    spares: int = 0  # spare reservations left after this client's puts (commit_renew)
    releases: int = 0
    deletes: int = 0
    prefetches: int = 0
    heartbeats: int = 0
    load_waits: int = 0  # get items that waited for a load from NVMe
    load_bytes: int = 0  # bytes of this client's get items that waited for a load from NVMe
    durable_bytes: int = 0  # bytes made durable at this client's request
    flushes: int = 0  # flush_store requests
    streams: int = 0  # read_into / write_from streams opened
    stream_bytes: int = 0  # bytes moved by this client's stream chunks
    steps: int = 0  # steps begun (step markers)
    optimizer_items: int = 0  # parameters' optimizer steps applied at this client's request
    optimizer_parameters: int = 0  # ... and the elements they updated


@dataclass(eq=False)
class Session:
    id: int
    name: str
    pid: int
    start_time_s: float
    token: bytes
    connected_at_s: float  # wall clock, for display
    last_seen: float  # monotonic
    identities: set[bytes] = field(default_factory=set)
    watched_pid: int | None = None
    pidfd: int | None = None
    fd_conn: Any = None  # the fd server's connection object, once bound
    mapped_segments: set[int] = field(default_factory=set)
    retired_pending: set[int] = field(default_factory=set)
    counters: ClientCounters = field(default_factory=ClientCounters)
    alive: bool = True
    # Its requests whose replies wait for work off the loop (Deferred): bounded by
    # daemon.max_pending_requests_per_client.
    pending_replies: int = 0
    # The scheduler's streams of this client, by tensor namespace: (namespace, client name),
    # or a name with a "#<session id>" suffix while another live session holds that stream.
    streams: dict[str, StreamKey] = field(default_factory=dict)
    # The namespace of the step the client marked last: its accesses in every namespace
    # belong to that step's trace.
    step_namespace: str | None = None
    # The client's uid as the kernel reported it on the fd channel (SO_PEERCRED); None until
    # the channel binds (a one-off admin session never opens one).
    peer_uid: int | None = None
    # The private namespaces this session was granted (it created them or presented their
    # token); see `namespaces.Namespaces.check_request`.
    granted: set[str] = field(default_factory=set)
    # The namespaces this client got or reserved tensors in (each request's first item's: a
    # set insertion per request, not per item), for the monitor.
    namespaces: set[str] = field(default_factory=set)
    # Its GPU tier, one entry per device, as its last `device_report` said (device memory is
    # the client's own: the daemon knows only what it reports).
    devices: tuple[DeviceFigures, ...] = ()

    def describe(self) -> str:
        """For the log: the client's name shortened (a client chooses it, up to the
        protocol's limit)."""
        return f"client {self.id} ({shortened(self.name)!r}, pid {self.pid})"


def shortened(text: str, limit: int = 64) -> str:
    """A string a client chose (a name, up to the protocol's 64 KiB), cut for the log."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def open_pidfd(pid: int, start_time_s: float) -> int | None:
    """A pidfd for the process `pid` if it is the one that started at `start_time_s`.

    None when the process cannot be watched this way: it is gone, it is another
    process that reused the pid, or it lives in a pid namespace we cannot see.
    The session is then judged by its heartbeats alone.
    """
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None
    try:
        created = psutil.Process(pid).create_time()
    except psutil.Error:
        os.close(fd)
        return None
    if abs(created - start_time_s) > START_TIME_SLACK_S:
        os.close(fd)
        return None
    return fd


class Sessions:
    """Every open session, found by id, socket identity or token."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.by_id: dict[int, Session] = {}
        self.by_identity: dict[bytes, Session] = {}
        self._by_token: dict[bytes, Session] = {}
        self.opened_total = 0
        self.ended_total: dict[str, int] = {}

    def open(self, hello: Hello, identity: bytes) -> Session:
        session = Session(next(self._ids), hello.name, hello.pid, hello.start_time_s,
                          secrets.token_bytes(16), time.time(), time.monotonic())
        session.identities.add(identity)
        self.by_id[session.id] = session
        self.by_identity[identity] = session
        self._by_token[session.token] = session
        self.opened_total += 1
        return session

    def by_token(self, token: bytes) -> Session | None:
        return self._by_token.get(token)

    def attach(self, session: Session, identity: bytes) -> None:
        session.identities.add(identity)
        self.by_identity[identity] = session

    def detach(self, session: Session, identity: bytes) -> None:
        """The socket `identity` leaves the session (its client thread ended); the session stays."""
        session.identities.discard(identity)
        if self.by_identity.get(identity) is session:
            del self.by_identity[identity]

    def expired(self, now: float, timeout_s: float) -> list[Session]:
        return [s for s in self.by_id.values() if now - s.last_seen > timeout_s]

    def remove(self, session: Session, reason: str) -> None:
        session.alive = False
        self.by_id.pop(session.id, None)
        self._by_token.pop(session.token, None)
        for identity in session.identities:
            if self.by_identity.get(identity) is session:
                del self.by_identity[identity]
        self.ended_total[reason] = self.ended_total.get(reason, 0) + 1

    def __iter__(self) -> Any:
        return iter(list(self.by_id.values()))

    def __len__(self) -> int:
        return len(self.by_id)


_COUNTER_FIELDS = tuple(f.name for f in fields(ClientCounters))


def counters_dict(counters: ClientCounters) -> dict[str, int]:
    # Not dataclasses.asdict, which deep-copies field by field: 12x slower, and a telemetry
    # snapshot takes this of every client each second.
    return {name: getattr(counters, name) for name in _COUNTER_FIELDS}
