"""Benchmark trace-driven prefetch: step time with prefetch off, on, and the ideal, in one run.

    .venv/bin/python tools/bench_overlap.py [--dir /var/tmp/infinity-bench-overlap] [--rounds 3]
        [--layers 32] [--layer-bytes 32MiB]

JSON on stdout, progress on stderr. A synthetic step reads K layers of S bytes (float32 matrices
of 2048 rows) that live on NVMe, through infinityd, with a CPU tier of a quarter of them. Each
layer's compute is a real matrix multiply that consumes the leased view (x @ layer, under
`torch.set_num_threads(1)`, its result checked against the layer's known contents), with x's
row count picked so that one multiply takes C ms. Two regimes:

- compute dominates: C = 2 x the time the engine takes to read one layer;
- I/O dominates: C = 0.4 x that time.

Measured in this run and reported: C (the median of multiplies on a resident tensor), the
engine's read bandwidth (`infinity.io.IOEngine`, the daemon's settings, one O_DIRECT file per
layer, 4 layers in flight), and per round and regime the step time with prefetch off (a daemon
with `scheduler.prefetch = false`: demand loads, next-use eviction) and on (the defaults). The
ideal is max(K x C, (K x S - tier bytes) / bandwidth): the compute, or the bytes that cannot
stay in the tier read at the engine's speed. Targets: the median over rounds of on / ideal at
most 1.15 in both regimes; off / ideal visibly above. Also reported, outside the targets: the
engine's bandwidth again while another process multiplies as the I/O-dominated step does (the
share of the disk that the compute's memory traffic costs on this machine).

Then two clients (processes) with no compute at all, each stepping over its own K/2 layers
(the tier a quarter of the whole), so their demand is far above the engine: reported are the
bytes both read per second against the engine's bandwidth (target >= 0.8x), and each one's
stall (target: neither more than twice the other).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
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
from bench_launch import add_daemon_arguments, start_daemon, store_daemon_settings, typed_settings
from bench_store import RawEngine, _bytes, small_free_blocks_bytes
from infinity.config import InfinityConfig, MiB

console = Console(stderr=True)
ROWS = 2048  # every layer is a [ROWS, S / (4 ROWS)] float32 matrix
REGIMES = {"compute_dominated": 2.0, "io_dominated": 0.4}  # C in units of one layer's read time


def layer_value(i: int) -> float:
    return float(i % 7 + 1)  # small integers: sums of them are exact in float32


def consume(layer: torch.Tensor, x: torch.Tensor, i: int) -> None:
    """The compute of one layer: x @ layer, checked. x is all ones, so every output is
    ROWS x the layer's value."""
    out = x @ layer
    expected = ROWS * layer_value(i)
    if not (out[0, 0].item() == expected and out[-1, -1].item() == expected):
        raise SystemExit(f"layer{i}: the product is wrong (the bytes read back are not the layer's)")


def time_multiply(rows: int, layer: torch.Tensor, repeats: int = 5) -> float:
    x = torch.ones(rows, ROWS, device=layer.device)
    if layer.is_cuda:
        consume(layer, x, 0)  # the first call picks a kernel (cuBLAS)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        consume(layer, x, 0)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _multiply_loop(rows: int, shape: tuple[int, int], ready: Any, stop: Any) -> None:
    torch.set_num_threads(1)
    x = torch.ones(rows, ROWS)
    # Four layers, past the last-level cache: each multiply reads its layer from memory, as a
    # step's multiply reads the layer the daemon just loaded.
    layers = [torch.full(shape, layer_value(i)) for i in range(4)]
    ready.set()
    i = 0
    while not stop.is_set():
        consume(layers[i % 4], x, i % 4)
        i += 1


def engine_beside_multiply(raw: RawEngine, num_layers: int, layer_bytes: int, rows: int,
                           shape: tuple[int, int]) -> float:
    """The engine's read bandwidth (as measured alone) while another process multiplies like the
    I/O-dominated step does: what the disk gives when the compute shares the memory bus."""
    spawn = multiprocessing.get_context("spawn")
    ready, stop = spawn.Event(), spawn.Event()
    worker = spawn.Process(target=_multiply_loop, args=(rows, shape, ready, stop))
    worker.start()
    try:
        if not ready.wait(60):
            raise SystemExit("the multiplying process did not start")
        read_s = statistics.median(raw.read(num_layers) for _ in range(3))
    finally:
        stop.set()
        worker.join(60)
    return num_layers * layer_bytes / read_s


def rows_for(target_s: float, layer: torch.Tensor, *, max_rows: int = 1 << 16) -> int:
    """x's row count for one multiply of about `target_s` (the time grows with the rows once
    past the memory-bound floor; found by doubling, then refined linearly)."""
    rows = 1
    while time_multiply(rows, layer, 3) < target_s and rows < max_rows:
        rows *= 2
    low = rows // 2 if rows > 1 else 1
    t_low, t_high = time_multiply(low, layer, 3), time_multiply(rows, layer, 3)
    if t_high <= t_low:
        return rows
    return max(1, int(low + (rows - low) * (target_s - t_low) / (t_high - t_low)))


def run_step(client: Any, num_layers: int, x: torch.Tensor | None, *,
             namespace: str = "default") -> tuple[float, dict[str, Any]]:
    """One step over every layer; returns its wall time and the daemon's step report counters."""
    start = time.perf_counter()
    with client.step(namespace=namespace) as step:
        for i in range(num_layers):
            with client.get(f"layer{i}", namespace=namespace) as layer:
                if x is not None:
                    consume(layer, x, i)
                elif layer[0, 0].item() != layer_value(i):
                    raise SystemExit(f"layer{i} read back wrong")
    return time.perf_counter() - start, step.counters


def summarize(rounds: list[dict[str, Any]], compute_s: dict[str, float],
              rows_of_x: dict[str, int], num_layers: int) -> dict[str, Any]:
    """Per regime: C, the medians over rounds of the step times and of their ratios to the
    ideal, and the time per layer beyond the ideal (what the accesses themselves cost, which
    the ideal leaves out)."""
    summary: dict[str, Any] = {}
    for regime in compute_s:
        entries = [r[regime] for r in rounds]
        median = lambda key: statistics.median(e[key] for e in entries)  # noqa: E731
        summary[regime] = {
            "compute_ms": round(compute_s[regime] * 1e3, 3),
            "rows_of_x": rows_of_x[regime],
            "ideal_s_median": round(median("ideal_s"), 4),
            "prefetch_on_s_median": round(median("prefetch_on_s"), 4),
            "prefetch_off_s_median": round(median("prefetch_off_s"), 4),
            "prefetch_on_over_ideal_median": round(median("prefetch_on_over_ideal"), 3),
            "prefetch_off_over_ideal_median": round(median("prefetch_off_over_ideal"), 3),
            "prefetch_on_beyond_ideal_ms_per_layer": round(statistics.median(
                (e["prefetch_on_s"] - e["ideal_s"]) / num_layers for e in entries) * 1e3, 3),
        }
    return summary


def step_targets(summary: dict[str, Any]) -> dict[str, bool]:
    """The issue's targets for each regime: on within 1.15x the ideal; off visibly worse."""
    return {
        **{f"{regime}: on <= 1.15x ideal": s["prefetch_on_over_ideal_median"] <= 1.15
           for regime, s in summary.items()},
        **{f"{regime}: off visibly worse than on":
           s["prefetch_off_over_ideal_median"] > 1.1 * s["prefetch_on_over_ideal_median"]
           for regime, s in summary.items()},
    }


def _two_client_worker(config: InfinityConfig, namespace: str, num_layers: int, num_steps: int,
                       barrier: Any, out: Any) -> None:
    torch.set_num_threads(1)
    client = infinity.connect(config=config, name="bench-overlap-pair")
    try:
        run_step(client, num_layers, None, namespace=namespace)  # records the trace
        run_step(client, num_layers, None, namespace=namespace)
        barrier.wait()
        start = time.perf_counter()
        counters = [run_step(client, num_layers, None, namespace=namespace)[1]
                    for _ in range(num_steps)]
        out.send({"seconds": time.perf_counter() - start,
                  "stall_s": sum(c["stall_s"] for c in counters),
                  "disk_read_bytes": sum(c["disk_read_bytes"] for c in counters),
                  "bytes_got": sum(c["bytes_got"] for c in counters)})
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/var/tmp/infinity-bench-overlap",
                        help="a folder on the drive to measure (emptied first, removed after)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--layer-bytes", type=_bytes, default=32 * MiB)
    parser.add_argument("--pair-steps", type=int, default=4,
                        help="steps each of the two clients times")
    add_daemon_arguments(parser, set_example="scheduler.lookahead_accesses=8 (both daemons)")
    args = parser.parse_args(argv)
    extra = typed_settings(args.set)
    torch.set_num_threads(1)
    # O_DIRECT into physically scattered pages runs at about half speed on this VM's disk, and the
    # kernel hands its free fragments to whoever allocates first (the daemons' segments here).
    # Taking them first gives the daemons and the raw engine the same kind of memory.
    fragments = small_free_blocks_bytes()
    soak_bytes = (fragments + fragments // 4 + 64 * MiB if args.soak_bytes == "auto"
                  else _bytes(args.soak_bytes))
    soak = torch.ones(soak_bytes // 8, dtype=torch.int64) if soak_bytes else None
    num_layers, layer_bytes = args.layers, args.layer_bytes
    if layer_bytes % (4 * ROWS):
        raise SystemExit(f"--layer-bytes must be a multiple of {4 * ROWS}")
    tier_bytes = num_layers * layer_bytes // 4
    shape = (ROWS, layer_bytes // (4 * ROWS))
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)

    def settings(name: str, *, prefetch: bool) -> dict[str, Any]:
        return store_daemon_settings(args.dir, name, cpu_budget_bytes=tier_bytes,
                                     nvme_capacity_bytes=4 * num_layers * layer_bytes,
                                     prefetch=prefetch, extra=extra)

    daemons: dict[str, tuple[subprocess.Popen[bytes], InfinityConfig]] = {}
    rounds: list[dict[str, Any]] = []
    report: dict[str, Any] = {}
    try:
        for mode, prefetch in (("off", False), ("on", True)):
            folder = os.path.join(args.dir, mode)
            os.makedirs(folder)
            daemons[mode] = start_daemon(folder, settings(f"{mode}-daemon", prefetch=prefetch))
        config = daemons["on"][1]
        raw = RawEngine(os.path.join(args.dir, "raw"), config, num_layers, layer_bytes, 4)
        resident = torch.full(shape, layer_value(0))
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console) as progress:
            task = progress.add_task("writing the layers", total=2 * num_layers + 1)
            raw.write(num_layers)
            progress.advance(task)
            for mode, (_, daemon_config) in daemons.items():
                client = infinity.connect(config=daemon_config, name="bench-overlap-writer")
                for i in range(num_layers):
                    client.write_from(f"layer{i}", torch.full(shape, layer_value(i)))
                    progress.advance(task)
                client.close()

            progress.update(task, description="measuring the engine and the compute")
            read_s = statistics.median(raw.read(num_layers) for _ in range(3))
            bandwidth = num_layers * layer_bytes / read_s
            layer_read_s = layer_bytes / bandwidth
            xs: dict[str, torch.Tensor] = {}
            compute_s: dict[str, float] = {}
            for regime, factor in REGIMES.items():
                rows = rows_for(factor * layer_read_s, resident)
                xs[regime] = torch.ones(rows, ROWS)
                compute_s[regime] = time_multiply(rows, resident, 9)
            beside_bandwidth = engine_beside_multiply(
                raw, num_layers, layer_bytes, xs["io_dominated"].shape[0], shape)

            # Record each regime's trace once per daemon (its own client name: the timing of
            # the two regimes differs), then time one step per round, regime and mode.
            steps = len(REGIMES) * 2 * (args.rounds + 2)
            task = progress.add_task("steps", total=steps)
            for regime in REGIMES:
                for mode, (_, daemon_config) in daemons.items():
                    client = infinity.connect(config=daemon_config, name=f"bench-{regime}")
                    for _ in range(2):  # the first records; the second settles the timing
                        run_step(client, num_layers, xs[regime])
                        progress.advance(task)
                    client.close()
            for round_ in range(args.rounds):
                result: dict[str, Any] = {"engine_read_gbps": None}
                read_s = raw.read(num_layers)
                result["engine_read_gbps"] = round(num_layers * layer_bytes / read_s / 1e9, 3)
                round_bandwidth = num_layers * layer_bytes / read_s
                for regime in REGIMES:
                    ideal_s = max(num_layers * compute_s[regime],
                                  (num_layers * layer_bytes - tier_bytes) / round_bandwidth)
                    entry: dict[str, Any] = {"ideal_s": round(ideal_s, 4)}
                    for mode, (_, daemon_config) in daemons.items():
                        progress.update(task, description=f"round {round_ + 1}: {regime}, "
                                                          f"prefetch {mode}")
                        client = infinity.connect(config=daemon_config, name=f"bench-{regime}")
                        step_s, counters = run_step(client, num_layers, xs[regime])
                        client.close()
                        entry[f"prefetch_{mode}_s"] = round(step_s, 4)
                        entry[f"prefetch_{mode}_over_ideal"] = round(step_s / ideal_s, 3)
                        entry[f"prefetch_{mode}_counters"] = {
                            k: counters[k] for k in ("prefetch_hits", "inflight_hits",
                                                     "resident_hits", "misses", "stall_s",
                                                     "disk_read_bytes")}
                        progress.advance(task)
                    result[regime] = entry
                rounds.append(result)

            progress.update(task, description="two clients")
            report["two_clients"] = two_clients(daemons["on"][1], num_layers, shape,
                                                args.pair_steps, raw)
        stats = {mode: infinity.connect(config=c, name="bench-overlap-stats").stats()
                 for mode, (_, c) in daemons.items()}
    finally:
        for process, _ in daemons.values():
            process.send_signal(signal.SIGTERM)
            process.wait(60)
        shutil.rmtree(args.dir, ignore_errors=True)

    summary = summarize(rounds, compute_s, {r: x.shape[0] for r, x in xs.items()}, num_layers)
    pair = report["two_clients"]
    report = {
        "machine": {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
                    "engine": stats["on"]["tiers"]["nvme"]["engine"]},
        "settings": {"soak_bytes": soak_bytes, "free_blocks_of_64KiB_or_less": fragments,
                     "layers": num_layers, "layer_bytes": layer_bytes, "layer_shape": list(shape),
                     "tier_bytes": tier_bytes, "rounds": args.rounds, "io": config.io.__dict__,
                     "scheduler": {k: v for k, v in config.scheduler.__dict__.items()
                                   if k != "namespace_quota_bytes"}},
        "engine_read_gbps_at_start": round(bandwidth / 1e9, 3),
        # Not part of the targets: the engine alone again, beside a process multiplying as the
        # I/O-dominated step does. Its ratio is how much of the disk the compute's memory
        # traffic costs on this machine, whatever the daemon does.
        "engine_read_gbps_beside_multiply": round(beside_bandwidth / 1e9, 3),
        "engine_beside_multiply_over_alone": round(beside_bandwidth / bandwidth, 3),
        "rounds": rounds,
        "summary": summary,
        "two_clients": pair,
        "daemon_read_bandwidth_estimate_gbps": round(
            stats["on"]["scheduler"]["read_bandwidth_bytes_per_s"] / 1e9, 3),
        "targets_met": {
            **step_targets(summary),
            "two clients: together >= 0.8x engine": pair["together_over_engine"] >= 0.8,
            "two clients: stall within 2x": pair["stall_ratio"] <= 2.0,
        },
    }
    print(json.dumps(report, indent=1))
    del soak
    return 0


def two_clients(config: InfinityConfig, num_layers: int, shape: tuple[int, int], num_steps: int,
                raw: RawEngine) -> dict[str, Any]:
    """Two processes stepping with no compute over their own halves of the layers' bytes."""
    half = num_layers // 2
    writer = infinity.connect(config=config, name="bench-overlap-writer")
    for n in range(2):
        for i in range(half):
            writer.write_from(f"layer{i}", torch.full(shape, layer_value(i)), namespace=f"pair{n}")
    writer.close()
    spawn = multiprocessing.get_context("spawn")
    barrier = spawn.Barrier(3)
    pipes = [spawn.Pipe(duplex=False) for _ in range(2)]
    workers = [spawn.Process(target=_two_client_worker,
                             args=(config, f"pair{n}", half, num_steps, barrier, pipes[n][1]))
               for n in range(2)]
    for worker in workers:
        worker.start()
    barrier.wait(timeout=600)
    start = time.perf_counter()
    results = [receiver.recv() for receiver, _ in pipes]
    wall_s = time.perf_counter() - start
    for worker in workers:
        worker.join(60)
    engine_s = raw.read(num_layers)  # right after, the same bytes as both clients' steps
    engine_bps = num_layers * raw.tensor_bytes / engine_s
    read = sum(r["disk_read_bytes"] for r in results)
    stalls = [r["stall_s"] for r in results]
    return {
        "clients": results,
        "wall_s": round(wall_s, 4),
        "together_read_gbps": round(read / wall_s / 1e9, 3),
        "engine_read_gbps": round(engine_bps / 1e9, 3),
        "together_over_engine": round(read / wall_s / engine_bps, 3),
        "stall_ratio": round(max(stalls) / max(min(stalls), 1e-9), 3),
    }


if __name__ == "__main__":
    sys.exit(main())
