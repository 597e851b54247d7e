"""Infinity: a per-node daemon that keeps PyTorch tensors in a tiered GPU / CPU / NVMe store."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from infinity.client import Client, Lease, connect

__all__ = ["Client", "Lease", "connect", "__version__"]


def __getattr__(name: str) -> Any:
    # The client (and torch with it) loads on first use, so `import infinity` stays cheap for the
    # daemon, the CLI and the config loader.
    if name in ("Client", "Lease", "connect"):
        from infinity import client

        return getattr(client, name)
    raise AttributeError(f"module 'infinity' has no attribute {name!r}")
