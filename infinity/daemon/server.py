"""The daemon: builds its parts and services, binds the sockets, runs the loop, and closes.

This module only composes: the CPU arena, the tier manager, the catalog and
(with an NVMe tier) the scheduler hold the data; the services
(`infinity.daemon.services`) serve the requests; the dispatcher
(`infinity.daemon.dispatch`) owns the control socket and routes each request
to the handler its service registered. Everything runs on the event loop's
thread.

A new service is built here, after what it needs, and its routes are
registered with the others (see the services tuple in `Daemon.__init__`).
"""

from __future__ import annotations

import logging
import os

from infinity import __version__
from infinity.config import InfinityConfig
from infinity.daemon.arena import CpuArena
from infinity.daemon.catalog import Catalog, version_clock
from infinity.daemon.dispatch import Dispatcher
from infinity.daemon import namespace_file
from infinity.daemon.loop import EventLoop
from infinity.daemon.namespaces import Namespaces
from infinity.daemon.scheduler import Scheduler
from infinity.daemon.services.admin import AdminService
from infinity.daemon.services.base import DaemonCounters
from infinity.daemon.services.data import DataService
from infinity.daemon.services.handshake import SessionService
from infinity.daemon.services.namespaces import NamespaceService
from infinity.daemon.services.optimizer import OptimizerService
from infinity.daemon.services.verify import VerifyService
from infinity.daemon.services.prefetch import PrefetchPlanner
from infinity.daemon.services.steps import StepService
from infinity.daemon.services.streams import StreamService
from infinity.daemon.services.traces import TraceKeeper
from infinity.daemon.sessions import Sessions
from infinity.daemon.residency import Residency
from infinity.daemon.restore import restore_catalog
from infinity.daemon.streams import StreamTable
from infinity.daemon.tasks import LoopTaskPool
from infinity.daemon.telemetry import TelemetryPublisher
from infinity.daemon.tiers import TierManager
from infinity.protocol.paths import RuntimeLayout

log = logging.getLogger("infinityd")


class Daemon:
    """infinityd's parts and services, all on one loop thread."""

    def __init__(self, config: InfinityConfig, layout: RuntimeLayout, *, secret: bytes) -> None:
        self.config = config
        self.layout = layout
        self.loop = EventLoop()
        self.arena = CpuArena(config.cpu, poison=config.daemon.poison_released,
                              on_retire=self._on_segment_retired)
        # Built in one pass, each from what is built before it: residency (the one owner of
        # what is in the CPU tier, which the scheduler and the tiers ask), the scheduler, the
        # tiers, then the catalog on top of them; both stamp from one clock.
        self.residency = Residency()
        # The scheduler decides what the CPU tier keeps and loads ahead; with no NVMe tier
        # everything is resident and there is nothing to decide.
        self.scheduler: Scheduler | None = None
        if config.nvme.dirs:
            self.scheduler = Scheduler(config.scheduler, cpu_tier_bytes=config.cpu.budget_bytes,
                                       residency=self.residency.tensors,
                                       is_pinned=self.residency.is_pinned)
        clock = version_clock()
        self.tiers = TierManager(config, self.loop, self.arena, self.residency, clock=clock,
                                 scheduler=self.scheduler)
        self.catalog = Catalog(self.tiers, clock=clock,
                               spare_budget_bytes=config.cpu.spare_budget_bytes,
                               segment_class_of=self.arena.class_for,
                               max_tensors=config.daemon.max_tensors,
                               max_leased_per_client=config.daemon.max_leased_per_client)
        restored = restore_catalog(self.catalog, self.tiers.durability)
        if self.tiers.durable:
            log.info("NVMe tier: %d flushed tensor(s) restored from the index", restored)

        # --- the services, each after what it uses ---
        self.counters = DaemonCounters()
        self.sessions = Sessions()
        # The records register a read-only namespace's segment class with the arena, which the
        # catalog and the loads ask.
        self.namespaces = Namespaces(self.catalog, self.arena,
                                     session_alive=self.sessions.by_id.__contains__,
                                     records_path=namespace_file.records_path(config.nvme.dirs),
                                     run_in_worker=self.loop.run_in_worker,
                                     max_records=config.daemon.max_namespaces,
                                     max_per_client=config.daemon.max_namespaces_per_client)
        self.traces = TraceKeeper(self.scheduler, self.tiers)
        self.traces.restore()
        self.planner = PrefetchPlanner(config.scheduler, self.loop, self.scheduler, self.catalog,
                                       self.tiers, self.arena)
        self.steps = StepService(config.scheduler, self.scheduler, self.traces, self.planner,
                                 tensors=self.residency.tensors, namespaces=self.namespaces)
        self.data = DataService(self.catalog, self.tiers, self.scheduler, self.steps,
                                self.planner, self.counters, self.namespaces)
        self.streams = StreamTable(config.nvme, self.catalog, self.tiers,
                                   max_per_client=config.daemon.max_streams_per_client)
        self.stream_service = StreamService(self.streams, self.counters, self.namespaces)
        self.namespace_service = NamespaceService(self.namespaces, self.catalog)
        # Compute beside the data (the optimizer's kernels) runs on one native task pool whose
        # completions wake the loop, as the I/O engine's do.
        self.tasks = LoopTaskPool(self.loop)
        self.optimizer = OptimizerService(self.loop, self.catalog, self.tiers, self.counters,
                                          self.namespaces, self.tasks,
                                          cpu_tier_bytes=config.cpu.budget_bytes,
                                          item_delay_s=config.daemon.debug_step_delay_s)
        # A session's end: its scheduler streams first, then its streams, then its leases, then
        # the optimizer steps it had not sent all of.
        self.session_service = SessionService(
            config, layout, self.loop, self.arena, sessions=self.sessions,
            client_gone=(self.steps.client_gone, self.stream_service.client_gone,
                         self.data.client_gone, self.optimizer.client_gone),
            may_write=self.namespaces.may_map_writable, secret=secret)
        self.admin = AdminService(config, layout, arena=self.arena, catalog=self.catalog,
                                  tiers=self.tiers, scheduler=self.scheduler,
                                  sessions=self.sessions, fds=self.session_service.fds,
                                  streams=self.streams, counters=self.counters, stop=self.stop,
                                  optimizer_stats=self.optimizer.stats,
                                  hidden_from=self.namespaces.hidden_from)

        # --- the dispatcher: every op to its service's handler ---
        self.dispatcher = Dispatcher(self.loop, self.sessions, self.counters,
                                     release=self.data.release_ids,
                                     guard=self.namespaces.check_request,
                                     max_pending_per_client=(
                                         config.daemon.max_pending_requests_per_client))
        self.verifier = VerifyService(self.catalog, self.tiers.nvme, self.counters)
        for service in (self.session_service, self.data, self.stream_service, self.steps,
                        self.namespace_service, self.optimizer, self.verifier, self.admin):
            self.dispatcher.register(service.routes())
        self.dispatcher.register_socket_ops(openers=self.session_service.openers(),
                                            socket_routes=self.session_service.socket_routes())
        self.dispatcher.check_complete()
        # What the daemon tells about itself: a snapshot every telemetry.interval_s on the
        # telemetry socket, on the dispatcher's ZeroMQ context (no second I/O thread).
        self.telemetry = TelemetryPublisher(config.telemetry, self.loop, layout,
                                            self.dispatcher.context, snapshot=self.admin.snapshot)
        self.admin.telemetry = self.telemetry.describe
        if config.telemetry.prometheus_port or config.telemetry.prometheus_textfile:
            # Imported only when asked for: most daemons export nothing.
            from infinity.daemon.prometheus import PrometheusExporter

            self.telemetry.exporters.append(PrometheusExporter(
                config.telemetry, run_in_worker=self.loop.run_in_worker))

    # --- lifecycle ----------------------------------------------------------------

    def bind(self) -> None:
        """Open the control socket and the fd channel (stale socket files are removed first)."""
        for path in (self.layout.control_path, self.layout.fds_path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.dispatcher.bind(self.layout.control_endpoint)
        os.chmod(self.layout.control_path, 0o600)
        self.telemetry.bind()
        self.session_service.start(drain=self.dispatcher.drain)

    def run(self) -> None:
        log.info("infinityd %s serving %s (CPU tier budget %d bytes in segments of %d, "
                 "client timeout %.1fs)", __version__, self.layout.root, self.config.cpu.budget_bytes,
                 self.config.cpu.segment_bytes, self.config.daemon.client_timeout_s)
        if self.config.cpu.create_at_start:
            self.tiers.space.make_blanks_ahead()
        self.loop.run()

    def stop(self) -> None:
        """Ask the loop to end (thread-safe, signal-safe)."""
        self.loop.stop()

    def close(self) -> None:
        for session in list(self.sessions):
            self.steps.client_gone(session)  # traces refined since they were last saved
        self.traces.closing = self.planner.closing = self.data.closing = True
        self.optimizer.close()
        self.tasks.close()  # the steps under way finish their arithmetic first
        # First let the I/O and index work in flight finish: flushes that complete are still
        # answered, and nothing is freed under the engine.
        self.tiers.close()
        self.session_service.close()
        self.telemetry.close()  # before the dispatcher, which terminates the shared context
        self.dispatcher.close()
        self.loop.close()
        self.arena.close()
        for path in (self.layout.control_path, self.layout.fds_path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def _on_segment_retired(self, segment: int) -> None:
        self.session_service.segment_retired(segment)
