"""tools/fuzz.py and tools/soak.py keep working, each on a short run: the fuzz's frames leave the
daemon serving with every reference tensor intact, the soak's killed clients find every tensor
their ledger says was acknowledged, through eviction to NVMe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def run_tool(name: str, *args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, str(TOOLS / name), *args], capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def test_a_short_fuzz_leaves_the_daemon_serving_and_every_reference_tensor_intact(
        disk_tmp: str) -> None:
    report = run_tool("fuzz.py", "--frames", "3000", "--references", "37", "--sample-every",
                      "300", "--dir", disk_tmp)
    assert report["daemon_alive"]
    assert report["references_lost"] == report["references_wrong"] == 0
    assert all(count > 0 for count in report["frames_by_kind"].values())
    assert report["malformed_counted"] > 1000  # the frames reached the decoder, and failed there
    assert report["open_files_growth"] == 0
    assert os.listdir(disk_tmp) == []


def test_a_short_soak_loses_nothing_through_kills_and_eviction(disk_tmp: str) -> None:
    # --min-kills: on a busy machine the four clients (each importing torch) can take the whole
    # 8 s to start, and a client is killed only once past its start check.
    report = run_tool("soak.py", "--duration-s", "8", "--kill-every-s", "1", "--min-kills", "2",
                      "--cpu-budget-mib", "4", "--dir", disk_tmp)
    assert report["daemon_alive"] and report["worker_failures"] == 0, report
    assert report["kills"] >= 2, report
    assert report["checked"] > 0, report
    assert report["lost"] == report["wrong"] == report["wrong_reads"] == 0
    assert report["tier_counters"]["evictions"] > 0 and report["tier_counters"]["reloads"] > 0
    assert os.listdir(disk_tmp) == []
