"""`infinity tune DIR`: sweep the engine's settings on one drive and write the best into `[io]`.

Each setting tried writes and reads back the same bytes with O_DIRECT (where the
file system allows it) through the real engine; the score is the geometric mean
of write and read bandwidth, since the store does both. The winner is written
into the `[io]` table of the config file that `load_config` reads, keeping the
rest of the file (comments included), so the daemon uses it from its next start.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import tomlkit

from infinity.cli.sizes import TUNE_OP_BYTES
from infinity.config import USER_CONFIG_PATH, IOConfig, MiB, find_config_path, load_config
from infinity.errors import ConfigError, StoreDirectoryError
from infinity.io import IOEngine, IOOp, aligned_empty

OP_BYTES = TUNE_OP_BYTES


@dataclass(frozen=True)
class Trial:
    block_size_bytes: int
    queue_depth: int
    num_threads: int
    write_gbps: float
    read_gbps: float
    backend: str = ""  # the engine's, as [io] backend chose it

    @property
    def score(self) -> float:
        return math.sqrt(self.write_gbps * self.read_gbps)


def candidates(*, quick: bool) -> list[tuple[int, int, int]]:
    if quick:
        return [(1 * MiB, 8, 1), (4 * MiB, 32, 2)]
    cores = os.cpu_count() or 1
    threads = sorted({1, min(2, cores), min(4, cores)})
    return list(itertools.product([256 * 1024, 1 * MiB, 4 * MiB, 8 * MiB], [8, 32, 64], threads))


def _open_probe(directory: str) -> tuple[int, bool, str]:
    if not os.path.isdir(directory):
        raise StoreDirectoryError(f"{directory} is not a directory; create it or pass the drive's store directory")
    path = os.path.join(directory, ".infinity-tune.dat")
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600), True, path
    except OSError:
        pass  # no O_DIRECT here (tmpfs, say): buffered, as the store would do
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o600), False, path
    except OSError as exc:
        raise StoreDirectoryError(f"cannot create a probe file in {directory} ({exc.strerror}); "
                                  f"pass a directory you may write, on the drive to tune") from None


def measure(fd: int, direct: bool, buffer_address: int, file_bytes: int,
            setting: tuple[int, int, int], io: IOConfig) -> Trial:
    """One setting tried, with the rest of [io] (the backend, the staging) as configured."""
    block, depth, threads = setting
    tried = dataclasses.replace(io, block_size_bytes=block, queue_depth=depth, num_threads=threads)
    with IOEngine.from_config(tried) as engine:
        def move(*, is_write: bool) -> float:
            make = IOOp.write if is_write else IOOp.read
            ops = [make(fd=fd, address=buffer_address, nbytes=OP_BYTES, offset=offset, direct=direct)
                   for offset in range(0, file_bytes, OP_BYTES)]
            start = time.perf_counter()
            engine.submit(ops).result()
            return file_bytes / (time.perf_counter() - start) / 1e9

        write = move(is_write=True)
        read = move(is_write=False)
        backend = engine.backend
    return Trial(block, depth, threads, write, read, backend)


def sweep(directory: str, *, file_bytes: int, quick: bool, io: IOConfig | None = None) -> list[Trial]:
    from rich.progress import Progress

    file_bytes = max(OP_BYTES, file_bytes // OP_BYTES * OP_BYTES)
    fd, direct, path = _open_probe(directory)
    buffer = aligned_empty(OP_BYTES)
    buffer.random_(0, 256)
    trials = []
    try:
        try:
            os.posix_fallocate(fd, 0, file_bytes)
        except OSError as exc:
            raise StoreDirectoryError(
                f"{directory} has no room for the {file_bytes}-byte probe ({exc.strerror}); free "
                f"space there or pass a smaller --file-bytes") from None
        settings = candidates(quick=quick)
        with Progress(transient=True) as progress:
            task = progress.add_task(f"tuning {directory}", total=len(settings))
            for setting in settings:
                trials.append(measure(fd, direct, buffer.data_ptr(), file_bytes, setting,
                                      io or IOConfig()))
                progress.advance(task)
    finally:
        os.close(fd)
        os.unlink(path)
    return trials


def write_io_table(config_path: Path, best: Trial) -> None:
    """Set [io] block_size_bytes / queue_depth / num_threads in the file, keeping everything else."""
    document = tomlkit.parse(config_path.read_text()) if config_path.exists() else tomlkit.document()
    table = document.get("io")
    if table is None:
        table = tomlkit.table()
        document["io"] = table
    table["block_size_bytes"] = best.block_size_bytes
    table["queue_depth"] = best.queue_depth
    table["num_threads"] = best.num_threads
    IOConfig(**{k: v for k, v in table.items()}).validate()
    config_path = config_path.resolve()  # a symlinked config: its target is the file to edit
    config_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = config_path.with_suffix(config_path.suffix + ".tmp")
    tmp.write_text(tomlkit.dumps(document))
    if config_path.exists():
        os.chmod(tmp, stat.S_IMODE(config_path.stat().st_mode))  # keep who may read it
    os.replace(tmp, config_path)


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, overrides=args.overrides)  # and refuse a broken one
    trials = sweep(args.dir, file_bytes=args.file_bytes, quick=args.quick, io=config.io)
    best = max(trials, key=lambda t: t.score)
    config_path = find_config_path(args.config) or USER_CONFIG_PATH.expanduser()
    report = {
        "dir": os.path.abspath(args.dir),
        "best": {"block_size_bytes": best.block_size_bytes, "queue_depth": best.queue_depth,
                 "num_threads": best.num_threads, "backend": best.backend,
                 "write_gbps": round(best.write_gbps, 3),
                 "read_gbps": round(best.read_gbps, 3)},
        "trials": [{"block_size_bytes": t.block_size_bytes, "queue_depth": t.queue_depth,
                    "num_threads": t.num_threads, "write_gbps": round(t.write_gbps, 3),
                    "read_gbps": round(t.read_gbps, 3)} for t in trials],
        "config": None if args.dry_run else str(config_path),
    }
    if not args.dry_run:
        try:
            write_io_table(config_path, best)
        except OSError as exc:
            raise ConfigError(f"cannot write {config_path}: {exc.strerror}; pass --config to choose "
                              f"another file") from None
    print(json.dumps(report, indent=2))
    return 0
