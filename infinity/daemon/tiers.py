"""The tier manager: where each version's bytes live (CPU tier, NVMe, or both), and moving them.

`TierManager` is the one object the catalog, the server and the streams talk
to; it opens the NVMe tier and composes the modules that each own one job:

- `infinity.daemon.residency`: which versions are in the CPU tier, what I/O is
  on them, which may leave now (built first, before the scheduler and this);
- `infinity.daemon.growth`: the tiers' growth, room handed out and given back,
  versions freed once the catalog let go and their I/O ended;
- `infinity.daemon.eviction`: victims, evictions and write-behind;
- `infinity.daemon.loads`: loads and prefetches from NVMe;
- `infinity.daemon.durability`: flushes with the index ordering and the
  recovery from a failed fdatasync (`infinity.daemon.restore` rebuilds the
  catalog from the index at start).

It implements the catalog's `Storage` hooks, so it hears of every version
that is published, replaced, written in place or let go. The methods the
others call are the components' own, bound here once (no call through this
facade on the request path). Everything runs on the loop thread and nothing
blocks: I/O completes on the engine's threads and comes back through its
completion fd, SQLite through the index's. It knows nothing of sockets or
sessions: callers pass callbacks, which run on the loop thread with None or the
typed error.

Invariants:
- a version with a lease, I/O in flight or a stream on it is never evicted nor
  freed; a version being written back is not evicted before the write ends;
- an NVMe copy (`DiskCopy`) is immutable once written; its extents are freed
  only when no version owns it, the index does not point at it, and no index
  transaction that would point at it is in flight;
- index updates for one name are issued in version order (see durability).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Callable

from infinity.config import InfinityConfig
from infinity.daemon.arena import CpuArena, shmem_hugepages_allowed
from infinity.daemon.catalog import Key, Version
from infinity.daemon.diskcopy import DiskCopy
from infinity.daemon.durability import Durability
from infinity.daemon.eviction import Eviction
from infinity.daemon.growth import TierSpace
from infinity.daemon.loads import Loads
from infinity.daemon.loop import EventLoop
from infinity.daemon.policy import EvictionPolicy, default_policy
from infinity.daemon.residency import Callback, Residency, TierCounters
from infinity.daemon.scheduler import Scheduler
from infinity.errors import InfinityError
from infinity.io import IOEngine, probe_shared_memory_collapse
from infinity.store.durable import DurableIndex
from infinity.store.nvme import NvmeTier

__all__ = ["Callback", "DiskCopy", "TierManager", "staged_wanted"]

log = logging.getLogger("infinityd.tiers")


def staged_wanted(config: InfinityConfig, setting: str) -> bool:
    """Whether a direction of NVMe I/O goes through the engine's staging memory, by its setting
    (nvme.staged_reads, nvme.staged_writes); auto: when the CPU tier's shared memory cannot get
    huge pages (on request or by MADV_COLLAPSE), so that direct I/O scatters."""
    if setting != "auto":
        return setting == "on"
    collapsed = config.cpu.prefault and probe_shared_memory_collapse()[0]  # see create_segment
    return not (config.cpu.hugepages and (shmem_hugepages_allowed() or collapsed))


def void(_: object) -> None:
    """Drop a result (poll() returns counts the loop has no use for)."""


def _open_nvme(config: InfinityConfig, loop: EventLoop) -> tuple[IOEngine, NvmeTier, DurableIndex]:
    engine = IOEngine.from_config(config.io)
    nvme: NvmeTier | None = None
    try:
        nvme = NvmeTier(config.nvme, engine,
                        staged_reads=staged_wanted(config, config.nvme.staged_reads),
                        staged_writes=staged_wanted(config, config.nvme.staged_writes))
        index = DurableIndex(nvme)
    except BaseException:
        if nvme is not None:
            nvme.close()
        engine.close()
        raise
    loop.add_reader(engine.completion_fd, lambda: void(engine.poll()))
    loop.add_reader(index.completion_fd, lambda: void(index.poll()))
    log.info("NVMe tier: %s (engine %s%s); index %s",
             ", ".join(f"{d['path']} ({d['mode']})" for d in nvme.describe()), engine.backend,
             f": {engine.backend_note}" if engine.backend_note else "", index.path)
    return engine, nvme, index


class TierManager:
    """The CPU tier and the NVMe tier under one set of rules. Loop thread only."""

    def __init__(self, config: InfinityConfig, loop: EventLoop, arena: CpuArena,
                 residency: Residency, *, clock: Iterator[int],
                 scheduler: Scheduler | None = None,
                 on_change: Callable[[], None] | None = None) -> None:
        """`residency` is built first (the scheduler asks it what is pinned); `clock` is the
        catalog's stamp counter (deletes reach the index in order after the versions before
        them); `on_change` runs after anything that can change what the scheduler would
        prefetch."""
        self.config = config
        self.loop = loop
        self.arena = arena
        self.residency = residency
        # With a scheduler, it is the eviction policy and hears of every load and write-back.
        self.scheduler = scheduler
        self.policy: EvictionPolicy = scheduler.policy if scheduler is not None else default_policy()
        self.counters = TierCounters()
        self.engine: IOEngine | None = None
        self.nvme: NvmeTier | None = None
        self.index: DurableIndex | None = None
        if config.nvme.dirs:
            self.engine, self.nvme, self.index = _open_nvme(config, loop)
        self.space = space = TierSpace(config, loop, arena, residency, self.counters, self.nvme,
                                       on_change=on_change)
        self.eviction = eviction = Eviction(config, space, residency, self.counters, self.policy,
                                            scheduler=scheduler)
        self.loads = loads = Loads(config, space, eviction, residency, self.counters,
                                   scheduler=scheduler)
        self.durability = durability = Durability(config, space, eviction, residency,
                                                  self.counters, self.index, clock=clock)
        # The catalog's Storage hooks.
        self.allocate = eviction.allocate
        self.allocate_spare = space.allocate_spare
        self.free = space.free
        self.published = eviction.published
        self.unpublished = eviction.unpublished
        self.written = eviction.written
        self.released = space.released
        # CPU and NVMe space (streams, parked requests).
        self.allocate_slice = eviction.allocate_slice
        self.free_slice = space.free
        self.when_space = space.when_space
        self.address_of = space.address_of
        self.zero = space.zero
        self.allocate_disk = space.allocate_disk
        self.free_disk = space.free_disk
        # Residency and loads.
        self.touched = eviction.touched
        self.ensure_resident = loads.ensure_resident
        self.prefetch = loads.prefetch
        self.read_part = loads.read_part
        self.note_stream_write = loads.note_stream_write
        # Durability.
        self.require_durable = durability.require_durable
        self.make_durable = durability.make_durable
        self.remove_durable = durability.remove_durable
        self.is_durable = durability.is_durable

    @property
    def on_change(self) -> Callable[[], None]:
        return self.space.on_change

    @on_change.setter
    def on_change(self, callback: Callable[[], None]) -> None:
        self.space.on_change = callback

    @property
    def durable(self) -> bool:
        """Whether this daemon has an NVMe tier, hence durable writes."""
        return self.index is not None

    @property
    def resident(self) -> dict[Key, Version]:
        """The current versions in the CPU tier (kept with an NVMe tier only): `Residency`'s."""
        return self.residency.resident

    @property
    def write_error(self) -> InfinityError | None:
        return self.residency.write_error

    def kept_versions(self) -> tuple[int, int]:
        """(versions, bytes) published and not freed yet: current, held, or with I/O on them."""
        return self.space.num_versions, self.space.version_bytes

    def stats(self) -> dict[str, object]:
        tiers: dict[str, object] = {}
        nvme = self.nvme
        if nvme is not None:
            dirs = nvme.describe()
            write_error = self.residency.write_error
            tiers["nvme"] = {
                "dirs": dirs,
                "capacity_bytes": sum(int(d["capacity_bytes"]) for d in dirs),
                "used_bytes": sum(int(d["used_bytes"]) for d in dirs),
                "bytes_read": sum(int(d["bytes_read"]) for d in dirs),
                "bytes_written": sum(int(d["bytes_written"]) for d in dirs),
                "durable_tensors": len(self.durability.indexed),
                "index": self.index.path if self.index is not None else None,
                "engine": self.engine.backend if self.engine is not None else None,
                "write_error": str(write_error) if write_error is not None else None,
            }
        tiers["resident_tensors"] = len(self.residency.resident)
        tiers["evictions_writing_back"] = self.eviction.evicting
        tiers["write_behind_bytes"] = self.eviction.write_behind_bytes
        return tiers

    def close(self) -> None:
        """Finish what is in flight (queued reads and writes are cancelled, their requests get
        errors; index transactions already submitted complete), then release the store."""
        self.space.closing = True
        if self.engine is not None:
            self.loop.remove_reader(self.engine.completion_fd)
            self.engine.close()
        if self.index is not None:
            self.loop.remove_reader(self.index.completion_fd)
            self.index.close()
        if self.nvme is not None:
            self.nvme.close()
