"""infinity-top full screen in a real terminal: tmux runs it at 80x24 against a live daemon that
two clients load; the screen is read with `capture-pane`. Plus the frame itself at several
sizes (pure: no terminal)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from typing import Any

import pytest
import torch

from conftest import clean_environment, start_daemon_process, wait_until
from infinity.client.launch import settings_as_flags
from infinity.monitor.collector import BandwidthSample, Snapshot
from infinity.monitor.screen import SORTS, frame

TMUX = shutil.which("tmux")
SETTINGS = {"telemetry.interval_s": 0.25}


class Terminal:
    """A detached tmux session of its own server (its own socket), 80x24, running `command`."""

    def __init__(self, root: str, command: str) -> None:
        self.base = [str(TMUX), "-S", os.path.join(root, "tmux.sock"), "-f", "/dev/null"]
        self.env = {**clean_environment(), "TERM": "xterm-256color"}
        self._tmux("new-session", "-d", "-s", "top", "-x", "80", "-y", "24", command)

    def _tmux(self, *args: str) -> str:
        return subprocess.run([*self.base, *args], env=self.env, capture_output=True, text=True,
                              check=True, timeout=30).stdout

    def screen(self) -> str:
        try:
            return self._tmux("capture-pane", "-p", "-t", "top")
        except subprocess.CalledProcessError:  # the session ended
            return ""

    def showing(self, predicate: Any, *, what: str) -> str:
        """The screen, once `predicate(screen)` holds (polled: the screen has no event to await)."""
        def screen() -> str | None:
            text = self.screen()
            return text if predicate(text) else None
        return str(wait_until(screen, timeout_s=30, what=what))

    def send(self, key: str) -> None:
        self._tmux("send-keys", "-t", "top", key)

    def close(self) -> None:
        subprocess.run([*self.base, "kill-server"], env=self.env, capture_output=True, timeout=30)


def load(client: Any, name: str, stop: threading.Event) -> None:
    """Puts and gets of 1 MiB until told to stop: traffic in every snapshot."""
    data = torch.ones(256 * 1024)
    while not stop.is_set():
        client.put(name, data)
        with client.get(name):
            pass
        stop.wait(0.01)  # pacing, so that the two CPUs are left to the daemon and top too


def read_rate(screen: str) -> float:
    """The current figure of the `read` sparkline, bytes per second (0 when not drawn)."""
    match = re.search(r"^read .*?([\d.]+) (B|KiB|MiB|GiB)/s", screen, re.MULTILINE)
    if match is None:
        return 0.0
    return float(match.group(1)) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[
        match.group(2)]


def fits(screen: str) -> bool:
    """Every line ends before the last column: nothing was cut by the terminal's edge."""
    lines = screen.splitlines()
    return len(lines) <= 24 and all(len(line.rstrip()) < 80 for line in lines)


@pytest.mark.skipif(TMUX is None, reason="tmux is not installed: this test drives infinity-top "
                                         "in a real terminal through tmux")
def test_top_in_a_terminal_follows_the_daemon_through_a_restart(daemon_factory: Any) -> None:
    daemon = daemon_factory(nvme_tier=True, **SETTINGS)
    status = os.path.join(daemon.root, "top-status")
    top = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "infinity.monitor.top",
                                             *settings_as_flags(daemon.config)])
    terminal = Terminal(daemon.root, f"sh -c {shlex.quote(f'{top}; echo $? > {status}')}")
    stop = threading.Event()
    clients = [daemon.connect("loader-one"), daemon.connect("loader-two")]
    threads = [threading.Thread(target=load, args=(c, f"t{i}", stop))
               for i, c in enumerate(clients)]
    restarted = None
    try:
        for thread in threads:
            thread.start()
        screen = terminal.showing(lambda s: "loader-one" in s and "loader-two" in s
                                  and read_rate(s) > 0,
                                  what="both clients and a read rate on the screen")
        assert re.search(r"^cpu +\[", screen, re.MULTILINE)
        assert re.search(r"^nvme +\[", screen, re.MULTILINE)
        assert fits(screen), screen
        terminal.send("s")  # the next sort column
        terminal.showing(lambda s: f"sort: {SORTS[1]}" in s, what="the sort column to change")
        terminal.send("?")
        terminal.showing(lambda s: "this help" in s, what="the help")
        terminal.send("x")  # any key leaves it

        stop.set()
        for thread in threads:
            thread.join()
        for client in clients:
            client.close()
        daemon.stop()
        screen = terminal.showing(lambda s: "no infinityd is running" in s,
                                  what="the screen to say the daemon is gone")
        assert fits(screen), screen

        # The same runtime folder and store: the daemon comes back where top looks.
        restarted = start_daemon_process(daemon.root, **{
            "nvme.dirs": list(daemon.config.nvme.dirs), **SETTINGS})
        pid = restarted.process.pid
        screen = terminal.showing(lambda s: f"pid {pid}" in s and "cpu" in s,
                                  what="the restarted daemon's data on the screen")
        assert fits(screen), screen

        terminal.send("q")

        def exit_status() -> str | None:  # what the shell wrote once infinity-top ended
            if not os.path.exists(status):
                return None
            with open(status) as f:
                return f.read().strip() or None

        assert wait_until(exit_status, timeout_s=30, what="infinity-top to exit") == "0"
    finally:
        stop.set()
        terminal.close()
        if restarted is not None:
            restarted.stop()


STATS: dict[str, Any] = {
    "daemon": {"version": "0.1.0", "pid": 4321, "uptime_s": 90061, "protocol": 8,
               "requests_per_s": 12.0, "runtime_dir": "/run/user/1000/infinity",
               "settings": {"cpu_budget_bytes": 4 << 30, "nvme_dirs": ["/nvme0", "/nvme1"],
                            "io_backend": "io_uring", "io_queue_depth": 16, "prefetch": True}},
    "tiers": {"cpu": {"used_bytes": 3 << 30, "budget_bytes": 4 << 30, "leased_bytes": 1 << 20},
              "nvme": {"used_bytes": 1 << 30, "capacity_bytes": 128 << 30, "queue_depth": 0,
                       "dirs": [{"path": f"/nvme{i}/infinity", "used_bytes": 1 << 29,
                                 "capacity_bytes": 64 << 30} for i in range(2)]}},
    "scheduler": {"read_bandwidth_bytes_per_s": 2e9},
    "clients": [{"name": f"rank-{i}-of-a-job-with-a-very-long-name", "pid": 100 + i,
                 "resident_bytes": i << 20, "requests_per_s": float(i), "stall_s": 0.5,
                 "prefetch_hits": 3, "misses": 1, "namespaces": ["run"]} for i in range(30)],
}


@pytest.mark.parametrize("width,height", [(80, 24), (60, 16), (200, 60), (40, 10)])
def test_every_frame_fits_and_says_what_it_left_out(width: int, height: int) -> None:
    history = [BandwidthSample(float(i), 1e6 * i, 0.0, 0.0, 0.0) for i in range(90)]
    lines = [line.plain for line in frame(Snapshot(0.0, STATS), history, width=width,
                                          height=height)]
    assert len(lines) <= height and all(len(line) < width for line in lines)
    text = "\n".join(lines)
    assert "rank-29" in text or "…" in text  # a name is shortened, never cut silently
    if height >= 24:
        assert "more" in text or height >= 45  # the rows left out are counted


def test_sorting_by_name_puts_names_in_order() -> None:
    clients = [{"name": n, "resident_bytes": 1} for n in ("b", "c", "a")]
    lines = [line.plain for line in frame(Snapshot(0.0, {**STATS, "clients": clients}),
                                          width=80, height=24, sort="NAME")]
    names = [line.split()[0] for line in lines[lines.index("clients") + 2:-1]]
    assert names == ["a", "b", "c"]


@pytest.mark.parametrize("interval_s,source", [(0.2, "stream"), (0, "stats")])
def test_the_collector_takes_the_stream_or_asks_where_there_is_none(
        daemon_factory: Any, interval_s: float, source: str) -> None:
    from infinity.monitor.collector import TelemetryCollector

    daemon = daemon_factory(**{"telemetry.interval_s": interval_s})
    collector = TelemetryCollector(daemon.config, stale_after_s=0.5).start()
    try:
        def from_source() -> Snapshot | None:
            snapshot = collector.latest()
            return snapshot if snapshot.source == source and snapshot.error is None else None

        snapshot = wait_until(from_source, timeout_s=15, what=f"a snapshot from {source}")
        assert snapshot.stats["daemon"]["pid"] == daemon.process.pid
        assert collector.history()  # each snapshot's bandwidth is kept
    finally:
        collector.stop()


def test_a_large_terminal_also_shows_the_streams_and_the_recent_errors() -> None:
    stats = {**STATS, "clients": STATS["clients"][:2],
             "scheduler": {"clients": [{"namespace": "run", "client": "rank-0", "active": True,
                                        "state": "replaying", "trace_entries": 12,
                                        "totals": {"steps": 3, "misses": 1}}]},
             "recent_errors": [{"time_s": 1.7e9 + i, "code": "not_found", "client": "client 3",
                                "message": f"no tensor 'w{i}' in namespace 'default'; put or "
                                           f"reserve+commit it first"} for i in range(5)]}
    lines = [line.plain for line in frame(Snapshot(0.0, stats), width=80, height=40)]
    assert all(len(line) < 80 for line in lines) and len(lines) <= 40
    streams = lines.index("prefetch by stream")
    assert lines[streams + 2].split()[:5] == ["run", "rank-0", "replaying", "3", "12"]
    errors = lines.index("recent errors")
    assert "'w4'" in lines[errors + 1] and "'w0'" in lines[errors + 5]  # newest first
    # A message too long for the line ends after a whole word, with an ellipsis.
    full = "not_found client 3: no tensor 'w4' in namespace 'default'; put or reserve+commit"
    shown = lines[errors + 1].split(" ", 1)[1]  # after the clock
    assert shown.endswith("…") and full.startswith(shown[:-1]) and full[len(shown) - 1] == " "
