"""Benchmark staged I/O: NVMe to and from the CPU tier's kind of memory, direct against staged.

    .venv/bin/python tools/bench_staging.py [--dir /var/tmp/infinity-bench-staging] [--rounds 5]
        [--files 16] [--file-bytes 32MiB]

JSON on stdout, progress on stderr. The engine (the daemon's `[io]` settings, CRC32C per MiB
computed on write and verified on read) writes `--files` O_DIRECT files, 4 in flight, and reads
them back, with four kinds of memory, taking turns each round so the machine's background load
falls on all alike:

- private: anonymous memory on huge pages (the limit: what `bench_overlap` calls the
  engine's bandwidth);
- shared, direct: a fresh memfd mapping like a CPU-tier segment without shmem huge pages,
  each block moved straight to or from it;
- shared, staged: the same memory, each block going through the engine's staging memory
  (`IOOp.staged`, `nvme.staged_reads` / `staged_writes`) and a copy;
- shared, collapsed: another memfd mapping, prefaulted, then given 2 MiB pages with
  MADV_COLLAPSE as the daemon's arena does where shmem_enabled gives none
  (`_native.collapse_shared_memory`), each block moved straight to or from it.

Reported: GB/s per direction, kind and round, and the medians of the per-round ratios staged /
private, staged / direct and collapsed / private (with whether the collapse worked). Every write's checksums and every read's bytes are checked.
"""

from __future__ import annotations

import argparse
import array
import dataclasses
import json
import mmap
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_store import _bytes  # noqa: E402

from infinity.config import load_config  # noqa: E402
from infinity.io import IOEngine, IOOp, aligned_empty, crc32c  # noqa: E402
from infinity.io.native import native  # noqa: E402

MiB = 1024 * 1024
IN_FLIGHT = 4
_MADV_POPULATE_WRITE = 23


def _shared_memory(nbytes: int, *, collapse: bool = False
                   ) -> tuple[torch.Tensor, mmap.mmap, int, int | None]:
    """A prefaulted memfd mapping, as the daemon's segments are; collapse=True: then given huge
    pages as the arena does. The last item: the collapse's errno (0: done), None if not asked."""
    fd = os.memfd_create("infinity-bench-staging")
    os.ftruncate(fd, nbytes)
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    mm.madvise(_MADV_POPULATE_WRITE)
    failed = None
    if collapse:
        failed = native().collapse_shared_memory(fd, nbytes)
        mm.madvise(_MADV_POPULATE_WRITE)  # the collapse unmapped this mapping's pages
    return torch.frombuffer(mm, dtype=torch.uint8), mm, fd, failed  # type: ignore[call-overload]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/var/tmp/infinity-bench-staging",
                        help="a folder on the drive to measure (emptied first, removed after)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--file-bytes", type=_bytes, default=32 * MiB)
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE",
                        help="a setting for the engine, e.g. io.staging_bytes=8388608 (repeatable)")
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    config = load_config(env={}, overrides=args.set)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    size, count = args.file_bytes, args.files
    window = IN_FLIGHT * size
    fds: list[int] = []
    try:
        pattern = torch.arange(size, dtype=torch.int64).to(torch.uint8) ^ 0x5A
        source = aligned_empty(size)
        source.copy_(pattern)
        crcs = array.array("I", [crc32c(source[i:i + MiB]) for i in range(0, size, MiB)])
        for i in range(count):
            fd = os.open(os.path.join(args.dir, f"f{i:03d}"), os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
            fds.append(fd)
        private = aligned_empty(window)
        private.fill_(1)  # faulted in from user space: huge pages where THP allows
        shared, mm, memfd, _ = _shared_memory(window)
        collapsed, collapsed_mm, collapsed_fd, collapse_failed = _shared_memory(window, collapse=True)
        kinds = ["private", "shared_direct", "shared_staged", "shared_collapsed"]
        results: dict[str, list[float]] = {f"{d}_{k}": [] for d in ("write", "read") for k in kinds}
        written = array.array("I", bytes(4 * len(crcs)))  # what each write computes
        with IOEngine.from_config(config.io) as engine, Progress(console=console) as progress:
            task = progress.add_task("writes and reads", total=args.rounds * len(results))

            def timed(make: Any, buf: torch.Tensor, crc_address: int, staged: bool) -> float:
                start = time.perf_counter()
                for first in range(0, count, IN_FLIGHT):
                    engine.submit([make(fd=fd, address=buf.data_ptr() + k * size, nbytes=size,
                                        offset=0, crc_address=crc_address, staged=staged)
                                   for k, fd in enumerate(fds[first:first + IN_FLIGHT])]).result()
                return count * size / (time.perf_counter() - start) / 1e9

            for round_ in range(args.rounds):
                for kind in kinds[round_ % len(kinds):] + kinds[:round_ % len(kinds)]:
                    buf = {"private": private, "shared_collapsed": collapsed}.get(kind, shared)
                    staged = kind == "shared_staged"
                    for k in range(IN_FLIGHT):
                        buf[k * size:(k + 1) * size].copy_(pattern)
                    results[f"write_{kind}"].append(
                        timed(IOOp.write, buf, written.buffer_info()[0], staged))
                    if written != crcs:
                        raise SystemExit(f"{kind}: the writes' checksums differ from the data's")
                    buf.zero_()
                    results[f"read_{kind}"].append(timed(IOOp.read, buf, crcs.buffer_info()[0], staged))
                    if not all(torch.equal(buf[k * size:(k + 1) * size], pattern)
                               for k in range(IN_FLIGHT)):
                        raise SystemExit(f"{kind}: the bytes read differ from those written")
                    progress.advance(task, 2)
            staged_bytes = engine.staged_bytes
        del shared, collapsed, buf
        mm.close()
        collapsed_mm.close()
        os.close(memfd)
        os.close(collapsed_fd)
    finally:
        for fd in fds:
            os.close(fd)
        shutil.rmtree(args.dir, ignore_errors=True)

    def median(kind: str) -> float:
        return round(statistics.median(results[kind]), 3)

    out: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
                    "engine": engine.backend},
        "settings": {"files": count, "file_bytes": size, "in_flight": IN_FLIGHT,
                     "io": dataclasses.asdict(config.io)},
        "gbps": {kind: [round(v, 3) for v in values] for kind, values in results.items()},
        "median_gbps": {kind: median(kind) for kind in results},
        **{f"{d}_staged_over_{other}": round(statistics.median(
            s / o for s, o in zip(results[f"{d}_shared_staged"], results[f"{d}_{ref}"])), 3)
           for d in ("write", "read") for other, ref in (("private", "private"),
                                                         ("direct", "shared_direct"))},
        **{f"{d}_collapsed_over_private": round(statistics.median(
            c / p for c, p in zip(results[f"{d}_shared_collapsed"], results[f"{d}_private"])), 3)
           for d in ("write", "read")},
        "collapse": "done" if collapse_failed == 0 else f"failed: {os.strerror(collapse_failed or 0)}",
        "staged_bytes": staged_bytes,
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
