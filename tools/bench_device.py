"""Benchmark the GPU tier: host-to-device copies from the store, and a GPU step with prefetch.

    python tools/bench_device.py [--dir /var/tmp/infinity-bench-device] [--rounds 3]
        [--layers 32] [--layer-bytes 64MiB]

Needs a CUDA GPU (exits with a sentence saying so otherwise). JSON on stdout, progress on
stderr. Everything is compared with its limit measured in the same run:

1. **Copy bandwidth.** One layer from the store into device memory through `DeviceCache` with
   `CudaCopier` (a get that misses: the daemon's reply, then a copy on the side stream from the
   pinned shared segment), against `tensor.to("cuda", non_blocking=True)` from a page-locked
   torch tensor (`pin_memory()`, the limit) and from ordinary pageable memory. Medians.
2. **A GPU step.** K layers of S bytes (float32, 2048 rows), each consumed by a real matrix
   multiply on the GPU (x @ layer, its result checked, which waits for the GPU as a loss
   read-back does), x's rows picked so one multiply takes C ms. The device cache holds a
   quarter of the layers. Three regimes:
   - `resident_compute`: all layers in the CPU tier, C = 2 x one layer's pinned copy time;
   - `resident_copy`: the same, C = 0.4 x that time: the copies dominate;
   - `nvme_compute`: the layers on NVMe behind a CPU tier of a quarter of them, C = 2 x one
     layer's read time at the engine's bandwidth (`infinity.io.IOEngine`, O_DIRECT).
   Per regime and round: the step time with prefetch off (the daemon's and the cache's) and on,
   and the ideal: max(K x C, bytes that cannot stay on the GPU / pinned copy bandwidth, bytes
   that cannot stay in the CPU tier / engine bandwidth). Targets as for bench_overlap.py: the
   median of on / ideal at most 1.15; off visibly worse.
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
from bench_launch import start_daemon, store_daemon_settings
from bench_overlap import (ROWS, consume, layer_value, rows_for, step_targets, summarize,
                           time_multiply)
from bench_store import RawEngine, _bytes
from infinity.client.device import CudaCopier, DeviceCache
from infinity.config import InfinityConfig, MiB

console = Console(stderr=True)
REGIMES = {"resident_compute": ("copy", 2.0), "resident_copy": ("copy", 0.4),
           "nvme_compute": ("disk", 2.0)}


def timed_copy(source: torch.Tensor, repeats: int) -> float:
    """Median seconds of one host-to-device copy of `source` (synchronised)."""
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        source.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def timed_store_copy(client: Any, name: str, repeats: int) -> float:
    """Median seconds of a get through a device cache that misses (a fresh copy each time)."""
    cache = DeviceCache(client, budget_bytes=1 << 40, copier=CudaCopier("cuda"), prefetch=False)
    if cache.registration_failures:
        raise SystemExit(f"pinning the segments failed: {cache.registration_failures}")
    times = []
    for _ in range(repeats + 1):
        cache.clear()
        torch.cuda.synchronize()
        start = time.perf_counter()
        with cache.get(name):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    cache.close()
    return statistics.median(times[1:])


def timed_hit(client: Any, name: str, repeats: int) -> float:
    """Median seconds of a get through a device cache that holds the tensor already (the
    daemon's reply, the revision compared, no copy): what every access costs at least."""
    cache = DeviceCache(client, budget_bytes=1 << 40, copier=CudaCopier("cuda"), prefetch=False)
    with cache.get(name):
        pass
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        with cache.get(name):
            pass
        times.append(time.perf_counter() - start)
    cache.close()
    return statistics.median(times)


def run_step(client: Any, cache: DeviceCache, num_layers: int,
             x: torch.Tensor) -> tuple[float, dict[str, Any]]:
    """One step; its wall time, and the cache's counters for it with the milliseconds per
    layer spent in `cache.get` and in the multiply (its checks wait for the GPU)."""
    before = cache.stats.as_dict()
    get_s = consume_s = 0.0
    clock = time.perf_counter
    start = clock()
    with client.step():
        for i in range(num_layers):
            t0 = clock()
            lease = cache.get(f"layer{i}")
            t1 = clock()
            with lease as layer:
                consume(layer, x, i)
            get_s += t1 - t0
            consume_s += clock() - t1
    torch.cuda.synchronize()
    seconds = clock() - start
    after = cache.stats.as_dict()
    counters: dict[str, Any] = {k: after[k] - before[k] for k in (
        "hits", "inflight_hits", "misses", "prefetched", "wasted_prefetches")}
    counters["get_ms_per_layer"] = round(get_s / num_layers * 1e3, 3)
    counters["consume_ms_per_layer"] = round(consume_s / num_layers * 1e3, 3)
    return seconds, counters


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/var/tmp/infinity-bench-device",
                        help="a folder on the drive to measure (emptied first, removed after)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--layer-bytes", type=_bytes, default=64 * MiB)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_device.py needs a CUDA GPU, and torch sees none here")
    num_layers, layer_bytes = args.layers, args.layer_bytes
    if layer_bytes % (4 * ROWS):
        raise SystemExit(f"--layer-bytes must be a multiple of {4 * ROWS}")
    shape = (ROWS, layer_bytes // (4 * ROWS))
    quarter = num_layers * layer_bytes // 4
    device_budget = quarter
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)

    def settings(name: str, *, resident: bool, prefetch: bool) -> dict[str, Any]:
        # A resident daemon's tier holds every layer (and a spare); the other's a quarter.
        return store_daemon_settings(
            args.dir, name, prefetch=prefetch, nvme_capacity_bytes=4 * num_layers * layer_bytes,
            cpu_budget_bytes=(num_layers + 2) * layer_bytes if resident else quarter)

    daemons: dict[tuple[bool, str], tuple[subprocess.Popen[bytes], InfinityConfig]] = {}
    report: dict[str, Any] = {"machine": {"cpus": os.cpu_count(),
                                          "gpu": torch.cuda.get_device_name(),
                                          "torch": torch.__version__}}
    rounds: list[dict[str, Any]] = []
    try:
        for resident in (True, False):
            for mode in ("off", "on"):
                name = f"{'resident' if resident else 'nvme'}-{mode}"
                folder = os.path.join(args.dir, name)
                os.makedirs(folder)
                daemons[(resident, mode)] = start_daemon(
                    folder, settings(name + "-daemon", resident=resident, prefetch=mode == "on"))
        raw = RawEngine(os.path.join(args.dir, "raw"), daemons[(False, "on")][1], num_layers,
                        layer_bytes, 4)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console) as progress:
            task = progress.add_task("writing the layers", total=4 * num_layers + 1)
            raw.write(num_layers)
            progress.advance(task)
            for (resident, _), (_, config) in daemons.items():
                client = infinity.connect(config=config, name="bench-device-writer")
                for i in range(num_layers):
                    layer = torch.full(shape, layer_value(i))
                    if resident:
                        client.put(f"layer{i}", layer)
                    else:
                        client.write_from(f"layer{i}", layer)
                    progress.advance(task)
                client.close()

            progress.update(task, description="copy bandwidth")
            host = torch.full(shape, layer_value(0))
            pinned = host.pin_memory()
            pinned_s = timed_copy(pinned, 10)
            pageable_s = timed_copy(host, 10)
            client = infinity.connect(config=daemons[(True, "on")][1], name="bench-device-copy")
            store_s = timed_store_copy(client, "layer0", 10)
            hit_s = timed_hit(client, "layer0", 200)
            client.close()
            report["copy"] = {
                "layer_bytes": layer_bytes,
                "pinned_gbps": round(layer_bytes / pinned_s / 1e9, 3),
                "pageable_gbps": round(layer_bytes / pageable_s / 1e9, 3),
                "store_gbps": round(layer_bytes / store_s / 1e9, 3),
                "store_over_pinned": round(pinned_s / store_s, 3),
                "store_over_pageable": round(pageable_s / store_s, 3),
                "get_hit_us": round(hit_s * 1e6, 1),
            }
            disk_read_s = statistics.median(raw.read(num_layers) for _ in range(3))
            disk_bandwidth = num_layers * layer_bytes / disk_read_s
            copy_bandwidth = layer_bytes / pinned_s
            per_layer = {"copy": pinned_s, "disk": layer_bytes / disk_bandwidth}

            progress.update(task, description="sizing the multiplies")
            on_gpu = pinned.to("cuda")
            xs, compute_s = {}, {}
            for regime, (unit, factor) in REGIMES.items():
                rows = rows_for(factor * per_layer[unit], on_gpu, max_rows=1 << 18)
                xs[regime] = torch.ones(rows, ROWS, device="cuda")
                compute_s[regime] = time_multiply(rows, on_gpu, 9)
            del on_gpu

            # One client and cache per regime and mode, kept across rounds as a training loop
            # keeps them; two steps first (the first records the trace, the second settles).
            task = progress.add_task("steps", total=len(REGIMES) * 2 * (args.rounds + 2))
            runners: dict[tuple[str, str], tuple[Any, DeviceCache]] = {}
            for regime in REGIMES:
                resident = regime.startswith("resident")
                for mode in ("off", "on"):
                    client = infinity.connect(config=daemons[(resident, mode)][1],
                                              name=f"bench-{regime}")
                    cache = DeviceCache(client, budget_bytes=device_budget,
                                        copier=CudaCopier("cuda"), prefetch=mode == "on")
                    runners[(regime, mode)] = (client, cache)
                    for _ in range(2):
                        run_step(client, cache, num_layers, xs[regime])
                        progress.advance(task)
            for round_ in range(args.rounds):
                read_s = raw.read(num_layers)
                round_disk = num_layers * layer_bytes / read_s
                result: dict[str, Any] = {"engine_read_gbps": round(round_disk / 1e9, 3)}
                for regime in REGIMES:
                    resident = regime.startswith("resident")
                    ideal_s = max(num_layers * compute_s[regime],
                                  (num_layers * layer_bytes - device_budget) / copy_bandwidth,
                                  0.0 if resident else
                                  (num_layers * layer_bytes - quarter) / round_disk)
                    entry: dict[str, Any] = {"ideal_s": round(ideal_s, 4)}
                    for mode in ("off", "on"):
                        progress.update(task, description=f"round {round_ + 1}: {regime}, "
                                                          f"prefetch {mode}")
                        client, cache = runners[(regime, mode)]
                        step_s, counters = run_step(client, cache, num_layers, xs[regime])
                        entry[f"prefetch_{mode}_s"] = round(step_s, 4)
                        entry[f"prefetch_{mode}_over_ideal"] = round(step_s / ideal_s, 3)
                        entry[f"prefetch_{mode}_device_cache"] = counters
                        progress.advance(task)
                    result[regime] = entry
                rounds.append(result)
            for client, cache in runners.values():
                cache.close()
                client.close()
    finally:
        for process, _ in daemons.values():
            process.send_signal(signal.SIGTERM)
            process.wait(60)
        shutil.rmtree(args.dir, ignore_errors=True)

    summary = summarize(rounds, compute_s, {r: x.shape[0] for r, x in xs.items()}, num_layers)
    report.update({
        "settings": {"layers": num_layers, "layer_bytes": layer_bytes, "layer_shape": list(shape),
                     "device_budget_bytes": device_budget, "cpu_tier_bytes_nvme": quarter,
                     "rounds": args.rounds},
        "engine_read_gbps_at_start": round(disk_bandwidth / 1e9, 3),
        "rounds": rounds,
        "summary": summary,
        "targets_met": step_targets(summary),
    })
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
