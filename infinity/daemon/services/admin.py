"""Admin: `stats` (the daemon's counters, tiers, catalog, clients and scheduler) and `shutdown`.

Reads every other part of the daemon and changes none: what `infinityd status`
and `infinity-top` show comes from here, and so does each telemetry snapshot
(`snapshot`: a sample for the rates, then `stats`). Every figure is a counter
its part keeps as it works; nothing here walks the catalog's tensors.
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
from infinity.daemon.telemetry import RateMeter
from infinity.daemon.tiers import TierManager
from infinity.protocol import wire
from infinity.protocol.paths import RuntimeLayout

log = logging.getLogger("infinityd")

MAX_CLIENT_NAMESPACES = 32  # of a client's namespaces, the first this many (by name) are listed


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
        self._started_wall = time.time()
        self.rates = RateMeter()
        # The telemetry section (the publisher's `describe`, set once it is built).
        self.telemetry: Callable[[], dict[str, Any]] = lambda: {"interval_s": 0.0}

    def routes(self) -> Routes:
        return {wire.Stats: self.stats_request, wire.Shutdown: self.shutdown}

    def stats_request(self, session: Session, request_id: int, message: wire.Stats) -> list[Any]:
        if not self.config.telemetry.interval_s:
            self.sample()  # no timer takes samples: the rates are since the last request
        stats = self.stats()
        hidden = self.hidden_from(session)
        if hidden:
            _leave_out(stats, hidden)
        return [stats]

    def snapshot(self) -> dict[str, Any]:
        """A telemetry snapshot: the rates over the interval just ended, and `stats`."""
        self.sample()
        return self.stats()

    def sample(self) -> None:
        """Read the counters whose rates `stats` reports."""
        counters: dict[Any, int] = {("cpu", "read"): self.counters.bytes_leased,
                                    ("cpu", "written"): self.counters.bytes_committed,
                                    ("daemon", "requests"): self.counters.requests}
        nvme = self.tiers.nvme
        if nvme is not None:
            for directory in nvme.directories:
                counters[("nvme", directory.path, "read")] = directory.bytes_read
                counters[("nvme", directory.path, "written")] = directory.bytes_written
        for session in self.sessions:
            c = session.counters
            counters[(session.id, "requests")] = c.requests
            counters[(session.id, "get_bytes")] = c.get_bytes
            counters[(session.id, "commit_bytes")] = c.commit_bytes
            counters[(session.id, "optimizer_items")] = c.optimizer_items
            counters[(session.id, "optimizer_parameters")] = c.optimizer_parameters
            counters[(session.id, "steps")] = c.steps
        self.rates.sample(time.monotonic(), counters)

    def shutdown(self, session: Session, request_id: int, message: wire.Shutdown) -> list[Any]:
        log.info("shutdown requested by %s", session.describe())
        self._stop()  # the loop ends after this turn: the reply goes first
        return [None]

    def _tier_stats(self) -> dict[str, Any]:
        extra = self.tiers.stats()
        rate = self.rates.rate
        residency = self.tiers.residency
        counters = self.counters
        tiers: dict[str, Any] = {"cpu": {
            **self.arena.stats(), "hugepages": self.config.cpu.hugepages,
            "lock": self.config.cpu.lock, "resident_tensors": extra.pop("resident_tensors"),
            "evictions_writing_back": extra.pop("evictions_writing_back"),
            "write_behind_bytes": extra.pop("write_behind_bytes"),
            # Pinned: held by a lease (each version once) or reserved; never evicted.
            "leased_bytes": self.catalog.leased_bytes,
            "reserved_bytes": self.catalog.reserved_bytes,
            # Dirty: no clean NVMe copy (kept with an NVMe tier only; without one, no copy is).
            "dirty_bytes": residency.dirty_bytes if self.tiers.nvme is not None else None,
            "loads_in_flight": len(residency.loads),
            "writebacks_in_flight": len(residency.writebacks),
            # Clients' reads and writes of the tier: bytes leased by gets, bytes committed.
            "read_bytes": counters.bytes_leased, "written_bytes": counters.bytes_committed,
            "read_bytes_per_s": rate(("cpu", "read")),
            "written_bytes_per_s": rate(("cpu", "written"))}}
        # The GPU tier is the clients' own: what each reported with its heartbeats.
        tiers["gpu"] = [{"client": s.name, "id": s.id, **d.as_dict()}
                        for s in self.sessions for d in s.devices]
        if "nvme" in extra:
            nvme: dict[str, Any] = dict(extra["nvme"])  # type: ignore[call-overload]
            for d in nvme["dirs"]:
                d["read_bytes_per_s"] = rate(("nvme", d["path"], "read"))
                d["written_bytes_per_s"] = rate(("nvme", d["path"], "written"))
            nvme["read_bytes_per_s"] = round(sum(d["read_bytes_per_s"] for d in nvme["dirs"]), 3)
            nvme["written_bytes_per_s"] = round(sum(d["written_bytes_per_s"]
                                                    for d in nvme["dirs"]), 3)
            # Ops submitted and not completed, each directory's (`queue_depth`) and all; and
            # the engine's batches (a batch stripes over the directories).
            nvme["queue_depth"] = sum(d["queue_depth"] for d in nvme["dirs"])
            engine = self.tiers.engine
            nvme["batches_in_flight"] = engine.pending() if engine is not None else 0
            tiers["nvme"] = nvme
        return tiers

    def _client_stats(self, session: Session, now: float,
                      streams: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
        leases, reservations = self.catalog.client_counts(session.id)
        held, reserved = self.catalog.client_bytes(session.id)
        rate = self.rates.rate
        # The scheduler's accounting of this client's streams (one per namespace it steps in).
        totals: dict[str, float] = {"stall_s": 0.0, "prefetch_hits": 0, "inflight_hits": 0,
                                    "resident_hits": 0, "misses": 0}
        for key in session.streams.values():
            entry = streams.get(key)
            if entry is not None:
                for name in totals:
                    value = entry["totals"].get(name)
                    if isinstance(value, (int, float)):
                        totals[name] += value
        totals["stall_s"] = round(totals["stall_s"], 6)
        return {
            "id": session.id, "name": session.name, "pid": session.pid,
            # (at most MAX_CLIENT_NAMESPACES, so a client of many namespaces keeps a snapshot small)
            "namespaces": sorted(session.namespaces | set(session.streams))[:MAX_CLIENT_NAMESPACES],
            "scheduler_streams": [list(key) for key in session.streams.values()],
            "watched_by_pidfd": session.pidfd is not None,
            "connected_at_s": session.connected_at_s,
            "idle_s": round(now - session.last_seen, 3),
            "sockets": len(session.identities), "mapped_segments": len(session.mapped_segments),
            "leases": leases, "reservations": reservations,
            "leased_bytes": held, "reserved_bytes": reserved, "resident_bytes": held + reserved,
            "gpu": [d.as_dict() for d in session.devices],
            "gpu_used_bytes": sum(d.used_bytes for d in session.devices),
            "requests_per_s": rate((session.id, "requests")),
            "get_bytes_per_s": rate((session.id, "get_bytes")),
            "commit_bytes_per_s": rate((session.id, "commit_bytes")),
            "optimizer_items_per_s": rate((session.id, "optimizer_items")),
            "optimizer_parameters_per_s": rate((session.id, "optimizer_parameters")),
            # Steps begun per second: a training client's steps, and a generating client's
            # tokens (its every forward, one per token, is a step of the daemon's trace).
            "steps_per_s": rate((session.id, "steps")),
            **totals,
            **counters_dict(session.counters),
        }

    def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        scheduler = self.scheduler.snapshot() if self.scheduler is not None else None
        streams = {(entry["namespace"], entry["client"]): entry
                   for entry in (scheduler["clients"] if scheduler is not None else ())}
        clients = [self._client_stats(session, now, streams) for session in self.sessions]
        counters = self.counters
        config = self.config
        return {
            "daemon": {
                "version": __version__, "protocol": wire.PROTOCOL_VERSION, "pid": os.getpid(),
                "uptime_s": round(now - self._started, 3), "runtime_dir": self.layout.root,
                "started_at_s": round(self._started_wall, 3),
                "client_timeout_s": config.daemon.client_timeout_s,
                "poison_released": config.daemon.poison_released,
                "requests_per_s": self.rates.rate(("daemon", "requests")),
                # What an operator asks first about a node's set-up, in one place.
                "settings": {
                    "cpu_budget_bytes": config.cpu.budget_bytes,
                    "cpu_segment_bytes": config.cpu.segment_bytes,
                    "nvme_dirs": list(config.nvme.dirs),
                    "io_backend": (self.tiers.engine.backend if self.tiers.engine is not None
                                   else config.io.backend),
                    "io_queue_depth": config.io.queue_depth,
                    "prefetch": config.scheduler.prefetch,
                    "telemetry_interval_s": config.telemetry.interval_s,
                },
            },
            "tiers": self._tier_stats(),
            "catalog": self.catalog.stats(),
            "clients": clients,
            "scheduler": scheduler,
            "optimizer": self.optimizer_stats(),
            "telemetry": self.telemetry(),
            "recent_errors": list(counters.recent_errors),
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
                # (fields read one by one: asdict deep-copies, 12x slower)
                "tiers": {f.name: getattr(self.tiers.counters, f.name)
                          for f in dataclasses.fields(self.tiers.counters)},
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
