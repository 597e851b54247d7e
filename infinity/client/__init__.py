"""The client side: transport to infinityd and the Client API.

`client` holds `connect()` and `Client`, which joins the calls kept by job:
`leases` (get, `Lease`), `writes` (reserve, commit, put), `streams`
(write_from, read_into), `steps` (steps and traces), `queries` (exists, list,
delete, stats), over `session` (the connection: hello and fd handshake,
per-thread channels, heartbeat, releases riding with the next message, close).
`spares` keeps the spare reservations puts leave; `tensors` checks what callers
pass. `channel` is the per-thread ZeroMQ transport; `segments` the shared-memory
mappings and tensor views; `device` the GPU-side cache; `launch` starting a
daemon on request; `admin` one-off requests without torch (status, stop,
infinity-top). Nothing here imports infinity.daemon.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from infinity.client.client import Client, Lease, StepResult, connect

__all__ = ["Client", "Lease", "StepResult", "connect"]


def __getattr__(name: str) -> Any:
    # Loaded on first use so that `infinity.client.admin` works without importing torch.
    if name in __all__:
        from infinity.client import client

        return getattr(client, name)
    raise AttributeError(f"module 'infinity.client' has no attribute {name!r}")
