"""Train a Llama whose training state is larger than the machine's RAM, its state on NVMe.

    .venv/bin/python tools/bench_scale.py [--state-ratio 1.5] [--steps 3] [--sequence 256]
                                          [--cpu-tier-bytes auto] [--dir /var/tmp] [--quick] \\
        > docs/results/bench_scale.json

JSON on stdout, a progress bar on stderr. The model is transformers' `LlamaForCausalLM` from a
`LlamaConfig` (nothing from a hub): 2560 wide, 6912 in the MLP, 20 heads of 128, a vocabulary of
32000, embeddings not tied, and as many layers as make its full training state at least
`--state-ratio` times this machine's RAM (MemTotal in /proc/meminfo). The training state counts
18 bytes a parameter: the parameter in bf16 (what the model computes in), its fp32 master copy,
both fp32 Adam moments and its fp32 gradient. On the project's 23 GiB machine that is 25 layers,
2.15 B parameters, 38.6 GB of state.

How it runs (each part a process of its own, so each one's memory is its own):

- The trainer is a worker (tools/peers/worker_protocol.py) that starts a private infinityd (CPU
  tier of `--cpu-tier-bytes`, NVMe tier in a folder under `--dir`, which must be a real disk: a
  tmpfs would put the "NVMe" in RAM). It builds the model inside `infinity.torch.empty_parameters()`
  (no values in RAM), streams each parameter's seeded initial values into the store in bf16 with
  `write_from` (one parameter in memory at a time: N(0, initializer_range) from a generator
  seeded by the run's seed and the parameter's index, norms at one, the scheme of Llama's own
  init), attaches the model with `offload(..., from_store=True)` and builds
  `infinity.torch.AdamW`, which writes the master weights and moments into the store.
- It trains batch `--batch` of `--sequence` random tokens: one warm-up step (no optimizer step
  of an earlier one runs into it, as one does into every later step), then `--steps` steps, each
  timed from its start to the next one's, then one more that ends the last timed one (and whose
  optimizer step is waited for), as tools/bench_train.py does.
- This process samples the resident memory of the trainer and of the daemon (psutil, every
  0.2 s), the daemon's disk use and the machine's CPU, and reports the peak of each phase.
- The bytes moved to and from the disk per step are the daemon's block I/O (/proc/<pid>/io) and
  its tier counters (bench_train's `daemon_counters`) from the first timed step's start to the
  step's after the last one's: the same point of the cycle at both ends, so the optimizer step
  still running into a step's start is counted once for each step. Over the same window, the
  tier's events per step (evictions, write-backs, reloads, prefetches, requests that waited for
  a load or for space, segments created). The I/O engine's read
  and overwrite bandwidth is then measured on the same disk (bench_train's `EngineBandwidth`,
  tools/bench_io.py's `EngineContender`), and the step time is reported against its I/O bound
  (bench_train's `io_bound_s`: read bytes over read GB/s plus written bytes over overwrite GB/s).

Before starting it checks that the disk has room for the whole state, the NVMe tier's room for
out-of-place writes, the bandwidth files and a reserve, and refuses otherwise; everything it
wrote is deleted at the end (`--keep` keeps it; after a failure only the logs are kept).

`--quick` trains a tiny Llama (2 layers, 64 wide) with a 64 MiB CPU tier for a smoke run: its
figures mean nothing and it does not hold the state ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))

from bench_train import (EngineBandwidth, daemon_counters, io_bound_s, median,  # noqa: E402
                         remove_run_folder)
from peers import train_common, worker_protocol  # noqa: E402
from peers.worker_protocol import Worker  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
SEED = 0
LR, WEIGHT_DECAY = 1e-4, 0.01
NAMESPACE = "bench-scale"
# Bytes of training state per parameter: the module computes in bf16, AdamW keeps an fp32 master
# copy and two fp32 moments, gradients are summed in the store in fp32.
STATE_BYTES = {"parameters_bf16": 2, "master_fp32": 4, "exp_avg_fp32": 4, "exp_avg_sq_fp32": 4,
               "gradients_fp32": 4}
BYTES_PER_PARAMETER = sum(STATE_BYTES.values())
WIDE: dict[str, Any] = {"hidden_size": 2560, "intermediate_size": 6912, "num_attention_heads": 20,
                        "num_key_value_heads": 20, "vocab_size": 32000}
TINY: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 172, "num_attention_heads": 4,
                        "num_key_value_heads": 4, "vocab_size": 512, "num_hidden_layers": 2}
# The NVMe tier writes out of place (a new version goes to fresh extents, the old ones are freed
# once the new ones are durable), so its file needs room beyond the state; and the disk keeps a
# reserve for everything else on it.
OUT_OF_PLACE_ROOM = 0.2
DISK_RESERVE_BYTES = 2 * GiB


# --- the model ------------------------------------------------------------------------------


def mem_total_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemTotal")


def layer_parameters(spec: dict[str, Any]) -> int:
    """One decoder layer's parameters: attention (q, k, v, o), the gated MLP, two norms."""
    width, mlp = spec["hidden_size"], spec["intermediate_size"]
    kv_width = width // spec["num_attention_heads"] * spec["num_key_value_heads"]
    return 2 * width * width + 2 * width * kv_width + 3 * width * mlp + 2 * width


def parameters_of(spec: dict[str, Any]) -> int:
    """All parameters: the layers, the embedding and the (untied) head, the final norm."""
    width = spec["hidden_size"]
    return (spec["num_hidden_layers"] * layer_parameters(spec)
            + 2 * spec["vocab_size"] * width + width)


def choose_spec(ram_bytes: int, state_ratio: float, quick: bool) -> dict[str, Any]:
    """The model: WIDE with the fewest layers whose training state is `state_ratio` x RAM."""
    if quick:
        return dict(TINY)
    target = state_ratio * ram_bytes / BYTES_PER_PARAMETER
    fixed = parameters_of({**WIDE, "num_hidden_layers": 0})
    layers = max(1, math.ceil((target - fixed) / layer_parameters(WIDE)))
    return {**WIDE, "num_hidden_layers": layers}


def llama_config(spec: dict[str, Any], sequence: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**spec, max_position_embeddings=max(sequence, 256),
                       tie_word_embeddings=False, use_cache=False)


def initial_value(name: str, shape: tuple[int, ...], index: int, std: float) -> Any:
    """A parameter's starting values in bf16, from a generator seeded by its index: norms at
    one, everything else N(0, std), as Llama's `_init_weights` draws them."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(SEED * 1_000_003 + index)
    return torch.empty(shape).normal_(0.0, std, generator=generator).to(torch.bfloat16)


def cpu_tier_bytes(choice: str, spec: dict[str, Any], quick: bool) -> tuple[int, str]:
    """The daemon's CPU tier and why. The daemon's step holds one parameter's tensors in the
    tier at once (parameter, gradient, master copy, both moments), the largest being the
    embedding's and the head's: `auto` is 4 GiB, or that step plus 1 GiB where it is more."""
    if choice != "auto":
        return int(choice) // (2 * MiB) * (2 * MiB), "given by --cpu-tier-bytes"
    if quick:
        return 64 * MiB, "--quick"
    largest = spec["vocab_size"] * spec["hidden_size"]
    one_step = sum(-(-largest * nbytes // (2 * MiB)) * 2 * MiB for nbytes in STATE_BYTES.values())
    if one_step + GiB <= 4 * GiB:
        return 4 * GiB, "4 GiB: room for the largest parameter's step and for prefetch"
    return one_step + GiB, "the largest parameter's step (its 5 tensors) plus 1 GiB"


def filesystem_type(path: str) -> str:
    """The type of the file system holding `path` (the longest mount point above it)."""
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    with open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            point = fields[1].replace("\\040", " ")
            inside = real == point or real.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best, kind = point, fields[2]
    return kind


# --- the trainer (run as `bench_scale.py --worker`) -----------------------------------------


class Trainer:
    """The worker's state: its daemon, its client, the offloaded model and its optimizer."""

    def __init__(self) -> None:
        self.daemon: Any = None
        self.client: Any = None
        self.model: Any = None
        self.optimizer: Any = None
        self.request: dict[str, Any] = {}
        self.starts: list[float] = []

    def start(self, request: dict[str, Any]) -> dict[str, Any]:
        """Start the private daemon (in this worker's process group, so it ends with it)."""
        import infinity
        from bench_launch import start_daemon

        self.daemon, config = start_daemon(request["folder"], request["settings"])
        self.client = infinity.connect(config=config, name="bench-scale-trainer")
        return {"daemon_pid": self.daemon.pid}

    def build(self, request: dict[str, Any]) -> dict[str, Any]:
        """The model without values, its seeded values streamed into the store parameter by
        parameter, the model attached to them, and the optimizer (which writes its state)."""
        import torch

        import infinity.torch as itorch
        from transformers import LlamaForCausalLM

        self.request = request
        config = llama_config(request["spec"], int(request["sequence"]))
        started = time.perf_counter()
        with itorch.empty_parameters():
            model = LlamaForCausalLM(config)
        model.train()
        built = time.perf_counter()
        for index, (name, param) in enumerate(model.named_parameters()):
            value = initial_value(name, tuple(param.shape), index, config.initializer_range)
            self.client.write_from(name, value, namespace=NAMESPACE)
            del value
        written = time.perf_counter()
        self.model = itorch.offload(model, self.client, namespace=NAMESPACE, from_store=True)
        self.optimizer = itorch.AdamW(self.model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        done = time.perf_counter()
        return {"parameters": sum(p.numel() for p in self.model.parameters()),
                "parameter_tensors": len(list(self.model.parameters())),
                "largest_parameter": max(p.numel() for p in self.model.parameters()),
                "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
                "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                "build_s": round(built - started, 2), "write_values_s": round(written - built, 2),
                "offload_and_optimizer_s": round(done - written, 2)}

    def step(self, request: dict[str, Any]) -> dict[str, Any]:
        """One training step; the disk counters as it starts."""
        step = int(request["step"])
        self.starts.append(time.perf_counter())
        counters = daemon_counters(self.client, self.daemon.pid)
        tiers = self.client.stats()["counters"]["tiers"]
        # How the tier got its bytes: evictions, write-backs, reloads, prefetches, and the
        # requests that waited for a load or for space.
        events = {key: value for key, value in tiers.items() if not key.endswith("_bytes")}
        vocab = int(self.request["spec"]["vocab_size"])
        ids = train_common.batch_for(step, batch=int(self.request["batch"]),
                                     sequence=int(self.request["sequence"]), vocab=vocab,
                                     seed=SEED)
        begun = time.perf_counter()
        loss = self.model(input_ids=ids, labels=ids).loss
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad()
        # Where the time went: a forward waits for the optimizer step before it (unit by unit),
        # a backward for its gradients to go into the store; step() only sends the step.
        phases = {"forward_s": forward - begun, "backward_s": backward - forward,
                  "step_sent_s": time.perf_counter() - backward}
        return {"loss": float(loss.detach()), "counters": counters, "events": events,
                "phases": phases}

    def finish(self, request: dict[str, Any]) -> dict[str, Any]:
        """Wait for the optimizer step still running in the daemon; the steps' start times."""
        started = time.perf_counter()
        self.optimizer.synchronize()
        return {"seconds": [b - a for a, b in zip(self.starts, self.starts[1:])],
                "last_step_wait_s": round(time.perf_counter() - started, 3)}

    def close(self) -> None:
        from bench_launch import stop_daemon

        stop_daemon(self.client, self.daemon, wait_s=120)


def worker_main() -> int:
    trainer = Trainer()
    try:
        return worker_protocol.serve({"start": trainer.start, "build": trainer.build,
                                      "step": trainer.step, "finish": trainer.finish})
    finally:
        trainer.close()


# --- the benchmark's side: memory and disk sampling -------------------------------------------


class Sampler(threading.Thread):
    """Samples the trainer's and the daemon's resident memory every `interval_s` (the peak of
    each per phase), the machine's available memory, and every second the daemon's store (for
    the progress bar and the NVMe file's peak size). Its daemon client is used only here."""

    def __init__(self, pids: dict[str, int], client: Any, on_stats: Any,
                 interval_s: float = 0.2) -> None:
        super().__init__(name="bench-scale-sampler", daemon=True)
        import psutil

        self.processes = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.client = client
        self.on_stats = on_stats
        self.interval_s = interval_s
        self.phase = "start"
        self.peaks: dict[str, dict[str, dict[str, int]]] = {}
        self.min_available_bytes = psutil.virtual_memory().available
        self.nvme_file_peak_bytes = 0
        self.nvme_used_peak_bytes = 0
        self.samples = 0
        self._done = threading.Event()
        self._lock = threading.Lock()

    def sample(self) -> None:
        import psutil

        for name, process in self.processes.items():
            try:
                memory = process.memory_info()
            except psutil.Error:  # ended (at shutdown)
                continue
            with self._lock:
                peak = self.peaks.setdefault(self.phase, {}).setdefault(
                    name, {"rss_bytes": 0, "shared_bytes_at_peak": 0, "private_bytes": 0})
                if memory.rss > peak["rss_bytes"]:
                    peak["rss_bytes"], peak["shared_bytes_at_peak"] = memory.rss, memory.shared
                peak["private_bytes"] = max(peak["private_bytes"], memory.rss - memory.shared)
        self.min_available_bytes = min(self.min_available_bytes,
                                       psutil.virtual_memory().available)
        self.samples += 1

    def poll_store(self) -> None:
        try:
            stats = self.client.stats()
        except Exception:  # the daemon shutting down
            return
        nvme = stats["tiers"].get("nvme", {})
        self.nvme_file_peak_bytes = max(self.nvme_file_peak_bytes,
                                        sum(d.get("file_bytes", 0) for d in nvme.get("dirs", [])))
        self.nvme_used_peak_bytes = max(self.nvme_used_peak_bytes, nvme.get("used_bytes", 0))
        self.on_stats(stats)

    def set_phase(self, phase: str) -> None:
        with self._lock:
            self.phase = phase

    def run(self) -> None:
        last_poll = 0.0
        while not self._done.wait(self.interval_s):
            self.sample()
            if time.monotonic() - last_poll >= 1.0:
                last_poll = time.monotonic()
                self.poll_store()

    def stop(self) -> None:
        self._done.set()
        self.join(10)


class CpuUse:
    """The machine's busy CPU time over an interval, and the share of it that was ours."""

    def __init__(self, pids: list[int]) -> None:
        import psutil

        self.processes = [psutil.Process(pid) for pid in pids]
        self.started = time.monotonic()
        self.machine = psutil.cpu_times()
        self.ours = sum(self._ours())

    def _ours(self) -> list[float]:
        return [sum(p.cpu_times()[:2]) for p in self.processes]

    def result(self) -> dict[str, float]:
        import psutil

        wall = time.monotonic() - self.started
        now = psutil.cpu_times()
        busy = sum(now) - sum(self.machine) - ((now.idle - self.machine.idle)
                                               + (now.iowait - self.machine.iowait))
        ours = sum(self._ours()) - self.ours
        available = wall * (os.cpu_count() or 1)
        return {"wall_s": round(wall, 1), "machine_busy_fraction": round(busy / available, 3),
                "ours_fraction": round(ours / available, 3),
                "others_fraction": round(max(0.0, busy - ours) / available, 3),
                "iowait_fraction": round((now.iowait - self.machine.iowait) / available, 3)}


# --- the benchmark's side: the run ------------------------------------------------------------


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """The model, the state and the daemon's tiers for this machine, and the disk check."""
    ram = mem_total_bytes()
    spec = choose_spec(ram, args.state_ratio, args.quick)
    parameters = parameters_of(spec)
    state_bytes = parameters * BYTES_PER_PARAMETER
    cpu_tier, why = cpu_tier_bytes(args.cpu_tier_bytes, spec, args.quick)
    nvme_capacity = int(state_bytes * (1 + OUT_OF_PLACE_ROOM)) // (2 * MiB) * (2 * MiB) + GiB
    free = shutil.disk_usage(args.dir).free
    needed = nvme_capacity + args.engine_bytes + DISK_RESERVE_BYTES
    if needed > free:
        raise SystemExit(
            f"bench_scale: {args.dir} has {free / 1e9:.1f} GB free and this run needs "
            f"{needed / 1e9:.1f} GB: the training state ({state_bytes / 1e9:.1f} GB, "
            f"{parameters / 1e9:.2f} B parameters x {BYTES_PER_PARAMETER} bytes), "
            f"{OUT_OF_PLACE_ROOM:.0%} more for the NVMe tier's out-of-place writes, "
            f"{args.engine_bytes / 1e9:.1f} GB for the bandwidth measurement and a "
            f"{DISK_RESERVE_BYTES / 1e9:.1f} GB reserve; free space there, pick another --dir, "
            f"or lower --state-ratio")
    fs_type = filesystem_type(args.dir)
    if fs_type in ("tmpfs", "ramfs") and not args.quick:
        raise SystemExit(f"bench_scale: {args.dir} is on {fs_type}, which is RAM: the NVMe tier "
                         f"must be on a real disk; pass --dir on one (e.g. /var/tmp)")
    return {"ram_bytes": ram, "spec": spec, "parameters": parameters,
            "state_bytes": state_bytes, "state_over_ram": round(state_bytes / ram, 3),
            "state_bytes_by_kind": {kind: parameters * n for kind, n in STATE_BYTES.items()},
            "cpu_tier_bytes": cpu_tier, "cpu_tier_why": why,
            "nvme_capacity_bytes": nvme_capacity, "disk_free_bytes_before": free,
            "filesystem": fs_type}


def per_step(before: dict[str, int], after: dict[str, int], steps: int) -> dict[str, int]:
    return {key: round((after[key] - before.get(key, 0)) / steps) for key in after}


def run(args: argparse.Namespace, setup: dict[str, Any], base: str, console: Any) -> dict[str, Any]:
    import infinity
    from bench_launch import store_daemon_settings
    from infinity.config import load_config
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    settings = store_daemon_settings(base, "daemon", cpu_budget_bytes=setup["cpu_tier_bytes"],
                                     nvme_capacity_bytes=setup["nvme_capacity_bytes"],
                                     prefetch=True)
    # A forward's get may wait for a sub-group of the step behind tens of GB of I/O.
    settings["daemon.request_timeout_s"] = 900.0
    log_dir = os.path.join(base, "logs")
    worker = Worker([sys.executable, str(Path(__file__).resolve()), "--worker"],
                    stderr_path=os.path.join(log_dir, "trainer.log"), name="trainer")
    result: dict[str, Any] = {}
    sampler: Sampler | None = None
    monitor: Any = None
    engine: EngineBandwidth | None = None
    # Params, master copies and both moments: what is in the store once the optimizer exists.
    stored_target = setup["parameters"] * (BYTES_PER_PARAMETER - STATE_BYTES["gradients_fp32"])
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(),
                      TextColumn("{task.fields[figures]}"), TimeElapsedColumn(),
                      console=console) as progress:
            # The daemon's settings file and its log go with the logs.
            daemon_pid = worker.call("start", folder=log_dir, settings=settings)["daemon_pid"]
            config = load_config(os.path.join(log_dir, "bench.toml"), env={}, overrides=settings)
            monitor = infinity.connect(config=config, name="bench-scale-monitor")
            building = progress.add_task("state into the store", total=stored_target,
                                         figures="")
            stored_all = threading.Event()

            def on_stats(stats: dict[str, Any]) -> None:
                if stored_all.is_set():  # the steps' gradients come on top: not this bar's
                    return
                stored = stats["catalog"]["namespaces"].get(NAMESPACE, {}).get("bytes", 0)
                progress.update(building, completed=min(stored, stored_target),
                                figures=f"{stored / 1e9:.1f} / {stored_target / 1e9:.1f} GB")

            sampler = Sampler({"trainer": worker.pid, "daemon": daemon_pid}, monitor, on_stats)
            sampler.set_phase("build")
            sampler.start()
            built = worker.call("build", spec=setup["spec"], batch=args.batch,
                                sequence=args.sequence)
            stored_all.set()
            progress.update(building, completed=stored_target,
                            figures=f"{stored_target / 1e9:.1f} GB")
            progress.console.print(f"built: values written in {built['write_values_s']} s, "
                                   f"offload and optimizer state in "
                                   f"{built['offload_and_optimizer_s']} s")
            if built["parameters"] != setup["parameters"]:
                raise RuntimeError(f"the model has {built['parameters']} parameters and the plan "
                                   f"counted {setup['parameters']}: parameters_of is wrong")
            result["build"] = built
            # Step 0 warms up: nothing of an earlier optimizer step runs into it, as one does
            # into every later step. Then the timed steps, then one that ends the last of them.
            stepping = progress.add_task("steps", total=args.steps + 2, figures="")
            sampler.set_phase("steps")
            answers = []
            cpu: CpuUse | None = None
            for step in range(args.steps + 2):
                if step == 1:
                    cpu = CpuUse([worker.pid, daemon_pid])
                if step == args.steps + 1:
                    assert cpu is not None
                    result["cpu_during_steps"] = cpu.result()
                answers.append(worker.call("step", step=step))
                progress.update(stepping, advance=1,
                                figures=f"loss {answers[-1]['loss']:.4f}")
                progress.console.print(f"step {step} returned, loss {answers[-1]['loss']:.4f}")
            finished = worker.call("finish")
            sampler.set_phase("after")
            seconds = finished["seconds"][1:args.steps + 1]
            result["steps"] = {
                "seconds": [round(s, 3) for s in seconds], "median_s": round(median(seconds), 3),
                "losses": [round(a["loss"], 5) for a in answers[1:args.steps + 1]],
                "phases": {key: [round(a["phases"][key], 3) for a in answers[1:args.steps + 1]]
                           for key in answers[0]["phases"]},
                "warmup_s": round(finished["seconds"][0], 3),
                "warmup_loss": round(answers[0]["loss"], 5),
                "last_step_wait_s": finished["last_step_wait_s"]}
            result["disk_bytes_per_step"] = per_step(answers[1]["counters"],
                                                     answers[args.steps + 1]["counters"],
                                                     args.steps)
            result["tier_events_per_step"] = per_step(answers[1]["events"],
                                                      answers[args.steps + 1]["events"],
                                                      args.steps)
            console.print("measuring the engine's bandwidth on the same disk")
            engine = EngineBandwidth(os.path.join(base, "engine"), args.engine_bytes)
            for seed in range(args.engine_rounds):
                engine.measure(seed)
            result["engine"] = {"read_gbps": round(median(engine.read_gbps), 3),
                                "overwrite_gbps": round(median(engine.write_gbps), 3),
                                "per_round_read_gbps": [round(x, 3) for x in engine.read_gbps],
                                "per_round_overwrite_gbps": [round(x, 3)
                                                             for x in engine.write_gbps],
                                "bytes_per_round": engine.count * engine.contender.tensor_bytes,
                                "settings": engine.settings}
    finally:
        if sampler is not None:
            sampler.stop()
        if monitor is not None:
            monitor.close()
        worker.close(timeout_s=180.0)  # the daemon's shutdown writes its index
        if engine is not None:
            engine.close()
    assert sampler is not None
    result["rss_peaks"] = {phase: peaks for phase, peaks in sampler.peaks.items()
                           if phase in ("build", "steps")}
    result["min_available_bytes"] = sampler.min_available_bytes
    result["nvme_file_peak_bytes"] = sampler.nvme_file_peak_bytes
    result["nvme_used_peak_bytes"] = sampler.nvme_used_peak_bytes
    result["samples"] = sampler.samples
    return result


def summarize(result: dict[str, Any]) -> None:
    """The I/O bound of a step from the daemon's block I/O, and from its tier counters."""
    moved = result["disk_bytes_per_step"]
    read_gbps, write_gbps = result["engine"]["read_gbps"], result["engine"]["overwrite_gbps"]
    bound = io_bound_s(moved["read_bytes"], moved["write_bytes"], read_gbps, write_gbps)
    tier_bound = io_bound_s(moved["tier_read_bytes"], moved["tier_write_bytes"], read_gbps,
                            write_gbps)
    step = result["steps"]["median_s"]
    result["io_bound_s"] = round(bound, 3)
    result["io_bound_from_tier_counters_s"] = round(tier_bound, 3)
    result["step_over_io_bound"] = round(step / bound, 3) if bound > 0 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--state-ratio", type=float, default=1.5,
                        help="the training state's size over this machine's RAM (MemTotal)")
    parser.add_argument("--steps", type=int, default=3, help="timed training steps")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--sequence", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--cpu-tier-bytes", default="auto",
                        help="the daemon's CPU tier: bytes, or auto (see cpu_tier_bytes)")
    parser.add_argument("--dir", default="/var/tmp",
                        help="where the NVMe tier and the bandwidth files go (a real disk)")
    parser.add_argument("--engine-bytes", type=int, default=2 * GiB,
                        help="bytes the engine reads and overwrites per bandwidth round")
    parser.add_argument("--engine-rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a tiny model: a smoke run")
    parser.add_argument("--keep", action="store_true", help="keep the store, logs and files")
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.quick:
        args.engine_bytes = min(args.engine_bytes, 64 * MiB)
        args.sequence = min(args.sequence, 32)

    from rich.console import Console

    console = Console(stderr=True)
    setup = plan(args)
    console.print(f"{setup['parameters']:,} parameters "
                  f"({setup['spec']['num_hidden_layers']} layers), training state "
                  f"{setup['state_bytes'] / 1e9:.1f} GB = {setup['state_over_ram']}x RAM; "
                  f"CPU tier {setup['cpu_tier_bytes'] / GiB:.2f} GiB")
    # A SIGTERM ends the run like an error: the finally blocks stop the worker and the daemon.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    base = tempfile.mkdtemp(prefix="infinity-bench-scale-", dir=args.dir)
    os.makedirs(os.path.join(base, "logs"))
    report: dict[str, Any] = {
        "command": " ".join(["tools/bench_scale.py", *(argv if argv is not None
                                                       else sys.argv[1:])]),
        "quick": args.quick,
        "machine": {"cpus": os.cpu_count(), "ram_bytes": setup["ram_bytes"],
                    "load_avg_1m": round(os.getloadavg()[0], 2)},
        "model": {"class": "LlamaForCausalLM", "config": setup["spec"],
                  "parameters": setup["parameters"], "batch": args.batch,
                  "sequence": args.sequence, "seed": SEED, "lr": LR,
                  "weight_decay": WEIGHT_DECAY},
        "state": {"bytes": setup["state_bytes"], "over_ram": setup["state_over_ram"],
                  "bytes_per_parameter": BYTES_PER_PARAMETER,
                  "by_kind": setup["state_bytes_by_kind"]},
        "daemon": {"cpu_tier_bytes": setup["cpu_tier_bytes"], "cpu_tier_why": setup["cpu_tier_why"],
                   "nvme_capacity_bytes": setup["nvme_capacity_bytes"]},
        "disk": {"dir": base, "filesystem": setup["filesystem"],
                 "free_bytes_before": setup["disk_free_bytes_before"]},
    }
    failed = False
    try:
        result = run(args, setup, base, console)
    except BaseException:
        failed = True
        console.print(f"[red]failed; the trainer's and the daemon's logs are in "
                      f"{os.path.join(base, 'logs')}")
        raise
    finally:
        report["machine"]["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
        remove_run_folder(base, failed=failed, keep=args.keep)
    summarize(result)
    report["build"] = result.pop("build")
    report["cpu_during_steps"] = result.pop("cpu_during_steps")
    report["disk"] |= {"nvme_file_peak_bytes": result.pop("nvme_file_peak_bytes"),
                       "nvme_used_peak_bytes": result.pop("nvme_used_peak_bytes")}
    report["machine"]["min_available_bytes"] = result.pop("min_available_bytes")
    report |= result
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
