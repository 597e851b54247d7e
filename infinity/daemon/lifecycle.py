"""infinityd's life outside the loop: the runtime folder, the lock, the pid file, the secret,
start and stop.

Everything the daemon leaves in its runtime folder is private to its user:
the folder 0700, every file in it 0600 (the secret, the lock files, the pid
file, the log), the sockets 0600 (`server`, `fdserver`).

One daemon per runtime folder: whoever holds `infinityd.lock` (fcntl.flock) is
the daemon; the pid file is only informative. `start` launches `infinityd run`
in a new session with a pipe on which the daemon writes "ready" once its
sockets are bound, so `start` returns exactly when the daemon answers (or
reports why it did not, with the tail of its log).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import resource
import secrets
import select
import signal
import stat
import subprocess
import sys
import time
from typing import Iterator, Sequence

from infinity.errors import ConfigError, DaemonAlreadyRunningError, DaemonUnavailableError
from infinity.protocol.paths import (SECRET_BYTES, SECRET_FILE_MAX_BYTES, RuntimeLayout,
                                     child_environment)

READY_MESSAGE = b"ready\n"
# How long a daemon retries the lock: a client probing it holds it for microseconds.
LOCK_RETRY_S = 0.5


# What the daemon asks for when the hard limit allows more (or is unlimited): every client
# thread's socket, every client's pidfd and fd channel, every segment's memfd are open files.
OPEN_FILES_WANTED = 65536
OPEN_FILES_FEW = 4096  # below this, the daemon warns


def raise_open_file_limit() -> int:
    """Lift the soft limit on open files towards the hard one (shells start most processes at
    1024: a few hundred clients' sockets, pidfds and channels); returns the limit now in force.
    A daemon that cannot raise it runs with what it has."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_WANTED)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            return want
        except (ValueError, OSError):
            pass
    return soft


def prepare_runtime_dir(layout: RuntimeLayout) -> None:
    """Create the runtime folder private to this user (0700), or check an existing one."""
    layout.check()
    try:
        os.makedirs(layout.root, mode=0o700, exist_ok=True)
        info = os.stat(layout.root)
    except FileExistsError:
        raise ConfigError(f"daemon.runtime_dir {layout.root} is not a folder; remove it or "
                          f"choose another daemon.runtime_dir") from None
    except OSError as exc:
        raise ConfigError(f"daemon.runtime_dir {layout.root} cannot be created "
                          f"({exc.strerror}); choose a folder you may write") from None
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"daemon.runtime_dir {layout.root} is not a directory")
    if info.st_uid != os.geteuid():
        raise ConfigError(
            f"daemon.runtime_dir {layout.root} belongs to uid {info.st_uid}, not to you "
            f"(uid {os.geteuid()}); choose a folder of your own")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(layout.root, 0o700)  # sockets inside must not be reachable by other users


def daemon_secret(layout: RuntimeLayout) -> bytes:
    """The secret every hello must carry: the one in `infinityd.secret`, made at the first start
    and kept across restarts (a client may have read it already); a new one when the file is
    missing, not this user's, open to others, or not a secret. Written 0600 with O_EXCL to a
    temporary name and renamed, so nobody ever reads a partial or a more open file."""
    path = layout.secret_path
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # missing, or a link (O_NOFOLLOW): made anew
        fd = -1
    if fd >= 0:
        try:
            info = os.fstat(fd)
            text = os.read(fd, SECRET_FILE_MAX_BYTES)
        finally:
            os.close(fd)
        private = (stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()
                   and stat.S_IMODE(info.st_mode) & 0o077 == 0)
        try:
            secret = bytes.fromhex(text.decode("ascii").strip())
        except ValueError:
            secret = b""
        if private and len(secret) == SECRET_BYTES:
            return secret
        # Open to others, someone else's, or damaged: whoever could read it may know it.
        logging.getLogger("infinityd").warning(
            "%s was not a private secret of this user (mode %o, uid %d); a new one replaces it",
            path, stat.S_IMODE(info.st_mode), info.st_uid)
    secret = secrets.token_bytes(SECRET_BYTES)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, secret.hex().encode("ascii") + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return secret


def _private_file(path: str, flags: int) -> int:
    """An fd of `path` opened with `flags`, created 0600 (and made 0600 if it was more open):
    the runtime folder is private already, this holds should someone loosen the folder."""
    fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    if stat.S_IMODE(os.fstat(fd).st_mode) & 0o077:
        os.fchmod(fd, 0o600)
    return fd


class RuntimeLock:
    """The flock that makes a daemon the only one of its runtime folder."""

    def __init__(self, layout: RuntimeLayout) -> None:
        self.layout = layout
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = _private_file(self.layout.lock_path, os.O_RDWR)
        try:
            locked = _flock_within(fd, LOCK_RETRY_S)
        except BaseException:
            os.close(fd)
            raise
        if not locked:
            os.close(fd)
            pid = self.layout.read_pid()
            raise DaemonAlreadyRunningError(
                f"infinityd{f' (pid {pid})' if pid else ''} already serves "
                f"{self.layout.root}; stop it with `infinityd stop` or choose another "
                f"daemon.runtime_dir")
        self._fd = fd
        tmp = self.layout.pid_path + ".tmp"
        with os.fdopen(_private_file(tmp, os.O_WRONLY | os.O_TRUNC), "w") as f:
            f.write(f"{os.getpid()}\n")
        os.replace(tmp, self.layout.pid_path)

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.layout.pid_path)
        except FileNotFoundError:
            pass
        os.close(self._fd)  # drops the flock
        self._fd = None


@contextlib.contextmanager
def start_lock(layout: RuntimeLayout, *, timeout_s: float) -> Iterator[None]:
    """Held from the check for a running daemon until the one started serves, so that several
    `infinityd start` (several `connect(start=True)`) at once start one daemon, and the others
    find it serving."""
    fd = _private_file(layout.start_lock_path, os.O_RDWR)
    try:
        if not _flock_within(fd, timeout_s):
            raise DaemonUnavailableError(
                f"another `infinityd start` in {layout.root} did not finish within "
                f"{timeout_s:g}s (daemon.start_timeout_s); see {layout.log_path}")
        yield
    finally:
        os.close(fd)  # drops the flock


def _flock_within(fd: int, timeout_s: float) -> bool:
    """Take an exclusive flock on `fd`, retrying for `timeout_s`; False if it stayed taken."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def _log_tail(layout: RuntimeLayout, start_bytes: int = 0, lines: int = 15) -> str:
    """The last lines of the log written from byte `start_bytes` on (this start's, not the
    earlier runs' appended before it)."""
    try:
        with open(layout.log_path, "rb") as f:
            f.seek(start_bytes)
            text = f.read().decode(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "".join(text.splitlines(keepends=True)[-lines:]).strip() or "(nothing logged)"


def start_background(layout: RuntimeLayout, run_args: Sequence[str], *, timeout_s: float) -> int:
    """Launch `infinityd run <run_args>` detached; return its pid once it serves.

    The caller checks first that no daemon runs; a race with another starter
    ends with one of them reporting DaemonAlreadyRunningError from the log.
    """
    prepare_runtime_dir(layout)
    read_end, write_end = os.pipe()
    try:
        log_fd = _private_file(layout.log_path, os.O_WRONLY | os.O_APPEND)
        with os.fdopen(log_fd, "ab") as log_file:
            start_bytes = log_file.tell()  # the runs before this one's lines stay out of errors
            proc = subprocess.Popen(
                [sys.executable, "-m", "infinity.daemon.main", "run", "--ready-fd", str(write_end),
                 *run_args],
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, pass_fds=(write_end,),
                start_new_session=True, close_fds=True, env=child_environment())
        os.close(write_end)
        write_end = -1
        ready, _, _ = select.select([read_end], [], [], timeout_s)
        message = os.read(read_end, 64) if ready else b""
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)
    if message == READY_MESSAGE:
        return proc.pid
    if not ready:
        proc.terminate()
        raise DaemonUnavailableError(
            f"infinityd did not answer within {timeout_s:g}s (daemon.start_timeout_s); its log "
            f"{layout.log_path} ends with:\n{_log_tail(layout, start_bytes)}")
    proc.wait(timeout=timeout_s)
    raise DaemonUnavailableError(
        f"infinityd failed to start (exit status {proc.returncode}); its log {layout.log_path} "
        f"ends with:\n{_log_tail(layout, start_bytes)}")


def wait_for_exit(pid: int, timeout_s: float) -> bool:
    """True once process `pid` has exited (within the timeout)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([fd], [], [], timeout_s)
        return bool(ready)
    finally:
        os.close(fd)


def terminate(pid: int, timeout_s: float) -> bool:
    """SIGTERM (a clean shutdown too), then wait; True if it exited."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    return wait_for_exit(pid, timeout_s)
