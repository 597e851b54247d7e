"""Steps: the clients' step markers and what they will read next, as the scheduler sees them.

Each client's accesses in a namespace belong to one scheduler stream, named
(namespace, client name): the trace a later process of the same name replays.
While a client marks steps, its accesses in every namespace go to the stream of
its step's namespace. A client whose name another live client holds gets a
stream of its own, "<name>#<session id>", kept only as long as its session
(one trace cannot describe two processes). Traces are kept in the index by
`TraceKeeper`; the plans that follow news are started by `PrefetchPlanner`.

Without an NVMe tier there is no scheduler: steps are answered "untracked" and
nothing is upcoming.
"""

from __future__ import annotations

import time
from typing import Any

from infinity.config import SchedulerConfig
from infinity.daemon.catalog import Version
from infinity.daemon.namespaces import Namespaces
from infinity.daemon.scheduler import Scheduler, StreamKey
from infinity.daemon.scheduler.view import TensorResidency
from infinity.daemon.services.base import Routes
from infinity.daemon.services.prefetch import PrefetchPlanner
from infinity.daemon.services.traces import TraceKeeper
from infinity.daemon.sessions import Session
from infinity.protocol import wire


class StepService:
    """The `step` and `upcoming` requests, and each session's scheduler streams."""

    def __init__(self, config: SchedulerConfig, scheduler: Scheduler | None, traces: TraceKeeper,
                 planner: PrefetchPlanner, *, tensors: TensorResidency,
                 namespaces: Namespaces) -> None:
        self.config = config
        self.namespaces = namespaces  # a step's namespace is one its session touches
        self.scheduler = scheduler
        self.tensors = tensors  # the residency the scheduler asks: a write makes a tensor resident
        self.traces = traces
        self.planner = planner
        self._owners: dict[StreamKey, int] = {}  # stream -> the live session that holds it
        # Streams of a client whose name another live client had: keyed "<name>#<session id>",
        # kept only as long as their session.
        self._private: set[StreamKey] = set()

    def routes(self) -> Routes:
        return {wire.Step: self.step, wire.Upcoming: self.upcoming}

    # --- streams -------------------------------------------------------------------

    def stream_of(self, session: Session, namespace: str) -> StreamKey:
        """The scheduler stream a client's access in `namespace` belongs to (see Session)."""
        if session.step_namespace is not None:
            namespace = session.step_namespace
        stream = session.streams.get(namespace)
        if stream is None:
            stream = (namespace, session.name)
            if self._owners.get(stream, session.id) != session.id:
                # Another live client has this name: one trace cannot describe two processes.
                # (A client may be named like such a key itself: take one nobody holds.)
                suffix = f"#{session.id}"
                while (namespace, session.name + suffix) in self._owners:
                    suffix += f"#{session.id}"
                stream = (namespace, session.name + suffix)
                self._private.add(stream)
            self._owners[stream] = session.id
            session.streams[namespace] = stream
            assert self.scheduler is not None
            self.scheduler.attach(stream, time.monotonic())
        return stream

    def wrote(self, session: Session, version: Version) -> None:
        """The session published `version`: a write access of its stream."""
        if self.scheduler is not None:
            stream = self.stream_of(session, version.key[0])
            self.tensors.make_resident(version.key, version.nbytes)
            self.scheduler.touched(stream, version.key, version.nbytes, time.monotonic(), write=True)
            self.planner.due = True

    def _save_trace(self, stream: StreamKey) -> None:
        if stream not in self._private:  # a "#<id>" stream lives only as long as its session
            self.traces.save(stream)

    # --- requests ------------------------------------------------------------------

    def upcoming(self, session: Session, request_id: int, message: wire.Upcoming) -> list[Any]:
        upcoming: list[list[Any]] = []
        # The stream this client's accesses in the namespace go to, if it has one yet (asking
        # makes none: it is not an access).
        stream = session.streams.get(session.step_namespace or message.namespace)
        if self.scheduler is not None and stream is not None:
            upcoming = [[key[1], nbytes] for key, nbytes in self.scheduler.upcoming(
                stream, namespace=message.namespace, max_entries=message.max_entries,
                max_bytes=message.max_bytes)]
        return [upcoming]

    def step(self, session: Session, request_id: int, message: wire.Step) -> list[Any]:
        self.namespaces.admit(session, (message.namespace,))  # it may give the session a stream
        if message.phase == "begin":
            session.counters.steps += 1
        scheduler = self.scheduler
        if scheduler is None:
            report = wire.StepReport("untracked", 0, {})
            return [report.to_wire() if message.phase == "end" else None]
        now = time.monotonic()
        if message.phase == "abort":
            scheduler.step_abort(self.stream_of(session, message.namespace), now)
            self.planner.due = True
            return [None]
        if message.phase == "begin":
            if session.step_namespace not in (None, message.namespace):
                # A step in another namespace was left open: it ends here.
                self._end_step(session, now)
            session.step_namespace = message.namespace
            stream = self.stream_of(session, message.namespace)
            summary = scheduler.step_begin(stream, now)
        else:
            session.step_namespace = message.namespace
            stream = self.stream_of(session, message.namespace)
            summary = scheduler.step_end(stream, now)
        self.planner.due = True
        result = None
        if summary is not None:
            if summary.trace_updated:
                self._save_trace(stream)
            result = wire.StepReport(summary.outcome, summary.trace_entries,
                                     summary.counters).to_wire()
        return [result]

    def _end_step(self, session: Session, now: float) -> None:
        assert self.scheduler is not None and session.step_namespace is not None
        stream = self.stream_of(session, session.step_namespace)
        if self.scheduler.step_end(stream, now).trace_updated:
            self._save_trace(stream)

    # --- a session's end -------------------------------------------------------------

    def client_gone(self, session: Session) -> None:
        """The session ends (or the daemon stops): its streams are left, their traces saved."""
        scheduler = self.scheduler
        if scheduler is None:
            return
        now = time.monotonic()
        for stream in session.streams.values():
            scheduler.client_gone(stream, now)
            if self._owners.get(stream) == session.id:
                del self._owners[stream]
            if stream in self._private:
                self._private.discard(stream)
                scheduler.remove_stream(stream)  # never saved: nobody can come back to it
            elif scheduler.trace_of(stream) is None:
                # Nothing to come back to: a stream per namespace ever stepped in would
                # otherwise stay for the daemon's life (and every plan would walk them).
                scheduler.remove_stream(stream)
            else:
                self._save_trace(stream)  # with the timing its replayed steps refined
        session.streams.clear()
        # Clients named anew for each job would otherwise leave a trace each, for good.
        for stream in scheduler.traces_beyond(self.config.max_kept_traces):
            scheduler.remove_stream(stream)
            self._save_trace(stream)  # no trace now: deleted from the index
            self.traces.forget(stream)
        self.planner.due = True
