"""Starting infinityd on a client's behalf (`infinity.connect(start=True)`).

The client never imports the daemon: it runs `infinityd start` as a separate
program with every setting in a TOML file of its own (`--config`), and none of
the `INFINITY_*` setting variables, so the daemon runs with exactly the
client's settings, whatever the default config file or the environment hold,
and returns once the daemon answers.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile

from infinity.config import (ENV_CONFIG_PATH, TABLES, InfinityConfig, is_setting_variable,
                             settings_as_toml, settings_text)
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
    env = {name: value for name, value in child_environment().items()
           if not is_setting_variable(name) and name != ENV_CONFIG_PATH}
    fd, path = tempfile.mkstemp(prefix="infinityd-start-", suffix=".toml")  # 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:  # what the loader reads, whatever the locale
            f.write(settings_as_toml(config))
        command = [sys.executable, "-m", "infinity.daemon.main", "start", "--config", path]
        done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              env=env, timeout=config.daemon.start_timeout_s + 10)
    except subprocess.TimeoutExpired:
        raise DaemonUnavailableError(
            f"infinityd did not start within {config.daemon.start_timeout_s:g}s "
            f"(daemon.start_timeout_s)") from None
    except OSError as exc:
        raise DaemonUnavailableError(f"could not run infinityd ({exc}); is Infinity installed "
                                     f"for {sys.executable}?") from None
    finally:
        os.unlink(path)  # read: the daemon answered (or gave up) before `start` returned
    if done.returncode != 0:
        raise DaemonUnavailableError(
            f"could not start infinityd: {(done.stderr or done.stdout).strip()}")
