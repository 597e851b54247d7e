"""infinity-top reads a real daemon's stats, and says in words when there is none."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import torch

from infinity.client.launch import settings_as_flags


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


def test_once_draws_the_tables(daemon: Any) -> None:
    result = run_top(daemon.config, "--once")
    assert result.returncode == 0
    assert "tiers" in result.stdout and "clients" in result.stdout


def test_absent_daemon_is_reported_not_raised(daemon: Any) -> None:
    daemon.stop()
    result = run_top(daemon.config, "--json")
    snapshot = json.loads(result.stdout)
    assert result.returncode == 1 and "no infinityd is running" in snapshot["error"]
