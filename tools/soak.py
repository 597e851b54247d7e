"""A bounded soak of infinityd: clients putting, reading, deleting and flushing through eviction,
killed and started again at random, while the daemon's memory and files are watched.

    .venv/bin/python tools/soak.py [--duration-s 600] [--clients 4] [--seed 1]
                                   [--cpu-budget-mib 32] [--dir /var/tmp] > soak.json

A private daemon with an NVMe tier (on `--dir`, a real disk) behind a CPU tier much smaller than
what the clients keep, so tensors are evicted and loaded again all the time. Each client is a
process of its own (`--worker`) working in its namespace on up to `--names` names: put (a new
value of a seeded random dtype and odd shape), get (compared bit for bit with what it last
put), delete, and now and then `flush_store` (everything durable). It keeps a ledger file of
what it believes the store holds: a line before each put or delete (the intent) and one after
the daemon acknowledged it. Every `--kill-every-s` on average a random client that is past its
start is killed with SIGKILL and a new one started on its ledger: it first checks every name
against the ledger (the acknowledged value, or where the kill came between intent and
acknowledgement either the old or the new one; a name acknowledged deleted must be gone) and
then goes on working.

Every second the daemon's RSS, anonymous memory, open files and CPU-tier bytes in use are
sampled. Printed (JSON): operations by kind, kills, checks, tensors lost or wrong (must be 0),
whether the daemon lived throughout, and growth once warm: the samples' maxima over the last
fifth of the run against those over the second fifth (the first is the warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

import infinity
from bench_launch import daemon_figures, start_daemon
from infinity.config import MiB, load_config

# How long past its duration a run waits for --min-kills.
MIN_KILLS_GRACE_S = 120.0

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int32, torch.int64,
          torch.uint8, torch.float64, torch.bool]


def value_of(name: str, version: int) -> torch.Tensor:
    """The value a client puts as `name`'s `version`: seeded, of a dtype and odd shape that
    change with the version (up to ~1.5 MiB)."""
    seed = version * 7919 + sum(map(ord, name)) * 31
    generator = torch.Generator().manual_seed(seed)
    dtype = DTYPES[seed % len(DTYPES)]
    shape = (1 + seed % 97, 1 + (seed // 97) % 1531)
    values = torch.randint(-120, 120, shape, generator=generator)
    return values > 0 if dtype == torch.bool else values.to(dtype)


# --- a client (--worker) ------------------------------------------------------------------------

def read_ledger(path: str) -> dict[str, tuple[int | None, int | None]]:
    """name -> (acknowledged version or None if deleted/never, version in flight or None);
    version -1 in flight is a delete."""
    state: dict[str, tuple[int | None, int | None]] = {}
    if not os.path.exists(path):
        return state
    with open(path) as ledger:
        for line in ledger:
            parts = line.split()
            if len(parts) != 3:
                continue  # a line the kill cut short: its operation was not acknowledged
            what, name, version_text = parts
            version = int(version_text)
            done, _ = state.get(name, (None, None))
            if what == "intent":
                state[name] = (done, version)
            else:  # "done"
                state[name] = (None if version < 0 else version, None)
    return state


def check_against_ledger(client: Any, namespace: str,
                         ledger: dict[str, tuple[int | None, int | None]]
                         ) -> tuple[int, int, int, dict[str, int]]:
    """(checked, lost, wrong, the version each present name holds) for every name of the
    ledger: a name holds its acknowledged version, or where a kill came between intent and
    acknowledgement, either that or the one in flight (a delete's: none)."""
    checked = lost = wrong = 0
    holds: dict[str, int] = {}
    for name, (done, pending) in ledger.items():
        allowed = [done] if pending is None else [done, None if pending < 0 else pending]
        checked += 1
        if not client.exists(name, namespace=namespace):
            if None not in allowed:
                lost += 1
            continue
        with client.get(name, namespace=namespace) as view:
            stored = view.clone()
        match = [v for v in allowed if v is not None and value_of(name, v).dtype == stored.dtype
                 and torch.equal(value_of(name, v), stored)]
        if match:
            holds[name] = match[0]
        else:
            wrong += 1
    return checked, lost, wrong, holds


def worker(settings_file: str, runtime_dir: str, index: int, ledger_path: str,
           names: int, seed: int, report_path: str) -> None:
    config = load_config(settings_file, env={}, overrides={"daemon.runtime_dir": runtime_dir})
    client = infinity.connect(config=config, name=f"soak-{index}")
    namespace = f"soak-{index}"
    ledger_state = read_ledger(ledger_path)
    checked, lost, wrong, holds = check_against_ledger(client, namespace, ledger_state)
    # Versions only grow (a put after a kill must not reuse one the store may hold).
    versions = {name: max(v for v in (done, pending, 0) if v is not None)
                for name, (done, pending) in ledger_state.items()}
    versions.update(holds)
    present = set(holds)
    counts = {"put": 0, "get": 0, "delete": 0, "flush": 0, "wrong_reads": 0}
    rng = random.Random(seed)
    last_report = 0.0
    with open(ledger_path, "a", buffering=1) as ledger:
        def write_report() -> None:
            with open(report_path + ".tmp", "w") as f:
                json.dump({"checked": checked, "lost": lost, "wrong": wrong, **counts}, f)
            os.replace(report_path + ".tmp", report_path)

        write_report()
        while True:
            name = f"t{rng.randrange(names)}"
            action = rng.random()
            if action < 0.45 or name not in present:
                version = versions.get(name, 0) + 1
                ledger.write(f"intent {name} {version}\n")
                client.put(name, value_of(name, version), namespace=namespace)
                ledger.write(f"done {name} {version}\n")
                versions[name] = version
                present.add(name)
                counts["put"] += 1
            elif action < 0.85:
                with client.get(name, namespace=namespace) as view:
                    expected = value_of(name, versions[name])
                    if not (view.dtype == expected.dtype and torch.equal(view, expected)):
                        counts["wrong_reads"] += 1
                counts["get"] += 1
            elif action < 0.99:
                ledger.write(f"intent {name} -1\n")
                client.delete(name, namespace=namespace)
                ledger.write(f"done {name} -1\n")
                present.discard(name)
                counts["delete"] += 1
            else:
                client.flush_store()
                counts["flush"] += 1
            if time.monotonic() - last_report > 0.5:
                write_report()
                last_report = time.monotonic()


# --- the conductor --------------------------------------------------------------------------------

def sample(pid: int, client: Any) -> dict[str, int]:
    return {**daemon_figures(pid),
            "cpu_used_bytes": int(client.stats()["tiers"]["cpu"]["used_bytes"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--names", type=int, default=61, help="names per client")
    parser.add_argument("--kill-every-s", type=float, default=5.0)
    parser.add_argument("--min-kills", type=int, default=0,
                        help="go on past --duration-s (by up to 120 s) until this many kills: on "
                             "a busy machine the clients may take the whole run to start")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cpu-budget-mib", type=int, default=32,
                        help="the daemon's CPU tier: far less than the clients keep")
    parser.add_argument("--dir", default="/var/tmp")
    parser.add_argument("--worker", nargs=7, metavar="ARG", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        settings, runtime, index, ledger, names, seed, report = args.worker
        worker(settings, runtime, int(index), ledger, int(names), int(seed), report)
        return 0
    console = Console(stderr=True)
    rng = random.Random(args.seed)
    folder = tempfile.mkdtemp(prefix="infinity-soak-", dir=args.dir)
    os.makedirs(os.path.join(folder, "store"))
    process, config = start_daemon(folder, {
        "daemon.runtime_dir": os.path.join(folder, "rt"), "daemon.log_level": "warning",
        "cpu.budget_bytes": args.cpu_budget_mib * MiB, "cpu.segment_bytes": 4 * MiB,
        "nvme.dirs": [os.path.join(folder, "store")]})
    settings_file = os.path.join(folder, "bench.toml")
    workers: dict[int, subprocess.Popen[bytes]] = {}
    starts = {i: 0 for i in range(args.clients)}
    totals = {"checked": 0, "lost": 0, "wrong": 0, "put": 0, "get": 0, "delete": 0, "flush": 0,
              "wrong_reads": 0}
    failed_workers = 0
    kills = 0
    samples: list[dict[str, int]] = []

    def start(index: int) -> None:
        starts[index] += 1
        workers[index] = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", settings_file,
             config.daemon.runtime_dir, str(index), os.path.join(folder, f"ledger-{index}"),
             str(args.names), str(args.seed * 1000 + index * 100 + starts[index]),
             os.path.join(folder, f"report-{index}-{starts[index]}")],
            stdin=subprocess.DEVNULL)

    def collect(index: int) -> None:
        path = os.path.join(folder, f"report-{index}-{starts[index]}")
        if os.path.exists(path):
            with open(path) as f:
                report = json.load(f)
            for key in totals:
                totals[key] += report.get(key, 0)

    watcher = infinity.connect(config=config, name="soak-watcher")
    alive = True
    tier_counters: dict[str, Any] = {}
    try:
        for index in range(args.clients):
            start(index)
        began = time.monotonic()
        next_kill = began + rng.expovariate(1 / args.kill_every_s)
        columns = (TextColumn("soak"), BarColumn(), TextColumn("{task.fields[kills]} kills"),
                   TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("soak", total=args.duration_s, kills=0)
            while (time.monotonic() - began < args.duration_s or (
                    kills < args.min_kills
                    and time.monotonic() - began < args.duration_s + MIN_KILLS_GRACE_S)):
                time.sleep(1.0)
                if process.poll() is not None:
                    alive = False
                    break
                samples.append(sample(process.pid, watcher))
                for index, job in list(workers.items()):
                    if job.poll() is not None:  # a worker that stopped by itself failed
                        failed_workers += 1
                        collect(index)
                        start(index)
                working = [i for i in range(args.clients) if os.path.exists(
                    os.path.join(folder, f"report-{i}-{starts[i]}"))]  # past its start check
                if time.monotonic() >= next_kill and working:
                    index = rng.choice(working)
                    workers[index].send_signal(signal.SIGKILL)
                    workers[index].wait()
                    collect(index)
                    kills += 1
                    start(index)
                    next_kill = time.monotonic() + rng.expovariate(1 / args.kill_every_s)
                progress.update(task, completed=time.monotonic() - began, kills=kills)
        for index, job in workers.items():  # a last check of every ledger by a fresh client
            job.send_signal(signal.SIGKILL)
            job.wait()
            collect(index)
        if alive:
            for index in range(args.clients):
                start(index)
            deadline = time.monotonic() + 120
            for index in range(args.clients):
                path = os.path.join(folder, f"report-{index}-{starts[index]}")
                while not os.path.exists(path) and time.monotonic() < deadline:
                    time.sleep(0.1)
                workers[index].send_signal(signal.SIGKILL)
                workers[index].wait()
                collect(index)
        alive = alive and process.poll() is None
        tier_counters = watcher.stats()["counters"]["tiers"] if alive else {}
    finally:
        for job in workers.values():
            if job.poll() is None:
                job.kill()
                job.wait()
        watcher.close()
        if process.poll() is None:
            process.terminate()
            process.wait(60)
        shutil.rmtree(folder, ignore_errors=True)
    fifth = max(1, len(samples) // 5)
    keys = list(samples[0]) if samples else []
    # Growth once warm: the largest sample of the last fifth of the run against the largest of
    # the second (the first is the warm-up); maxima, since clients come and go all the time.
    warm = {key: max(s[key] for s in samples[fifth:2 * fifth] or samples) for key in keys}
    end = {key: max(s[key] for s in samples[-fifth:]) for key in keys}
    result = {
        "duration_s": args.duration_s, "ran_s": round(time.monotonic() - began, 1),
        "clients": args.clients, "kills": kills,
        "worker_failures": failed_workers, "daemon_alive": alive, **totals,
        "tier_counters": tier_counters,  # evictions and reloads: the tier was churned
        "samples": len(samples), "second_fifth_max": warm, "last_fifth_max": end,
        "growth_once_warm": {key: end[key] - warm[key] for key in keys},
        # The trend, not only its ends: the largest sample of each minute.
        "anon_bytes_by_minute": [max(s["anon_bytes"] for s in samples[i:i + 60])
                                 for i in range(0, len(samples), 60)],
    }
    print(json.dumps(result, indent=2))
    ok = alive and totals["lost"] == 0 and totals["wrong"] == 0 and totals["wrong_reads"] == 0
    return 0 if ok and failed_workers == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
