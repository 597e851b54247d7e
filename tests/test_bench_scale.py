"""tools/bench_scale.py keeps working: its `--quick` run trains a tiny Llama through a private
infinityd and reports every figure the full run reports, and leaves nothing on disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parent.parent / "tools" / "bench_scale.py"


def test_the_quick_run_reports_steps_io_bound_and_peak_memory(disk_tmp: str) -> None:
    done = subprocess.run([sys.executable, str(TOOL), "--quick", "--dir", disk_tmp],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["quick"] is True
    parameters = report["model"]["parameters"]
    assert report["build"]["parameters"] == parameters
    assert report["build"]["dtype"] == "bfloat16"
    assert report["state"]["bytes"] == 18 * parameters
    assert sum(report["state"]["by_kind"].values()) == report["state"]["bytes"]
    steps = report["steps"]
    assert len(steps["seconds"]) == len(steps["losses"]) == 3
    assert all(s > 0 for s in steps["seconds"])
    assert steps["median_s"] == sorted(steps["seconds"])[1]
    moved = report["disk_bytes_per_step"]
    assert {"read_bytes", "write_bytes", "tier_read_bytes", "tier_write_bytes"} <= set(moved)
    assert {"evictions", "reloads", "space_waits"} <= set(report["tier_events_per_step"])
    assert report["engine"]["read_gbps"] > 0 and report["engine"]["overwrite_gbps"] > 0
    assert report["io_bound_s"] >= 0 and "step_over_io_bound" in report
    for phase in ("build", "steps"):
        for process in ("trainer", "daemon"):
            assert report["rss_peaks"][phase][process]["rss_bytes"] > 0
    assert report["machine"]["ram_bytes"] > 0
    assert 0 <= report["cpu_during_steps"]["machine_busy_fraction"]
    assert os.listdir(disk_tmp) == []  # the store, the logs and the bandwidth files are gone
