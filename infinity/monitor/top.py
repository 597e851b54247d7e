"""`infinity-top`: the node's daemon at a glance (tiers, clients, prefetch, counters), drawn with rich.

Drawing only reads the collector's latest snapshot, so a slow or absent daemon
never freezes the screen; a missing value is shown as "-".
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
import time
from typing import Any, Sequence

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from infinity.config import MiB, load_config
from infinity.errors import InfinityError
from infinity.monitor.collector import Snapshot, StatsCollector


def _mib(value: Any) -> str:
    return f"{value / MiB:,.1f} MiB" if isinstance(value, (int, float)) else "-"


def _table(value: Any, key: str) -> dict[str, Any]:
    """value[key] when both are tables, else an empty one: a value missing or of another kind
    (an older or newer daemon) shows as "-", never as an error."""
    inner = value.get(key) if isinstance(value, dict) else None
    return inner if isinstance(inner, dict) else {}


def _rows(value: Any, key: str) -> list[dict[str, Any]]:
    inner = value.get(key) if isinstance(value, dict) else None
    return ([row for row in inner if isinstance(row, dict)] if isinstance(inner, (list, tuple))
            else [])


def render(snapshot: Snapshot) -> Group:
    if snapshot.error is not None:
        return Group(Text(f"infinityd: {snapshot.error}", style="yellow"))
    stats = snapshot.stats if isinstance(snapshot.stats, dict) else {}
    daemon = _table(stats, "daemon")
    # Data is never markup: a client's name or a path may hold brackets.
    head = Text.assemble(("infinityd", "bold"), f" {daemon.get('version', '-')}  pid "
                         f"{daemon.get('pid', '-')}  up {daemon.get('uptime_s', '-')} s  "
                         f"{daemon.get('runtime_dir', '-')}")
    tiers = Table(title="tiers")
    for column in ("tier", "used", "budget / capacity", "detail"):
        tiers.add_column(column)
    cpu = _table(_table(stats, "tiers"), "cpu")
    tiers.add_row("cpu", _mib(cpu.get("used_bytes")), _mib(cpu.get("budget_bytes")),
                  f"{cpu.get('num_segments', '-')} segments, {cpu.get('resident_tensors', '-')} resident")
    nvme = _table(stats, "tiers").get("nvme")
    if isinstance(nvme, dict):
        dirs = nvme.get("dirs")
        tiers.add_row("nvme", _mib(nvme.get("used_bytes")), _mib(nvme.get("capacity_bytes")),
                      f"{len(dirs) if isinstance(dirs, (list, tuple)) else '-'} directories")
    clients = Table(title="clients")
    for column in ("id", "name", "pid", "leases", "reservations", "idle s"):
        clients.add_column(column)
    for c in _rows(stats, "clients"):
        clients.add_row(*(Text(str(c.get(k, "-")))
                          for k in ("id", "name", "pid", "leases", "reservations", "idle_s")))
    parts: list[Any] = [head, tiers, clients]
    scheduler = stats.get("scheduler")
    if isinstance(scheduler, dict):
        parts.append(_scheduler_table(scheduler))
    counters = _table(stats, "counters")
    totals = Table(title="counters")
    totals.add_column("counter")
    totals.add_column("value")
    for key in ("requests", "items", "bytes_leased", "bytes_committed", "deferred_replies", "malformed"):
        totals.add_row(key, str(counters.get(key, "-")))
    parts.append(totals)
    return Group(*parts)


def _scheduler_table(scheduler: dict[str, Any]) -> Table:
    """One row per client stream: its trace, where it finds its data, and how long it waited."""
    bandwidth = scheduler.get("read_bandwidth_bytes_per_s")
    title = "prefetch" + (f" (disk reads at {_mib(bandwidth)}/s)" if bandwidth else "")
    table = Table(title=title)
    for column in ("namespace", "client", "state", "steps", "trace", "hits", "in flight",
                   "misses", "stall s", "lookahead"):
        table.add_column(column)
    for entry in _rows(scheduler, "clients"):
        totals = _table(entry, "totals")
        hits = (totals.get("prefetch_hits", 0) or 0) + (totals.get("resident_hits", 0) or 0)
        stall = totals.get("stall_s")
        table.add_row(Text(str(entry.get("namespace", "-"))), Text(str(entry.get("client", "-"))),
                      Text(str(entry.get("state", "-")) + ("" if entry.get("active") else " (gone)")),
                      str(totals.get("steps", "-")), str(entry.get("trace_entries", "-")),
                      str(hits), str(totals.get("inflight_hits", "-")),
                      str(totals.get("misses", "-")),
                      f"{stall:.3f}" if isinstance(stall, (int, float)) else "-",
                      _mib(entry.get("lookahead_bytes")))
    return table


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="infinity-top", description="Show what infinityd is doing.")
    parser.add_argument("--config", help="TOML config file (as for infinityd)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE",
                        help="override one setting, e.g. --set daemon.runtime_dir=/run/x (repeatable)")
    parser.add_argument("--once", action="store_true", help="print one snapshot and exit")
    parser.add_argument("--json", action="store_true", help="print one snapshot as JSON and exit")
    parser.add_argument("--interval-s", type=_positive_seconds, default=1.0,
                        help="between snapshots; where the output is not a terminal, each one is "
                             "printed below the last")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, overrides=args.overrides)
    except InfinityError as exc:
        print(f"infinity-top: {exc}", file=sys.stderr)
        return 2
    collector = StatsCollector(config, interval_s=args.interval_s)
    if args.json or args.once:
        snapshot = collector.poll_once()
        if args.json:
            print(json.dumps({"taken_at_s": snapshot.taken_at_s, "error": snapshot.error, "stats": snapshot.stats}))
        else:
            Console().print(render(snapshot))
        return 1 if snapshot.error else 0
    collector.start()
    try:
        if not sys.stdout.isatty():
            return _print_snapshots(collector, interval_s=args.interval_s)
        with Live(render(collector.wait_first(5.0)), refresh_per_second=4, screen=True) as live:
            while True:
                time.sleep(args.interval_s / 4)
                live.update(render(collector.latest()))
    except KeyboardInterrupt:
        return 0
    finally:
        collector.stop()


def _print_snapshots(collector: StatsCollector, *, interval_s: float) -> int:
    """Output to a pipe or a file: a full-screen display shows nothing there, so each new
    snapshot is printed below the last, once per interval, as `top -b` does."""
    snapshot = collector.wait_first(5.0)
    try:
        while True:
            # Drawn into a string first: rich handles a closed pipe itself, by exiting with 1.
            text = io.StringIO()
            Console(file=text, width=120).print(render(snapshot))
            sys.stdout.write(text.getvalue())
            sys.stdout.flush()
            time.sleep(interval_s)
            snapshot = collector.latest()
    except BrokenPipeError:  # the reader stopped reading (`infinity-top | head`): done
        # Python flushes stdout again at exit; on the closed pipe that would print an error.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
