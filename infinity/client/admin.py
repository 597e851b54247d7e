"""One-off requests to infinityd without a full Client: what `infinityd status`, `stop` and
`infinity-top` use.

No torch and no shared memory: a single channel opens a session, asks, and
says bye. The session has no fd channel, so the daemon watches it through
its pidfd or its silence only, which is plenty for one request.
"""

from __future__ import annotations

import os
from typing import Any

import psutil
import zmq

from infinity.client.channel import Channel
from infinity.config import InfinityConfig
from infinity.errors import DaemonUnavailableError
from infinity.protocol import wire
from infinity.protocol.paths import RuntimeLayout


STATUS_CLIENT_NAME = "infinityd status"
STOP_CLIENT_NAME = "infinityd stop"
MONITOR_CLIENT_NAME = "infinity-top"
# Sessions of the project's own tools: they come and go by themselves, hold nothing a stop
# would break, and `infinityd stop` does not count them as clients attached.
TOOL_CLIENT_NAMES = frozenset({STATUS_CLIENT_NAME, STOP_CLIENT_NAME, MONITOR_CLIENT_NAME})


def _request(config: InfinityConfig, message: wire.Request, *, name: str) -> Any:
    layout = RuntimeLayout(config.daemon.runtime_dir)
    layout.check()
    if not layout.daemon_running():
        raise DaemonUnavailableError(f"no infinityd is running for runtime folder {layout.root}")
    context = zmq.Context(io_threads=1)
    channel = Channel(context, layout.control_endpoint, timeout_s=config.daemon.request_timeout_s,
                      daemon_gone=lambda: None if layout.daemon_running() else "its lock is free")
    try:
        hello = channel.call(1, wire.Hello(wire.PROTOCOL_VERSION, name, os.getpid(),
                                           psutil.Process().create_time(), layout.read_secret()))
        if hello.failure is not None:
            raise hello.failure.exception()
        reply = channel.call(2, message)
        if reply.failure is not None:
            raise reply.failure.exception()
        result = reply.results[0]
        if isinstance(result, wire.ItemError):
            raise result.exception()
        if not isinstance(message, wire.Shutdown):
            channel.send(3, wire.Bye(), expect_reply=False)
        return result
    finally:
        channel.close(linger_ms=200)
        context.term()


def daemon_stats(config: InfinityConfig, *, name: str = STATUS_CLIENT_NAME) -> dict[str, Any]:
    """The daemon's `stats` map; `name` is the session's, as the daemon lists it among clients."""
    return wire.decode_stats(_request(config, wire.Stats(), name=name))


def shutdown_daemon(config: InfinityConfig) -> None:
    """Ask the daemon to stop cleanly; returns once it has acknowledged."""
    _request(config, wire.Shutdown(), name=STOP_CLIENT_NAME)
