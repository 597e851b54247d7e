"""Benchmark the native Adam kernel against torch's CPU AdamW and the memory bound, in one run.

    .venv/bin/python tools/bench_adam.py [--sizes 100M,400M] [--rounds 7] [--threads N]
                                         [--no-daemon] [--no-deepspeed]

JSON on stdout, progress on stderr. Every subject updates the same fp32 buffers (parameter,
gradient, both moments: 16 bytes of state per parameter read and 12 written), one step at a time,
subjects in turn within each round (rotated), so the machine's background load falls on all alike:

- `infinity`: `_native.adam_step` (AdamW, the path `adam_implementation()` names), the range
  split across `--threads` threads (default: torch's intra-op thread count), each call without
  the GIL; `infinity_1thread` the same on one thread;
- `infinity_pool`: the same kernel as the daemon runs it, on a native `TaskPool` of `--threads`
  threads in 256 K-element chunks (the daemon's `CHUNK_ELEMENTS`), without a daemon: the kernel's
  multi-threaded path, and the figure the targets below take for "the kernel";
- `torch_foreach`: `torch.optim.AdamW(foreach=True)`; `torch_fused`: `torch.optim.AdamW(fused=True)`
  (torch's fused CPU kernel), both holding the very same tensors as their state;
- `bound`: the same bytes moved with one add per element, the moments stored back as read
  (`implementation="bound"`), split like `infinity`: what memory alone allows;
- `infinity_daemon` (unless --no-daemon): the same step as an `adam_step` request to a private
  infinityd whose CPU tier holds another copy of the four tensors (its own threads run the kernel
  in 256 K-element chunks): the kernel plus the request's round trip, leases and hand-offs.

- `deepspeed_cpu_adam` (unless --no-deepspeed, or "skipped" with the reason where the peers' venv
  is missing): DeepSpeed's `DeepSpeedCPUAdam` (AdamW mode) on its own copy of the same buffers, in
  a worker process running the peers' python (tools/peers/deepspeed_adam_worker.py, set up by
  tools/peers/setup_peers.sh), so this process needs no DeepSpeed; the worker times the step
  itself and takes its turn in the rounds like every other subject.

Reported per subject: the median step time and parameters per second, and the ratios of
`infinity` to the bound, to the best of torch's, and to the best of torch's fused kernel and
DeepSpeed's (the issue's target).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import infinity
from bench_launch import start_daemon
from peers.worker_protocol import Worker, WorkerError
from infinity import _native
from infinity.config import MiB
from infinity.io.tasks import TaskPool
from infinity.protocol.wire import AdamGroup, AdamItem

POOL_CHUNK_ELEMENTS = 1 << 18  # the daemon's OptimizerService.CHUNK_ELEMENTS

BYTES_MOVED_PER_PARAM = 28  # read p, g, m, v (16 bytes); write p, m, v (12 bytes)
PEERS_DIR = os.environ.get("INFINITY_PEERS_DIR", "/var/tmp/infinity-peers")
DS_ADAM_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers",
                              "deepspeed_adam_worker.py")


def parse_count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return int(float(text[:-1] if scale != 1 else text) * scale)


class Buffers:
    """One parameter's fp32 buffers, shared by every subject."""

    def __init__(self, numel: int) -> None:
        generator = torch.Generator().manual_seed(numel)
        self.param = torch.nn.Parameter(torch.randn(numel, generator=generator))
        self.param.grad = torch.randn(numel, generator=generator)
        self.exp_avg = torch.zeros(numel)
        self.exp_avg_sq = torch.zeros(numel)
        self.numel = numel


def kernel_step(buffers: Buffers, pool: ThreadPoolExecutor | None, num_threads: int, step: int,
                implementation: str) -> None:
    grad = buffers.param.grad
    assert grad is not None
    addresses = (buffers.param.data_ptr(), grad.data_ptr(), buffers.exp_avg.data_ptr(),
                 buffers.exp_avg_sq.data_ptr())

    def run(begin: int, end: int) -> None:
        _native.adam_step(addresses[0] + 4 * begin, addresses[1] + 4 * begin, "float32",
                          addresses[2] + 4 * begin, addresses[3] + 4 * begin, 0, "none",
                          end - begin, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,
                          weight_decay=0.01, step=step, decoupled=True,
                          implementation=implementation)

    if pool is None or num_threads <= 1:
        run(0, buffers.numel)
        return
    piece = -(-buffers.numel // num_threads)
    piece = (piece + 1023) // 1024 * 1024  # whole cache lines and vectors per thread
    ranges = [(b, min(b + piece, buffers.numel)) for b in range(0, buffers.numel, piece)]
    for future in [pool.submit(run, b, e) for b, e in ranges]:
        future.result()


def torch_optimizer(buffers: Buffers, **options: Any) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW([buffers.param], lr=1e-4, weight_decay=0.01, **options)
    # The same tensors as everyone else's moments: no second copy of the state.
    optimizer.state[buffers.param] = {"step": torch.tensor(0.0), "exp_avg": buffers.exp_avg,
                                      "exp_avg_sq": buffers.exp_avg_sq}
    return optimizer


class DaemonStep:
    """The step as a request to a private infinityd holding its own copy of the state."""

    GROUP = AdamGroup(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                      decoupled=True, grad_scale=1.0)

    def __init__(self, buffers: Buffers) -> None:
        self.folder = tempfile.mkdtemp(prefix="infinity-bench-adam-", dir="/var/tmp")
        state_bytes = buffers.numel * 16
        budget = (state_bytes * 9 // 8 + 256 * MiB) // (2 * MiB) * (2 * MiB)
        self.process, config = start_daemon(self.folder, {
            "daemon.runtime_dir": os.path.join(self.folder, "rt"), "daemon.log_level": "warning",
            "daemon.request_timeout_s": 600.0, "cpu.budget_bytes": budget,
            "cpu.segment_bytes": min(1024 * MiB, budget)})
        self.client = infinity.connect(config=config, name="bench-adam")
        grad = buffers.param.grad
        assert grad is not None
        for name, tensor in (("p", buffers.param.detach()), ("p.grad", grad),
                             ("p.exp_avg", buffers.exp_avg), ("p.exp_avg_sq", buffers.exp_avg_sq)):
            self.client.write_from(name, tensor)
        self.step_count = 0

    def __call__(self) -> None:
        self.step_count += 1
        self.client.adam_step([self.GROUP], [AdamItem("p", "p.grad", "", "p.exp_avg",
                                                      "p.exp_avg_sq", 0, self.step_count)])

    def close(self) -> None:
        self.client.close()
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(60)
        shutil.rmtree(self.folder, ignore_errors=True)


def start_deepspeed_worker() -> tuple[Worker | None, str]:
    """The DeepSpeedCPUAdam worker on the peers' python, or None and why not."""
    python = os.path.join(PEERS_DIR, "venv", "bin", "python")
    if not os.path.exists(python):
        return None, f"no DeepSpeed venv at {python}: run tools/peers/setup_peers.sh"
    env = {**os.environ, "DS_ACCELERATOR": "cpu",
           "TORCH_EXTENSIONS_DIR": os.path.join(PEERS_DIR, "torch_extensions")}
    log = os.path.join(tempfile.gettempdir(), f"bench-adam-deepspeed-{os.getpid()}.log")
    return Worker([python, DS_ADAM_WORKER], env=env, stderr_path=log,
                  name="DeepSpeedCPUAdam worker"), ""


class DeepSpeedStep:
    """One DeepSpeedCPUAdam step in the worker; returns the worker's own timing of it."""

    def __init__(self, worker: Worker, numel: int, num_threads: int) -> None:
        self.worker = worker
        self.info = worker.call("init", numel=numel, threads=num_threads)

    def __call__(self) -> float:
        return float(self.worker.call("step")["seconds"])


def measure(numel: int, rounds: int, num_threads: int, progress: Progress, *,
            daemon: bool, deepspeed: Worker | None) -> dict[str, Any]:
    buffers = Buffers(numel)
    pool = ThreadPoolExecutor(max_workers=num_threads) if num_threads > 1 else None
    foreach = torch_optimizer(buffers, foreach=True)
    fused = torch_optimizer(buffers, fused=True)
    steps = {"n": 0}

    def ours(threads: int, implementation: str = "auto") -> Callable[[], None]:
        def run() -> None:
            steps["n"] += 1
            kernel_step(buffers, pool if threads > 1 else None, threads, steps["n"], implementation)
        return run

    task_pool = TaskPool(num_threads=num_threads)

    def on_pool() -> None:
        steps["n"] += 1
        grad = buffers.param.grad
        assert grad is not None
        task_pool.submit_adam(
            param=buffers.param.data_ptr(), grad=grad.data_ptr(), grad_dtype="float32",
            exp_avg=buffers.exp_avg.data_ptr(), exp_avg_sq=buffers.exp_avg_sq.data_ptr(),
            numel=buffers.numel, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
            step=steps["n"], decoupled=True, chunk_elements=POOL_CHUNK_ELEMENTS).result()

    subjects: dict[str, Callable[[], float | None]] = {
        "infinity": ours(num_threads),
        "infinity_pool": on_pool,
        "infinity_1thread": ours(1),
        "torch_foreach": foreach.step,
        "torch_fused": fused.step,
        "bound": ours(num_threads, "bound"),
    }
    through_daemon = DaemonStep(buffers) if daemon else None
    if through_daemon is not None:
        subjects["infinity_daemon"] = through_daemon
    if deepspeed is not None:
        subjects["deepspeed_cpu_adam"] = DeepSpeedStep(deepspeed, numel, num_threads)
    times: dict[str, list[float]] = {name: [] for name in subjects}
    order = list(subjects.items())
    task = progress.add_task(f"{numel / 1e6:.0f}M parameters", total=rounds * len(order))
    for name, subject in order:  # warm-up: page faults, thread start, torch's first-call setup
        subject()
    for round_ in range(rounds):
        shift = round_ % len(order)
        for name, subject in order[shift:] + order[:shift]:
            start = time.perf_counter()
            own_time = subject()  # a worker's subject answers its own timing
            elapsed = time.perf_counter() - start
            times[name].append(own_time if isinstance(own_time, float) else elapsed)
            progress.advance(task)
    if pool is not None:
        pool.shutdown()
    task_pool.close()
    if through_daemon is not None:
        through_daemon.close()
    result: dict[str, Any] = {}
    for name, samples in times.items():
        median = statistics.median(samples)
        result[name] = {"median_s": round(median, 5), "params_per_s": round(numel / median),
                        "gbytes_per_s": round(numel * BYTES_MOVED_PER_PARAM / median / 1e9, 2)}
    ours_s = result["infinity"]["median_s"]
    best_torch = min(result["torch_foreach"]["median_s"], result["torch_fused"]["median_s"])
    pool_s = result["infinity_pool"]["median_s"]
    result["ratios"] = {
        "infinity_over_bound": round(result["bound"]["median_s"] / ours_s, 3),
        "pool_over_bound": round(result["bound"]["median_s"] / pool_s, 3),
        "pool_over_torch_fused": round(result["torch_fused"]["median_s"] / pool_s, 3),
        **({"daemon_over_bound": round(result["bound"]["median_s"]
                                       / result["infinity_daemon"]["median_s"], 3)}
           if daemon else {}),
        "infinity_over_best_torch": round(best_torch / ours_s, 3),
        "infinity_over_torch_fused": round(result["torch_fused"]["median_s"] / ours_s, 3),
    }
    if deepspeed is not None:
        best_peer = min(result["torch_fused"]["median_s"], result["deepspeed_cpu_adam"]["median_s"])
        result["ratios"]["infinity_over_deepspeed"] = round(
            result["deepspeed_cpu_adam"]["median_s"] / ours_s, 3)
        result["ratios"]["infinity_over_best_fused_or_deepspeed"] = round(best_peer / ours_s, 3)
        result["ratios"]["pool_over_best_fused_or_deepspeed"] = round(best_peer / pool_s, 3)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100M,400M", help="parameter counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-daemon", action="store_true",
                        help="leave out the step through infinityd")
    parser.add_argument("--no-deepspeed", action="store_true",
                        help="leave out DeepSpeedCPUAdam (the peers' venv)")
    args = parser.parse_args(argv)
    sizes = [parse_count(text) for text in args.sizes.split(",")]
    console = Console(stderr=True)
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "kernel_threads": args.threads, "load_avg_1m": round(os.getloadavg()[0], 2),
                    "adam_implementation": _native.adam_implementation(),
                    "torch": torch.__version__},
        "rounds": args.rounds,
        "sizes": {},
    }
    deepspeed, skipped = (None, "--no-deepspeed") if args.no_deepspeed else start_deepspeed_worker()
    if skipped:
        report["skipped"] = {"deepspeed_cpu_adam": skipped}
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console) as progress:
            for numel in sizes:
                report["sizes"][str(numel)] = measure(numel, args.rounds, args.threads, progress,
                                                      daemon=not args.no_daemon,
                                                      deepspeed=deepspeed)
    except WorkerError as error:
        console.print(f"[red]{error}")
        raise
    finally:
        if deepspeed is not None:
            deepspeed.close()
    ratios = [size["ratios"] for size in report["sizes"].values()]
    report["targets_met"] = {  # "the kernel": as the daemon runs it, on the native task pool
        "kernel >= 0.95x bound": all(r["pool_over_bound"] >= 0.95 for r in ratios),
        "kernel >= torch fused": all(r["pool_over_torch_fused"] >= 1.0 for r in ratios),
    }
    if deepspeed is not None:
        report["targets_met"]["kernel >= best of torch fused and DeepSpeedCPUAdam"] = all(
            r["pool_over_best_fused_or_deepspeed"] >= 1.0 for r in ratios)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
