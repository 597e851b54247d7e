"""Benchmark infinityd against its limits, in one run; prints JSON on stdout.

    python tools/bench_daemon.py [--rounds 5] [--iterations 2000] [--seconds 3] [--put-repeats 15]
        [--set TABLE.KEY=VALUE ...]

Measured request by request in turn (echo, get, batched get, ...) so that the
machine's background load hits every subject alike:

- a bare echo: pyzmq ROUTER/DEALER over ipc:// in a separate process, msgpack
  on both sides, of a message shaped like a one-item get (and of one shaped
  like a 32-item get);
- this project's `get` + release of a resident tensor, and a 32-item
  batched `get` + release, through a real infinityd;

then requests per second with 1 and 4 client processes (get + release), and
`put` of 64 MiB against a `copy_` between two pre-touched tensors (median of
several each; each put follows a put of the same tensor, as in a training loop, so it
fills the spare reservation the last one left and makes one round trip), then the
same put step by step with both round trips (reserve, copy, commit) for comparison. Ratios are reported against the echo of the same run.
Targets: get+release and batched get p50 <= 1.5x and p99 <= 2x the echo;
put >= 0.9x the copy_. Also sampled with the latencies, outside the targets: a `put`
of 4 KiB of a name put before (one round trip, on the spare the last put left).
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
import tempfile
import time
from typing import Any

import msgpack
import torch
import zmq
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import infinity
from bench_launch import start_daemon, typed_settings
from infinity.config import InfinityConfig
from infinity.io.buffers import fill_method

MiB = 1024 * 1024
SPAWN = multiprocessing.get_context("spawn")
BATCH = 32
PUT_BYTES = 64 * MiB
WARM_UP_PUTS = 17  # the 3 x 5 trials of the fill's method, and 2 more


def _percentile(samples_ns: list[int], q: float) -> float:
    ordered = sorted(samples_ns)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000.0


def _latency(samples_ns: list[int]) -> dict[str, float]:
    return {"p50_us": round(_percentile(samples_ns, 0.50), 2),
            "p99_us": round(_percentile(samples_ns, 0.99), 2), "samples": len(samples_ns)}


# --- the bare echo -----------------------------------------------------------------------------

def _echo_server(endpoint: str, ready: Any) -> None:
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.bind(endpoint)
    ready.set()
    while True:
        identity, payload = sock.recv_multipart()
        message = msgpack.unpackb(payload)
        if message == "stop":
            break
        sock.send_multipart([identity, msgpack.packb(message)])
    sock.close(linger=0)
    context.term()


class Echo:
    def __init__(self, folder: str) -> None:
        endpoint = f"ipc://{folder}/echo.sock"
        ready = SPAWN.Event()
        self.process = SPAWN.Process(target=_echo_server, args=(endpoint, ready), daemon=True)
        self.process.start()
        ready.wait(60)
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.connect(endpoint)
        self.request_id = 0

    def round_trip(self, body: list[Any]) -> int:
        """One request-shaped message there and back, msgpack on both ends; ns."""
        self.request_id += 1
        start = time.perf_counter_ns()
        self.sock.send(msgpack.packb(["get", self.request_id, body]))
        msgpack.unpackb(self.sock.recv())
        return time.perf_counter_ns() - start

    def close(self) -> None:
        self.sock.send(msgpack.packb("stop"))
        self.process.join(10)
        self.sock.close(linger=0)
        self.context.term()


# --- the daemon ---------------------------------------------------------------------------------

def _start_daemon(folder: str, extra: dict[str, Any] | None = None
                  ) -> tuple[subprocess.Popen[bytes], InfinityConfig]:
    return start_daemon(folder, {
        "daemon.runtime_dir": os.path.join(folder, "rt"),
        "cpu.budget_bytes": 1024 * MiB,
        "cpu.segment_bytes": 256 * MiB,
        "daemon.log_level": "warning",
        **(extra or {}),
    })


def _names(count: int) -> list[str]:
    return [f"bench.{i}" for i in range(count)]


def _throughput_worker(config: InfinityConfig, seconds: float, barrier: Any, out: Any) -> None:
    torch.set_num_threads(1)
    client = infinity.connect(config=config, name="bench-rps")
    try:
        barrier.wait()
        count = 0
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            for _ in range(50):
                with client.get("bench.0"):
                    pass
            count += 50
        out.put(count)
    finally:
        client.close()


def _requests_per_s(config: InfinityConfig, processes: int, seconds: float) -> float:
    barrier = SPAWN.Barrier(processes + 1)
    out = SPAWN.Queue()
    workers = [SPAWN.Process(target=_throughput_worker, args=(config, seconds, barrier, out))
               for _ in range(processes)]
    for worker in workers:
        worker.start()
    barrier.wait()
    start = time.perf_counter()
    total = sum(out.get(timeout=seconds + 60) for _ in workers)
    elapsed = time.perf_counter() - start
    for worker in workers:
        worker.join(30)
    return round(total / elapsed, 1)


# --- the run ------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=2000, help="per subject and round")
    parser.add_argument("--seconds", type=float, default=3.0, help="per throughput measurement")
    parser.add_argument("--put-repeats", type=int, default=15)
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE",
                        help="a setting of the daemon and the client, e.g. "
                             "cpu.spare_fraction=0 (repeatable)")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    console = Console(stderr=True)
    folder = tempfile.mkdtemp(prefix="infb-", dir="/var/tmp")
    echo = None
    daemon = None
    client = None
    try:
        echo = Echo(folder)
        daemon, config = _start_daemon(folder, typed_settings(args.set))
        client = infinity.connect(config=config, name="bench")
        names = _names(BATCH)
        client.put_many({name: torch.randn(1024) for name in names})  # 4 KiB each, resident
        one_body = [["default", names[0], False]]
        batch_body = [["default", name, False] for name in names]
        samples: dict[str, list[int]] = {"echo": [], "echo_batch32": [], "get_release": [],
                                         "get_batch32": [], "put_4KiB": []}
        get, get_many, clock = client.get, client.get_many, time.perf_counter_ns
        small = torch.randn(1024)

        def run_put() -> int:
            start = clock()
            client.put("bench.small", small)  # type: ignore[union-attr]
            return clock() - start

        def run_get() -> int:
            start = clock()
            with get(names[0]):
                pass
            return clock() - start

        def run_batch() -> int:
            start = clock()
            with get_many(names):
                pass
            return clock() - start

        subjects = {"echo": lambda: echo.round_trip(one_body),  # type: ignore[union-attr]
                    "echo_batch32": lambda: echo.round_trip(batch_body),  # type: ignore[union-attr]
                    "get_release": run_get, "get_batch32": run_batch, "put_4KiB": run_put}
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console) as progress:
            task = progress.add_task("latency", total=args.rounds * len(subjects))
            for name, subject in subjects.items():  # warm-up: first-touch, caches, allocators
                for _ in range(200):
                    subject()
            # Sample the subjects in turn, one request each, so that the background load of a
            # shared machine falls on all of them alike, not on whichever ran during a burst.
            order = list(subjects.items())
            for round_ in range(args.rounds):
                for i in range(args.iterations):
                    shift = (i + round_) % len(order)
                    for name, subject in order[shift:] + order[:shift]:
                        samples[name].append(subject())
                progress.advance(task, len(subjects))

            task = progress.add_task("requests/s", total=2)
            rps = {}
            for processes in (1, 4):
                rps[f"clients_{processes}"] = _requests_per_s(config, processes, args.seconds)
                progress.advance(task)

            task = progress.add_task("put 64 MiB vs copy_",
                                     total=args.put_repeats * 2 + WARM_UP_PUTS)
            source = torch.randn(PUT_BYTES // 4)
            target = torch.empty_like(source)
            target.zero_()  # pre-touched, like the store's prefaulted segments
            target.copy_(source)
            # Puts first: the slices of the alternating versions and the spare exist, and the
            # fill's method is chosen (copy_into times copy_ and its streaming copies in turn).
            for _ in range(WARM_UP_PUTS):
                client.put("bench.big", source)
                progress.advance(task)
            copy_s, put_s, echo_after_copy_ns = [], [], []
            reserve_s, fill_s, commit_s = [], [], []
            reserves_before = client.stats()["counters"]["ops"].get("reserve", 0)
            for _ in range(args.put_repeats):
                start = time.perf_counter()
                target.copy_(source)
                copy_s.append(time.perf_counter() - start)
                # What one bare round trip costs right after such a copy, for the breakdown below.
                echo_after_copy_ns.append(echo.round_trip(one_body))
                target.copy_(source)
                start = time.perf_counter()
                client.put("bench.big", source)
                put_s.append(time.perf_counter() - start)
                progress.advance(task)
            # How many of those puts had to reserve (none, when each found the spare the one
            # before it left).
            puts_that_reserved = (client.stats()["counters"]["ops"].get("reserve", 0)
                                  - reserves_before)
            # A put step by step with both round trips (reserve, fill, commit; not part of the
            # ratio): a plain commit leaves no spare, so each reserve here asks the daemon.
            for _ in range(args.put_repeats):
                target.copy_(source)
                t0 = time.perf_counter()
                views = client.reserve({"bench.big": source})
                t1 = time.perf_counter()
                views["bench.big"].copy_(source)
                t2 = time.perf_counter()
                client.commit("bench.big")
                t3 = time.perf_counter()
                reserve_s.append(t1 - t0)
                fill_s.append(t2 - t1)
                commit_s.append(t3 - t2)
                progress.advance(task)
            with client.get("bench.big") as stored:
                assert torch.equal(stored, source), "put stored different bytes"

        lat = {name: _latency(values) for name, values in samples.items()}
        echo_lat, echo32 = lat["echo"], lat["echo_batch32"]
        for name in ("get_release", "get_batch32", "put_4KiB"):
            lat[name]["p50_ratio_to_echo"] = round(lat[name]["p50_us"] / echo_lat["p50_us"], 3)
            lat[name]["p99_ratio_to_echo"] = round(lat[name]["p99_us"] / echo_lat["p99_us"], 3)
        lat["get_batch32"]["p50_ratio_to_echo_batch32"] = round(
            lat["get_batch32"]["p50_us"] / echo32["p50_us"], 3)
        lat["get_batch32"]["p99_ratio_to_echo_batch32"] = round(
            lat["get_batch32"]["p99_us"] / echo32["p99_us"], 3)
        copy_med, put_med = statistics.median(copy_s), statistics.median(put_s)
        echo_after_ms = statistics.median(echo_after_copy_ns) / 1e6
        ms = lambda values: round(statistics.median(values) * 1e3, 3)  # noqa: E731
        put = {"bytes": PUT_BYTES, "copy_ms": round(copy_med * 1e3, 3),
               "put_ms": round(put_med * 1e3, 3),
               "copy_gbps": round(PUT_BYTES / copy_med / 1e9, 3),
               "put_gbps": round(PUT_BYTES / put_med / 1e9, 3),
               "ratio_to_copy": round(copy_med / put_med, 3), "repeats": args.put_repeats,
               # Each put against the copy_ just before it: steadier when the load drifts.
               "paired_ratio_median": round(statistics.median(
                   c / p for c, p in zip(copy_s, put_s)), 3),
               "puts_that_reserved": puts_that_reserved,
               "fill_method": fill_method(),
               "two_round_trips_ms": {"reserve": ms(reserve_s), "fill_copy": ms(fill_s),
                                      "commit": ms(commit_s)},
               "fill_ratio_to_copy": round(copy_med / statistics.median(fill_s), 3),
               # A put with a spare needs one acknowledged round trip (commit_renew); this is
               # what a bare echo costs right after a 64 MiB copy on this machine, the floor
               # of that overhead.
               "echo_after_copy_ms": round(echo_after_ms, 3),
               "ratio_to_copy_plus_one_echo": round(
                   (copy_med + echo_after_ms / 1e3) / put_med, 3)}
        report = {
            "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                        "load_avg_1m": round(os.getloadavg()[0], 2)},
            "settings": {text.split("=", 1)[0].strip(): text.split("=", 1)[1].strip()
                         for text in args.set},
            "latency": lat,
            "requests_per_s": rps,
            "put_64MiB": put,
            "targets_met": {
                "get_release_p50<=1.5x": lat["get_release"]["p50_ratio_to_echo"] <= 1.5,
                "get_release_p99<=2x": lat["get_release"]["p99_ratio_to_echo"] <= 2.0,
                "get_batch32_p50<=1.5x": lat["get_batch32"]["p50_ratio_to_echo"] <= 1.5,
                "get_batch32_p99<=2x": lat["get_batch32"]["p99_ratio_to_echo"] <= 2.0,
                "put>=0.9x_copy": put["ratio_to_copy"] >= 0.9,
            },
        }
        print(json.dumps(report, indent=2))
        return 0
    finally:
        if client is not None:
            client.close()
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(30)
        if echo is not None:
            echo.close()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
