"""Benchmark infinityd's NVMe tier against the raw engine on the same directory, in one run.

    .venv/bin/python tools/bench_store.py [--dir /var/tmp/infinity-bench-store] [--rounds 3]
        [--total-bytes 4GiB] [--tensor-bytes 64MiB] [--tier-bytes 1GiB] [--writeback-bytes 2GiB]

JSON on stdout, progress on stderr. Each round runs, one after the other so that the disk's
background load falls on all alike:

- raw read: `infinity.io.IOEngine` reads `--total-bytes` as `--tensor-bytes` files with
  O_DIRECT, `--in-flight` tensors at a time (no checksums);
- reload: a client `get_many`s the same amount of tensors of the same size, `--in-flight` per
  request, that are only on NVMe (the CPU tier is a quarter of the data and they are read in
  the same order every round, so every get misses): the daemon loads them with the same engine
  straight into its shared segments, CRC32C verified, evicting clean tensors as it goes; the
  client checks the first and last 4 KiB of each against what was written;
- raw write: the engine writes `--writeback-bytes` to such files, `--in-flight` at a time;
- write-back: with the CPU tier full of dirty tensors, a client `put`s `--writeback-bytes`
  more; each put needs the eviction of a dirty tensor, which the daemon writes back (the
  engine writing straight from the shared segment, CRC32C per MiB, into fresh extents), plus
  up to `nvme.write_behind_bytes` ahead. Its bandwidth is the bytes the daemon wrote back
  (its own counter) over the wall time from the first put until its write-backs are done.

A first round warms both up and is not reported: the daemon creates its CPU tier's segments
and grows its store file there, as the raw engine's files were written before timing.
Ratios are per round (daemon over the raw engine of that round) and their medians.
Targets: reload >= 0.9x raw reads, write-back >= 0.9x raw writes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import infinity
from bench_launch import add_daemon_arguments, start_daemon, typed_settings
from infinity.config import GiB, InfinityConfig, MiB
from infinity.io import IOEngine, IOOp, aligned_empty

console = Console(stderr=True)
PAGE = 4096


def small_free_blocks_bytes(max_order: int = 4) -> int:
    """Free memory in blocks of at most 2**max_order pages, from /proc/buddyinfo (0 if absent)."""
    total = 0
    try:
        with open("/proc/buddyinfo") as f:
            for line in f:
                counts = [int(c) for c in line.split()[4:]]
                total += sum(n * PAGE << order for order, n in enumerate(counts[:max_order + 1]))
    except OSError:
        return 0
    return total


def _bytes(text: str) -> int:
    units = {"KiB": 1024, "MiB": MiB, "GiB": GiB}
    for unit, size in units.items():
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * size)
    return int(text)


# --- the daemon ------------------------------------------------------------------------------



def fill(buf: torch.Tensor, key: int) -> None:
    """Tensor `key`'s bytes: a ramp offset by the key (cheap to make, differs per tensor)."""
    words = buf.view(torch.int64)
    torch.arange(key << 32, (key << 32) + words.numel(), out=words)


def edges_match(view: torch.Tensor, key: int) -> bool:
    """The first and last 4 KiB of a tensor against what `fill` wrote (the engine checked all
    of it against its CRC32C; this checks it is the right tensor, at a negligible cost)."""
    words = view.reshape(-1).view(torch.int64)
    n, edge = words.numel(), PAGE // 8
    head = torch.arange(key << 32, (key << 32) + edge, dtype=torch.int64)
    tail = torch.arange((key << 32) + n - edge, (key << 32) + n, dtype=torch.int64)
    return torch.equal(words[:edge], head) and torch.equal(words[-edge:], tail)


# --- the raw engine -------------------------------------------------------------------------

class RawEngine:
    """The same engine settings as the daemon, one O_DIRECT file per tensor."""

    def __init__(self, folder: str, config: InfinityConfig, count: int, tensor_bytes: int,
                 in_flight: int) -> None:
        self.folder = folder
        os.makedirs(folder, exist_ok=True)
        self.config = config
        self.paths = [os.path.join(folder, f"t{i:05d}.bin") for i in range(count)]
        self.tensor_bytes = tensor_bytes
        self.in_flight = in_flight
        self.buffers = [aligned_empty(tensor_bytes) for _ in range(in_flight)]
        for i, buf in enumerate(self.buffers):
            fill(buf, 7000 + i)

    def _run(self, count: int, *, write: bool) -> float:
        flags = os.O_DIRECT | (os.O_WRONLY | os.O_CREAT if write else os.O_RDONLY)
        fds = [os.open(p, flags, 0o600) for p in self.paths[:count]]
        make = IOOp.write if write else IOOp.read
        try:
            with IOEngine.from_config(self.config.io) as engine:
                start = time.perf_counter()
                for first in range(0, count, self.in_flight):
                    group = range(first, min(count, first + self.in_flight))
                    engine.submit([make(fd=fds[i], address=self.buffers[i - first].data_ptr(),
                                        nbytes=self.tensor_bytes, offset=0)
                                   for i in group]).result()
                return time.perf_counter() - start
        finally:
            for fd in fds:
                os.close(fd)

    def write(self, count: int) -> float:
        return self._run(count, write=True)

    def read(self, count: int) -> float:
        return self._run(count, write=False)


# --- the run ----------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/var/tmp/infinity-bench-store",
                        help="a folder on the drive to measure (emptied first, removed after)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--total-bytes", type=_bytes, default=4 * GiB,
                        help="bytes reloaded per round (at least 4GiB for the target)")
    parser.add_argument("--tensor-bytes", type=_bytes, default=64 * MiB)
    parser.add_argument("--tier-bytes", type=_bytes, default=1 * GiB,
                        help="the daemon's CPU tier (cpu.budget_bytes)")
    parser.add_argument("--writeback-bytes", type=_bytes, default=2 * GiB,
                        help="bytes put per round in the write-back phase")
    parser.add_argument("--in-flight", type=int, default=4,
                        help="tensors per get_many request, and per raw engine batch")
    add_daemon_arguments(parser, set_example="nvme.staged_reads=on (the raw engine takes [io])")
    args = parser.parse_args(argv)
    extra = typed_settings(args.set)
    # The kernel hands out its free fragments (pages left by processes that exited) before
    # whole blocks, and O_DIRECT into scattered pages is much slower on this VM's virtio disk.
    # Whichever buffers are allocated first (the raw engine's or the daemon's segments) would
    # get them; taking them here first keeps the comparison even.
    fragments = small_free_blocks_bytes()
    soak_bytes = (fragments + fragments // 4 + 64 * MiB if args.soak_bytes == "auto"
                  else _bytes(args.soak_bytes))
    soak = torch.ones(soak_bytes // 8, dtype=torch.int64) if soak_bytes else None
    count = args.total_bytes // args.tensor_bytes
    puts = args.writeback_bytes // args.tensor_bytes
    tier_count = args.tier_bytes // args.tensor_bytes
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(os.path.join(args.dir, "store"))
    settings: dict[str, Any] = {
        "daemon.runtime_dir": os.path.join(args.dir, "rt"),
        "daemon.log_level": "warning",
        "daemon.request_timeout_s": 120.0,
        "cpu.budget_bytes": args.tier_bytes,
        "cpu.segment_bytes": min(256 * MiB, args.tier_bytes),
        "nvme.dirs": [os.path.join(args.dir, "store")],
        "nvme.capacity_bytes_per_dir": 4 * (args.total_bytes + args.writeback_bytes
                                            + args.tier_bytes),
        **extra,
    }
    daemon, config = start_daemon(args.dir, settings)
    client = None
    rounds: list[dict[str, float]] = []
    try:
        client = infinity.connect(config=config, name="bench-store")
        raw = RawEngine(os.path.join(args.dir, "raw"), config, count, args.tensor_bytes,
                        args.in_flight)
        source = aligned_empty(args.tensor_bytes)
        names = [f"r{i:05d}" for i in range(count)]
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console) as progress:
            task = progress.add_task("writing the tensors", total=count)
            raw.write(count)  # the raw files exist and are written once, untimed
            for i, name in enumerate(names):
                fill(source, i)
                client.write_from(name, source)  # straight to NVMe: not resident
                progress.advance(task)
            steps = (args.rounds + 1) * 4
            task = progress.add_task("rounds", total=steps)
            for round_ in range(-1, args.rounds):  # round -1 warms up and is not reported
                label = "warm-up" if round_ < 0 else f"round {round_ + 1}"
                progress.update(task, description=f"{label}: raw read")
                raw_read_s = raw.read(count)
                progress.advance(task)

                progress.update(task, description=f"{label}: reload")
                before = client.stats()["counters"]["tiers"]
                start = time.perf_counter()
                for first in range(0, count, args.in_flight):
                    group = names[first:first + args.in_flight]
                    with client.get_many(group) as views:
                        for j, view in enumerate(views):
                            if not edges_match(view, first + j):
                                raise SystemExit(f"tensor {group[j]} read back wrong")
                reload_s = time.perf_counter() - start
                after = client.stats()["counters"]["tiers"]
                reloaded = after["reload_bytes"] - before["reload_bytes"]
                if reloaded != count * args.tensor_bytes:
                    raise SystemExit(f"expected every get to reload from NVMe, but {reloaded} "
                                     f"bytes of {count * args.tensor_bytes} were")
                progress.advance(task)

                progress.update(task, description=f"{label}: raw write")
                raw_write_s = raw.write(puts)
                progress.advance(task)

                progress.update(task, description=f"{label}: write-back")
                fill(source, 50_000)
                for i in range(tier_count):  # untimed: the tier full of dirty tensors
                    client.put(f"w{i:05d}", source)
                before = client.stats()["counters"]["tiers"]
                start = time.perf_counter()
                for i in range(puts):
                    source.view(torch.int64)[0] = i  # each differs; making data is not timed
                    client.put(f"w{tier_count + i:05d}", source)
                # Until the write-backs started meanwhile (evictions and write-behind) are done,
                # as the raw engine's time includes its last write: bytes and time both count.
                while any(client.stats()["tiers"]["cpu"][k]
                          for k in ("evictions_writing_back", "write_behind_bytes")):
                    time.sleep(0.001)  # no event says so from outside; stats is the way
                writeback_s = time.perf_counter() - start
                after = client.stats()["counters"]["tiers"]
                written = after["writeback_bytes"] - before["writeback_bytes"]
                client.delete([f"w{i:05d}" for i in range(tier_count + puts)])
                progress.advance(task)
                if round_ < 0:
                    continue
                total = count * args.tensor_bytes
                rounds.append({
                    "raw_read_gbps": round(total / raw_read_s / 1e9, 3),
                    "reload_gbps": round(total / reload_s / 1e9, 3),
                    "raw_write_gbps": round(puts * args.tensor_bytes / raw_write_s / 1e9, 3),
                    "writeback_gbps": round(written / writeback_s / 1e9, 3),
                    "written_back_bytes": written,
                })
                rounds[-1]["reload_ratio"] = round(
                    rounds[-1]["reload_gbps"] / rounds[-1]["raw_read_gbps"], 3)
                rounds[-1]["writeback_ratio"] = round(
                    rounds[-1]["writeback_gbps"] / rounds[-1]["raw_write_gbps"], 3)
        stats = client.stats()
    finally:
        if client is not None:
            client.close()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
        shutil.rmtree(args.dir, ignore_errors=True)

    def median(key: str) -> float:
        return round(statistics.median(r[key] for r in rounds), 3)

    medians = {key: median(key) for key in ("raw_read_gbps", "reload_gbps", "raw_write_gbps",
                                            "writeback_gbps", "reload_ratio", "writeback_ratio")}
    report = {
        "machine": {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
                    "engine": stats["tiers"]["nvme"]["engine"]},
        "settings": {"total_bytes": count * args.tensor_bytes, "tensor_bytes": args.tensor_bytes,
                     "tier_bytes": args.tier_bytes,
                     "writeback_bytes": puts * args.tensor_bytes, "in_flight": args.in_flight,
                     "rounds": args.rounds, "io": config.io.__dict__,
                     "soak_bytes": soak_bytes, "free_blocks_of_64KiB_or_less": fragments,
                     "write_behind_bytes": config.nvme.write_behind_bytes},
        "rounds": rounds,
        "medians": medians,
        "ratio_of_medians": {
            "reload": round(medians["reload_gbps"] / medians["raw_read_gbps"], 3),
            "writeback": round(medians["writeback_gbps"] / medians["raw_write_gbps"], 3)},
        "daemon_counters": {k: v for k, v in stats["counters"]["tiers"].items() if v},
        "targets_met": {
            "reload>=0.9x_raw_read": medians["reload_ratio"] >= 0.9,
            "writeback>=0.9x_raw_write": medians["writeback_ratio"] >= 0.9,
        },
    }
    print(json.dumps(report, indent=1))
    del soak
    return 0


if __name__ == "__main__":
    sys.exit(main())
