"""Shared fixtures. Stores live on a real disk (O_DIRECT needs one): under /var/tmp, never a tmpfs."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import pytest

DISK_TMP_ROOT = os.environ.get("INFINITY_TEST_DISK_DIR", "/var/tmp")


@pytest.fixture
def disk_tmp() -> Iterator[str]:
    """A fresh directory on the real disk, removed afterwards."""
    path = tempfile.mkdtemp(prefix="infinity-test-", dir=DISK_TMP_ROOT)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _mount(fstype: str, options: str | None) -> Iterator[str]:
    """Mount a real small file system for a test; skip (saying why) where mounting is not allowed."""
    import subprocess

    path = tempfile.mkdtemp(prefix=f"infinity-{fstype}-", dir=DISK_TMP_ROOT)
    command = ["mount", "-t", fstype] + (["-o", options] if options else []) + ["none", path]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        os.rmdir(path)
        pytest.skip(f"cannot mount {fstype} here ({result.stderr.strip() or 'not root'}); "
                    f"this test needs root to create a real {fstype}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)
        os.rmdir(path)


@pytest.fixture
def ramfs_dir() -> Iterator[str]:
    """A real ramfs: a file system that refuses O_DIRECT (tmpfs accepts it on recent kernels)."""
    yield from _mount("ramfs", None)


@pytest.fixture
def tiny_tmpfs_dir() -> Iterator[str]:
    """A real 8 MiB tmpfs, to fill up."""
    yield from _mount("tmpfs", "size=8m")


@pytest.fixture
def loop_fs() -> Iterator[Any]:
    """A real 64 MiB ext4 on a loop device, mounted errors=remount-ro, whose faults the test
    causes: read-only, a dead device, failing writes (`tests/loopfs.py`). Skips if not root."""
    from loopfs import loop_ext4

    with loop_ext4(64 * 1024 * 1024, under=DISK_TMP_ROOT) as fs:
        yield fs


# --- infinityd: real daemon processes in private runtime folders -----------------------------
# (used by tests/test_daemon_*.py, test_client_*.py and test_protocol_*.py)

import select  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any, Callable  # noqa: E402

# A suite started in the background of a non-interactive shell (`bash scripts/test.sh &`, nohup)
# inherits SIGINT and SIGQUIT ignored (POSIX), and so would every process it starts: Python keeps
# an inherited SIG_IGN, so the tests that press ctrl-c on a CLI (`test_daemon_lifecycle`,
# `test_monitor_top`) waited 30 s for children that never heard it. Give them what a terminal
# gives: the default dispositions, in this process and so in its children.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGQUIT) == signal.SIG_IGN:
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)

# Small tiers and short timeouts keep the daemon suite fast; tests override what they exercise.
DAEMON_TEST_SETTINGS: dict[str, Any] = {
    "cpu.budget_bytes": 64 * 1024 * 1024,
    "cpu.segment_bytes": 8 * 1024 * 1024,
    "daemon.client_timeout_s": 5.0,
    "daemon.heartbeat_interval_s": 0.5,
    "daemon.request_timeout_s": 10.0,
    "daemon.start_timeout_s": 30.0,
    "daemon.log_level": "debug",
}


# A small node for the NVMe-tier tests that replay steps: an 8 MiB CPU tier in 4 MiB segments.
PREFETCH_SETTINGS: dict[str, Any] = {
    "cpu.budget_bytes": 8 * 1024 * 1024,
    "cpu.segment_bytes": 4 * 1024 * 1024,
    "nvme.stripe_bytes": 1024 * 1024,
    "nvme.file_grow_bytes": 16 * 1024 * 1024,
    "nvme.write_behind_bytes": 2 * 1024 * 1024,
    "io.num_threads": 2,
    "io.queue_depth": 8,
}


def short_tmp_root() -> str:
    """A fresh folder short enough for Unix socket paths (108 bytes), on the real disk."""
    return tempfile.mkdtemp(prefix="inf-", dir=DISK_TMP_ROOT)


def wait_until(predicate: Callable[[], Any], *, timeout_s: float, what: str) -> Any:
    """Poll `predicate` until it returns something true; for states the daemon exposes only
    through `stats` (there is no event to wait on from outside)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.01)


def rss_growth_during(pid: int, action: Callable[[], Any], *, interval_s: float) -> int:
    """How far the resident memory of process `pid` rose above its size at the start while
    `action` ran, sampled every `interval_s`."""
    import psutil

    process = psutil.Process(pid)
    start = process.memory_info().rss
    peak = [start]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(interval_s):
            peak[0] = max(peak[0], process.memory_info().rss)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        action()
    finally:
        done.set()
        sampler.join()
    return peak[0] - start


def run_in_threads(work: Callable[[int], None], count: int) -> None:
    """Run work(0) .. work(count - 1) on threads at once; re-raise the first failure here."""
    errors: list[BaseException] = []

    def run(me: int) -> None:
        try:
            work(me)
        except BaseException as exc:  # the test's thread raises it below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(me,)) for me in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def outcome_in_forked_child(action: Callable[[], Any]) -> bytes:
    """Fork; the child runs `action` and reports b"returned", b"forked" (ForkedClientError) or
    b"other"; b"hung" if it said nothing within 10 s (it is then killed)."""
    from infinity.errors import ForkedClientError

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave at once
        try:
            action()
            outcome = b"returned"
        except ForkedClientError:
            outcome = b"forked"
        except BaseException:  # noqa: BLE001 - reported as such
            outcome = b"other"
        os.write(write_end, outcome)
        os._exit(0)
    os.close(write_end)
    ready = select.select([read_end], [], [], 10)[0]
    outcome = os.read(read_end, 16) if ready else b"hung"
    os.close(read_end)
    if not ready:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return outcome


@dataclass
class RunningDaemon:
    """An `infinityd run` child process with its settings, runtime folder and log."""

    config: Any  # infinity.config.InfinityConfig
    process: subprocess.Popen[bytes]
    root: str
    log_path: str

    @property
    def runtime_dir(self) -> str:
        return str(self.config.daemon.runtime_dir)

    def connect(self, name: str = "test") -> Any:
        import infinity

        return infinity.connect(config=self.config, name=name)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def assert_serving(self) -> None:
        assert self.process.poll() is None, f"infinityd exited:\n{self.log()[-3000:]}"

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise AssertionError(f"infinityd did not stop on SIGTERM:\n{self.log()[-3000:]}")
        return self.process.returncode


def daemon_settings_file(root: str) -> str:
    """An empty settings file, so neither ~/.config nor INFINITY_CONFIG leaks into a test."""
    path = os.path.join(root, "settings.toml")
    with open(path, "w") as f:
        f.write("# infinityd test settings: everything comes from --set flags\n")
    return path


def clean_environment() -> dict[str, str]:
    from infinity.protocol.paths import child_environment

    return {k: v for k, v in child_environment().items() if not k.startswith("INFINITY_")}


def _flag_text(value: Any) -> str:
    """A typed setting as `--set` text (lists, like nvme.dirs, are comma-separated)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    if isinstance(value, dict):  # namespace quotas: name=bytes,name=bytes
        return ",".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def start_daemon_process(root: str, **overrides: Any) -> RunningDaemon:
    """Start `infinityd run` in `root`/rt with the test settings plus `overrides`
    (keys like "cpu.budget_bytes"); returns once it serves."""
    from infinity.config import load_config

    settings = {**DAEMON_TEST_SETTINGS, "daemon.runtime_dir": os.path.join(root, "rt"), **overrides}
    settings_file = daemon_settings_file(root)
    config = load_config(settings_file, env={}, overrides=settings)
    flags = [arg for key, value in settings.items() for arg in ("--set", f"{key}={_flag_text(value)}")]
    log_path = os.path.join(root, "infinityd.log")
    read_end, write_end = os.pipe()
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "infinity.daemon.main", "run", "--ready-fd", str(write_end),
             "--config", settings_file, *flags],
            stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, pass_fds=(write_end,),
            env=clean_environment())
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 60)
        message = os.read(read_end, 64) if ready else b""
    finally:
        os.close(read_end)
    daemon = RunningDaemon(config, process, root, log_path)
    if message != b"ready\n":
        daemon.stop()
        raise AssertionError(f"infinityd did not start:\n{daemon.log()[-3000:]}")
    return daemon


@pytest.fixture
def daemon_factory() -> Iterator[Callable[..., RunningDaemon]]:
    """Start daemons with extra settings: `daemon_factory(**{"cpu.budget_bytes": ...})`."""
    started: list[RunningDaemon] = []
    roots: list[str] = []

    def start(*, nvme_tier: bool = False, **overrides: Any) -> RunningDaemon:
        root = short_tmp_root()
        roots.append(root)
        if nvme_tier:  # one store directory in the daemon's folder
            os.mkdir(os.path.join(root, "nvme"))
            overrides = {"nvme.dirs": [os.path.join(root, "nvme")], **overrides}
        started.append(start_daemon_process(root, **overrides))
        return started[-1]

    try:
        yield start
    finally:
        for daemon in started:
            daemon.stop()
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def nvme_daemon(daemon_factory: Callable[..., RunningDaemon]) -> RunningDaemon:
    """A real infinityd with an NVMe tier behind a small CPU tier (PREFETCH_SETTINGS)."""
    return daemon_factory(nvme_tier=True, **PREFETCH_SETTINGS)


@pytest.fixture
def daemon(daemon_factory: Callable[..., RunningDaemon]) -> RunningDaemon:
    """A real infinityd with the small test settings."""
    return daemon_factory()


@pytest.fixture
def client(daemon: RunningDaemon) -> Iterator[Any]:
    """A client of `daemon`, closed afterwards."""
    connection = daemon.connect("pytest")
    try:
        yield connection
    finally:
        connection.close()


def wait_until_worker_blocks_in_io() -> None:
    """Wait until the engine's worker thread sleeps in io_uring_enter / io_submit / io_getevents.

    A pipe read in flight is not observable from outside, but the worker's current system call
    is (/proc/self/task/TID/syscall): once it is in one of those, it has taken the op.
    """
    io_calls = {"426", "209", "208"}  # x86-64: io_uring_enter, io_submit, io_getevents
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/comm") as f:
                    if not f.read().startswith(("inf-uring", "inf-aio")):
                        continue
                with open(f"/proc/self/task/{task}/syscall") as f:
                    if f.read().split()[0] in io_calls:
                        return
            except (FileNotFoundError, IndexError, PermissionError):
                continue
        time.sleep(0.001)
    raise AssertionError("the engine's worker never started the pipe read")
