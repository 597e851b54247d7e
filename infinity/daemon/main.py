"""The `infinityd` command: run (foreground), start (background), stop, status.

    infinityd run    [--config PATH] [--set table.key=value ...]   serve here, logs on stderr
    infinityd start  [...]   serve in the background; returns once the daemon answers
    infinityd stop   [...] [--force]   clean shutdown (leases dropped, memory returned);
                             refused while clients are attached, unless --force
    infinityd status [...] [--json]   version, tiers, clients

Settings come only from `infinity.config.load_config`. Exit status: 0 done,
1 error, 3 `status`/`stop` found no daemon, 4 `stop` refused (clients attached).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import sys
from typing import Any, Callable

from infinity.config import InfinityConfig, load_config
from infinity.errors import DaemonUnavailableError, InfinityError
from infinity.protocol.paths import RuntimeLayout

NOT_RUNNING = 3
STOP_REFUSED = 4


def _run(config: InfinityConfig, args: argparse.Namespace) -> int:
    from infinity.daemon import lifecycle
    from infinity.daemon.server import Daemon

    layout = RuntimeLayout(config.daemon.runtime_dir)
    logging.basicConfig(
        level=config.daemon.log_level.upper(), stream=sys.stderr,
        format="%(asctime)s infinityd[%(process)d] %(levelname)s %(name)s: %(message)s")
    # Whatever the daemon creates (runtime files, NVMe extent files, the index and its WAL,
    # markers, folders) is its user's alone unless said otherwise: a 0022 umask from a shell
    # would leave files that others may read.
    os.umask(0o077)
    lifecycle.prepare_runtime_dir(layout)
    open_files = lifecycle.raise_open_file_limit()
    if open_files < lifecycle.OPEN_FILES_FEW:
        logging.getLogger("infinityd").warning(
            "at most %d open files (the hard limit): every client thread's socket and every "
            "client's pidfd and fd channel is one, so a few hundred clients may exhaust them; "
            "raise it (ulimit -Hn, LimitNOFILE= in the systemd unit)", open_files)
    lock = lifecycle.RuntimeLock(layout)
    lock.acquire()
    daemon: Daemon | None = None
    try:
        daemon = Daemon(config, layout, secret=lifecycle.daemon_secret(layout))
        daemon.bind()
        # The loop allocates a few short-lived, acyclic objects per request: collect cycles
        # rarely, and never walk the long-lived startup objects again.
        gc.freeze()
        gc.set_threshold(50_000, 50, 100)
        stop = daemon.stop
        signal.signal(signal.SIGTERM, lambda *_: stop())
        signal.signal(signal.SIGINT, lambda *_: stop())
        if args.ready_fd is not None:
            os.write(args.ready_fd, lifecycle.READY_MESSAGE)
            os.close(args.ready_fd)
        daemon.run()
        logging.getLogger("infinityd").info("stopping")
    finally:
        if daemon is not None:
            daemon.close()
        lock.release()
    return 0


def _start(config: InfinityConfig, args: argparse.Namespace) -> int:
    from infinity.daemon import lifecycle

    layout = RuntimeLayout(config.daemon.runtime_dir)
    layout.check()
    lifecycle.prepare_runtime_dir(layout)
    with lifecycle.start_lock(layout, timeout_s=config.daemon.start_timeout_s):
        if layout.daemon_running():  # started by whoever held the start lock before this
            print(f"infinityd is already running (pid {layout.read_pid()}) at {layout.root}")
            return 0
        run_args: list[str] = []
        if args.config:
            run_args += ["--config", args.config]
        for override in args.overrides:
            run_args += ["--set", override]
        pid = lifecycle.start_background(layout, run_args, timeout_s=config.daemon.start_timeout_s)
    print(f"infinityd started (pid {pid}) at {layout.root}; log: {layout.log_path}")
    return 0


def _stop(config: InfinityConfig, args: argparse.Namespace) -> int:
    from infinity.client.admin import shutdown_daemon
    from infinity.daemon import lifecycle

    layout = RuntimeLayout(config.daemon.runtime_dir)
    layout.check()
    if not layout.daemon_running():
        print(f"infinityd is not running at {layout.root}")
        return NOT_RUNNING
    pid = layout.read_pid()
    refusal = None if args.force else _clients_attached(config)
    if refusal is not None:
        print(f"infinityd stop: {refusal}", file=sys.stderr)
        return STOP_REFUSED
    try:
        shutdown_daemon(config)
    except DaemonUnavailableError:
        if pid is None:
            raise
        lifecycle.terminate(pid, config.daemon.start_timeout_s)  # it does not answer: signal it
    if pid is not None and not lifecycle.wait_for_exit(pid, config.daemon.start_timeout_s):
        raise DaemonUnavailableError(f"infinityd (pid {pid}) did not stop within "
                                     f"{config.daemon.start_timeout_s:g}s; kill it with kill -9 {pid}")
    print(f"infinityd stopped{f' (pid {pid})' if pid else ''}")
    return 0


def _clients_attached(config: InfinityConfig) -> str | None:
    """Why not to stop now, or None. Stopping drops every client's session, leases and
    unflushed tensors: a trainer still running would fail. So `stop` names the clients attached
    and stops only with --force; the project's own tools (infinity-top, `infinityd status`) do
    not count. (One that connects between this check and the stop is dropped all the same.)"""
    from infinity.client.admin import TOOL_CLIENT_NAMES, daemon_stats

    try:
        clients = daemon_stats(config)["clients"]
    except DaemonUnavailableError:
        return None  # it does not answer: `stop` signals it, as before
    others = [c for c in clients
              if c.get("pid") != os.getpid() and c.get("name") not in TOOL_CLIENT_NAMES]
    if others:
        names = ", ".join(f"{c.get('name')} (pid {c.get('pid')})" for c in others[:5])
        more = f" and {len(others) - 5} more" if len(others) > 5 else ""
        return (f"{len(others)} client(s) attached: {names}{more}; stopping would drop their "
                f"sessions and leases. Stop them first (flush what you want to keep), or pass "
                f"--force")
    return None


def _human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{n} B"
        value /= 1024
    return f"{n} B"


def format_status(stats: dict[str, Any]) -> str:
    d, cpu, cat = stats["daemon"], stats["tiers"]["cpu"], stats["catalog"]
    lines = [
        f"infinityd {d['version']} (protocol {d['protocol']}), pid {d['pid']}, "
        f"up {d['uptime_s']:.1f}s, runtime folder {d['runtime_dir']}",
        f"CPU tier: {_human_bytes(cpu['used_bytes'])} used of {_human_bytes(cpu['budget_bytes'])} "
        f"budget; {cpu['num_segments']} segment(s) holding {_human_bytes(cpu['allocated_bytes'])}",
        *([f"NVMe tier: {_human_bytes(nvme['used_bytes'])} used of "
           f"{_human_bytes(nvme['capacity_bytes'])} in {len(nvme['dirs'])} dir(s); "
           f"{nvme['durable_tensors']} durable tensor(s); "
           f"{stats['counters']['tiers']['evictions']} eviction(s), "
           f"{stats['counters']['tiers']['reloads']} reload(s)"]
          if (nvme := stats["tiers"].get("nvme")) else []),
        f"catalog: {cat['num_tensors']} tensor(s), {_human_bytes(cat['tensor_bytes'])} in "
        f"{len(cat['namespaces'])} namespace(s); {cat['num_leases']} lease(s), "
        f"{cat['num_reservations']} reservation(s)",
        f"clients: {len(stats['clients'])}",
    ]
    for c in stats["clients"]:
        lines.append(f"  #{c['id']} {c['name']} pid {c['pid']}: {c['leases']} lease(s), "
                     f"{c['reservations']} reservation(s), {c['requests']} request(s), "
                     f"idle {c['idle_s']:.1f}s")
    return "\n".join(lines)


def _status(config: InfinityConfig, args: argparse.Namespace) -> int:
    from infinity.client.admin import daemon_stats

    layout = RuntimeLayout(config.daemon.runtime_dir)
    layout.check()
    if not layout.daemon_running():
        print(f"infinityd is not running at {layout.root}")
        return NOT_RUNNING
    stats = daemon_stats(config)
    print(json.dumps(stats, indent=2, sort_keys=True) if args.json else format_status(stats))
    return 0


COMMANDS: dict[str, Callable[[InfinityConfig, argparse.Namespace], int]] = {
    "run": _run, "start": _start, "stop": _stop, "status": _status}


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", metavar="PATH", help="TOML settings file")
    common.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="TABLE.KEY=VALUE", help="override one setting (repeatable)")
    parser = argparse.ArgumentParser(
        prog="infinityd", description="The Infinity node daemon: a shared tensor store.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", parents=[common], help="serve in the foreground, logs on stderr")
    run.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    commands.add_parser("start", parents=[common],
                        help="serve in the background; returns once the daemon answers")
    stop = commands.add_parser("stop", parents=[common],
                               help="stop the daemon cleanly (refused while clients are attached)")
    stop.add_argument("--force", action="store_true",
                      help="stop even while clients are attached (their sessions are dropped)")
    status = commands.add_parser("status", parents=[common], help="version, tiers and clients")
    status.add_argument("--json", action="store_true", help="print the full stats as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.config, overrides=args.overrides)
        return COMMANDS[args.command](config, args)
    except InfinityError as exc:
        print(f"infinityd {args.command}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the runtime folder's files: read-only, full, gone
        print(f"infinityd {args.command}: {exc.strerror} ({exc.filename}); check "
              f"daemon.runtime_dir, or choose another", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"infinityd {args.command}: interrupted"
              + ("; the daemon may still be starting (infinityd status)"
                 if args.command == "start" else ""), file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
