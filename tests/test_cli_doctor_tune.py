"""`infinity doctor` reports what it finds; `infinity tune` writes settings the loader then applies."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from infinity.config import load_config


def infinity_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "infinity.cli.main", *args], capture_output=True,
                          text=True, timeout=240, env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"})


def findings_by_area(stdout: str) -> dict[str, dict[str, str]]:
    return {f["area"]: f for f in json.loads(stdout)}


def test_doctor_reports_o_direct_on_a_real_disk(disk_tmp: str) -> None:
    result = infinity_cli("doctor", "--json", disk_tmp)
    found = findings_by_area(result.stdout)
    assert found[f"O_DIRECT {disk_tmp}"]["status"] == "ok"
    for area in ("io_uring", "kernel AIO", "CPU SIMD", "memory", "locked memory", "huge pages", "NUMA"):
        assert area in found, area


def test_doctor_warns_where_o_direct_is_refused(ramfs_dir: str) -> None:
    found = findings_by_area(infinity_cli("doctor", "--json", ramfs_dir).stdout)
    finding = found[f"O_DIRECT {ramfs_dir}"]
    assert finding["status"] == "warn" and "refuses O_DIRECT" in finding["seen"]


def test_doctor_fails_for_a_missing_directory(disk_tmp: str) -> None:
    missing = str(Path(disk_tmp) / "absent")
    result = infinity_cli("doctor", "--json", missing)
    assert result.returncode == 1
    assert "mkdir -p" in findings_by_area(result.stdout)[f"O_DIRECT {missing}"]["advice"]


def test_doctor_flags_a_cpu_tier_that_cannot_be_locked(disk_tmp: str) -> None:
    def low_memlock() -> None:  # 8 MiB, whatever the caller's limit (root may have none)
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (8 << 20, resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]))

    result = subprocess.run(
        [sys.executable, "-m", "infinity.cli.main", "doctor", "--json", "--set", "cpu.lock=true",
         "--set", f"cpu.budget_bytes={1 << 30}", disk_tmp],
        capture_output=True, text=True, timeout=240, preexec_fn=low_memlock,
        env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"})
    found = findings_by_area(result.stdout)
    assert found["memory"]["status"] == "ok"  # 1 GiB fits: only the lock limit is at fault
    assert found["locked memory"]["status"] == "fail"
    assert "LimitMEMLOCK=infinity" in found["locked memory"]["advice"]
    assert result.returncode == 1


def test_tune_writes_the_io_table_and_keeps_the_rest(disk_tmp: str) -> None:
    config = Path(disk_tmp) / "infinity.toml"
    config.write_text("# my settings\n[io]\nbackend = \"auto\"\n\n[daemon]\nclient_timeout_s = 7.5\n")
    result = infinity_cli("tune", "--quick", "--file-bytes", str(64 << 20), "--config", str(config), disk_tmp)
    assert result.returncode == 0, result.stderr
    best = json.loads(result.stdout)["best"]
    loaded = load_config(config, env={})
    assert (loaded.io.block_size_bytes, loaded.io.queue_depth, loaded.io.num_threads) == (
        best["block_size_bytes"], best["queue_depth"], best["num_threads"])
    assert loaded.daemon.client_timeout_s == 7.5
    assert config.read_text().startswith("# my settings")


def test_tune_tries_its_settings_with_the_rest_of_io_as_configured(disk_tmp: str) -> None:
    result = infinity_cli("tune", "--quick", "--dry-run", "--file-bytes", str(64 << 20),
                          "--set", "io.backend=threads", disk_tmp)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["best"]["backend"] == "threads"  # not the default's choice


def test_tune_refuses_a_missing_directory(disk_tmp: str) -> None:
    result = infinity_cli("tune", "--quick", "--dry-run", str(Path(disk_tmp) / "absent"))
    assert result.returncode == 2
    assert "not a directory" in result.stderr


@pytest.mark.parametrize("size", ["1000", str((64 << 20) - 1), "64MiB"])
def test_tune_refuses_a_probe_size_it_cannot_move_with_a_usage_error(disk_tmp: str, size: str) -> None:
    result = infinity_cli("tune", "--quick", "--file-bytes", size, disk_tmp)
    assert result.returncode == 2 and "--file-bytes" in result.stderr
    assert os.listdir(disk_tmp) == []  # nothing probed


def test_tune_of_a_folder_where_no_file_can_be_made_says_so() -> None:
    result = infinity_cli("tune", "--quick", "--dry-run", "/proc")  # a folder nobody may write
    assert result.returncode == 2, result.stderr
    assert "cannot create a probe file in /proc" in result.stderr and "Traceback" not in result.stderr


def test_doctor_judges_huge_pages_by_the_shared_memory_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    # The CPU tier is memfd shared memory: shmem_enabled decides, not the anonymous-memory
    # setting. Sysfs is read through doctor._read, replaced here: the machine's own setting
    # is not something a test should change.
    from infinity.cli import doctor
    from infinity.config import load_config

    config = load_config(env={})
    files = {"/sys/kernel/mm/transparent_hugepage/enabled": "always [madvise] never",
             "/proc/meminfo": "HugePages_Total:       0\n"}
    monkeypatch.setattr(doctor, "_read", lambda path: files.get(path))
    # And the kernel's MADV_COLLAPSE, which gives shared memory huge pages whatever
    # shmem_enabled says (but "deny"): taken as missing first.
    collapse = (False, "the kernel has no MADV_COLLAPSE")
    monkeypatch.setattr(doctor, "probe_shared_memory_collapse", lambda: collapse)
    files["/sys/kernel/mm/transparent_hugepage/shmem_enabled"] = "always within_size advise [never] deny force"
    finding = doctor.check_hugepages(config)
    assert finding.status == "warn" and "shmem_enabled" in finding.advice
    files["/sys/kernel/mm/transparent_hugepage/shmem_enabled"] = "always within_size [advise] never deny force"
    assert doctor.check_hugepages(config).status == "ok"
    collapse = (True, "")
    files["/sys/kernel/mm/transparent_hugepage/shmem_enabled"] = "always within_size advise [never] deny force"
    finding = doctor.check_hugepages(config)
    assert finding.status == "ok" and "MADV_COLLAPSE" in finding.seen
    files["/sys/kernel/mm/transparent_hugepage/shmem_enabled"] = "always within_size advise never [deny] force"
    assert doctor.check_hugepages(config).status == "warn"
    # Segments are collapsed only when prefaulted.
    files["/sys/kernel/mm/transparent_hugepage/shmem_enabled"] = "always within_size advise [never] deny force"
    assert doctor.check_hugepages(load_config(env={}, overrides=["cpu.prefault=false"])).status == "warn"


def test_tune_on_a_drive_without_room_for_its_probe_says_so(tiny_tmpfs_dir: str) -> None:
    result = infinity_cli("tune", "--quick", "--dry-run", "--file-bytes", str(64 << 20), tiny_tmpfs_dir)
    assert result.returncode == 2, result.stderr
    assert "no room" in result.stderr and "Traceback" not in result.stderr


def test_tune_edits_a_symlinked_config_in_place_and_keeps_its_mode(disk_tmp: str) -> None:
    real = Path(disk_tmp) / "real.toml"
    real.write_text("[daemon]\nclient_timeout_s = 7.5\n")
    real.chmod(0o600)
    link = Path(disk_tmp) / "link.toml"
    link.symlink_to(real)
    result = infinity_cli("tune", "--quick", "--file-bytes", str(64 << 20), "--config", str(link), disk_tmp)
    assert result.returncode == 0, result.stderr
    assert link.is_symlink() and "[io]" in real.read_text()
    assert real.stat().st_mode & 0o777 == 0o600
