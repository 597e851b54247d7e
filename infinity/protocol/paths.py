"""The runtime folder's layout: where infinityd's sockets, lock, pid file and secret live.

Client and daemon agree on these names through this module alone. The folder is
`daemon.runtime_dir` (private to the user, 0700); a Unix socket path must fit
the kernel's 108-byte `sun_path`, so a too-long folder is a ConfigError.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from dataclasses import dataclass

from infinity.errors import ConfigError

# sun_path is 108 bytes including the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107
# The secret file holds SECRET_BYTES random bytes as hex and a newline; reading stops here.
SECRET_BYTES = 32
SECRET_FILE_MAX_BYTES = 4 * SECRET_BYTES


@dataclass(frozen=True)
class RuntimeLayout:
    """The files of one daemon's runtime folder."""

    root: str

    @property
    def control_path(self) -> str:
        return os.path.join(self.root, "control.sock")

    @property
    def control_endpoint(self) -> str:
        return "ipc://" + self.control_path

    @property
    def telemetry_path(self) -> str:
        """The daemon's telemetry stream (ZeroMQ PUB): one snapshot per `telemetry.interval_s`."""
        return os.path.join(self.root, "telemetry.sock")

    @property
    def telemetry_endpoint(self) -> str:
        return "ipc://" + self.telemetry_path

    @property
    def fds_path(self) -> str:
        return os.path.join(self.root, "fds.sock")

    @property
    def lock_path(self) -> str:
        return os.path.join(self.root, "infinityd.lock")

    @property
    def pid_path(self) -> str:
        return os.path.join(self.root, "infinityd.pid")

    @property
    def log_path(self) -> str:
        return os.path.join(self.root, "infinityd.log")

    @property
    def secret_path(self) -> str:
        """The daemon's secret (hex, 0600): a hello must carry it (see `read_secret`)."""
        return os.path.join(self.root, "infinityd.secret")

    def read_secret(self) -> bytes:
        """The daemon's secret as a client presents it in its hello; empty when this process
        cannot read it (another user's daemon, or none started yet), which the daemon refuses
        with an AuthenticationError that says why."""
        try:
            with open(self.secret_path, "rb") as f:
                text = f.read(SECRET_FILE_MAX_BYTES)
            return bytes.fromhex(text.decode("ascii").strip())
        except (OSError, ValueError):
            return b""

    @property
    def start_lock_path(self) -> str:
        """Held by an `infinityd start` from its check for a daemon until that daemon serves."""
        return os.path.join(self.root, "start.lock")

    def check(self) -> None:
        """ConfigError when a socket path would not fit a Unix socket address."""
        for path in (self.control_path, self.fds_path, self.telemetry_path):
            if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
                raise ConfigError(
                    f"daemon.runtime_dir {self.root!r} is too long: the socket path {path!r} must "
                    f"be at most {MAX_SOCKET_PATH_BYTES} bytes; choose a shorter daemon.runtime_dir")

    def check_private(self) -> None:
        """ConfigError when the folder exists but is not a private folder of this user: a
        client must not talk to sockets that someone else may have put there."""
        try:
            info = os.stat(self.root)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise ConfigError(f"daemon.runtime_dir {self.root} cannot be used ({exc.strerror}); "
                              f"choose a folder of your own") from None
        if not stat.S_ISDIR(info.st_mode):
            raise ConfigError(f"daemon.runtime_dir {self.root} is not a folder; remove it or "
                              f"choose another daemon.runtime_dir")
        # Root too: to see to another user's daemon, run as that user (sudo -u).
        if info.st_uid != os.geteuid():
            raise ConfigError(
                f"daemon.runtime_dir {self.root} belongs to uid {info.st_uid}, not to you (uid "
                f"{os.geteuid()}): its sockets may be anyone's; choose a folder of your own")
        if stat.S_IMODE(info.st_mode) & 0o022:
            raise ConfigError(
                f"daemon.runtime_dir {self.root} may be written by other users (mode "
                f"{stat.S_IMODE(info.st_mode):o}); `chmod 700 {self.root}` or choose another")

    def daemon_running(self) -> bool:
        """True while some infinityd holds this folder's lock (the lock is the truth, not the pid file)."""
        self.check_private()
        try:
            fd = os.open(self.lock_path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return True
            raise
        finally:
            os.close(fd)  # closing also drops our probe lock at once
        return False

    def read_pid(self) -> int | None:
        """The pid written by the daemon that holds the lock, if it has written it yet."""
        try:
            with open(self.pid_path) as f:
                return int(f.read().strip() or 0) or None
        except (FileNotFoundError, ValueError):
            return None


def child_environment() -> dict[str, str]:
    """The environment for running `python -m infinity...` as a child: it finds this same package
    (also when it runs from a source tree that is not installed)."""
    # The folder that holds the `infinity` package, found from this file (infinity/protocol/
    # paths.py) rather than by importing `infinity`, whose __init__ reaches the client, which
    # imports this module: the protocol layer imports nothing above it.
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if package_root not in parts:
        env["PYTHONPATH"] = os.pathsep.join([package_root, *parts])
    return env
