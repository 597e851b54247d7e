"""The one configuration loader: TOML file, then `INFINITY_*` environment, then flags.

Each component owns a small frozen dataclass of settings with its own
`validate()`; `InfinityConfig` groups them into tables named like the TOML
tables. A setting has the same name everywhere:

    TOML          [io] queue_depth = 64
    environment   INFINITY_IO_QUEUE_DEPTH=64
    flag          --set io.queue_depth=64

Later sources override earlier ones. Unknown tables, keys and `INFINITY_*`
variables are errors, never silently ignored. The file is found from an
explicit path, else `INFINITY_CONFIG`, else `~/.config/infinity/infinity.toml`
when it exists; with none of them the built-in defaults apply.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from infinity.errors import ConfigError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

ENV_PREFIX = "INFINITY_"
MAX_SECONDS = 86400  # the longest any duration setting may be
ENV_CONFIG_PATH = "INFINITY_CONFIG"
# Variables with the prefix that name no setting: the config file's path, and those the
# project's scripts, build, tests and benchmarks read. Any other INFINITY_* must be a setting.
NOT_SETTINGS = frozenset({ENV_CONFIG_PATH, "INFINITY_VENV", "INFINITY_BUILD_JOBS",
                          "INFINITY_NATIVE_ASAN", "INFINITY_TEST_DISK_DIR",
                          "INFINITY_TEST_WORKERS"})
# The peers' setup script (tools/peers) reads INFINITY_PEERS_*: no setting table is called that.
NOT_SETTINGS_PREFIX = "INFINITY_PEERS_"


def is_setting_variable(name: str) -> bool:
    """Whether an environment variable names a setting (INFINITY_TABLE_KEY), as opposed to one
    the scripts, the build or the tests read."""
    return (name.startswith(ENV_PREFIX) and name not in NOT_SETTINGS
            and not name.startswith(NOT_SETTINGS_PREFIX))
USER_CONFIG_PATH = Path("~/.config/infinity/infinity.toml")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


@dataclass(frozen=True)
class IOConfig:
    """The native async I/O engine. `infinity tune DIR` writes this table."""

    backend: str = "auto"  # auto | io_uring | aio | threads
    block_size_bytes: int = 1 * MiB
    # Chunks each worker keeps in flight. Enough to keep the disk busy (1 MiB x 16 x 2 workers is
    # 32 MiB), and no more: a deeper queue serves every op in flight at once, so a tensor loaded
    # ahead of another arrives no sooner than it (docs/BENCHMARKS.md, bench_overlap).
    queue_depth: int = 16
    num_threads: int = 0  # 0: min(4, cores)
    # Each worker thread's staging memory for staged ops (`nvme.staged_reads`, `staged_writes`),
    # in whole blocks
    # (at least one); it also bounds that thread's staged ops in flight. Small, so that staged
    # data is still in the last-level cache when it is checked and copied.
    staging_bytes: int = 4 * MiB

    def validate(self) -> None:
        _require(
            self.backend in ("auto", "io_uring", "aio", "threads"),
            f"io.backend must be auto, io_uring, aio or threads, not {self.backend!r}",
        )
        _require(
            _power_of_two(self.block_size_bytes) and 4 * KiB <= self.block_size_bytes <= 64 * MiB,
            "io.block_size_bytes must be a power of two between 4096 and 67108864",
        )
        _require(1 <= self.queue_depth <= 4096, "io.queue_depth must be between 1 and 4096")
        _require(0 <= self.num_threads <= 256, "io.num_threads must be between 0 (automatic) and 256")
        _require(0 < self.staging_bytes <= 1024 * MiB,
                 "io.staging_bytes must be between 1 and 1073741824 (it is used in whole blocks, at least one)")

    def resolved_num_threads(self) -> int:
        return self.num_threads or max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True)
class NvmeConfig:
    """The NVMe tier: one directory per drive, striped."""

    dirs: tuple[str, ...] = ()
    capacity_bytes_per_dir: int = 64 * GiB
    stripe_bytes: int = 4 * MiB
    file_grow_bytes: int = 256 * MiB  # preallocation step of each directory's extent file
    direct: str = "auto"  # auto: O_DIRECT where the file system allows it | on | off
    # read_into / write_from move a tensor through `stream_depth` staging slices of this size
    # in the CPU tier, one I/O each, so that copies in the client overlap the disk.
    stream_chunk_bytes: int = 8 * MiB
    stream_depth: int = 4
    # When eviction meets dirty tensors, the tier keeps up to this many more bytes of the
    # coldest dirty tensors being written back, so that later evictions find clean victims.
    write_behind_bytes: int = 256 * MiB
    # Loads (reads) and write-backs (writes) through the engine's huge-page staging memory, a
    # copy into or out of the CPU tier: a disk (notably a virtual one) moves data to and from
    # scattered 4 KiB pages far slower, and the tier's shared memory is such pages when the
    # kernel had little contiguous memory free as the daemon made it (without shmem huge
    # pages). auto: on unless the tier gets huge pages. Off by default (in place, as DESIGN.md
    # says): measured in docs/BENCHMARKS.md, staging wins on fragmented memory and loses up to
    # ~15% on contiguous memory, which is what a daemon started on a fresh node gets.
    staged_reads: str = "off"
    staged_writes: str = "off"

    def validate(self) -> None:
        _require(
            self.capacity_bytes_per_dir > 0 and self.capacity_bytes_per_dir % (4 * KiB) == 0,
            "nvme.capacity_bytes_per_dir must be a positive multiple of 4096",
        )
        _require(
            self.stripe_bytes > 0 and self.stripe_bytes % MiB == 0,
            "nvme.stripe_bytes must be a positive multiple of 1 MiB (1048576), the checksum block",
        )
        _require(
            self.file_grow_bytes > 0 and self.file_grow_bytes % (4 * KiB) == 0,
            "nvme.file_grow_bytes must be a positive multiple of 4096",
        )
        _require(self.direct in ("auto", "on", "off"), "nvme.direct must be auto, on or off")
        _require(len(set(self.dirs)) == len(self.dirs), "nvme.dirs lists a directory twice")
        _require(
            self.stream_chunk_bytes > 0 and self.stream_chunk_bytes % MiB == 0,
            "nvme.stream_chunk_bytes must be a positive multiple of 1 MiB (1048576), the checksum block",
        )
        _require(1 <= self.stream_depth <= 64, "nvme.stream_depth must be between 1 and 64")
        _require(self.write_behind_bytes >= 0, "nvme.write_behind_bytes must be 0 (off) or more")
        for key in ("staged_reads", "staged_writes"):
            _require(getattr(self, key) in ("auto", "on", "off"), f"nvme.{key} must be auto, on or off")


@dataclass(frozen=True)
class CpuTierConfig:
    """The daemon's shared-memory CPU tier."""

    budget_bytes: int = 4 * GiB
    segment_bytes: int = 256 * MiB
    # Huge pages where the system allows (MADV_HUGEPAGE, else MADV_COLLAPSE with prefault);
    # silently 4 KiB pages where it does not. Also what lets NVMe loads run at the disk's speed.
    hugepages: bool = True
    lock: bool = False  # mlock the segments (needs RLIMIT_MEMLOCK >= budget)
    prefault: bool = True
    # Make the budget's segments at start, in the background, instead of when first needed:
    # memory the VM has not backed yet takes 180-250 ms a 64 MiB segment to make on this
    # project's VM, which a fresh daemon's first step otherwise waits for. The daemon then
    # holds its whole budget from the start.
    create_at_start: bool = False
    # The share of the budget that may hold spare reservations: after a `put`, the daemon keeps
    # a fresh slice of the same name and shape for that client's next put of it (one round trip
    # instead of two), taken only from free room (or a segment the budget allows), never by
    # evicting. 0: none.
    spare_fraction: float = 0.125

    @property
    def spare_budget_bytes(self) -> int:
        return int(self.budget_bytes * self.spare_fraction)

    def validate(self) -> None:
        _require(0.0 <= self.spare_fraction <= 0.5, "cpu.spare_fraction must be between 0 and 0.5")
        _require(self.segment_bytes >= 2 * MiB and self.segment_bytes % (2 * MiB) == 0,
                 "cpu.segment_bytes must be a positive multiple of 2 MiB (2097152)")
        _require(self.budget_bytes >= self.segment_bytes,
                 f"cpu.budget_bytes ({self.budget_bytes}) must be at least one segment "
                 f"(cpu.segment_bytes, {self.segment_bytes}); lower cpu.segment_bytes too")
        # Segments come in 2 MiB granules: a remainder could never hold anything, and a tensor
        # that fits the budget but not its granules would be neither too large nor ever placed.
        _require(self.budget_bytes % (2 * MiB) == 0,
                 "cpu.budget_bytes must be a multiple of 2 MiB (2097152)")


def _default_runtime_dir() -> str:
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base):
        return os.path.join(base, "infinity")
    return f"/tmp/infinity-{os.getuid()}"


@dataclass(frozen=True)
class DaemonConfig:
    """infinityd itself: where it lives and how it judges clients."""

    runtime_dir: str = field(default_factory=_default_runtime_dir)
    client_timeout_s: float = 5.0
    heartbeat_interval_s: float = 1.0
    poison_released: bool = False  # debug: overwrite released slices so stale views show
    log_level: str = "info"
    request_timeout_s: float = 30.0  # a client gives up on a reply after this long
    start_timeout_s: float = 30.0  # `infinityd start` / connect(start=True) wait this long for it
    # debug: each parameter of an optimizer step waits this long after the one before it, so a
    # test can stop a trainer in the middle of the daemon's step (0: no wait)
    debug_step_delay_s: float = 0.0
    # Bounds on what clients may open (each session holds a pidfd and an fd-channel socket; a
    # stream, its slots): past them a hello or a stream_open gets a LimitExceededError.
    max_clients: int = 1024
    max_streams_per_client: int = 1024
    # Requests of one client whose replies wait for work off the loop (a get waiting for its
    # load, a stream chunk, a wait for steps): past it, the next request is refused at once.
    max_pending_requests_per_client: int = 4096
    # What holds the daemon's memory without holding tier bytes (so no budget or quota bounds
    # it: a tensor of zero elements costs about 1 KiB of catalog): tensors and reservations,
    # namespace records, the namespaces one client touches (each may give it a scheduler
    # stream), and the tensors one client holds under leases.
    max_tensors: int = 1 << 20
    max_namespaces: int = 65536
    max_namespaces_per_client: int = 4096
    max_leased_per_client: int = 1 << 20

    def validate(self) -> None:
        _require(bool(self.runtime_dir), "daemon.runtime_dir must not be empty")
        _require(self.client_timeout_s > 0, "daemon.client_timeout_s must be positive")
        _require(
            0 < self.heartbeat_interval_s < self.client_timeout_s,
            "daemon.heartbeat_interval_s must be positive and below daemon.client_timeout_s",
        )
        _require(self.log_level in ("debug", "info", "warning", "error"),
                 "daemon.log_level must be debug, info, warning or error")
        _require(self.request_timeout_s > 0, "daemon.request_timeout_s must be positive")
        _require(self.start_timeout_s > 0, "daemon.start_timeout_s must be positive")
        _require(self.debug_step_delay_s >= 0, "daemon.debug_step_delay_s must be 0 or more")
        _require(self.max_clients >= 1, "daemon.max_clients must be at least 1")
        _require(self.max_streams_per_client >= 1,
                 "daemon.max_streams_per_client must be at least 1")
        _require(self.max_pending_requests_per_client >= 1,
                 "daemon.max_pending_requests_per_client must be at least 1")
        for name in ("max_tensors", "max_namespaces", "max_namespaces_per_client",
                     "max_leased_per_client"):
            _require(getattr(self, name) >= 1, f"daemon.{name} must be at least 1")


@dataclass(frozen=True)
class SchedulerConfig:
    """Trace-driven prefetch, next-use eviction and fair sharing (`infinity.daemon.scheduler`)."""

    # Off: no trace-driven prefetch (eviction still follows next use, accounting still runs);
    # what `tools/bench_overlap.py` compares against.
    prefetch: bool = True
    # The prefetch lookahead, in bytes, is the read bandwidth (this stream's share)
    # times the expected compute time of the next `lookahead_accesses` accesses,
    # and at least `lookahead_min_s` of disk time (it covers latency when the
    # client's accesses come in bursts, and keeps the disk busy where the next
    # accesses are a streamed model's small tensors: from 0.01 s to 0.05 s, a 1.1B
    # Llama's tokens took 14% less time, int8 and bf16, docs/BENCHMARKS.md; a
    # training step's next four accesses take about that long already).
    lookahead_accesses: int = 4
    lookahead_min_s: float = 0.05
    # The upcoming data a stream may hold in the tier (resident, in flight and
    # planned), as a fraction of the tier, split evenly between prefetching streams.
    lookahead_max_fraction: float = 0.5
    # Prefetch bytes the engine may have in flight at once, split evenly between
    # competing streams: a short engine queue keeps a newcomer or a demand miss
    # from waiting behind another client's whole window.
    prefetch_inflight_max_bytes: int = 64 * MiB
    # Fair sharing: the bytes each competing stream may add to a plan per deficit
    # round robin round, and how far (in bytes loaded) a stream may get ahead of
    # the least served competing stream.
    fair_quantum_bytes: int = 4 * MiB
    # An access may match one of the next `divergence_window` trace entries
    # (skipping the ones before it); this many unexpected accesses in a row, or a
    # step ending with this many entries left, mean the order changed; so do this
    # many (or an eighth of the trace) tensors off the trace in two steps running.
    divergence_window: int = 4
    # Read bandwidth: an EWMA over samples of bytes read per second of engine
    # busy time. A sample closes when the engine goes idle after at least
    # `bandwidth_sample_min_s` of busy time, or after `bandwidth_sample_max_s`
    # of continuous busy time. The initial value stands until the first sample.
    bandwidth_ewma_alpha: float = 0.25
    bandwidth_sample_min_s: float = 0.005
    bandwidth_sample_max_s: float = 0.1
    initial_read_bandwidth_bytes_per_s: float = 1.0 * GiB
    # A plan looks at most this many trace entries ahead of each client's cursor (it runs on
    # the daemon's loop after every get: its cost must stay bounded however long the trace).
    lookahead_max_entries: int = 1024
    # How fast a trace's timing follows the steps that replay it.
    trace_timing_ewma_alpha: float = 0.25
    # A step with more accesses than this is not traced.
    trace_max_entries: int = 1_000_000
    # Between steps (and near a step's end) prefetch the start of the next step.
    prefetch_across_steps: bool = True
    # Traces kept (in memory and in the store's index) for clients that left, so a restarted
    # one prefetches from its first step; past this many, those that left longest ago go.
    max_kept_traces: int = 1024
    # CPU-tier quotas per tensor namespace. TOML: an inline table
    # `namespace_quota_bytes = { weights = 1073741824 }`; environment and flags:
    # `weights=1073741824,optim=2147483648`.
    namespace_quota_bytes: tuple[tuple[str, int], ...] = ()

    def validate(self) -> None:
        _require(1 <= self.lookahead_accesses <= 1_000_000,
                 "scheduler.lookahead_accesses must be between 1 and 1000000")
        _require(0 <= self.lookahead_min_s <= 60, "scheduler.lookahead_min_s must be between 0 and 60")
        _require(0 < self.lookahead_max_fraction <= 1,
                 "scheduler.lookahead_max_fraction must be above 0 and at most 1")
        _require(self.prefetch_inflight_max_bytes > 0,
                 "scheduler.prefetch_inflight_max_bytes must be positive")
        _require(self.fair_quantum_bytes > 0, "scheduler.fair_quantum_bytes must be positive")
        _require(1 <= self.divergence_window <= 1024,
                 "scheduler.divergence_window must be between 1 and 1024")
        _require(self.max_kept_traces >= 0, "scheduler.max_kept_traces must be 0 or more")
        _require(0 < self.bandwidth_ewma_alpha <= 1,
                 "scheduler.bandwidth_ewma_alpha must be above 0 and at most 1")
        _require(self.bandwidth_sample_min_s >= 0, "scheduler.bandwidth_sample_min_s must be >= 0")
        _require(self.bandwidth_sample_max_s > 0
                 and self.bandwidth_sample_max_s >= self.bandwidth_sample_min_s,
                 "scheduler.bandwidth_sample_max_s must be positive and at least bandwidth_sample_min_s")
        _require(self.initial_read_bandwidth_bytes_per_s > 0
                 and math.isfinite(self.initial_read_bandwidth_bytes_per_s),
                 "scheduler.initial_read_bandwidth_bytes_per_s must be a positive number")
        _require(0 < self.trace_timing_ewma_alpha <= 1,
                 "scheduler.trace_timing_ewma_alpha must be above 0 and at most 1")
        _require(self.trace_max_entries >= 1, "scheduler.trace_max_entries must be positive")
        _require(1 <= self.lookahead_max_entries <= 1_000_000,
                 "scheduler.lookahead_max_entries must be between 1 and 1000000")
        names = [name for name, _ in self.namespace_quota_bytes]
        _require(len(set(names)) == len(names), "scheduler.namespace_quota_bytes names a namespace twice")
        for name, quota in self.namespace_quota_bytes:
            _require(isinstance(name, str) and bool(name),
                     "scheduler.namespace_quota_bytes: namespaces must be non-empty strings")
            _require(isinstance(quota, int) and not isinstance(quota, bool) and quota > 0,
                     f"scheduler.namespace_quota_bytes: the quota of {name!r} must be a positive byte count")

    def quota_bytes(self, namespace: str) -> int | None:
        for name, quota in self.namespace_quota_bytes:
            if name == namespace:
                return quota
        return None


@dataclass(frozen=True)
class TelemetryConfig:
    """What infinityd tells about itself: the snapshot stream and the Prometheus metrics."""

    # A snapshot every interval_s on the telemetry socket of the runtime folder (ZeroMQ PUB),
    # and the rates in `stats` (requests/s, bytes/s) are over the last interval.
    # 0: no stream and no timer; `stats` then measures rates since the previous `stats`.
    interval_s: float = 1.0
    # Prometheus, off by default: an HTTP endpoint on this port (0: none) ...
    prometheus_port: int = 0
    prometheus_address: str = "127.0.0.1"
    # ... and/or a textfile for node_exporter's textfile collector, rewritten every interval
    # ("": none). Both need interval_s > 0: they show the latest snapshot.
    prometheus_textfile: str = ""

    def validate(self) -> None:
        _require(self.interval_s == 0 or self.interval_s >= 0.01,
                 "telemetry.interval_s must be 0 (off) or at least 0.01 seconds")
        _require(0 <= self.prometheus_port <= 65535,
                 "telemetry.prometheus_port must be 0 (off) or a TCP port, 1 to 65535")
        _require(bool(self.prometheus_address), "telemetry.prometheus_address must not be empty")
        _require(not (self.prometheus_textfile or self.prometheus_port) or self.interval_s > 0,
                 "the Prometheus metrics are the telemetry snapshots, taken every "
                 "telemetry.interval_s; set telemetry.interval_s above 0")


@dataclass(frozen=True)
class InfinityConfig:
    """All settings, one table per component."""

    io: IOConfig = field(default_factory=IOConfig)
    nvme: NvmeConfig = field(default_factory=NvmeConfig)
    cpu: CpuTierConfig = field(default_factory=CpuTierConfig)
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    source: str = "defaults"  # the file it was read from, for messages

    def validate(self) -> None:
        self.io.validate()
        self.nvme.validate()
        self.cpu.validate()
        self.daemon.validate()
        self.scheduler.validate()
        self.telemetry.validate()

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in TABLES}


TABLES: dict[str, type] = {
    "io": IOConfig,
    "nvme": NvmeConfig,
    "cpu": CpuTierConfig,
    "daemon": DaemonConfig,
    "scheduler": SchedulerConfig,
    "telemetry": TelemetryConfig,
}


def _fields(table: str) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(TABLES[table])}


def _coerce(table: str, key: str, raw: Any, *, from_text: bool) -> Any:
    """Turn a TOML value (or, with from_text, an environment/flag string) into the field's type."""
    where = f"{table}.{key}"
    kind = _fields(table)[key].type
    try:
        if kind in ("int", int):
            if from_text:
                return int(str(raw).replace("_", ""), 0)
            _require(isinstance(raw, int) and not isinstance(raw, bool), f"{where} must be an integer")
            return raw
        if kind in ("float", float):
            if from_text:
                number = float(raw)
            else:
                _require(isinstance(raw, (int, float)) and not isinstance(raw, bool),
                         f"{where} must be a number")
                number = float(raw)
            # No setting means anything by inf or nan; an infinite timeout hung the client.
            _require(math.isfinite(number), f"{where} must be a finite number, not {raw!r}")
            seconds = key.endswith("_s") and not key.endswith("_per_s")
            _require(not seconds or number <= MAX_SECONDS,
                     f"{where} is {number:g} seconds; give at most {MAX_SECONDS} (a day)")
            return number
        if kind in ("bool", bool):
            if from_text:
                text = str(raw).strip().lower()
                _require(text in ("1", "0", "true", "false", "yes", "no", "on", "off"),
                         f"{where} must be true or false, not {raw!r}")
                return text in ("1", "true", "yes", "on")
            _require(isinstance(raw, bool), f"{where} must be true or false")
            return raw
        if kind in ("str", str):
            _require(isinstance(raw, str), f"{where} must be a string")
            return raw
        if kind in ("tuple[str, ...]",):
            if from_text:
                return tuple(p for p in str(raw).split(os.pathsep if os.pathsep in str(raw) else ",") if p)
            _require(isinstance(raw, list) and all(isinstance(x, str) for x in raw),
                     f"{where} must be a list of strings")
            return tuple(raw)
        if kind in ("tuple[tuple[str, int], ...]",):
            return _quota_pairs(where, raw, from_text=from_text)
    except ValueError as exc:
        raise ConfigError(f"{where}: cannot read {raw!r} ({exc})") from None
    raise ConfigError(f"{where}: unsupported setting type {kind}")


def _quota_pairs(where: str, raw: Any, *, from_text: bool) -> tuple[tuple[str, int], ...]:
    """`{name = bytes}` (TOML) or `name=bytes,name=bytes` (text) as sorted (name, bytes) pairs."""
    if from_text:
        pairs: list[tuple[str, Any]] = []
        for part in (p.strip() for p in str(raw).split(",")):
            if not part:
                continue
            name, sep, number = part.rpartition("=")
            _require(bool(sep) and bool(name.strip()),
                     f"{where} must look like name=bytes,name=bytes, not {raw!r}")
            pairs.append((name.strip(), int(number.strip().replace("_", ""), 0)))
    elif isinstance(raw, dict):
        pairs = list(raw.items())
    else:
        _require(isinstance(raw, (list, tuple)) and all(
            isinstance(p, (list, tuple)) and len(p) == 2 for p in raw),
            f"{where} must be a table of namespace = bytes")
        pairs = [(p[0], p[1]) for p in raw]
    for name, number in pairs:
        _require(isinstance(name, str) and "," not in name and "=" not in name,
                 f"{where}: namespace {name!r} cannot have a quota here (no ',' or '=' in its name)")
        _require(isinstance(number, int) and not isinstance(number, bool),
                 f"{where}: the quota of {name!r} must be an integer byte count")
    return tuple(sorted(pairs))


def settings_text(value: Any) -> str:
    """A setting's value in the loader's text syntax (environment variables and --set flags)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        if all(isinstance(v, (tuple, list)) and len(v) == 2 for v in value) and value:
            return ",".join(f"{name}={number}" for name, number in value)
        return os.pathsep.join(value)
    return repr(value) if isinstance(value, float) else str(value)


def settings_as_toml(config: InfinityConfig) -> str:
    """Every setting as the TOML file `load_config` reads back to the same values: unlike the
    text of flags, it carries any path (a comma or a colon in a folder's name) as it is."""
    import tomlkit  # only this and `infinity tune` write TOML

    document = tomlkit.document()
    for table in TABLES:
        section = tomlkit.table()
        for key, value in dataclasses.asdict(getattr(config, table)).items():
            if _fields(table)[key].type == "tuple[tuple[str, int], ...]":
                pairs = tomlkit.inline_table()
                pairs.update({name: number for name, number in value})
                section[key] = pairs
            else:
                section[key] = list(value) if isinstance(value, tuple) else value
        document[table] = section
    return tomlkit.dumps(document)


def _apply(values: dict[str, dict[str, Any]], table: str, key: str, raw: Any, *,
           from_text: bool, origin: str) -> None:
    if table not in TABLES:
        raise ConfigError(f"{origin}: unknown table [{table}]; known tables: {', '.join(TABLES)}")
    if key not in _fields(table):
        known = ", ".join(_fields(table))
        raise ConfigError(f"{origin}: unknown setting {table}.{key}; [{table}] has: {known}")
    values.setdefault(table, {})[key] = _coerce(table, key, raw, from_text=from_text)


def find_config_path(explicit: str | os.PathLike[str] | None = None,
                     *, env: Mapping[str, str] | None = None) -> Path | None:
    """The config file that `load_config` would read, or None for built-in defaults."""
    env = os.environ if env is None else env
    if explicit:
        return Path(explicit).expanduser()
    if env.get(ENV_CONFIG_PATH):
        return Path(env[ENV_CONFIG_PATH]).expanduser()
    user = USER_CONFIG_PATH.expanduser()
    return user if user.exists() else None


def load_config(path: str | os.PathLike[str] | None = None, *,
                env: Mapping[str, str] | None = None,
                overrides: Sequence[str] | Mapping[str, Any] = ()) -> InfinityConfig:
    """Read the file, the environment and the flag overrides, validate, and return the settings.

    `overrides` is either `["io.queue_depth=64", ...]` (flag text) or a mapping
    `{"io.queue_depth": 64}` of already-typed values.
    """
    env = os.environ if env is None else env
    values: dict[str, dict[str, Any]] = {}
    config_path = find_config_path(path, env=env)
    source = "defaults"
    if config_path is not None:
        named_by = ("--config" if path else ENV_CONFIG_PATH if env.get(ENV_CONFIG_PATH)
                    else "the default location")
        try:
            with open(config_path, "rb") as f:
                document = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {config_path} (from {named_by}) does not exist; "
                              f"create it or name another") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {config_path} is not valid TOML: {exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {config_path} is not UTF-8 text ({exc.reason}); "
                              f"save it as UTF-8 TOML") from None
        except OSError as exc:
            raise ConfigError(f"config file {config_path} (from {named_by}) cannot be read: "
                              f"{exc.strerror or exc}; name a readable TOML file") from None
        for table, entries in document.items():
            if not isinstance(entries, dict):
                raise ConfigError(f"{config_path}: top-level key {table!r} must be a [table]")
            for key, raw in entries.items():
                _apply(values, table, key, raw, from_text=False, origin=str(config_path))
        source = str(config_path)

    for name, raw in env.items():
        if not is_setting_variable(name):
            continue
        rest = name[len(ENV_PREFIX):].lower()
        table, _, key = rest.partition("_")
        _apply(values, table, key, raw, from_text=True, origin=f"environment variable {name}")

    items = overrides.items() if isinstance(overrides, Mapping) else (
        _split_flag(text) for text in overrides)
    for dotted, raw in items:
        table, _, key = dotted.partition(".")
        _apply(values, table, key, raw, from_text=isinstance(raw, str) and not isinstance(overrides, Mapping),
               origin=f"setting {dotted}")

    try:
        config = InfinityConfig(
            **{table: TABLES[table](**values.get(table, {})) for table in TABLES}, source=source)
    except TypeError as exc:
        raise ConfigError(str(exc)) from None
    config.validate()
    return config


def _split_flag(text: str) -> tuple[str, str]:
    dotted, sep, raw = text.partition("=")
    if not sep or "." not in dotted:
        raise ConfigError(f"setting {text!r} must look like table.key=value, e.g. io.queue_depth=64")
    return dotted.strip(), raw.strip()
