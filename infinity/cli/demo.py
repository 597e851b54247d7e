"""`infinity demo`: the main job on its built-in default.

Part one moves random tensors through the NVMe tier in a folder under the
current directory and reads them back verified (the engine at work). Part two
starts `infinityd` in a private runtime folder, puts tensors through one client
process, reads them bit-exactly from a second one through shared memory, and
stops the daemon. Part three (`demo_train`) fine-tunes a small GPT-2 whose
parameters and Adam states live on NVMe through a daemon whose CPU tier holds a
quarter of them, draws the loss curve and lets the model write a line. Part four
(`demo_generate`) imports the trained model into a fresh daemon's store and lets it write the
same line again with its weights streamed from NVMe.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import os
import shutil
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from infinity.cli.sizes import DEMO_TENSOR_BYTES
from infinity.config import InfinityConfig, MiB, load_config
from infinity.errors import StoreDirectoryError
from infinity.io import IOEngine, aligned_empty
from infinity.protocol.paths import RuntimeLayout
from infinity.store.durable import LOCK_FILE_NAME
from infinity.store.nvme import NvmeTier

TENSOR_BYTES = DEMO_TENSOR_BYTES


def _progress(console: Console) -> Progress:
    # The speed shown is the disk's alone, as in the JSON report, not the bar's pace (which
    # includes making and checking the random bytes).
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[disk]}"),
                    TimeRemainingColumn(), console=console)


def _disk_speed(nbytes: int, seconds: float) -> str:
    return f"disk {nbytes / seconds / 1e9:.2f} GB/s" if seconds > 0 else "disk -"


def io_part(config: InfinityConfig, io_bytes: int, console: Console) -> dict[str, object]:
    """Write `io_bytes` of random tensors through the NVMe tier, read them back, compare."""
    count = max(1, io_bytes // TENSOR_BYTES)
    buffers = [aligned_empty(TENSOR_BYTES) for _ in range(2)]
    generator = torch.Generator().manual_seed(0)
    seeds = torch.randint(0, 2**31, (count,), generator=generator).tolist()
    with IOEngine.from_config(config.io) as engine:
        tier = NvmeTier(config.nvme, engine)
        try:
            layouts = []
            write_s = read_s = 0.0
            with _progress(console) as progress:
                task = progress.add_task("NVMe tier: write", total=count * TENSOR_BYTES, disk="")
                for i, seed in enumerate(seeds):
                    buf = buffers[i % 2]
                    buf.random_(0, 256, generator=torch.Generator().manual_seed(seed))
                    start = time.perf_counter()
                    layouts.append(tier.write_tensor(buf).result())
                    write_s += time.perf_counter() - start
                    progress.update(task, advance=TENSOR_BYTES,
                                    disk=_disk_speed((i + 1) * TENSOR_BYTES, write_s))
                task = progress.add_task("NVMe tier: read + verify", total=count * TENSOR_BYTES,
                                         disk="")
                expected = aligned_empty(TENSOR_BYTES)
                for i, (layout, seed) in enumerate(zip(layouts, seeds)):
                    start = time.perf_counter()
                    tier.read_into(layout, buffers[0].data_ptr()).result()
                    read_s += time.perf_counter() - start
                    expected.random_(0, 256, generator=torch.Generator().manual_seed(seed))
                    if not torch.equal(expected, buffers[0]):
                        raise RuntimeError("a tensor read back differs from what was written")
                    progress.update(task, advance=TENSOR_BYTES,
                                    disk=_disk_speed((i + 1) * TENSOR_BYTES, read_s))
            for layout in layouts:
                tier.free(layout)
            return {
                "backend": engine.backend,
                "directories": tier.describe(),
                "tensors": count,
                "write_gbps": round(count * TENSOR_BYTES / write_s / 1e9, 3),
                "read_gbps": round(count * TENSOR_BYTES / read_s / 1e9, 3),
                "verified": True,
            }
        finally:
            tier.close()


DEMO_SENTINEL = ".infinity-demo"  # marks a store folder as the demo's own, to remove at will


def _store_lock(store: Path) -> int | None:
    """The store's lock taken (its fd: hold it while emptying the store), or None when a
    process holds it (a daemon serving the store)."""
    try:
        fd = os.open(store / LOCK_FILE_NAME, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise StoreDirectoryError(f"cannot open {store / LOCK_FILE_NAME}: {exc.strerror}; pass "
                                  f"another --dir") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _fresh_demo_folder(store: Path, runtime: Path) -> None:
    """An empty store folder for the demo: one an interrupted demo left is emptied (it would
    hold extents no index knows), anything else there is refused, never removed, and so is the
    demo's own while a daemon runs on it (or is starting: the runtime folder's lock comes first)."""
    if store.exists() and any(store.iterdir()):
        if not (store / DEMO_SENTINEL).exists():
            raise StoreDirectoryError(
                f"{store} already holds files the demo did not make; pass another --dir")
        lock = None if RuntimeLayout(str(runtime)).daemon_running() else _store_lock(store)
        if lock is None:
            raise StoreDirectoryError(
                f"a daemon still serves the demo's store {store} (an earlier demo stopped before "
                f"it could stop it); stop it with `infinityd stop --set daemon.runtime_dir="
                f"{runtime}`, or pass another --dir")
        try:
            shutil.rmtree(store)
        finally:
            os.close(lock)
    store.mkdir(parents=True, exist_ok=True)
    (store / DEMO_SENTINEL).touch()


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    base = Path(args.dir).resolve()
    store = base / "store"
    config = load_config(args.config, overrides=[f"nvme.dirs={store}", *args.overrides])
    _fresh_demo_folder(store, base / "run")
    # The raw tier has no index: beside the daemon's store, never in it (it would write over
    # a store's extents, and the daemon refuses a directory holding extents it has no index of).
    raw_dirs = [Path(d) / "infinity-demo-raw" for d in config.nvme.dirs]
    for raw in raw_dirs:
        raw.mkdir(exist_ok=True)
    raw_config = dataclasses.replace(
        config, nvme=dataclasses.replace(config.nvme, dirs=tuple(str(d) for d in raw_dirs)))
    console.rule("[bold]Infinity demo")
    try:
        report: dict[str, object] = {"io": io_part(raw_config, args.io_bytes, console)}
    finally:
        for raw in raw_dirs:
            shutil.rmtree(raw, ignore_errors=True)
    from infinity.cli import demo_daemon

    report["daemon"] = demo_daemon.daemon_part(config, base / "run", console)
    if args.train_steps > 0:
        from infinity.cli import demo_train

        train_store = base / "train-store"
        generate_store = base / "generate-store"
        model_dir = base / "trained-model"
        _fresh_demo_folder(train_store, base / "train-run")
        _fresh_demo_folder(generate_store, base / "generate-run")
        shutil.rmtree(model_dir, ignore_errors=True)
        try:
            report["train"] = trained = demo_train.train_part(
                config, base, console, steps=args.train_steps, save_dir=model_dir)
            shutil.rmtree(train_store, ignore_errors=True)
            from infinity.cli import demo_generate

            report["generate"] = generate = demo_generate.generate_part(
                config, base, console, model_dir=model_dir, prompt=demo_train.PROMPT,
                max_new_tokens=demo_train.SAMPLE_TOKENS, sample_seed=demo_train.SAMPLE_SEED)
            same = generate["generated"] == trained["generated"]
            generate["same_as_trainer"] = same
            console.print("the same line as the trainer's model wrote: "
                          + ("[bold green]yes" if same else "[bold red]no"))
        finally:
            shutil.rmtree(train_store, ignore_errors=True)
            shutil.rmtree(generate_store, ignore_errors=True)
            shutil.rmtree(model_dir, ignore_errors=True)
    print(json.dumps(report, indent=2))
    shutil.rmtree(store, ignore_errors=True)
    return 0

