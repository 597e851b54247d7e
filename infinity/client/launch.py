"""Starting infinityd on a client's behalf (`infinity.connect(start=True)`).

The client never imports the daemon: it runs `infinityd start` as a separate
program with every setting passed as a `--set` flag, so the daemon runs with
exactly the client's settings, and returns once the daemon answers.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from infinity.config import TABLES, InfinityConfig, settings_text
from infinity.errors import DaemonUnavailableError
from infinity.protocol.paths import child_environment


def settings_as_flags(config: InfinityConfig) -> list[str]:
    """`--set table.key=value` for every setting, in the loader's text syntax."""
    flags: list[str] = []
    for table in TABLES:
        for key, value in dataclasses.asdict(getattr(config, table)).items():
            flags += ["--set", f"{table}.{key}={settings_text(value)}"]
    return flags


def start_daemon(config: InfinityConfig) -> None:
    """Run `infinityd start` with these settings; DaemonUnavailableError with its words if it fails."""
    command = [sys.executable, "-m", "infinity.daemon.main", "start", *settings_as_flags(config)]
    try:
        done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=child_environment(),
                              timeout=config.daemon.start_timeout_s + 10)
    except subprocess.TimeoutExpired:
        raise DaemonUnavailableError(
            f"infinityd did not start within {config.daemon.start_timeout_s:g}s "
            f"(daemon.start_timeout_s)") from None
    if done.returncode != 0:
        raise DaemonUnavailableError(
            f"could not start infinityd: {(done.stderr or done.stdout).strip()}")
