"""`infinity-top`: the node's daemon at a glance, full screen, as `htop` shows a machine.

Tier usage bars, bandwidth over the last minute, prefetch hit rate and stall
time, a sortable client table, and the daemon's version, uptime and set-up
(`infinity.monitor.screen` draws them). A collector thread receives the daemon's
telemetry snapshots (`infinity.monitor.collector`), so drawing never waits on
the daemon; when none runs the screen says so, and the data comes back with
it. Keys, read in cbreak mode: q quits, s sorts by the next column, ? helps.

Not on a terminal: `--once` prints one frame, `--json` one snapshot (the
daemon's `stats`), and output into a pipe gets a frame per interval, one below
the other, as `top -b` does.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import select
import sys
import termios
import time
import tty
from typing import Any, Sequence

from rich.console import Console
from rich.live import Live
from rich.text import Text

from infinity.config import InfinityConfig, load_config
from infinity.errors import InfinityError
from infinity.monitor.collector import Snapshot, StatsCollector, TelemetryCollector
from infinity.monitor.screen import SORTS, frame, render_text

KEY_WAIT_S = 0.25  # how long the screen waits for a key before looking for a new snapshot
REDRAW_S = 1.0  # a frame at least this often (the uptime moves) even if nothing else did
ONCE_HEIGHT = 200  # --once and the pipe: a frame this tall at most (clients beyond are counted)


def render(snapshot: Snapshot, *, width: int = 120) -> Text:
    """One frame of `snapshot` for printing (no bandwidth history: one snapshot has none)."""
    return render_text(frame(snapshot, width=width, height=ONCE_HEIGHT))


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
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.add_argument("--json", action="store_true", help="print one snapshot as JSON and exit")
    parser.add_argument("--interval-s", type=_positive_seconds, default=1.0,
                        help="where the output is not a terminal, a frame is printed this often, "
                             "each below the last")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, overrides=args.overrides)
    except InfinityError as exc:
        print(f"infinity-top: {exc}", file=sys.stderr)
        return 2
    if args.json or args.once:
        snapshot = StatsCollector(config).poll_once()
        if args.json:
            print(json.dumps({"taken_at_s": snapshot.taken_at_s, "error": snapshot.error, "stats": snapshot.stats}))
        else:
            console = Console()
            console.print(render(snapshot, width=console.width))
        return 1 if snapshot.error else 0
    try:
        if not sys.stdout.isatty():
            return _print_snapshots(config, interval_s=args.interval_s)
        return _full_screen(config)
    except KeyboardInterrupt:
        return 0


def _full_screen(config: InfinityConfig) -> int:
    collector = TelemetryCollector(config).start()
    keys = sys.stdin.fileno() if sys.stdin.isatty() else None
    saved = termios.tcgetattr(keys) if keys is not None else None
    try:
        if keys is not None:
            tty.setcbreak(keys)  # keys one by one, unechoed; Ctrl-C still interrupts
        console = Console()
        sort, help_shown = 0, False
        drawn: tuple[Any, ...] = ()
        drawn_at = 0.0
        with Live(console=console, screen=True, auto_refresh=False, transient=True) as live:
            while True:
                snapshot = collector.latest()
                state = (id(snapshot), console.size, sort, help_shown)
                if state != drawn or time.monotonic() - drawn_at >= REDRAW_S:
                    width, height = console.size
                    live.update(render_text(frame(snapshot, collector.history(), width=width,
                                                  height=height, sort=SORTS[sort],
                                                  help=help_shown)), refresh=True)
                    drawn, drawn_at = state, time.monotonic()
                if keys is None:
                    time.sleep(KEY_WAIT_S)
                    continue
                if not select.select([keys], [], [], KEY_WAIT_S)[0]:
                    continue
                key = os.read(keys, 1)
                if key in (b"q", b"Q"):
                    return 0
                if help_shown:  # any other key leaves the help
                    help_shown = False
                elif key == b"s":
                    sort = (sort + 1) % len(SORTS)
                elif key == b"?":
                    help_shown = True
    finally:
        if saved is not None and keys is not None:
            termios.tcsetattr(keys, termios.TCSADRAIN, saved)
        collector.stop()


def _print_snapshots(config: InfinityConfig, *, interval_s: float) -> int:
    """Output to a pipe or a file: a full-screen display shows nothing there, so each new
    snapshot is printed below the last, once per interval, as `top -b` does."""
    collector = StatsCollector(config, interval_s=interval_s).start()
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
    finally:
        collector.stop()


if __name__ == "__main__":
    sys.exit(main())
