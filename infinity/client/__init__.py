"""The client side: transport to infinityd and the Client API.

`client` holds `connect()`, `Client` and `Lease`; `channel` the per-thread
ZeroMQ transport; `segments` the shared-memory mappings and tensor views;
`launch` starting a daemon on request; `admin` one-off requests without
torch (status, stop). Nothing here imports infinity.daemon.
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
