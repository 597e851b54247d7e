"""Starting a private infinityd for a benchmark (settings as --set flags, wait for its ready fd),
and stopping it."""

from __future__ import annotations

import argparse
import os
import select
import subprocess
import sys
from typing import Any

from infinity.config import InfinityConfig, MiB, load_config
from infinity.protocol.paths import child_environment


def add_daemon_arguments(parser: argparse.ArgumentParser, *, set_example: str) -> None:
    """--soak-bytes and --set, as every benchmark that starts a daemon takes them."""
    parser.add_argument("--soak-bytes", default="auto",
                        help="memory taken (and held) before anything else: a size, 0 for none, "
                             "or auto (the free blocks of 64 KiB and less, see bench_store.py)")
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE",
                        help=f"a daemon setting, e.g. {set_example} (repeatable)")


def typed_settings(texts: list[str]) -> dict[str, Any]:
    """`--set table.key=value` texts as {"table.key": value}, validated and in the settings' own
    types, to merge into `start_daemon`'s settings."""
    typed = load_config(env={}, overrides=texts)
    keys = (text.split("=", 1)[0].strip() for text in texts)
    return {key: getattr(getattr(typed, key.split(".")[0]), key.split(".")[1]) for key in keys}


def store_daemon_settings(root: str, name: str, *, cpu_budget_bytes: int,
                          nvme_capacity_bytes: int, prefetch: bool,
                          extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The settings of a benchmark daemon called `name` under `root`: a CPU tier of
    `cpu_budget_bytes` (segments of at most 256 MiB) before one store directory, which this
    creates; `extra` (from --set) overrides all but the prefetch switch."""
    os.makedirs(os.path.join(root, name, "store"))
    return {
        "daemon.runtime_dir": os.path.join(root, name, "rt"),
        "daemon.log_level": "warning",
        "daemon.request_timeout_s": 120.0,
        "cpu.budget_bytes": cpu_budget_bytes,
        "cpu.segment_bytes": min(256 * MiB, cpu_budget_bytes),
        "nvme.dirs": [os.path.join(root, name, "store")],
        "nvme.capacity_bytes_per_dir": nvme_capacity_bytes,
        **(extra or {}),
        "scheduler.prefetch": prefetch,
    }


def start_daemon(folder: str, settings: dict[str, Any]) -> tuple[subprocess.Popen[bytes], InfinityConfig]:
    settings_file = os.path.join(folder, "bench.toml")
    with open(settings_file, "w") as f:
        f.write("# benchmark settings come from --set flags\n")
    config = load_config(settings_file, env={}, overrides=settings)
    flags = [a for k, v in settings.items()
             for a in ("--set", f"{k}={','.join(v) if isinstance(v, list) else v}")]
    read_end, write_end = os.pipe()
    env = {k: v for k, v in child_environment().items() if not k.startswith("INFINITY_")}
    with open(os.path.join(folder, "infinityd.log"), "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "infinity.daemon.main", "run", "--ready-fd", str(write_end),
             "--config", settings_file, *flags],
            stdout=log, stderr=log, pass_fds=(write_end,), env=env)
    os.close(write_end)
    ready, _, _ = select.select([read_end], [], [], 60)
    message = os.read(read_end, 64) if ready else b""
    os.close(read_end)
    if message != b"ready\n":
        process.kill()
        raise SystemExit(f"infinityd did not start; see {folder}/infinityd.log")
    return process, config


def stop_daemon(client: Any, daemon: subprocess.Popen[bytes] | None, *,
                wait_s: float = 60.0) -> None:
    """Ask a benchmark's daemon to shut down through `client` (then closed), wait for it to exit
    (its shutdown writes its index), and kill it if it does not within `wait_s`."""
    if client is not None:
        try:
            client.shutdown_daemon()
        except Exception:  # the daemon gone already: the wait below says so
            pass
        client.close()
    if daemon is not None:
        try:
            daemon.wait(wait_s)
        except Exception:
            daemon.kill()
            daemon.wait(10)


def daemon_figures(pid: int) -> dict[str, int]:
    """A running daemon's resident and anonymous memory and its open files (/proc), as the
    reliability tools sample them."""
    figures = {"rss_bytes": 0, "anon_bytes": 0}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(("VmRSS:", "RssAnon:")):
                key = "rss_bytes" if line.startswith("VmRSS:") else "anon_bytes"
                figures[key] = int(line.split()[1]) * 1024
    return {**figures, "open_files": len(os.listdir(f"/proc/{pid}/fd"))}
