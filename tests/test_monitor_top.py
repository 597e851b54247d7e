"""infinity-top reads a real daemon's stats, and says in words when there is none; it and
`infinityd status` ask with one-off requests, without torch."""

from __future__ import annotations

import io
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
from rich.console import Console

from infinity.client.launch import settings_as_flags
from infinity.monitor.collector import Snapshot
from infinity.monitor.top import render


def run_top(config: Any, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from infinity.monitor.top import main; raise SystemExit(main())",
                           *flags, *settings_as_flags(config)], capture_output=True, text=True, timeout=60)


def test_json_snapshot_shows_clients_and_the_cpu_tier(daemon: Any, client: Any) -> None:
    client.put("w", torch.ones(1001))
    result = run_top(daemon.config, "--json")
    snapshot = json.loads(result.stdout)
    assert result.returncode == 0 and snapshot["error"] is None
    assert "pytest" in {c["name"] for c in snapshot["stats"]["clients"]}
    assert snapshot["stats"]["tiers"]["cpu"]["used_bytes"] >= 4004


def imported_modules(importtime_report: str) -> set[str]:
    """The modules a `python -X importtime` run imported, from its report on stderr."""
    return {line.rsplit("|", 1)[1].strip() for line in importtime_report.splitlines()
            if line.startswith("import time:") and "|" in line}


def torch_modules(modules: set[str]) -> set[str]:
    return {name for name in modules if name == "torch" or name.startswith("torch.")}


def test_json_snapshot_is_a_one_off_request_that_imports_no_torch(daemon: Any, client: Any) -> None:
    client.put("w", torch.ones(3))
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "infinity.monitor.top", "--json",
                             *settings_as_flags(daemon.config)], capture_output=True, text=True, timeout=60)
    snapshot = json.loads(result.stdout)
    assert result.returncode == 0 and snapshot["error"] is None
    assert snapshot["stats"]["catalog"]["num_tensors"] == 1
    imported = imported_modules(result.stderr)
    assert "infinity.monitor.collector" in imported  # the report was read
    assert torch_modules(imported) == set()


def test_the_data_api_imports_neither_the_ui_nor_torch() -> None:
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", "import infinity.monitor.collector"],
                            capture_output=True, text=True, timeout=60)
    imported = imported_modules(result.stderr)
    assert result.returncode == 0 and "infinity.client.admin" in imported
    assert torch_modules(imported) == set()
    assert {name for name in imported if name == "rich" or name.startswith("rich.")
            or name == "infinity.monitor.top"} == set()


def test_infinityd_status_is_a_one_off_request_that_imports_no_torch(daemon: Any) -> None:
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "infinity.daemon.main", "status",
                             "--json", *settings_as_flags(daemon.config)],
                            capture_output=True, text=True, timeout=60)
    report = json.loads(result.stdout)
    assert result.returncode == 0 and report["daemon"]["pid"] == daemon.process.pid
    imported = imported_modules(result.stderr)
    assert "infinity.client.admin" in imported  # the report was read
    assert torch_modules(imported) == set()


def test_once_draws_the_tables(daemon: Any) -> None:
    result = run_top(daemon.config, "--once")
    assert result.returncode == 0
    assert "tiers" in result.stdout and "clients" in result.stdout


def test_absent_daemon_is_reported_not_raised(daemon: Any) -> None:
    daemon.stop()
    result = run_top(daemon.config, "--json")
    snapshot = json.loads(result.stdout)
    assert result.returncode == 1 and "no infinityd is running" in snapshot["error"]


def drawn(stats: dict[str, Any]) -> str:
    console = Console(file=io.StringIO(), width=200)
    console.print(render(Snapshot(0.0, stats=stats)))
    return console.file.getvalue()  # type: ignore[attr-defined]


def test_the_nvme_row_counts_the_daemons_directories(nvme_daemon: Any) -> None:
    client = nvme_daemon.connect("top")
    assert re.search(r"^nvme .* dirs 1 ", drawn(client.stats()), re.MULTILINE)
    client.close()


@pytest.mark.parametrize("stats", [
    {"daemon": None, "tiers": None, "clients": None, "counters": None},
    {"tiers": {"cpu": None, "nvme": {"dirs": None}}, "clients": [None, "x", {"name": 3}]},
    {"scheduler": {"clients": [{"totals": None}, None]}},
    {},
])
def test_values_missing_or_of_another_kind_are_drawn_as_dashes(stats: dict[str, Any]) -> None:
    assert "-" in drawn(stats)  # nothing raised


@pytest.mark.parametrize("interval", ["-1", "0", "nan", "inf", "soon"])
def test_an_interval_that_is_not_a_positive_number_is_refused_with_a_usage_error(
        daemon: Any, interval: str) -> None:
    result = run_top(daemon.config, "--interval-s", interval)
    assert result.returncode == 2 and "is not a positive number of seconds" in result.stderr


def test_a_client_name_with_brackets_is_drawn_as_text(daemon: Any) -> None:
    named = daemon.connect("trainer[/]")
    try:
        result = run_top(daemon.config, "--once")
    finally:
        named.close()
    assert result.returncode == 0, result.stderr
    assert "trainer[/]" in result.stdout


def test_stopping_the_collector_does_not_wait_for_a_hung_daemon(daemon: Any) -> None:
    import dataclasses
    import signal
    import time

    from infinity.monitor.collector import STOP_WAIT_S, StatsCollector

    patient = dataclasses.replace(daemon.config, daemon=dataclasses.replace(
        daemon.config.daemon, request_timeout_s=30.0))
    collector = StatsCollector(patient, interval_s=0.05)
    collector.start()
    daemon.process.send_signal(signal.SIGSTOP)  # its next poll waits for an answer
    try:
        time.sleep(0.3)  # six poll intervals: one is under way (no event says so from outside)
        started = time.monotonic()
        collector.stop()
        assert time.monotonic() - started < STOP_WAIT_S + 2  # not the 30 s a poll may wait
    finally:
        daemon.process.send_signal(signal.SIGCONT)


def _start_top(config: Any, *flags: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "from infinity.monitor.top import main; raise SystemExit(main())",
                             *flags, *settings_as_flags(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _read_until(top: subprocess.Popen[bytes], text: bytes, count: int, timeout_s: float = 30.0) -> bytes:
    """What top printed until `text` showed `count` times (or the time ran out)."""
    assert top.stdout is not None
    seen = b""
    deadline = time.monotonic() + timeout_s
    while seen.count(text) < count and time.monotonic() < deadline:
        if select.select([top.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(top.stdout.fileno(), 65536)
            if not chunk:
                break
            seen += chunk
    return seen


def test_into_a_pipe_it_prints_a_snapshot_per_interval_until_interrupted(daemon: Any) -> None:
    top = _start_top(daemon.config, "--interval-s", "0.05")
    printed = _read_until(top, b"tiers", 2)  # a full-screen display would print nothing here
    top.send_signal(signal.SIGINT)
    _, stderr = top.communicate(timeout=30)
    assert printed.count(b"tiers") >= 2 and top.returncode == 0, stderr


def test_a_reader_that_stops_reading_ends_it_quietly(daemon: Any) -> None:
    top = _start_top(daemon.config, "--interval-s", "0.05")
    assert top.stdout is not None and top.stderr is not None
    assert b"tiers" in _read_until(top, b"tiers", 1)
    top.stdout.close()  # as `infinity-top | head -1` does
    assert top.wait(timeout=30) == 0
    assert top.stderr.read() == b""


def test_json_agrees_with_the_daemons_own_stats(daemon: Any, client: Any) -> None:
    client.put("w", torch.ones(4096))
    result = run_top(daemon.config, "--json")
    shown = json.loads(result.stdout)["stats"]
    own = client.stats()
    assert shown["catalog"] == own["catalog"]
    for key in ("used_bytes", "budget_bytes", "leased_bytes", "written_bytes"):
        assert shown["tiers"]["cpu"][key] == own["tiers"]["cpu"][key]
    assert shown["daemon"]["pid"] == own["daemon"]["pid"] == daemon.process.pid
    assert {c["name"] for c in shown["clients"]} - {"infinity-top"} == \
        {c["name"] for c in own["clients"]} - {"infinity-top"} == {"pytest"}
    me = next(c for c in shown["clients"] if c["name"] == "pytest")
    assert me["commit_bytes"] == 16384 and list(me["namespaces"]) == ["default"]
