"""`infinity demo`, the README's main job, end to end on a small size."""

import fcntl
import json
import os
import re
import subprocess
import sys

from infinity.protocol.paths import RuntimeLayout


def test_demo_moves_data_through_the_tier_and_the_daemon(disk_tmp: str) -> None:
    # What an interrupted earlier run left in the demo's own (marked) store folder.
    os.makedirs(os.path.join(disk_tmp, "store"))
    with open(os.path.join(disk_tmp, "store", ".infinity-demo"), "wb"):
        pass
    with open(os.path.join(disk_tmp, "store", "infinity-extents.dat"), "wb") as f:
        f.write(bytes(4096))
    result = subprocess.run(
        [sys.executable, "-m", "infinity.cli.main", "demo", "--dir", disk_tmp, "--io-bytes", str(128 << 20),
         "--train-steps", "3"],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "HOME": disk_tmp, "INFINITY_CONFIG": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["io"]["verified"] is True and report["io"]["tensors"] == 2
    # The progress bars show the speeds the report gives (the disk's, not the bars' pace).
    shown = [float(x) for x in re.findall(r"disk (\d+\.\d+) GB/s", result.stderr)]
    for key in ("write_gbps", "read_gbps"):
        assert any(abs(speed - report["io"][key]) <= 0.006 for speed in shown), (key, shown)
    assert report["daemon"] == {"tensors": 37, "bit_exact": True, "zero_copy": True,
                                "cpu_budget_bytes": 512 << 20}  # the demo's, smaller than the default
    assert not RuntimeLayout(os.path.join(disk_tmp, "run")).daemon_running()  # the demo stopped it
    # Training with the state on NVMe: the state was larger than the CPU tier and moved through
    # the disk, the loss is a number, and the curve was drawn (braille), not printed as a column.
    train = report["train"]
    assert train["steps"] == 3 and train["state_bytes"] >= 4 * train["cpu_budget_bytes"] * 0.9
    assert train["nvme_read_bytes"] > 0 and train["nvme_written_bytes"] > 0
    assert 0 < train["last_loss"] < 10
    assert "training loss" in result.stderr and any(0x2801 <= ord(c) <= 0x28FF for c in result.stderr)
    assert not RuntimeLayout(os.path.join(disk_tmp, "train-run")).daemon_running()
    # Generating: the trained model, imported, wrote the trainer's line with most of its weights
    # on NVMe, and the daemon is stopped.
    generate = report["generate"]
    assert generate["same_as_trainer"] is True and generate["tokens"] > 0
    assert generate["weight_bytes"] >= 2 * generate["cpu_budget_bytes"]
    assert generate["nvme_read_bytes"] > 0
    assert not RuntimeLayout(os.path.join(disk_tmp, "generate-run")).daemon_running()


def test_demo_keeps_a_cpu_tier_the_user_set(disk_tmp: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "infinity.cli.main", "demo", "--dir", disk_tmp, "--io-bytes", str(64 << 20),
         "--train-steps", "0",
         "--set", f"cpu.budget_bytes={134 << 20}", "--set", f"cpu.segment_bytes={32 << 20}"],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "HOME": disk_tmp, "INFINITY_CONFIG": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["daemon"]["cpu_budget_bytes"] == 134 << 20


def test_demo_refuses_a_store_folder_it_did_not_make_and_leaves_it_alone(disk_tmp: str) -> None:
    store = os.path.join(disk_tmp, "store")
    os.makedirs(store)
    precious = os.path.join(store, "infinity-index.sqlite")
    with open(precious, "wb") as f:
        f.write(b"someone's store")
    result = subprocess.run(
        [sys.executable, "-m", "infinity.cli.main", "demo", "--dir", disk_tmp],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "HOME": disk_tmp, "INFINITY_CONFIG": ""})
    assert result.returncode == 2 and "did not make" in result.stderr
    with open(precious, "rb") as f:
        assert f.read() == b"someone's store"


def test_demo_leaves_its_store_alone_while_a_daemon_still_serves_it(disk_tmp: str) -> None:
    store = os.path.join(disk_tmp, "store")
    os.makedirs(store)
    for name in (".infinity-demo", "infinity-extents.dat"):
        with open(os.path.join(store, name), "wb") as f:
            f.write(b"x" * 4096)
    lock = os.open(os.path.join(store, "infinity-store.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)  # as an earlier demo's daemon, still running, holds it
    try:
        result = subprocess.run(
            [sys.executable, "-m", "infinity.cli.main", "demo", "--dir", disk_tmp],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "HOME": disk_tmp, "INFINITY_CONFIG": ""})
    finally:
        os.close(lock)
    assert result.returncode == 2 and "still serves" in result.stderr
    assert os.path.getsize(os.path.join(store, "infinity-extents.dat")) == 4096


def test_the_demos_smaller_tier_never_falls_below_a_segment_the_user_set() -> None:
    from infinity.cli.demo_daemon import demo_cpu_tier
    from infinity.config import CpuTierConfig

    assert demo_cpu_tier(CpuTierConfig()) == CpuTierConfig(budget_bytes=512 << 20, segment_bytes=64 << 20)
    big_segments = demo_cpu_tier(CpuTierConfig(segment_bytes=1 << 30))
    assert big_segments.segment_bytes == 1 << 30 and big_segments.budget_bytes == 1 << 30
