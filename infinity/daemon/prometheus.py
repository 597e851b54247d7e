"""Prometheus: the telemetry snapshot's figures as metrics, over HTTP and/or in a textfile.

Off by default (`telemetry.prometheus_port`, `telemetry.prometheus_textfile`).
The exporter keeps the latest snapshot the publisher hands it (`update`, on the
loop thread) and turns it into metric families when it is scraped (on
prometheus_client's HTTP thread: it reads that one immutable map and touches
no part of the daemon) or when the textfile is rewritten (on the loop's
worker thread: the loop never waits on the disk). Names follow Prometheus'
conventions: `infinity_` first, base units in the name (`_bytes`,
`_seconds`), counters end in `_total`, per-directory and per-client figures
are labels.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from infinity.config import TelemetryConfig
from infinity.errors import ConfigError

log = logging.getLogger("infinityd")

RunInWorker = Callable[[Callable[[], None], Callable[[Any], None]], None]


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class _Families:
    """Builds metric families, skipping figures a snapshot does not carry."""

    def __init__(self) -> None:
        self.families: list[Metric] = []

    def gauge(self, name: str, doc: str, value: Any) -> None:
        number = _number(value)
        if number is not None:
            self.families.append(GaugeMetricFamily(name, doc, value=number))

    def counter(self, name: str, doc: str, value: Any) -> None:
        number = _number(value)
        if number is not None:
            self.families.append(CounterMetricFamily(name, doc, value=number))

    def labelled(self, family: GaugeMetricFamily | CounterMetricFamily,
                 rows: list[tuple[list[str], Any]]) -> None:
        for labels, value in rows:
            number = _number(value)
            if number is not None:
                family.add_metric(labels, number)
        self.families.append(family)


def metric_families(stats: dict[str, Any]) -> list[Metric]:
    """The metrics of one `stats` map (what a scrape or the textfile shows)."""
    out = _Families()
    daemon = stats.get("daemon") or {}
    info = GaugeMetricFamily("infinity_daemon_info", "infinityd's version and protocol; always 1",
                             labels=["version", "protocol"])
    info.add_metric([str(daemon.get("version", "")), str(daemon.get("protocol", ""))], 1.0)
    out.families.append(info)
    out.gauge("infinity_daemon_uptime_seconds", "Seconds since infinityd started",
              daemon.get("uptime_s"))
    out.gauge("infinity_daemon_start_time_seconds", "When infinityd started (Unix time)",
              daemon.get("started_at_s"))
    counters = stats.get("counters") or {}
    out.counter("infinity_requests", "Requests received", counters.get("requests"))
    errors = CounterMetricFamily("infinity_errors", "Errors answered, by error code",
                                 labels=["code"])
    codes = sorted((counters.get("errors") or {}).items())
    out.labelled(errors, [([code], n) for code, n in codes])

    cpu = (stats.get("tiers") or {}).get("cpu") or {}
    for key, name, doc in (
            ("budget_bytes", "capacity_bytes", "The CPU tier's budget"),
            ("used_bytes", "used_bytes", "Bytes of the CPU tier in use"),
            ("leased_bytes", "leased_bytes", "Bytes of the CPU tier held by leases (pinned)"),
            ("reserved_bytes", "reserved_bytes", "Bytes of the CPU tier reserved by clients"),
            ("dirty_bytes", "dirty_bytes", "Bytes of the CPU tier with no clean NVMe copy"),
            ("loads_in_flight", "loads_in_flight", "Loads from NVMe under way"),
            ("resident_tensors", "resident_tensors", "Tensors resident in the CPU tier")):
        out.gauge(f"infinity_cpu_tier_{name}", doc, cpu.get(key))
    out.counter("infinity_cpu_tier_read_bytes", "Bytes clients leased from the CPU tier",
                cpu.get("read_bytes"))
    out.counter("infinity_cpu_tier_written_bytes", "Bytes clients committed to the CPU tier",
                cpu.get("written_bytes"))

    nvme = (stats.get("tiers") or {}).get("nvme")
    if isinstance(nvme, dict):
        dirs = [d for d in nvme.get("dirs") or () if isinstance(d, dict)]
        for key, name, kind, doc in (
                ("capacity_bytes", "infinity_nvme_capacity_bytes", GaugeMetricFamily,
                 "An NVMe directory's capacity"),
                ("used_bytes", "infinity_nvme_used_bytes", GaugeMetricFamily,
                 "Bytes of an NVMe directory in use"),
                ("bytes_read", "infinity_nvme_read_bytes", CounterMetricFamily,
                 "Bytes read from an NVMe directory"),
                ("bytes_written", "infinity_nvme_written_bytes", CounterMetricFamily,
                 "Bytes written to an NVMe directory"),
                ("queue_depth", "infinity_nvme_queue_depth", GaugeMetricFamily,
                 "I/O ops submitted to an NVMe directory and not completed")):
            out.labelled(kind(name, doc, labels=["dir"]),
                         [([str(d.get("path"))], d.get(key)) for d in dirs])
        out.labelled(GaugeMetricFamily(
            "infinity_nvme_failed", "1 once an NVMe directory failed (its file system turned "
            "read-only, or its device reports errors): nothing more is written there",
            labels=["dir"]), [([str(d.get("path"))], int(bool(d.get("failure")))) for d in dirs])

    gpus = [g for g in (stats.get("tiers") or {}).get("gpu") or () if isinstance(g, dict)]
    for key, name, kind, doc in (
            ("budget_bytes", "infinity_gpu_tier_capacity_bytes", GaugeMetricFamily,
             "A client's device cache budget on a device (as the client reported it)"),
            ("used_bytes", "infinity_gpu_tier_used_bytes", GaugeMetricFamily,
             "Bytes of a client's device caches in use on a device"),
            ("copied_bytes", "infinity_gpu_tier_copied_bytes", CounterMetricFamily,
             "Bytes a client copied into device memory")):
        out.labelled(kind(name, doc, labels=["client", "id", "device"]),
                     [([str(g.get("client")), str(g.get("id")), str(g.get("device"))], g.get(key))
                      for g in gpus])

    catalog = stats.get("catalog") or {}
    out.gauge("infinity_tensors", "Tensors in the store", catalog.get("num_tensors"))
    out.gauge("infinity_tensor_bytes", "Bytes of the store's current tensors",
              catalog.get("tensor_bytes"))

    clients = [c for c in stats.get("clients") or () if isinstance(c, dict)]
    out.gauge("infinity_clients", "Clients attached", len(clients))
    for key, name, kind, doc in (
            ("requests", "infinity_client_requests", CounterMetricFamily, "A client's requests"),
            ("resident_bytes", "infinity_client_resident_bytes", GaugeMetricFamily,
             "Bytes a client holds in the CPU tier (leased and reserved)"),
            ("leases", "infinity_client_leases", GaugeMetricFamily, "Leases a client holds"),
            ("get_bytes", "infinity_client_get_bytes", CounterMetricFamily,
             "Bytes a client's gets leased"),
            ("commit_bytes", "infinity_client_commit_bytes", CounterMetricFamily,
             "Bytes a client committed"),
            ("stall_s", "infinity_client_stall_seconds", CounterMetricFamily,
             "Seconds a client's gets waited for loads from NVMe"),
            ("prefetch_hits", "infinity_client_prefetch_hits", CounterMetricFamily,
             "Reads a client found resident thanks to a prefetch"),
            ("misses", "infinity_client_prefetch_misses", CounterMetricFamily,
             "Reads a client had to wait for (not resident, no prefetch under way)"),
            ("steps", "infinity_client_steps", CounterMetricFamily,
             "Steps a client began (a generating client: one per token)"),
            ("optimizer_items", "infinity_client_optimizer_steps", CounterMetricFamily,
             "Parameters' optimizer steps infinityd applied for a client"),
            ("optimizer_parameters", "infinity_client_optimizer_parameters", CounterMetricFamily,
             "Parameter elements those steps updated")):
        out.labelled(kind(name, doc, labels=["client", "id"]),
                     [([str(c.get("name")), str(c.get("id"))], c.get(key)) for c in clients])
    telemetry = stats.get("telemetry") or {}
    out.counter("infinity_telemetry_snapshots", "Telemetry snapshots taken",
                telemetry.get("snapshots"))
    return out.families


class _SnapshotCollector:
    """prometheus_client's collector interface over the latest snapshot."""

    def __init__(self) -> None:
        self.latest: dict[str, Any] | None = None

    def collect(self) -> Iterator[Metric]:
        latest = self.latest  # one read: the publisher swaps in a new map, never edits one
        if latest is not None:
            yield from metric_families(latest)


class PrometheusExporter:
    """Serves `telemetry.prometheus_port` and rewrites `telemetry.prometheus_textfile`."""

    def __init__(self, config: TelemetryConfig, *, run_in_worker: RunInWorker) -> None:
        self.config = config
        self._run_in_worker = run_in_worker
        self._collector = _SnapshotCollector()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self._collector)  # type: ignore[arg-type]
        self._server: Any = None
        self._writing = False  # a textfile write is under way: the next snapshot skips it
        if config.prometheus_port:
            try:
                self._server, _ = start_http_server(config.prometheus_port,
                                                    config.prometheus_address,
                                                    registry=self.registry)
            except OSError as exc:
                raise ConfigError(
                    f"telemetry.prometheus_port {config.prometheus_port} on "
                    f"{config.prometheus_address} cannot be served ({exc.strerror or exc}); "
                    f"choose a free port, or 0 for none") from None
            log.info("Prometheus metrics on http://%s:%d/metrics", config.prometheus_address,
                     config.prometheus_port)

    def update(self, stats: dict[str, Any]) -> None:
        self._collector.latest = stats
        path = self.config.prometheus_textfile
        if path and not self._writing:
            self._writing = True
            self._run_in_worker(lambda: write_to_textfile(path, self.registry), self._written)

    def _written(self, future: Any) -> None:
        self._writing = False
        error = future.exception()
        if error is not None:
            log.warning("the Prometheus textfile %s was not written: %s",
                        self.config.prometheus_textfile, error)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
