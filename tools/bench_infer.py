"""Benchmark streamed generation: Infinity against Accelerate's disk offload, the same memory limit.

    .venv/bin/python tools/bench_infer.py [--rounds 2] [--new-tokens 16] [--prompt-tokens 32]
                                          [--batch 4] [--dir /var/tmp] [--quick]
                                          [--configs memory,infinity,infinity-int8,
                                            infinity-int8-head,infinity-int4,accelerate]
                                          > bench_infer.json

Must run as root on a machine with cgroup v1's memory controller (/sys/fs/cgroup/memory): each
subject runs in a memory cgroup of its own. JSON on stdout, progress on stderr.

The model: a Llama of about 1.1B parameters (TinyLlama's shape) built from a config with seeded
weights and saved in bf16 with `save_pretrained` (2.2 GB, in shards; kept under `--dir` between
runs), imported into a private infinityd's store once (`infinity.torch.model_store`), with its
int8 and int4 copies where a quantized subject runs. The memory budget is a quarter of the
(bf16) weight bytes, for every subject.

The subjects, each a fresh worker process per round (tools/peers/worker_protocol.py), in a memory
cgroup whose limit, page cache included, is the budget plus the same fixed allowance for the
runtime (`--allowance-bytes`: the interpreter, torch, activations, the KV cache), so that the
budget binds both sides alike and neither reads "disk" out of a page cache larger than the
budget:

- `memory`: the whole model in the process (`from_pretrained`), no limit: the compute's floor;
- `infinity`: a private infinityd whose CPU tier is the budget (the daemon is the worker's child,
  in the same cgroup; it makes its tier's segments at start, `cpu.create_at_start`, while the
  worker builds the model), the model built with `infinity.torch.generation.load_causal_lm`:
  weights stream from NVMe, prefetched by the step trace;
- `infinity-int8`, `infinity-int4`: the same, streaming the import's quantized copies of the
  linear layers' weights (`load_causal_lm(quantization=...)`), dequantized layer by layer
  (decode steps multiply from the codes), the output projection in bf16;
- `infinity-int8-head`: int8 with the output projection's copy streamed too
  (`quantized_lm_head=True`; in the error report, form "int8+lm_head");
- `accelerate`: transformers + Accelerate, `device_map="auto"` with `max_memory={"cpu": budget}`
  (tools/peers/accelerate_generate_worker.py, in the peers' venv from tools/peers/setup_peers.sh;
  "skipped" where it is missing). Its offloaded weights are read from the safetensors files
  through the page cache, which is dropped for these files before each of its turns.

Each turn generates `--new-tokens` greedy tokens after a seeded prompt of `--prompt-tokens`
(batch 1: time to the first token, seconds per token after it), then the same with `--batch`
prompts (tokens per second). The subjects take turns round by round, the order rotated. Each
round also measures the I/O engine's read bandwidth on the same directory: the disk floor is the
bytes that must come from disk per token (the weights beyond the budget) over it.

Last, the shared copy: one infinityd whose CPU tier holds the whole model and `--share-processes`
worker processes generating from it, against the same number of processes each loading the model
(`from_pretrained`), and one of each: the cgroups' peak memory (page cache included).

Reported: medians of every figure, the tokens of each subject (the full-precision ones must
agree: the same greedy tokens; for each quantized one, the share of its tokens that differ from
the model in memory's), the ratios and the issue's targets: seconds per token at least 3x better
than Accelerate's (5x with int8), within 1.25x of max(in memory, disk floor), and the processes
sharing one copy using at most 1.2x the memory of one. Each form's disk floor counts the bytes
that form streams (its copies, and the tensors left in full precision) beyond the budget.

The quantized copies' error against full precision on the same model (tools/quant_error.py, in
memory, no limit: the largest and mean absolute difference of the logits over a fixed prompt set,
the share of greedy tokens that change) runs last, unless `--no-error`.

`--quick` uses a tiny Llama (4 layers, 64 wide): a smoke run whose figures mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))
sys.path.insert(0, str(TOOLS / "peers"))

import generate_common  # noqa: E402
from peers import worker_protocol  # noqa: E402
from peers.worker_protocol import Worker  # noqa: E402

CONFIGS = ("memory", "infinity", "infinity-int8", "infinity-int8-head", "infinity-int4",
           "accelerate")
# The quantized subjects' forms; "+lm_head": the output projection's copy streamed too.
FORMS = {"infinity-int8": "int8", "infinity-int8-head": "int8+lm_head", "infinity-int4": "int4"}
PEERS_DIR = Path(os.environ.get("INFINITY_PEERS_DIR", "/var/tmp/infinity-peers"))
ACCELERATE_WORKER = TOOLS / "peers" / "accelerate_generate_worker.py"
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
NAMESPACE = "bench-infer"
SEED = 0
MiB = 1 << 20


def log(text: str) -> None:
    print(f"[bench_infer] {text}", file=sys.stderr, flush=True)


# --- memory cgroups ---------------------------------------------------------------------------


class MemoryCgroup:
    """A cgroup v1 memory group: a limit (page cache included) and its peak usage."""

    def __init__(self, name: str, limit_bytes: int | None) -> None:
        self.path = CGROUP_ROOT / f"infinity-bench-{name}-{os.getpid()}"
        self.path.mkdir()
        if limit_bytes is not None:
            (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    @contextlib.contextmanager
    def joined(self) -> Iterator[None]:
        """This process in the group for a while: what it starts meanwhile (a daemon) is born
        in it, and charged to it from its first page (a process that joins later leaves what
        it took before behind)."""
        home = next(line.split(":", 2)[2].strip() for line in Path("/proc/self/cgroup").read_text().splitlines()
                    if line.split(":", 2)[1] == "memory")
        self.add(os.getpid())
        try:
            yield
        finally:
            (CGROUP_ROOT / home.lstrip("/") / "cgroup.procs").write_text(str(os.getpid()))

    def peak_bytes(self) -> int:
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def limit_hits(self) -> int:
        return int((self.path / "memory.failcnt").read_text())

    def close(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                self.path.rmdir()
                return
            except OSError:  # its processes are still exiting
                time.sleep(0.1)
        log(f"could not remove {self.path}")


@contextlib.contextmanager
def cgroup(name: str, limit_bytes: int | None) -> Iterator[MemoryCgroup]:
    group = MemoryCgroup(name, limit_bytes)
    try:
        yield group
    finally:
        group.close()


def drop_page_cache(folder: Path) -> None:
    """Make the kernel forget the cached pages of every file under `folder`."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# --- the workers (this file run with --worker NAME) -------------------------------------------


class GenerateWorker:
    """A `memory` or `infinity` subject in its own process."""

    def __init__(self, config: str) -> None:
        self.config = config
        self.model: Any = None
        self.client: Any = None
        self.daemon: Any = None

    def init(self, request: dict[str, Any]) -> dict[str, Any]:
        import torch

        started = time.perf_counter()
        if self.config == "memory":
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(request["model_dir"],
                                                              torch_dtype=torch.bfloat16).eval()
        else:
            import infinity
            from bench_launch import start_daemon
            from infinity.config import load_config
            from infinity.torch.generation import load_causal_lm

            if request.get("settings") is not None:  # a daemon of its own, in its cgroup
                self.daemon, config = start_daemon(request["folder"], request["settings"])
            else:  # attach to a running one
                config = load_config(env={}, overrides=[f"daemon.runtime_dir={request['runtime_dir']}"])
            # The daemon keeps a step trace per namespace and client name, across restarts:
            # each subject has a name of its own, as separate programs would, so that a bf16
            # turn does not replay the int8 turn's trace (and load its first steps on demand).
            self.client = infinity.connect(config=config,
                                           name=request.get("name", f"bench-infer-{self.config}"))
            form = FORMS.get(self.config)
            self.model = load_causal_lm(self.client, namespace=NAMESPACE,
                                        quantization=form.split("+")[0] if form else None,
                                        quantized_lm_head=bool(form and form.endswith("+lm_head")))
        return {"load_s": time.perf_counter() - started,
                "daemon_pid": self.daemon.pid if self.daemon is not None else None}

    def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        ids = generate_common.prompt_ids(int(request["batch"]), int(request["length"]),
                                         int(request["vocab"]), int(request["seed"]))
        pid = self.daemon.pid if self.daemon is not None else "self"
        before = worker_protocol.proc_io_bytes(pid)
        answer = generate_common.timed_generate(self.model, ids, int(request["new_tokens"]))
        answer["disk_read_bytes"] = worker_protocol.proc_io_bytes(pid)["read_bytes"] - before["read_bytes"]
        if self.client is not None:
            answer["stall_s"] = self.client.stats().get("scheduler", {}).get("stall_s")
        return answer

    def close(self) -> None:
        if self.client is not None:
            if self.daemon is not None:
                with contextlib.suppress(Exception):
                    self.client.shutdown_daemon()
            self.client.close()
        if self.daemon is not None:
            try:
                self.daemon.wait(60)
            except Exception:
                self.daemon.kill()


def worker_main(config: str) -> int:
    worker = GenerateWorker(config)
    try:
        return worker_protocol.serve({"init": worker.init, "generate": worker.generate})
    finally:
        worker.close()


def start_worker(config: str, log_dir: Path, group: MemoryCgroup) -> Worker:
    log_path = str(log_dir / f"{config}.log")
    if config == "accelerate":
        python = PEERS_DIR / "venv" / "bin" / "python"
        if not python.exists():
            raise FileNotFoundError(f"no peers venv at {python}: run tools/peers/setup_peers.sh")
        worker = Worker([str(python), str(ACCELERATE_WORKER)], stderr_path=log_path, name=config)
    else:
        worker = Worker([sys.executable, str(Path(__file__).resolve()), "--worker", config],
                        stderr_path=log_path, name=config)
    group.add(worker.pid)  # before it loads anything: what it and its children take counts
    return worker


# --- the benchmark's side ---------------------------------------------------------------------


def prepare_model(spec: dict[str, Any], root: Path, shard_bytes: int) -> tuple[Path, int]:
    """The saved model folder for `spec` (made once, kept) and its weight bytes."""
    key = hashlib.sha256(json.dumps([spec, SEED, shard_bytes], sort_keys=True).encode()).hexdigest()
    folder = root / f"bench-infer-model-{key[:12]}"
    marker = folder / "weight_bytes"
    if not marker.exists():
        shutil.rmtree(folder, ignore_errors=True)
        log(f"building and saving the model into {folder}")
        weight_bytes = generate_common.save_model(spec, str(folder), seed=SEED,
                                                  shard_bytes=shard_bytes)
        marker.write_text(str(weight_bytes))
    return folder, int(marker.read_text())


def daemon_settings(work: Path, *, cpu_budget_bytes: int, weight_bytes: int) -> dict[str, Any]:
    """The store all Infinity subjects share (made by the first call), its CPU tier as given."""
    store = work / "store"
    store.mkdir(exist_ok=True)
    segment = min(256 * MiB, max(2 * MiB, cpu_budget_bytes // 8 // (2 * MiB) * (2 * MiB)))
    return {"daemon.runtime_dir": str(work / "rt"), "daemon.log_level": "warning",
            "daemon.request_timeout_s": 600.0,
            "cpu.budget_bytes": max(segment, cpu_budget_bytes // segment * segment),
            "cpu.segment_bytes": segment, "nvme.dirs": [str(store)],
            # The weights, their int8 and int4 copies (at most 0.8x of them) and room.
            "nvme.capacity_bytes_per_dir": (3 * weight_bytes + (1 << 30)) // 4096 * 4096,
            "scheduler.prefetch": True,
            # A node's daemon is there before its clients: its tier is made while the model
            # is built, not while the first token waits for it (docs/BENCHMARKS.md, session 21).
            "cpu.create_at_start": True}


def import_model(model_dir: Path, work: Path, weight_bytes: int,
                 forms: tuple[str, ...]) -> dict[str, Any]:
    """Import the model (with the quantized `forms`); the import's time, its report, and the
    bytes each form streams a token (full precision: "bf16")."""
    import infinity
    from bench_launch import start_daemon
    from infinity.torch.model_store import import_model as store_import
    from infinity.torch.model_store import require_model

    settings = daemon_settings(work, cpu_budget_bytes=max(64 * MiB, weight_bytes // 4),
                               weight_bytes=weight_bytes)
    daemon, config = start_daemon(str(work), settings)
    try:
        client = infinity.connect(config=config, name="bench-infer-import")
        started = time.perf_counter()
        report = store_import(client, str(model_dir), namespace=NAMESPACE, progress=False,
                              quantize=forms)
        seconds = time.perf_counter() - started
        manifest = require_model(client, NAMESPACE)
        client.shutdown_daemon()
        client.close()
        daemon.wait(60)
    finally:
        if daemon.poll() is None:
            daemon.kill()
    return {"import_s": seconds, "report": str(report),
            "streamed_bytes": streamed_bytes(manifest, weight_bytes)}


def streamed_bytes(manifest: dict[str, Any], weight_bytes: int) -> dict[str, int]:
    """The bytes a token's forward leases, per form: every weight in full precision, or the
    form's copies plus the tensors it leaves in full precision (the output projection among
    them, but in "FORM+lm_head")."""
    import math

    import torch

    from infinity.torch.model_quantized import quantized_weights

    def full(name: str) -> int:
        spec = manifest["tensors"][name]
        return math.prod(spec["shape"]) * getattr(torch, spec["dtype"]).itemsize

    figures = {"bf16": weight_bytes}
    for form, record in (manifest.get("quantized") or {}).items():
        copies = quantized_weights(manifest, form)
        head = record.get("output_projection")
        for name, with_head in ((form, False), (form + "+lm_head", True)):
            if with_head and head is None:
                continue
            chosen = [n for n in copies if with_head or n != head]
            figures[name] = (weight_bytes - sum(full(n) for n in chosen)
                             + sum(copies[n].nbytes for n in chosen))
    return figures


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def one_turn(config: str, args: argparse.Namespace, *, model_dir: Path, work: Path,
             budget_bytes: int, weight_bytes: int, vocab: int) -> dict[str, Any]:
    limit = None if config == "memory" else budget_bytes + args.allowance_bytes
    if config == "accelerate":
        drop_page_cache(model_dir)
    with cgroup(config, limit) as group:
        worker = start_worker(config, work / "logs", group)
        try:
            request: dict[str, Any] = {"model_dir": str(model_dir)}
            if config.startswith("infinity"):
                request.update(folder=str(work),
                               settings=daemon_settings(work, cpu_budget_bytes=budget_bytes,
                                                        weight_bytes=weight_bytes))
            if config == "accelerate":
                offload_dir = work / "accelerate-offload"
                offload_dir.mkdir(exist_ok=True)
                request.update(budget_bytes=budget_bytes, offload_dir=str(offload_dir))
            turn: dict[str, Any] = {"init": worker.call("init", **request)}
            common = dict(length=args.prompt_tokens, vocab=vocab, seed=SEED,
                          new_tokens=args.new_tokens)
            turn["single"] = worker.call("generate", batch=1, **common)
            if args.batch > 1:
                turn["batched"] = worker.call("generate", batch=args.batch, **common)
        except worker_protocol.WorkerError as exc:
            turn = {"error": str(exc)}
        finally:
            worker.close()
        turn["cgroup_peak_bytes"] = group.peak_bytes()
        turn["cgroup_limit_bytes"] = limit
        turn["cgroup_limit_hits"] = group.limit_hits()
    return turn


def shared_copy(args: argparse.Namespace, *, model_dir: Path, work: Path,
                weight_bytes: int, vocab: int) -> dict[str, Any]:
    """Peak memory of N processes generating from one daemon's copy, and of N separate loads."""
    from bench_launch import start_daemon

    result: dict[str, Any] = {}
    common = dict(batch=1, length=args.prompt_tokens, vocab=vocab, seed=SEED,
                  new_tokens=min(4, args.new_tokens))
    for kind in ("infinity", "memory"):
        for count in (1, args.share_processes):
            label = f"{kind}_x{count}"
            log(f"shared copy: {label}")
            # Uncached, so the pages a load maps are charged to this group (page cache is
            # charged to the group that first reads it).
            drop_page_cache(model_dir)
            with cgroup(f"share-{label}", None) as group:
                daemon = None
                workers: list[Worker] = []
                try:
                    request: dict[str, Any] = {"model_dir": str(model_dir)}
                    if kind == "infinity":
                        settings = daemon_settings(work, weight_bytes=weight_bytes,
                                                   cpu_budget_bytes=weight_bytes * 5 // 4 + 256 * MiB)
                        with group.joined():
                            daemon, _ = start_daemon(str(work), settings)
                        request["runtime_dir"] = settings["daemon.runtime_dir"]
                    for index in range(count):
                        worker = start_worker(kind, work / "logs", group)
                        workers.append(worker)
                        worker.call("init", **request, name=f"bench-infer-share-{index}")
                    tokens = [worker.call("generate", **common)["tokens"] for worker in workers]
                    result[label] = {"peak_bytes": group.peak_bytes(),
                                     "same_tokens": all(t == tokens[0] for t in tokens)}
                finally:
                    for worker in workers:
                        worker.close()
                    if daemon is not None:
                        daemon.terminate()
                        daemon.wait(60)
    for kind in ("infinity", "memory"):
        one = result[f"{kind}_x1"]["peak_bytes"]
        many = result[f"{kind}_x{args.share_processes}"]["peak_bytes"]
        result[f"{kind}_ratio"] = round(many / one, 3)
        # What each process beyond the first adds: its runtime (interpreter, torch,
        # activations), and for separate loads its own copy of the weights.
        result[f"{kind}_bytes_per_extra_process"] = (many - one) // max(1, args.share_processes - 1)
    return result


def summarize(result: dict[str, Any], read_gbps: float) -> None:
    per_config: dict[str, Any] = {}
    for config, turns in result["turns"].items():
        good = [t for t in turns if "error" not in t]
        per_config[config] = {
            "per_token_s": median([t["single"].get("per_token_s") for t in good]),
            "first_token_s": median([t["single"].get("first_token_s") for t in good]),
            "batched_tokens_per_s": median([
                len(t["batched"]["tokens"]) * len(t["batched"]["tokens"][0]) / t["batched"]["total_s"]
                for t in good if "batched" in t]),
            "disk_read_bytes_per_token": median([
                t["single"]["disk_read_bytes"] / max(1, len(t["single"]["tokens"][0]))
                for t in good]),
            "load_s": median([t["init"]["load_s"] for t in good]),
            "cgroup_peak_bytes": max((t["cgroup_peak_bytes"] for t in good), default=None),
            "errors": [t["error"] for t in turns if "error" in t],
        }
    result["summary"] = per_config
    budget = result["budget_bytes"]
    streamed = (result.get("import") or {}).get("streamed_bytes") or {"bf16": result["weight_bytes"]}
    floors: dict[str, Any] = {}
    for form, nbytes in streamed.items():
        floor_bytes = max(0, nbytes - budget)
        floors[form] = {"streamed_bytes": nbytes, "bytes_per_token": floor_bytes,
                        "seconds_per_token": floor_bytes / (read_gbps * 1e9) if read_gbps else None}
    result["disk_floor"] = {**floors["bf16"], "read_gbps": round(read_gbps, 3), "by_form": floors}
    first_tokens = {c: t[0] for c, t in ((c, [x for x in turns if "single" in x])
                                         for c, turns in result["turns"].items()) if t}
    full = {c: first["single"]["tokens"] for c, first in first_tokens.items() if c not in FORMS}
    result["same_greedy_tokens"] = len({json.dumps(v) for v in full.values()}) <= 1
    reference = first_tokens.get("memory") or first_tokens.get("infinity")
    changed: dict[str, Any] = {}
    for config, first in first_tokens.items():
        if config in FORMS and reference is not None:
            changed[config] = {run: changed_share(first[run]["tokens"], reference[run]["tokens"])
                               for run in ("single", "batched") if run in first and run in reference}
    result["quantized_tokens_changed"] = changed
    in_memory = per_config.get("memory", {}).get("per_token_s")
    theirs = per_config.get("accelerate", {}).get("per_token_s")
    targets: dict[str, Any] = {}
    for config, form, target in (("infinity", "bf16", 3.0), ("infinity-int8", "int8", 5.0),
                                 ("infinity-int8-head", "int8+lm_head", 5.0),
                                 ("infinity-int4", "int4", None)):
        ours = per_config.get(config, {}).get("per_token_s")
        suffix = "" if config == "infinity" else "_" + form.replace("+", "_")
        if ours and theirs:
            ratio = theirs / ours
            targets["faster_than_accelerate" + suffix] = {
                "ratio": round(ratio, 2), "target": target,
                "met": ratio >= target if target is not None else None}
        floor_s = floors.get(form, {}).get("seconds_per_token")
        if ours and in_memory and floor_s is not None:
            bound = max(in_memory, floor_s)
            targets["over_bound" + suffix] = {
                "ratio": round(ours / bound, 3), "bound_s": bound,
                "target": 1.25 if config == "infinity" else None,
                "met": ours / bound <= 1.25 if config == "infinity" else None}
    share = result.get("shared_copy")
    if share:
        targets["shared_copy"] = {"ratio": share["infinity_ratio"], "target": 1.2,
                                  "met": share["infinity_ratio"] <= 1.2}
    result["targets"] = targets


def changed_share(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """The share of positions whose token differs (sequences of equal lengths)."""
    pairs = [(a, b) for row, ref in zip(tokens, reference) for a, b in zip(row, ref)]
    return round(sum(a != b for a, b in pairs) / max(1, len(pairs)), 4)


def quantization_error(model_dir: Path, forms: list[str], args: argparse.Namespace) -> Any:
    """tools/quant_error.py on the benchmark's model, in a process of its own (no limit)."""
    done = subprocess.run(
        [sys.executable, str(TOOLS / "quant_error.py"), str(model_dir), "--forms", ",".join(forms),
         "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens)],
        capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4, help="prompts of the batched run")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--dir", default="/var/tmp", help="where the model, store and logs go")
    parser.add_argument("--allowance-bytes", type=int, default=1536 * MiB,
                        help="memory beyond the budget for each subject's runtime")
    parser.add_argument("--share-processes", type=int, default=4)
    parser.add_argument("--no-share", action="store_true", help="leave out the shared-copy part")
    parser.add_argument("--no-error", action="store_true",
                        help="leave out the quantized copies' error (tools/quant_error.py)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    if not CGROUP_ROOT.is_dir() or os.geteuid() != 0:
        print("bench_infer needs root and cgroup v1's memory controller at "
              f"{CGROUP_ROOT} to bind each subject's memory", file=sys.stderr)
        return 2
    configs = [c for c in args.configs.split(",") if c]
    spec = generate_common.LLAMA_TINY if args.quick else generate_common.LLAMA_1B
    root = Path(args.dir)
    model_dir, weight_bytes = prepare_model(spec, root, shard_bytes=(1 << 20) if args.quick
                                            else 500 * 10**6)
    work = root / f"bench-infer-{os.getpid()}"
    (work / "logs").mkdir(parents=True)
    budget_bytes = weight_bytes // 4
    result: dict[str, Any] = {"model": spec, "weight_bytes": weight_bytes,
                              "budget_bytes": budget_bytes, "allowance_bytes": args.allowance_bytes,
                              "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens,
                              "batch": args.batch, "turns": {c: [] for c in configs}}
    try:
        from bench_train import EngineBandwidth

        if "accelerate" in configs and not (PEERS_DIR / "venv" / "bin" / "python").exists():
            result["turns"]["accelerate"] = [{"error": "skipped: no peers venv "
                                              "(tools/peers/setup_peers.sh)"}]
            configs.remove("accelerate")
        forms = tuple(dict.fromkeys(FORMS[c] for c in configs if c in FORMS))
        imported = tuple(dict.fromkeys(form.split("+")[0] for form in forms))
        if any(c.startswith("infinity") for c in configs) or not args.no_share:
            log(f"importing the model into the store (quantized: {', '.join(imported) or 'no'})")
            result["import"] = import_model(model_dir, work, weight_bytes, imported)
        bandwidth = EngineBandwidth(str(work), min(1 << 30, max(64 * MiB, weight_bytes // 2)))
        for round_index in range(args.rounds):
            order = configs[round_index % len(configs):] + configs[:round_index % len(configs)]
            for config in order:
                log(f"round {round_index + 1}: {config}")
                result["turns"][config].append(one_turn(
                    config, args, model_dir=model_dir, work=work, budget_bytes=budget_bytes,
                    weight_bytes=weight_bytes, vocab=spec["vocab_size"]))
            bandwidth.measure(round_index)
        read_gbps = median(bandwidth.read_gbps) or 0.0
        bandwidth.close()
        if not args.no_share:
            result["shared_copy"] = shared_copy(args, model_dir=model_dir, work=work,
                                                weight_bytes=weight_bytes,
                                                vocab=spec["vocab_size"])
        if forms and not args.no_error:
            log("the quantized copies' error against full precision")
            result["quantization_error"] = quantization_error(model_dir, list(forms), args)
        summarize(result, read_gbps)
    finally:
        logs = work / "logs"
        result["log_dir"] = str(logs)
        for path in work.iterdir():
            if path != logs:
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
