"""Benchmark a training step: plain PyTorch, Infinity (CPU tier, NVMe) and DeepSpeed ZeRO-3 NVMe.

    .venv/bin/python tools/bench_train.py [--rounds 2] [--steps 3] [--models small,large]
                                          [--configs plain,infinity_cpu,infinity_nvme,deepspeed_nvme]
                                          [--dir /var/tmp] [--quick] > bench_train.json

JSON on stdout, progress on stderr. The models (`--models`), each the same GPT-2 built from
`GPT2Config()`'s defaults (124M parameters, fp32, dropout off, weights from seed 0; nothing from
a hub), trained with AdamW (lr 1e-4, weight decay 0.01) on the same random token batches:

- `small`: batch 1, sequence 256 (the issue's configuration);
- `large`: batch 1, sequence 1024 (GPT-2's whole context). The bytes of state a step moves do not
  depend on the tokens, the compute grows with them (4x the tokens, and attention's quadratic
  part), so here the compute outweighs the I/O: the configuration where an offloaded step should
  come closest to the in-memory one.

The subjects (`--configs`), each a worker process of its own (tools/peers/worker_protocol.py), so
its memory and its /proc/<pid>/io are its own and all of it ends with it:

- `plain`: the model in the process, `torch.optim.AdamW` with torch's defaults;
- `infinity_cpu`: `infinity.torch.offload` + `infinity.torch.AdamW` with a private infinityd
  whose CPU tier is larger than the training state (everything stays in memory);
- `infinity_nvme`: the same with the state on NVMe behind a CPU tier of a quarter of the training
  state (parameters, gradients and both moments: 16 bytes per fp32 parameter, whose master
  weights are the parameters themselves; `--nvme-cpu-budget`, see `nvme_cpu_budget`; the JSON
  says which and why);
- `infinity_nvme_noguess` (not in the default set): the same with the optimizer's guesses off
  (`AdamW(speculate=False)`), for an interleaved A/B of the step guessed during backward;
- `plain_passive`, `infinity_nvme_passive` (not in the default set): `plain` and `infinity_nvme`
  with `OMP_WAIT_POLICY=PASSIVE` in the worker's environment (torch's OpenMP threads sleep between
  parallel regions instead of spinning on cores the daemon needs), for an interleaved A/B;
- `deepspeed_nvme`: DeepSpeed ZeRO-3 with `offload_param` and `offload_optimizer` on NVMe, in the
  peers' venv (tools/peers/deepspeed_train_worker.py; set up by tools/peers/setup_peers.sh),
  "skipped" with the reason where that venv is missing.

Each subject first runs one warm-up step (not counted); then `--rounds` rounds, each running
`--steps` steps of every subject in turn (the order rotated per round), and one measurement of
the I/O engine's read and overwrite bandwidth on the same directory (tools/bench_io.py's
`EngineContender`, the daemon's I/O settings). A step is timed from its start to the next step's
start: each turn ends with one more step that is not timed (and, for Infinity, a forward pass
without gradients), so an optimizer step that returns before its work is done is counted in full
and leaves nothing running into the next subject's turn.

Reported per model and subject: the median step time, the losses of the first timed steps (the
same model, weights and data give the same losses), the CPU time a step took (the worker's
process and, for Infinity, its daemon's; `cpu_bound_s` is that over the machine's cores: no
step can be shorter), and the bytes moved to and from the disk per step: the block I/O of the daemon's process (Infinity) or of DeepSpeed's worker, from
/proc/<pid>/io, and for Infinity also the daemon's own tier counters (`client.stats()`). Then the
ratios of the medians to plain PyTorch and to DeepSpeed, the I/O bound of a step (its bytes over
the engine's bandwidth: read bytes / read GB/s + written bytes / overwrite GB/s) and the issue's
targets: the NVMe step at least 1.4x faster than DeepSpeed's (small model), and within 1.25x of
max(plain PyTorch, the I/O bound).

`--quick` trains a tiny GPT-2 (2 layers, 64 wide) for a smoke run: its figures mean nothing.
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
from pathlib import Path
from typing import Any, Callable

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))

from peers import train_common, worker_protocol  # noqa: E402
from peers.worker_protocol import Worker  # noqa: E402

CONFIGS = ("plain", "infinity_cpu", "infinity_nvme", "deepspeed_nvme", "infinity_nvme_noguess",
           "plain_passive", "infinity_nvme_passive")
NVME_CONFIGS = ("infinity_nvme", "infinity_nvme_noguess")
PASSIVE = "_passive"  # a subject's suffix: its worker runs with OMP_WAIT_POLICY=PASSIVE
PEERS_DIR = Path(os.environ.get("INFINITY_PEERS_DIR", "/var/tmp/infinity-peers"))
DS_WORKER = TOOLS / "peers" / "deepspeed_train_worker.py"
SEED = 0
LR, WEIGHT_DECAY = 1e-4, 0.01
MiB = 1 << 20


def models(quick: bool) -> dict[str, dict[str, Any]]:
    spec = train_common.TINY if quick else train_common.GPT2_124M
    return {"small": {"spec": spec, "batch": 1, "sequence": 64 if quick else 256},
            "large": {"spec": spec, "batch": 1, "sequence": 256 if quick else 1024}}


# --- the workers' side (run as `bench_train.py --worker CONFIG`) -----------------------------


def state_bytes_of(model: Any) -> int:
    """Parameters, gradients and both moments, fp32: 16 bytes per parameter."""
    return sum(p.numel() for p in model.parameters()) * 16


def nvme_cpu_budget(choice: str, state_bytes: int, largest_param_bytes: int) -> tuple[int, str]:
    """The CPU tier of `infinity_nvme` and why: a quarter of the training state (`quarter`), a
    size in bytes, or `auto`: the quarter, raised where one parameter's step cannot fit in it.

    The daemon's optimizer step holds one parameter's four tensors (parameter, gradient, both
    moments) in the tier at once, each a segment of its own when it is over half a segment
    (rounded up to 2 MiB). GPT-2 124M's 50257 x 768 embedding makes that 4 x 148 MiB, more than
    a quarter of the state (474 MiB): `auto` gives those four and 128 MiB for the rest.
    """
    quarter = max(16 * MiB, state_bytes // 4 // (2 * MiB) * (2 * MiB))
    if choice == "quarter":
        return quarter, "a quarter of the training state"
    if choice != "auto":
        return int(choice) // (2 * MiB) * (2 * MiB), "given by --nvme-cpu-budget"
    one_step = 4 * (-(-largest_param_bytes // (2 * MiB)) * (2 * MiB)) + 128 * MiB
    if one_step <= quarter:
        return quarter, "a quarter of the training state"
    return one_step, (f"raised from a quarter of the training state ({quarter} bytes): one "
                      f"parameter's step needs its 4 tensors of {largest_param_bytes} bytes in "
                      f"the tier at once, plus 128 MiB for the rest")


def daemon_settings(config: str, folder: str, state_bytes: int,
                    nvme_budget: int) -> dict[str, Any]:
    from bench_launch import store_daemon_settings

    if config == "infinity_cpu":  # room for all of it, and then some
        budget = (state_bytes * 5 // 4 + 512 * MiB) // (2 * MiB) * (2 * MiB)
    else:
        budget = nvme_budget
    settings = store_daemon_settings(folder, "daemon", cpu_budget_bytes=budget,
                                     nvme_capacity_bytes=4 * state_bytes + (1 << 30),
                                     prefetch=True)
    settings["daemon.request_timeout_s"] = 600.0
    return settings


def daemon_counters(client: Any, daemon_pid: int) -> dict[str, int]:
    """The disk bytes a daemon moved so far: its process's block I/O (/proc/<pid>/io) and its
    NVMe tier's own counters (reloads and streamed reads; write-backs and streamed writes); and
    the CPU time this worker's process and the daemon's used so far."""
    io = worker_protocol.proc_io_bytes(daemon_pid)
    tiers = client.stats().get("counters", {}).get("tiers", {})
    return {**io, "cpu_ms": worker_protocol.proc_cpu_ms(),
            "daemon_cpu_ms": worker_protocol.proc_cpu_ms(daemon_pid),
            "tier_read_bytes": tiers.get("reload_bytes", 0) + tiers.get("stream_read_bytes", 0),
            "tier_write_bytes": (tiers.get("writeback_bytes", 0)
                                 + tiers.get("stream_write_bytes", 0))}


def io_bound_s(read_bytes: float, write_bytes: float, read_gbps: float,
               write_gbps: float) -> float:
    """The time the disk needs for a step's bytes at the engine's measured bandwidth: reads at
    its read GB/s plus writes at its overwrite GB/s (the two do not overlap in this bound)."""
    return read_bytes / (read_gbps * 1e9) + write_bytes / (write_gbps * 1e9)


def base_config(config: str) -> str:
    """What a subject runs (`infinity_nvme_passive` runs `infinity_nvme`)."""
    return config.removesuffix(PASSIVE)


class TrainWorker:
    """The worker's state: its model, optimizer and (for Infinity) daemon."""

    def __init__(self, config: str) -> None:
        self.config = base_config(config)
        self.train_step: Callable[[int], float] | None = None
        self.settle: Callable[[], None] = lambda: None
        self.io_counters: Callable[[], dict[str, int]] = worker_protocol.proc_counters
        self.client: Any = None
        self.daemon: Any = None

    def init(self, request: dict[str, Any]) -> dict[str, Any]:
        import torch

        spec, batch, sequence = request["spec"], int(request["batch"]), int(request["sequence"])
        vocab = train_common.vocab_size(spec)
        model = train_common.build_model(spec, SEED)
        state_bytes = state_bytes_of(model)
        answer: dict[str, Any] = {"parameters": sum(p.numel() for p in model.parameters()),
                                  "state_bytes": state_bytes, "torch": torch.__version__}
        if self.config == "plain":
            optimizer: Any = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        else:
            import infinity
            import infinity.torch as itorch
            from bench_launch import start_daemon, typed_settings

            largest = max(p.numel() * p.element_size() for p in model.parameters())
            nvme_budget, why = nvme_cpu_budget(request.get("nvme_cpu_budget", "quarter"),
                                               state_bytes, largest)
            settings = daemon_settings(self.config, request["folder"], state_bytes, nvme_budget)
            settings.update(typed_settings(request.get("daemon_settings", [])))
            answer["cpu_segment_bytes"] = settings["cpu.segment_bytes"]
            if self.config in NVME_CONFIGS:
                answer["cpu_budget_why"] = why
                answer["cpu_budget_over_state"] = round(settings["cpu.budget_bytes"]
                                                        / state_bytes, 3)
            self.daemon, daemon_config = start_daemon(request["folder"], settings)
            self.client = infinity.connect(config=daemon_config, name=f"bench-train-{self.config}")
            model = itorch.offload(model, self.client, namespace="bench-train")
            optimizer = itorch.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                     speculate=self.config != "infinity_nvme_noguess")
            self.io_counters = self.daemon_counters
            answer["cpu_budget_bytes"] = settings["cpu.budget_bytes"]
            answer["daemon_pid"] = self.daemon.pid

            def settle() -> None:  # waits for whatever the last step left the daemon to do
                with torch.no_grad():
                    ids = train_common.batch_for(0, batch=batch, sequence=sequence, vocab=vocab,
                                                 seed=SEED)
                    model(input_ids=ids)
            self.settle = settle

        def train_step(step: int) -> float:
            ids = train_common.batch_for(step, batch=batch, sequence=sequence, vocab=vocab,
                                         seed=SEED)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return float(loss.detach())

        self.train_step = train_step
        return answer

    def daemon_counters(self) -> dict[str, int]:
        return daemon_counters(self.client, self.daemon.pid)

    def steps(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.train_step is not None
        return train_common.run_steps(self.train_step, first_step=int(request["first_step"]),
                                      count=int(request["count"]), io_counters=self.io_counters,
                                      settle=self.settle)

    def close(self) -> None:
        from bench_launch import stop_daemon

        stop_daemon(self.client, self.daemon, wait_s=60)


def worker_main(config: str) -> int:
    worker = TrainWorker(config)
    try:
        return worker_protocol.serve({"init": worker.init, "steps": worker.steps})
    finally:
        worker.close()


# --- the benchmark's side ---------------------------------------------------------------------


def start_worker(config: str, folder: str, log_dir: str) -> Worker:
    log = os.path.join(log_dir, f"{config}.log")
    if config == "deepspeed_nvme":
        python = PEERS_DIR / "venv" / "bin" / "python"
        if not python.exists():
            raise FileNotFoundError(f"no DeepSpeed venv at {python}: run tools/peers/setup_peers.sh")
        env = {**os.environ, "DS_ACCELERATOR": "cpu",
               "TORCH_EXTENSIONS_DIR": str(PEERS_DIR / "torch_extensions")}
        return Worker([str(python), str(DS_WORKER)], env=env, stderr_path=log, name=config)
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"} if config.endswith(PASSIVE) else None
    return Worker([sys.executable, str(Path(__file__).resolve()), "--worker", config],
                  env=env, stderr_path=log, name=config)


class EngineBandwidth:
    """The I/O engine's read and overwrite GB/s on the benchmark's directory, once per round."""

    def __init__(self, folder: str, total_bytes: int) -> None:
        from bench_io import EngineContender, Pattern

        from infinity.config import IOConfig

        tensor_bytes = min(64 * MiB, total_bytes)
        self.count = max(1, total_bytes // tensor_bytes)
        self.contender = EngineContender(folder, self.count, tensor_bytes, Pattern(tensor_bytes))
        io = IOConfig()  # the daemon's own settings
        self.settings = {"block_size_bytes": io.block_size_bytes, "queue_depth": io.queue_depth,
                         "num_threads": io.num_threads, "in_flight": 4}
        self.contender.run("write", self.settings, seed=1)
        self.read_gbps: list[float] = []
        self.write_gbps: list[float] = []

    def measure(self, seed: int) -> None:
        nbytes = self.count * self.contender.tensor_bytes
        seconds, verified = self.contender.run("read", self.settings, seed=1)
        if verified is False:
            raise RuntimeError("the engine read back data that its write did not write")
        self.read_gbps.append(nbytes / seconds / 1e9)
        seconds, _ = self.contender.run("overwrite", self.settings, seed=1)
        self.write_gbps.append(nbytes / seconds / 1e9)

    def close(self) -> None:
        self.contender.cleanup()


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def run_model(name: str, model: dict[str, Any], configs: list[str], args: argparse.Namespace,
              base: str, log_dir: str, console: Any) -> dict[str, Any]:
    result: dict[str, Any] = {"batch": model["batch"], "sequence": model["sequence"],
                              "subjects": {}, "skipped": {}, "failed": {}}

    def fail(config: str, error: worker_protocol.WorkerError) -> None:
        """A subject that failed is reported with its error and left out from then on."""
        result["failed"][config] = str(error).split("; its stderr ends with")[0]
        console.print(f"[red]{name}: {config} failed: {result['failed'][config]}")
        result["subjects"].pop(config, None)
        workers.pop(config).close()

    workers: dict[str, Worker] = {}
    engine: EngineBandwidth | None = None
    try:
        for config in configs:
            folder = os.path.join(base, f"{name}-{config}")
            os.makedirs(folder)
            console.print(f"{name}: starting {config}")
            try:
                worker = start_worker(config, folder, log_dir)
            except FileNotFoundError as error:
                result["skipped"][config] = str(error)
                continue
            workers[config] = worker
            request = {"spec": model["spec"], "seed": SEED, "batch": model["batch"],
                       "sequence": model["sequence"], "folder": folder}
            if config == "deepspeed_nvme":
                request |= {"swap_dir": os.path.join(folder, "swap"),
                            "buffer_count": args.ds_buffer_count, "lr": LR,
                            "weight_decay": WEIGHT_DECAY}
            if base_config(config) in NVME_CONFIGS:
                request["nvme_cpu_budget"] = args.nvme_cpu_budget
            if config.startswith("infinity"):
                request["daemon_settings"] = args.set
            started = time.perf_counter()
            try:
                info = worker.call("init", **request)
            except worker_protocol.WorkerError as error:
                fail(config, error)
                continue
            info["init_s"] = round(time.perf_counter() - started, 2)
            result["subjects"][config] = {"info": info, "seconds": [], "losses": [],
                                          "io": [], "per_round_median_s": []}
        engine = EngineBandwidth(os.path.join(base, f"{name}-engine"), args.engine_bytes)
        next_step = {config: 0 for config in workers}

        def turn(config: str, count: int) -> dict[str, Any]:
            answer = workers[config].call("steps", first_step=next_step[config], count=count)
            next_step[config] += count + 1
            return answer

        for config in list(workers):  # warm-up: one step (and the tail) each, not counted
            console.print(f"{name}: warm-up {config}")
            try:
                warm = turn(config, 1)
            except worker_protocol.WorkerError as error:
                fail(config, error)
                continue
            result["subjects"][config]["warmup_s"] = round(warm["seconds"][0], 3)
        for round_index in range(args.rounds):
            names = list(workers)
            if not names:
                break
            order = names[round_index % len(names):] + names[:round_index % len(names)]
            for config in order:
                try:
                    answer = turn(config, args.steps)
                except worker_protocol.WorkerError as error:
                    fail(config, error)
                    continue
                subject = result["subjects"][config]
                subject["seconds"] += answer["seconds"]
                subject["losses"] += answer["losses"]
                subject["io"].append({**answer["io"], "steps": args.steps})
                subject["per_round_median_s"].append(round(median(answer["seconds"]), 4))
                console.print(f"{name} round {round_index + 1}: {config} "
                              f"{' '.join(f'{s:.2f}' for s in answer['seconds'])} s")
            engine.measure(round_index)
    finally:
        for worker in workers.values():
            worker.close()
        if engine is not None:
            engine.close()
    read_gbps, write_gbps = median(engine.read_gbps), median(engine.write_gbps)
    result["engine"] = {"read_gbps": round(read_gbps, 3), "overwrite_gbps": round(write_gbps, 3),
                        "per_round_read_gbps": [round(x, 3) for x in engine.read_gbps],
                        "per_round_overwrite_gbps": [round(x, 3) for x in engine.write_gbps],
                        "settings": engine.settings}
    summarize(result, read_gbps, write_gbps)
    return result


def summarize(result: dict[str, Any], read_gbps: float, write_gbps: float) -> None:
    subjects = result["subjects"]
    for subject in subjects.values():
        if not subject["io"]:  # failed before its first round
            continue
        steps = sum(io["steps"] for io in subject["io"])
        per_step = {key: round(sum(io.get(key, 0) for io in subject["io"]) / steps)
                    for key in subject["io"][0] if key != "steps"}
        subject["disk_bytes_per_step"] = per_step
        subject["median_s"] = round(median(subject["seconds"]), 4)
        subject["seconds"] = [round(s, 4) for s in subject["seconds"]]
        subject["losses"] = [round(x, 5) for x in subject["losses"]]
        subject["io_bound_s"] = round(io_bound_s(per_step["read_bytes"], per_step["write_bytes"],
                                                 read_gbps, write_gbps), 4)
        # The CPU a step took, the trainer's process and its daemon's together, and what that
        # alone needs of the machine's cores: a step cannot be shorter (all cores busy).
        cpu_s = (per_step.get("cpu_ms", 0) + per_step.get("daemon_cpu_ms", 0)) / 1000
        subject["cpu_s_per_step"] = round(cpu_s, 3)
        subject["cpu_bound_s"] = round(cpu_s / (os.cpu_count() or 1), 4)
        del subject["io"]
    ratios: dict[str, Any] = {}
    for peer in ("plain", "plain_passive", "deepspeed_nvme"):
        if peer not in subjects:
            continue
        for config, subject in subjects.items():
            if config != peer:  # > 1: `config` is that much slower than the peer
                ratios[f"{config}/{peer}"] = round(subject["median_s"] / subjects[peer]["median_s"], 3)
    if "deepspeed_nvme" in subjects and "infinity_nvme" in subjects:
        per_round = [d / i for d, i in zip(subjects["deepspeed_nvme"]["per_round_median_s"],
                                           subjects["infinity_nvme"]["per_round_median_s"])]
        ratios["deepspeed_nvme/infinity_nvme per round"] = [round(x, 3) for x in per_round]
    result["ratios"] = ratios
    targets: dict[str, Any] = {}
    nvme = subjects.get("infinity_nvme")
    if nvme is not None and "plain" in subjects:
        bound = max(subjects["plain"]["median_s"], nvme["io_bound_s"])
        result["infinity_nvme_bound_s"] = round(bound, 4)
        targets["infinity_nvme within 1.25x of max(plain, I/O bound)"] = {
            "ratio": round(nvme["median_s"] / bound, 3), "met": nvme["median_s"] <= 1.25 * bound}
    if nvme is not None and "deepspeed_nvme" in subjects:
        speedup = subjects["deepspeed_nvme"]["median_s"] / nvme["median_s"]
        targets["infinity_nvme >= 1.4x faster than deepspeed_nvme"] = {
            "ratio": round(speedup, 3), "met": speedup >= 1.4}
    result["targets"] = targets


def remove_run_folder(base: str, *, failed: bool, keep: bool) -> None:
    """The end of a run's folder: all of it goes after a success (unless `keep`), all but its
    `logs` after a failure (the data can be tens of GB; the logs say what failed)."""
    if not failed and not keep:
        shutil.rmtree(base, ignore_errors=True)
    elif failed:
        for entry in os.listdir(base):
            if entry != "logs":
                shutil.rmtree(os.path.join(base, entry), ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=[c for c in CONFIGS if c != "deepspeed_nvme"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--configs", default=",".join(CONFIGS[:4]),
                        help=f"subjects, comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--models", default="small,large", help="small, large or both")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per subject and round")
    parser.add_argument("--dir", default="/var/tmp",
                        help="where the NVMe folders go (a real disk, not tmpfs)")
    parser.add_argument("--engine-bytes", type=int, default=1 << 30,
                        help="bytes the engine reads and overwrites per round (its bandwidth)")
    parser.add_argument("--ds-buffer-count", type=int, default=56,
                        help="DeepSpeed offload_param buffer_count (fewer failed for GPT-2 124M)")
    parser.add_argument("--nvme-cpu-budget", default="quarter",
                        help="infinity_nvme's CPU tier: quarter (of the training state), auto "
                             "(before session 16: raised where one parameter's step needed its "
                             "four tensors resident), or bytes")
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE",
                        help="a setting of both Infinity daemons, e.g. cpu.segment_bytes=155189248 "
                             "(repeatable; applied over the benchmark's own)")
    parser.add_argument("--quick", action="store_true", help="a tiny model: a smoke run")
    parser.add_argument("--keep", action="store_true", help="keep the NVMe folders and logs")
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.worker)

    from rich.console import Console

    console = Console(stderr=True)
    configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configs {unknown}; pick from {', '.join(CONFIGS)}")
    if args.quick:
        args.engine_bytes = min(args.engine_bytes, 128 * MiB)
    chosen = models(args.quick)
    wanted = [m for m in args.models.split(",") if m]
    if set(wanted) - set(chosen):
        parser.error(f"--models takes small and/or large, not {args.models}")
    # A SIGTERM ends the run like an error: the finally blocks stop every worker and daemon.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    base = tempfile.mkdtemp(prefix="infinity-bench-train-", dir=args.dir)
    log_dir = os.path.join(base, "logs")
    os.makedirs(log_dir)
    import torch

    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
                    "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                    # Every worker inherits it: with "PASSIVE", torch's OpenMP threads sleep
                    # between parallel regions instead of spinning on cores a daemon needs.
                    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "")},
        "dir": base, "rounds": args.rounds, "steps_per_round": args.steps, "quick": args.quick,
        "models": {},
    }
    failed = False
    try:
        for name in wanted:
            report["models"][name] = run_model(name, chosen[name], configs, args, base, log_dir,
                                               console)
    except BaseException:
        failed = True
        console.print(f"[red]failed; the workers' logs are in {log_dir}")
        raise
    finally:
        report["machine"]["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
        remove_run_folder(base, failed=failed, keep=args.keep)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
