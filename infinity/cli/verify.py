"""`infinity verify`: check every flushed tensor of the NVMe store against its checksums.

Offline, it opens the store the way infinityd does (the index in the first of
`nvme.dirs`, the extent files, the store lock), reads every tensor the index
names, 1 MiB checksum block by block, with the CRC32C verified in the
engine's threads, and reports each tensor that does not read back whole by
namespace and name. While an infinityd serves the store (its lock is held),
it asks that daemon instead, found by the same settings' runtime folder: the
daemon's `verify` request reads back every tensor that has an NVMe copy, as
it serves (`infinity.daemon.services.verify`). It never writes tensor bytes.

Exit status: 0 every tensor verified, 1 at least one is corrupted, 2 the store
could not be checked at all (settings, a missing directory, a damaged index).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sqlite3
import sys
import time
from collections import deque
from typing import Any

from infinity.config import InfinityConfig, MiB, load_config
from infinity.errors import ConfigError, DaemonUnavailableError, InfinityError, StoreDirectoryError
from infinity.io import IOEngine, IOFuture, aligned_empty
from infinity.protocol import dtypes
from infinity.store.durable import (LOCK_FILE_NAME, DurableIndex, DurableRecord, index_path,
                                    store_files_in)
from infinity.store.nvme import EXTENT_FILE_NAME, NvmeTier

CHUNK_BYTES = 16 * MiB  # a multiple of the 1 MiB checksum block
IN_FLIGHT = 4


def _check_tensor(tier: NvmeTier, record: DurableRecord, buffers: list[Any]) -> str | None:
    """None if every block of the tensor reads back with its checksum; else what failed."""
    layout = record.layout
    try:
        expected = dtypes.tensor_nbytes(record.dtype, record.shape)
    except InfinityError as exc:
        return f"the index entry is not valid: {exc}"
    if expected != layout.nbytes:
        return (f"the index says {record.dtype}{list(record.shape)} ({expected} bytes) but the "
                f"layout holds {layout.nbytes} bytes")
    if not layout.nbytes:
        return None
    pending: deque[tuple[IOFuture, int]] = deque()  # (read, buffer it fills)
    free = list(range(len(buffers)))
    error: str | None = None
    for offset in range(0, layout.nbytes, CHUNK_BYTES):
        if not free:
            future, slot = pending.popleft()
            error = error or _outcome(future)
            free.append(slot)
        slot = free.pop()
        n = min(CHUNK_BYTES, layout.nbytes - offset)
        pending.append((tier.read_into(layout, buffers[slot].data_ptr(), offset_bytes=offset,
                                       nbytes=n), slot))
    while pending:
        error = error or _outcome(pending.popleft()[0])
    return error


def _outcome(future: IOFuture) -> str | None:
    exc = future.exception()
    return None if exc is None else str(exc)


def verify_store(config_path: str | None, overrides: list[str]) -> dict[str, Any]:
    """Check the store of these settings; a report (see `run` for its use)."""
    config = load_config(config_path, overrides=overrides)
    if not config.nvme.dirs:
        raise ConfigError("nvme.dirs is empty, so there is no store to verify; pass the settings "
                          "infinityd uses (--config PATH, or --set nvme.dirs=DIR)")
    report: dict[str, Any] = {"dirs": list(config.nvme.dirs), "tensors": 0, "bytes": 0,
                              "corrupted": [], "seconds": 0.0}
    first = os.path.abspath(config.nvme.dirs[0])
    if not os.path.exists(index_path(first)):
        # Nothing to check only if nothing is there: a directory missing, or one holding a
        # store's files (another order of nvme.dirs, say), is a store that could not be checked.
        for directory in config.nvme.dirs:
            if not os.path.isdir(directory):
                raise StoreDirectoryError(f"store directory {directory} does not exist; fix "
                                          f"nvme.dirs, or mount it")
            extents = os.path.join(directory, EXTENT_FILE_NAME)
            found = store_files_in(directory,
                                   os.path.getsize(extents) if os.path.exists(extents) else 0)
            if found is not None:
                raise StoreDirectoryError(
                    f"{directory} holds a store's files ({found}) but {first} holds no store "
                    f"index: is nvme.dirs the store's, in its order (the index is in the first)?")
        report["note"] = f"no store index at {index_path(first)}: nothing was ever flushed there"
        return report
    start = time.perf_counter()
    if _store_in_use(config.nvme.dirs[0]):
        return _verify_online(config, report, start)
    with IOEngine.from_config(config.io) as engine:
        tier = NvmeTier(config.nvme, engine)
        try:
            try:
                index = DurableIndex(tier)
                try:
                    records = index.load()
                finally:
                    index.close()
            except sqlite3.DatabaseError as exc:  # damage past the header shows when read
                raise StoreDirectoryError(
                    f"the store index {index_path(first)} is damaged ({exc}); restore the store "
                    f"from a backup") from None
            buffers = [aligned_empty(CHUNK_BYTES) for _ in range(IN_FLIGHT)]
            for record in records:
                problem = _check_tensor(tier, record, buffers)
                report["tensors"] += 1
                report["bytes"] += record.layout.nbytes
                if problem is not None:
                    report["corrupted"].append({"namespace": record.namespace,
                                                "name": record.name, "error": problem})
        finally:
            tier.close()
    report["seconds"] = round(time.perf_counter() - start, 3)
    return report


def _store_in_use(directory: str) -> bool:
    """Whether a process holds the store's lock (an infinityd serving it, or a verify)."""
    path = os.path.join(directory, LOCK_FILE_NAME)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _verify_online(config: InfinityConfig, report: dict[str, Any], start: float
                   ) -> dict[str, Any]:
    """Ask the infinityd of these settings, which serves the store, to verify it."""
    import infinity

    try:
        client = infinity.connect(config=config, name="infinity-verify")
    except DaemonUnavailableError:
        raise StoreDirectoryError(
            f"the store in {config.nvme.dirs[0]} is in use by a process that is not an infinityd "
            f"of these settings (daemon.runtime_dir {config.daemon.runtime_dir}); pass the "
            f"settings of the daemon that serves it, or stop that process") from None
    with client:
        served = [d["path"] for d in client.stats()["tiers"].get("nvme", {}).get("dirs", [])]
        if served[:1] != [os.path.abspath(config.nvme.dirs[0])]:
            raise StoreDirectoryError(
                f"the infinityd of daemon.runtime_dir {config.daemon.runtime_dir} serves "
                f"{served or 'no store'}, not the store in {config.nvme.dirs[0]}; pass the "
                f"settings of the daemon that serves it")
        summary = client.verify_store()
    report.update(online=True, tensors=summary["tensors"], bytes=summary["bytes"],
                  skipped=summary["skipped"], not_on_nvme=summary["not_on_nvme"],
                  corrupted=[{"namespace": ns, "name": name, "error": error}
                             for ns, name, error in summary["corrupted"]])
    if summary["num_corrupted"] > len(summary["corrupted"]):
        report["note"] = (f"{summary['num_corrupted']} tensors are corrupted; the first "
                          f"{len(summary['corrupted'])} are named")
    report["seconds"] = round(time.perf_counter() - start, 3)
    return report


def run(args: argparse.Namespace) -> int:
    report = verify_store(args.config, args.overrides)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        if "note" in report:
            print(report["note"])
        for bad in report["corrupted"]:
            print(f"CORRUPTED {bad['namespace']}/{bad['name']}: {bad['error']}")
        where = " by the running infinityd" if report.get("online") else ""
        print(f"{report['tensors']} tensor(s), {report['bytes']} bytes checked{where} in "
              f"{report['seconds']:.2f}s: {len(report['corrupted'])} corrupted")
    if report["corrupted"]:
        print("rewrite the corrupted tensors from a good copy, or delete them", file=sys.stderr)
        return 1
    return 0
