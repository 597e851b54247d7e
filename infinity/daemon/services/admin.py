"""Admin: `stats` (the daemon's counters, tiers, catalog, clients and scheduler) and `shutdown`.

Reads every other part of the daemon and changes none: what `infinityd status`
and `infinity-top` show comes from here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable

from infinity import __version__
from infinity.config import InfinityConfig
from infinity.daemon.arena import CpuArena
from infinity.daemon.catalog import Catalog
from infinity.daemon.scheduler import Scheduler
from infinity.daemon.services.base import DaemonCounters, Routes
from infinity.daemon.sessions import Session, Sessions, counters_dict
from infinity.daemon.fdserver import FdServer
from infinity.daemon.streams import StreamTable
from infinity.daemon.tiers import TierManager
from infinity.protocol import wire
from infinity.protocol.paths import RuntimeLayout

log = logging.getLogger("infinityd")


class AdminService:
    """The daemon's reports, and its stop on request."""

    def __init__(self, config: InfinityConfig, layout: RuntimeLayout, *, arena: CpuArena,
                 catalog: Catalog, tiers: TierManager, scheduler: Scheduler | None,
                 sessions: Sessions, fds: FdServer, streams: StreamTable,
                 counters: DaemonCounters, stop: Callable[[], None],
                 optimizer_stats: Callable[[], dict[str, Any]] = dict,
                 hidden_from: Callable[[Session], set[str]] = lambda session: set()) -> None:
        self.config = config
        self.hidden_from = hidden_from  # the private namespaces a session was not granted
        self.layout = layout
        self.arena = arena
        self.catalog = catalog
        self.tiers = tiers
        self.optimizer_stats = optimizer_stats
        self.scheduler = scheduler
        self.sessions = sessions
        self.fds = fds
        self.streams = streams
        self.counters = counters
        self._stop = stop
        self._started = time.monotonic()

    def routes(self) -> Routes:
        return {wire.Stats: self.stats_request, wire.Shutdown: self.shutdown}

    def stats_request(self, session: Session, request_id: int, message: wire.Stats) -> list[Any]:
        stats = self.stats()
        hidden = self.hidden_from(session)
        if hidden:
            _leave_out(stats, hidden)
        return [stats]

    def shutdown(self, session: Session, request_id: int, message: wire.Shutdown) -> list[Any]:
        log.info("shutdown requested by %s", session.describe())
        self._stop()  # the loop ends after this turn: the reply goes first
        return [None]

    def _tier_stats(self) -> dict[str, Any]:
        extra = self.tiers.stats()
        tiers: dict[str, Any] = {"cpu": {
            **self.arena.stats(), "hugepages": self.config.cpu.hugepages,
            "lock": self.config.cpu.lock, "resident_tensors": extra.pop("resident_tensors"),
            "evictions_writing_back": extra.pop("evictions_writing_back"),
            "write_behind_bytes": extra.pop("write_behind_bytes")}}
        if "nvme" in extra:
            tiers["nvme"] = extra["nvme"]
        return tiers

    def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        clients = []
        for session in self.sessions:
            leases, reservations = self.catalog.client_counts(session.id)
            clients.append({
                "id": session.id, "name": session.name, "pid": session.pid,
                "scheduler_streams": [list(key) for key in session.streams.values()],
                "watched_by_pidfd": session.pidfd is not None,
                "connected_at_s": session.connected_at_s,
                "idle_s": round(now - session.last_seen, 3),
                "sockets": len(session.identities), "mapped_segments": len(session.mapped_segments),
                "leases": leases, "reservations": reservations,
                **counters_dict(session.counters),
            })
        counters = self.counters
        return {
            "daemon": {
                "version": __version__, "protocol": wire.PROTOCOL_VERSION, "pid": os.getpid(),
                "uptime_s": round(now - self._started, 3), "runtime_dir": self.layout.root,
                "client_timeout_s": self.config.daemon.client_timeout_s,
                "poison_released": self.config.daemon.poison_released,
            },
            "tiers": self._tier_stats(),
            "catalog": self.catalog.stats(),
            "clients": clients,
            "scheduler": self.scheduler.snapshot() if self.scheduler is not None else None,
            "optimizer": self.optimizer_stats(),
            "counters": {
                "requests": counters.requests, "items": counters.items,
                "malformed": counters.malformed, "ops": dict(counters.ops),
                "errors": dict(counters.errors), "bytes_leased": counters.bytes_leased,
                "bytes_reserved": counters.bytes_reserved,
                "bytes_committed": counters.bytes_committed,
                "segments_created": self.tiers.counters.segments_created,
                "segment_failures": self.tiers.counters.segment_failures,
                "parked_requests": counters.parked_requests,
                "deferred_replies": counters.deferred_replies,
                "open_streams": len(self.streams),
                "tiers": dataclasses.asdict(self.tiers.counters),
                "fds_sent": self.fds.fds_sent,
                "clients_opened": self.sessions.opened_total,
                "clients_ended": dict(self.sessions.ended_total),
            },
        }


def _leave_out(stats: dict[str, Any], hidden: set[str]) -> None:
    """Take the namespaces in `hidden` (private ones the asking session was not granted) out of
    `stats`, where they are named: the catalog's namespaces, the scheduler's namespaces and
    streams, the clients' scheduler streams."""
    catalog = stats["catalog"]
    catalog["namespaces"] = {ns: c for ns, c in catalog["namespaces"].items() if ns not in hidden}
    scheduler = stats.get("scheduler")
    if scheduler is not None:
        scheduler["namespaces"] = [n for n in scheduler["namespaces"]
                                   if n["namespace"] not in hidden]
        scheduler["clients"] = [c for c in scheduler["clients"] if c["namespace"] not in hidden]
    for client in stats["clients"]:
        client["scheduler_streams"] = [key for key in client["scheduler_streams"]
                                       if key[0] not in hidden]
