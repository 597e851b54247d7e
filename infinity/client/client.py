"""The Client API: connect to infinityd, lease tensors as shared-memory views, write new versions.

    client = infinity.connect()
    client.put("w", torch.randn(4, 4))                 # reserve + copy + commit
    with client.get("w") as w:                         # a view of shared memory, leased
        y = x @ w
    views = client.reserve({"g": (torch.float32, (4, 4))})
    views["g"].copy_(grad); client.commit("g")         # readers of the old "g" keep it
    client.put("w", w, durable=True)                   # returns once it is on NVMe, indexed
    client.flush_store()                               # every tensor durable, one transaction
    client.write_from("huge", t); client.read_into("huge", out)   # any size, in pieces
    with client.step() as step:                        # a training step: the daemon learns
        ...                                            # its access order and prefetches it
    step.outcome, step.counters                        # "replayed", prefetch hits, stall ...

Durability (with an NVMe tier, `nvme.dirs`): a commit is visible at once but
not durable; `put(..., durable=True)` / `commit(..., durable=True)` and
`flush_store()` return only once the bytes are on NVMe (fdatasync) and the
store's index points at them, so a crash of the daemon at any later moment
keeps them. `flush()` is unrelated: it only makes sure the daemon has heard
of the leases this client released.

A Client is thread-safe: each thread talks through its own channel (see
`channel`), all in one session. A background thread sends heartbeats so an
idle client keeps its leases. After fork() the child's copy refuses to work
(ForkedClientError): the child must call `infinity.connect()` itself. Batched
calls send one request for all names; when some items fail, the others still
take effect and the first error is raised (a batched `get` releases what it
got before raising).
"""

from __future__ import annotations

import os
import sys
from typing import Mapping

from infinity.client.leases import Lease, LeaseCalls, PendingResident, ResidentRequester
from infinity.client.namespaces import NamespaceCalls
from infinity.client.optimizer import OptimizerCalls
from infinity.client.queries import QueryCalls
from infinity.client.session import Names
from infinity.client.steps import StepCalls, StepResult
from infinity.client.streams import StreamCalls
from infinity.client.tensors import TensorSpec
from infinity.client.writes import WriteCalls
from infinity.config import InfinityConfig, load_config
from infinity.errors import DaemonUnavailableError
from infinity.protocol.paths import RuntimeLayout


class Client(LeaseCalls, WriteCalls, StreamCalls, StepCalls, QueryCalls, NamespaceCalls,
             OptimizerCalls):
    """A session with infinityd. Create it with `infinity.connect()`.

    Its calls live by job in `leases`, `writes`, `streams`, `steps`, `queries`,
    `namespaces` and `optimizer`, over the
    session (`session`: connection, channels, heartbeat, closing); this class only joins them,
    so a call costs no more Python calls than if all were written here."""


def _default_name() -> str:
    """The program's name, with the rank under torch.distributed launchers (RANK), so that each
    process of a job keeps its own step trace across restarts."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    rank = os.environ.get("RANK")
    return f"{name}-rank{rank}" if rank and rank.isdigit() else name


def connect(*, config: InfinityConfig | None = None, start: bool = False,
            name: str | None = None, namespace_tokens: Mapping[str, str] | None = None
            ) -> Client:
    """Attach to the infinityd of these settings' runtime folder (starting one if `start`).
    `namespace_tokens`: {namespace: grant token} of private namespaces this client uses, each
    presented once connected (`Client.grant_namespace`)."""
    config = config if config is not None else load_config()
    layout = RuntimeLayout(config.daemon.runtime_dir)
    layout.check()
    if not layout.daemon_running():
        if not start:
            raise DaemonUnavailableError(
                f"no infinityd is running for runtime folder {layout.root}; start one with "
                f"`infinityd start` (or infinity.connect(start=True))")
        from infinity.client.launch import start_daemon

        start_daemon(config)
    client = Client(config, layout, name=name or _default_name())
    try:
        for namespace, token in (namespace_tokens or {}).items():
            client.grant_namespace(namespace, token)
    except BaseException:
        client.close()
        raise
    return client


__all__ = ["Client", "Lease", "Names", "PendingResident", "ResidentRequester", "StepResult",
           "TensorSpec", "connect"]
