#!/usr/bin/env python3
"""I/O benchmark: Infinity's engine and NVMe tier against fio and DeepSpeed's aio handle.

Every contender first picks its best settings, per mode, from a short sweep on the
same directory; then each moves `--total-bytes` of random data as `--tensor-bytes`
tensors in `--rounds` interleaved rounds of fresh-file writes, overwrites and reads
(reads read back what that contender's run wrote, and are verified). Prints JSON:
GB/s per contender per round, and per-round ratios with their medians.

Contenders:
  engine     infinity.io.IOEngine, one O_DIRECT file per tensor (like the peers)
  store      infinity.store.nvme.NvmeTier: extent file, CRC32C per MiB written and verified
  fio        fio with --direct=1, its best over io_uring/libaio, block size, depth, jobs
  deepspeed  deepspeed.ops.aio aio_handle sync_pwrite/sync_pread, in its own venv
             (tools/peers/setup_peers.sh); "skipped" with the reason where it is missing

    .venv/bin/python tools/bench_io.py --dir /var/tmp/infinity-bench > bench_io.json
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from rich.console import Console
from rich.progress import Progress

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import fio_runner  # noqa: E402

from infinity.config import GiB, IOConfig, MiB, NvmeConfig  # noqa: E402
from infinity.io import IOEngine, IOOp, aligned_empty  # noqa: E402
from infinity.store.nvme import EXTENT_FILE_NAME, NvmeTier, TensorLayout  # noqa: E402

MODES = ("write", "overwrite", "read")  # write = fresh files
PEERS_DIR = Path(os.environ.get("INFINITY_PEERS_DIR", "/var/tmp/infinity-peers"))
DS_WORKER = Path(__file__).resolve().parent / "peers" / "deepspeed_aio_worker.py"
console = Console(stderr=True)


def key_for(seed: int, index: int) -> int:
    """A 63-bit key per (run, tensor): every tensor's bytes differ, and a read can check them alone."""
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Pattern:
    """Random base data; tensor i of run `seed` holds base XOR key(seed, i)."""

    def __init__(self, tensor_bytes: int) -> None:
        self.base = aligned_empty(tensor_bytes).view(torch.int64)
        self.base.random_(generator=torch.Generator().manual_seed(1234))

    def fill(self, buf: torch.Tensor, seed: int, index: int) -> None:
        torch.bitwise_xor(self.base, key_for(seed, index), out=buf.view(torch.int64))

    def check(self, buf: torch.Tensor, seed: int, index: int) -> bool:
        return torch.equal(torch.bitwise_xor(buf.view(torch.int64), key_for(seed, index)), self.base)


class EngineContender:
    """The raw engine: one O_DIRECT file per tensor, `in_flight` tensors per batch."""

    name = "engine"

    def __init__(self, directory: str, count: int, tensor_bytes: int, pattern: Pattern) -> None:
        self.dir = os.path.join(directory, "engine")
        os.makedirs(self.dir, exist_ok=True)
        self.count = count
        self.paths = [os.path.join(self.dir, f"t{i:05d}.bin") for i in range(count)]
        self.tensor_bytes = tensor_bytes
        self.pattern = pattern
        self.buffers: list[torch.Tensor] = []

    def _buffers(self, n: int) -> list[torch.Tensor]:
        while len(self.buffers) < n:
            self.buffers.append(aligned_empty(self.tensor_bytes))
        return self.buffers[:n]

    def run(self, mode: str, settings: dict[str, int], seed: int) -> tuple[float, bool | None]:
        in_flight = settings["in_flight"]
        config = IOConfig(block_size_bytes=settings["block_size_bytes"], queue_depth=settings["queue_depth"],
                          num_threads=settings["num_threads"])
        if mode == "write":
            for p in self.paths:
                if os.path.exists(p):
                    os.unlink(p)
        flags = os.O_DIRECT | (os.O_RDONLY if mode == "read" else os.O_WRONLY | os.O_CREAT)
        seconds, verified = 0.0, True
        with IOEngine(config) as engine:
            for group in _chunks(range(len(self.paths)), in_flight):
                bufs = self._buffers(len(group))
                if mode != "read":
                    for buf, i in zip(bufs, group):
                        self.pattern.fill(buf, seed, i)
                start = time.perf_counter()
                fds = [os.open(self.paths[i], flags, 0o600) for i in group]
                make = IOOp.read if mode == "read" else IOOp.write
                engine.submit([make(fd=fd, address=buf.data_ptr(), nbytes=self.tensor_bytes, offset=0)
                               for fd, buf in zip(fds, bufs)]).result()
                for fd in fds:
                    os.close(fd)
                seconds += time.perf_counter() - start
                if mode == "read":
                    verified &= all(self.pattern.check(buf, seed, i) for buf, i in zip(bufs, group))
        return seconds, (verified if mode == "read" else None)

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class StoreContender:
    """The NVMe tier: one extent file, CRC32C per MiB computed on write and verified on read."""

    name = "store"

    def __init__(self, directory: str, count: int, tensor_bytes: int, pattern: Pattern) -> None:
        self.dir = os.path.join(directory, "store")
        os.makedirs(self.dir, exist_ok=True)
        self.count = count
        self.tensor_bytes = tensor_bytes
        self.pattern = pattern
        self.layouts: list[TensorLayout] = []
        self.buffers: list[torch.Tensor] = []

    def run(self, mode: str, settings: dict[str, int], seed: int) -> tuple[float, bool | None]:
        in_flight = settings["in_flight"]
        io = IOConfig(block_size_bytes=settings["block_size_bytes"], queue_depth=settings["queue_depth"],
                      num_threads=settings["num_threads"])
        # One stripe per tensor; the tier takes whole MiB stripes and 4 KiB capacities only.
        stripe = -(-self.tensor_bytes // MiB) * MiB
        nvme = NvmeConfig(dirs=(self.dir,), capacity_bytes_per_dir=(self.count + 1) * stripe,
                          stripe_bytes=stripe, file_grow_bytes=256 * MiB)
        if mode == "write":  # fresh: a new extent file, grown (fallocate) inside the timed region
            self.layouts = []
            path = os.path.join(self.dir, EXTENT_FILE_NAME)
            if os.path.exists(path):
                os.unlink(path)
        while len(self.buffers) < in_flight:
            self.buffers.append(aligned_empty(self.tensor_bytes))
        seconds, verified = 0.0, True
        with IOEngine(io) as engine:
            tier = NvmeTier(nvme, engine)
            for layout in self.layouts:
                tier.adopt(layout)
            try:
                for group in _chunks(range(self.count), in_flight):
                    bufs = self.buffers[:len(group)]
                    if mode != "read":
                        for buf, i in zip(bufs, group):
                            self.pattern.fill(buf, seed, i)
                    start = time.perf_counter()
                    if mode == "read":
                        futures = [tier.read_into(self.layouts[i], buf.data_ptr()) for buf, i in zip(bufs, group)]
                        for f in futures:
                            f.result()
                    else:
                        writes = [tier.write_from(buf.data_ptr(), self.tensor_bytes,
                                                  layout=self.layouts[i] if mode == "overwrite" else None)
                                  for buf, i in zip(bufs, group)]
                        done = [w.result() for w in writes]
                        if mode == "write":
                            self.layouts.extend(done)
                        else:
                            self.layouts[group[0]:group[-1] + 1] = done
                    seconds += time.perf_counter() - start
                    if mode == "read":
                        verified &= all(self.pattern.check(buf, seed, i) for buf, i in zip(bufs, group))
            finally:
                tier.close()
        return seconds, (verified if mode == "read" else None)

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _chunks(items: range, size: int) -> list[list[int]]:
    return [list(items[i:i + size]) for i in range(0, len(items), size)]


def sweep_infinity(contender: EngineContender | StoreContender, *, quick: bool) -> dict[str, dict[str, Any]]:
    """Best settings per mode for one of our contenders, on the sweep's data."""
    cores = os.cpu_count() or 1
    grid = list(itertools.product([1 * MiB, 4 * MiB, 8 * MiB], [8, 32, 64], sorted({1, min(2, cores)}), [1, 4]))
    if quick:
        grid = [(1 * MiB, 32, 1, 2), (4 * MiB, 32, 2, 4)]
    rows = []
    for block, depth, threads, in_flight in grid:
        settings = {"block_size_bytes": block, "queue_depth": depth, "num_threads": threads, "in_flight": in_flight}
        row: dict[str, Any] = {"settings": settings}
        for mode in ("write", "read", "overwrite"):
            seconds, ok = contender.run(mode, settings, seed=0)
            if ok is False:
                raise RuntimeError(f"{contender.name} read back wrong data during the sweep")
            row[mode] = contender.tensor_bytes * contender.count / seconds / 1e9
        rows.append(row)
    return {mode: {"gbps": round(best[mode], 3), **best["settings"]}
            for mode in MODES for best in [max(rows, key=lambda r: r[mode])]}


# --- the peers -------------------------------------------------------------------


def deepspeed_python() -> tuple[str | None, str]:
    python = PEERS_DIR / "venv" / "bin" / "python"
    if not python.exists():
        return None, f"no DeepSpeed venv at {python}: run tools/peers/setup_peers.sh"
    return str(python), ""


def deepspeed_env() -> dict[str, str]:
    return {**os.environ, "DS_ACCELERATOR": "cpu",
            "TORCH_EXTENSIONS_DIR": str(PEERS_DIR / "torch_extensions")}


def run_deepspeed(args: list[str], timeout_s: float) -> dict[str, Any]:
    python, reason = deepspeed_python()
    if python is None:
        raise RuntimeError(reason)
    out = subprocess.run([python, str(DS_WORKER), *args], capture_output=True, text=True,
                         env=deepspeed_env(), timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"DeepSpeed worker failed ({out.returncode}): {out.stderr.strip()[-1500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


class DeepSpeedContender:
    name = "deepspeed"

    def __init__(self, directory: str, count: int, tensor_bytes: int) -> None:
        self.dir = os.path.join(directory, "deepspeed")
        os.makedirs(self.dir, exist_ok=True)
        self.paths = [os.path.join(self.dir, f"t{i:05d}.bin") for i in range(count)]
        self.tensor_bytes = tensor_bytes

    def sweep(self, sweep_bytes: int, *, quick: bool) -> dict[str, dict[str, Any]]:
        extra = ["--block-sizes", "1M,4M", "--queue-depths", "32", "--parallelisms", "1,2"] if quick else []
        result = run_deepspeed(["--sweep", self.dir, "--total-bytes", str(sweep_bytes),
                                "--file-bytes", str(self.tensor_bytes), *extra], timeout_s=1800)
        return {mode: result["best"][mode] for mode in MODES}

    def run(self, mode: str, settings: dict[str, Any], seed: int) -> tuple[float, bool | None]:
        job = {"op": "read" if mode == "read" else "write", "paths": self.paths, "nbytes": self.tensor_bytes,
               "block_size": settings["block_size"], "queue_depth": settings["queue_depth"],
               "intra_op_parallelism": settings["intra_op_parallelism"],
               "single_submit": settings.get("single_submit", False),
               "overlap_events": settings.get("overlap_events", True),
               "seed": seed, "fresh": mode == "write", "verify": True}
        result = run_deepspeed([json.dumps(job)], timeout_s=1800)
        return float(result["seconds"]), result.get("verified")

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class FioContender:
    name = "fio"

    def __init__(self, directory: str, count: int, tensor_bytes: int) -> None:
        self.dir = os.path.join(directory, "fio")
        os.makedirs(self.dir, exist_ok=True)
        self.count = count
        self.tensor_bytes = tensor_bytes

    def sweep(self, sweep_bytes: int, *, quick: bool) -> dict[str, dict[str, Any]]:
        kwargs: dict[str, Any] = {}
        if quick:
            kwargs = {"block_sizes": (MiB,), "iodepths": (32,), "numjobs": (1,)}
        summary, reason = fio_runner.sweep(self.dir, total_bytes=sweep_bytes, file_size=self.tensor_bytes, **kwargs)
        if summary is None:
            raise RuntimeError(reason)
        return {mode: summary["best"][mode] for mode in MODES}

    def run(self, mode: str, settings: dict[str, Any], seed: int) -> tuple[float, bool | None]:
        gbps, detail = fio_runner.run_fio(self.dir, mode, nfiles=self.count, file_size=self.tensor_bytes,
                                          ioengine=settings["ioengine"], bs=settings["bs"],
                                          iodepth=settings["iodepth"], numjobs=settings["numjobs"],
                                          prepare=False)
        if gbps is None or not isinstance(detail, dict):
            raise RuntimeError(str(detail))
        return float(detail["seconds"]), None

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


# --- the run -----------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="bench-data", help="directory on the drive to measure")
    parser.add_argument("--total-bytes", type=int, default=8 * GiB, help="bytes per contender, mode and round")
    parser.add_argument("--tensor-bytes", type=int, default=64 * MiB)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sweep-bytes", type=int, default=1 * GiB, help="bytes per setting in the sweeps")
    parser.add_argument("--contenders", default="engine,store,fio,deepspeed")
    parser.add_argument("--quick", action="store_true", help="tiny sweeps (a smoke run, not a result)")
    args = parser.parse_args(argv)

    directory = os.path.abspath(args.dir)
    os.makedirs(directory, exist_ok=True)
    count = max(1, args.total_bytes // args.tensor_bytes)
    sweep_count = max(1, args.sweep_bytes // args.tensor_bytes)
    pattern = Pattern(args.tensor_bytes)
    wanted = args.contenders.split(",")
    report: dict[str, Any] = {
        "dir": directory, "tensor_bytes": args.tensor_bytes, "tensors": count,
        "bytes_per_run": count * args.tensor_bytes, "rounds": args.rounds,
        "settings": {}, "skipped": {}, "per_round": [], "medians": {}, "ratios": {},
    }

    makers: dict[str, Callable[[int], Any]] = {
        "engine": lambda n: EngineContender(directory, n, args.tensor_bytes, pattern),
        "store": lambda n: StoreContender(directory, n, args.tensor_bytes, pattern),
        "fio": lambda n: FioContender(directory, n, args.tensor_bytes),
        "deepspeed": lambda n: DeepSpeedContender(directory, n, args.tensor_bytes),
    }
    contenders: dict[str, Any] = {}
    console.rule("sweeps (each contender's best settings, per mode)")
    for name in wanted:
        console.print(f"sweeping {name} ...")
        small = makers[name](sweep_count)
        try:
            if name in ("engine", "store"):
                report["settings"][name] = sweep_infinity(small, quick=args.quick)
            else:
                report["settings"][name] = small.sweep(args.sweep_bytes, quick=args.quick)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            report["skipped"][name] = str(exc)
            console.print(f"[yellow]{name} skipped: {exc}")
        finally:
            small.cleanup()
        if name not in report["skipped"]:
            contenders[name] = makers[name](count)

    console.rule("rounds")
    names = list(contenders)
    try:
        with Progress(console=console) as progress:
            task = progress.add_task("rounds", total=args.rounds * len(MODES) * len(names))
            for r in range(args.rounds):
                row: dict[str, dict[str, float]] = {mode: {} for mode in MODES}
                order = names[r % len(names):] + names[:r % len(names)]  # rotate who goes first
                for mode in MODES:
                    for name in order:
                        seconds, verified = contenders[name].run(mode, report["settings"][name][mode], seed=r + 1)
                        if verified is False:
                            raise RuntimeError(f"{name} read back data that its write did not write (round {r})")
                        row[mode][name] = round(count * args.tensor_bytes / seconds / 1e9, 3)
                        progress.advance(task)
                report["per_round"].append(row)
                console.print(json.dumps(row))
    finally:
        for contender in contenders.values():
            contender.cleanup()

    for mode in MODES:
        report["medians"][mode] = {n: round(statistics.median(row[mode][n] for row in report["per_round"]), 3)
                                  for n in names}
        ratios = {}
        for ours in ("engine", "store"):
            for peer in ("fio", "deepspeed"):
                if ours in names and peer in names:
                    per_round = [row[mode][ours] / row[mode][peer] for row in report["per_round"]]
                    ratios[f"{ours}/{peer}"] = {"median": round(statistics.median(per_round), 3),
                                                "per_round": [round(x, 3) for x in per_round]}
        report["ratios"][mode] = ratios
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
