"""`infinity doctor`: what this machine offers Infinity, in words a user can act on.

Each check returns a `Finding` (ok / warn / fail, what was seen, what to do). A
check that cannot read a value reports that as a finding; it never raises.
"""

from __future__ import annotations

import argparse
import errno
import functools
import json
import mmap
import os
import resource
import shutil
import tempfile
from dataclasses import asdict, dataclass
from typing import Callable

import psutil

from infinity.config import GiB, InfinityConfig, MiB, load_config
from infinity.io import probe_shared_memory_collapse


@dataclass(frozen=True)
class Finding:
    area: str
    status: str  # ok | warn | fail
    seen: str
    advice: str = ""


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def check_io_uring() -> Finding:
    from infinity import _native

    usable, reason = _native.probe_io_uring()
    sysctl = _read("/proc/sys/kernel/io_uring_disabled")
    seen = reason + (f" (kernel.io_uring_disabled = {sysctl})" if sysctl is not None else "")
    if usable:
        return Finding("io_uring", "ok", seen)
    advice = "the engine falls back to kernel AIO; "
    if sysctl and sysctl != "0":
        advice += "to enable io_uring: sysctl -w kernel.io_uring_disabled=0"
    else:
        advice += "a container's seccomp profile may block io_uring_setup; allow it to use io_uring"
    return Finding("io_uring", "warn", seen, advice)


def check_aio() -> Finding:
    from infinity import _native

    usable, reason = _native.probe_aio()
    if usable:
        return Finding("kernel AIO", "ok", reason)
    return Finding("kernel AIO", "warn", reason,
                   "the engine falls back to a pread/pwrite thread pool, which is slower for O_DIRECT")


def check_direct(path: str) -> Finding:
    area = f"O_DIRECT {path}"
    if not os.path.isdir(path):
        return Finding(area, "fail", "directory does not exist", f"create it: mkdir -p {path}")
    try:
        fd, probe = tempfile.mkstemp(prefix=".infinity-doctor-", dir=path)
        os.close(fd)
    except OSError as exc:
        return Finding(area, "fail", f"cannot create a file: {exc.strerror}",
                       "make the directory writable by the daemon's user")
    try:
        try:
            fd = os.open(probe, os.O_RDWR | os.O_DIRECT)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return Finding(area, "warn", "the file system refuses O_DIRECT (tmpfs, ramfs or a network FS?)",
                               "the store works through the page cache with a pread/pwrite pool; use a "
                               "directory on a local NVMe drive for full speed")
            return Finding(area, "fail", f"open failed: {exc.strerror}", "check the directory")
        try:
            block = mmap.mmap(-1, 4096)
            os.pwritev(fd, [block], 0)
        except OSError as exc:
            return Finding(area, "warn", f"O_DIRECT write of 4 KiB failed: {exc.strerror}",
                           "the drive may need a larger logical block size; report this")
        finally:
            os.close(fd)
        return Finding(area, "ok", "O_DIRECT reads and writes work")
    finally:
        os.unlink(probe)


def check_free_space(path: str, capacity_bytes: int) -> Finding:
    area = f"free space {path}"
    try:
        free = shutil.disk_usage(path).free
    except OSError as exc:
        return Finding(area, "fail", f"cannot read: {exc.strerror}", "check the directory")
    seen = f"{free / GiB:.1f} GiB free, nvme.capacity_bytes_per_dir = {capacity_bytes / GiB:.1f} GiB"
    if free < capacity_bytes:
        return Finding(area, "warn", seen, "the store will fill the disk before its capacity: lower "
                       "nvme.capacity_bytes_per_dir or free space")
    return Finding(area, "ok", seen)


def check_simd() -> Finding:
    from infinity import _native

    level = _native.simd_level()
    if level in ("avx512", "avx2"):
        return Finding("CPU SIMD", "ok", f"{level} (CRC32C in hardware, streaming copies)")
    if level == "sse4.2":
        return Finding("CPU SIMD", "warn", "sse4.2 only", "optimizer kernels run without AVX2")
    return Finding("CPU SIMD", "warn", "no SSE4.2", "checksums run in software; expect lower bandwidth")


def check_memory(config: InfinityConfig) -> list[Finding]:
    findings = []
    total = psutil.virtual_memory().total
    budget = config.cpu.budget_bytes
    seen = f"{total / GiB:.1f} GiB RAM, cpu.budget_bytes = {budget / GiB:.1f} GiB"
    if budget > total * 0.8:
        findings.append(Finding("memory", "fail" if budget > total else "warn", seen,
                                "lower cpu.budget_bytes so the CPU tier leaves room for the trainers"))
    else:
        findings.append(Finding("memory", "ok", seen))
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / MiB:.0f} MiB"
    seen = f"RLIMIT_MEMLOCK {limit}, cpu.lock = {str(config.cpu.lock).lower()}"
    if soft != resource.RLIM_INFINITY and soft < budget:
        status = "fail" if config.cpu.lock else "warn"
        findings.append(Finding("locked memory", status, seen,
                                "raise it to cover the CPU tier (LimitMEMLOCK=infinity in the systemd unit, "
                                "or `ulimit -l unlimited`) so segments can be pinned for fast GPU copies"))
    else:
        findings.append(Finding("locked memory", "ok", seen))
    return findings


def check_hugepages(config: InfinityConfig) -> Finding:
    thp = _read("/sys/kernel/mm/transparent_hugepage/enabled")
    meminfo = _read("/proc/meminfo") or ""
    reserved = next((line.split()[1] for line in meminfo.splitlines() if line.startswith("HugePages_Total")), "?")
    if thp is None:
        return Finding("huge pages", "warn", "transparent huge pages not reported by this kernel",
                       "the CPU tier uses normal pages")
    mode = _chosen(thp)
    # The CPU tier is shared memory (memfd): what decides its page size is shmem_enabled, not the
    # anonymous-memory setting. On 4 KiB pages, O_DIRECT loads into it were ~0.7x as fast as into
    # huge pages on the project's VM (docs/BENCHMARKS.md, bench_overlap).
    shmem = _read("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    shmem_mode = _chosen(shmem) if shmem is not None else "not reported"
    seen = (f"transparent huge pages: {mode}; for shared memory (the CPU tier): {shmem_mode}; "
            f"reserved huge pages: {reserved}")
    collapses = config.cpu.hugepages and config.cpu.prefault  # see arena.create_segment
    if shmem_mode in ("never", "not reported") and collapses and probe_shared_memory_collapse()[0]:
        return Finding("huge pages", "ok", seen + "; the daemon collapses the CPU tier's shared "
                       "memory into huge pages (MADV_COLLAPSE)")
    if shmem_mode in ("never", "deny", "not reported"):
        return Finding("huge pages", "warn", seen,
                       "the CPU tier gets 4 KiB pages, and NVMe loads into it are slower; "
                       "echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled "
                       "lets it use huge pages")
    return Finding("huge pages", "ok", seen)


def _chosen(setting: str) -> str:
    """The selected value of a sysfs choice like "always [madvise] never"."""
    return setting[setting.find("[") + 1:setting.find("]")] if "[" in setting else setting.strip()


def check_numa() -> Finding:
    try:
        nodes = [n for n in os.listdir("/sys/devices/system/node") if n.startswith("node") and n[4:].isdigit()]
    except OSError:
        return Finding("NUMA", "ok", "no NUMA information (single node assumed)")
    if len(nodes) > 1:
        return Finding("NUMA", "warn", f"{len(nodes)} NUMA nodes",
                       "pin infinityd near the NVMe drives "
                       "(numactl --cpunodebind=N --membind=N) for the best bandwidth")
    return Finding("NUMA", "ok", "one NUMA node")


def collect(config: InfinityConfig, extra_dirs: list[str]) -> list[Finding]:
    checks: list[Callable[[], Finding | list[Finding]]] = [
        check_io_uring, check_aio, check_simd, lambda: check_memory(config), lambda: check_hugepages(config), check_numa]
    for path in dict.fromkeys([*config.nvme.dirs, *extra_dirs]):
        checks.append(functools.partial(check_direct, path))
        checks.append(functools.partial(check_free_space, path, config.nvme.capacity_bytes_per_dir))
    findings: list[Finding] = []
    for check in checks:
        try:
            result = check()
        except Exception as exc:  # a broken probe is a finding, not a crash
            result = Finding(getattr(check, "__name__", "check"), "warn", f"could not check: {exc}")
        findings.extend(result if isinstance(result, list) else [result])
    if not config.nvme.dirs and not extra_dirs:
        findings.append(Finding("store directories", "warn", "nvme.dirs is empty",
                                "set nvme.dirs to one directory per NVMe drive, or pass directories to check"))
    return findings


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, overrides=args.overrides)
    findings = collect(config, list(args.dirs))
    if args.json:
        print(json.dumps([asdict(f) for f in findings], indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"infinity doctor (settings from {config.source})")
        for column in ("area", "status", "seen", "what to do"):
            table.add_column(column)
        style = {"ok": "green", "warn": "yellow", "fail": "bold red"}
        for f in findings:
            table.add_row(f.area, f"[{style[f.status]}]{f.status}[/]", f.seen, f.advice)
        Console().print(table)
    return 1 if any(f.status == "fail" for f in findings) else 0
