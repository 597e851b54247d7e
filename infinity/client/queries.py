"""Calls about the catalog's names: exists, list, delete, prefetch hints, and the daemon's stats.

`QueryCalls` holds them for the Client: each is one request (a list of any length is asked
for in pages).
"""

from __future__ import annotations

from typing import Any

from infinity.client.session import Names, Session, as_names
from infinity.protocol import wire


class QueryCalls(Session):
    """The Client's catalog calls."""

    def prefetch(self, names: Names, *, namespace: str = "default") -> None:
        """Hint that these tensors are needed soon (no reply, no wait)."""
        self._send(wire.Prefetch(tuple(wire.TensorRef(namespace, n) for n in as_names(names))))

    def delete(self, names: Names, *, namespace: str = "default") -> None:
        """Remove names; current readers keep their versions until they release."""
        self._check_usable()  # before any lock: see `commit`
        listed = as_names(names)
        spared = self._spares.forget(namespace, listed)
        if spared:
            self._abort_quietly(spared, namespace)  # nothing more to put under these names
        self._raise_first(self._call(wire.Delete(tuple(wire.TensorRef(namespace, n)
                                                        for n in listed))))

    def exists(self, name: str, *, namespace: str = "default") -> bool:
        return self.exists_many([name], namespace=namespace)[0]

    def exists_many(self, names: Names, *, namespace: str = "default") -> list[bool]:
        results = self._call(wire.Exists(tuple(wire.TensorRef(namespace, n) for n in as_names(names))))
        self._raise_first(results)
        return [wire.decode_bool(r) for r in results]

    def list(self, *, namespace: str = "default", prefix: str = "") -> list[wire.TensorInfo]:
        """The tensors of a namespace whose names start with `prefix`, sorted by name."""
        listed: list[wire.TensorInfo] = []
        after = ""
        while True:  # in pages: one reply cannot carry a namespace of any size
            (result,) = self._call(wire.ListTensors((wire.ListItem(namespace, prefix, after),)))
            self._raise_first([result])
            page = wire.decode_infos(result)
            listed += page
            if len(page) < wire.LIST_PAGE:
                return listed
            after = page[-1].name

    def stats(self) -> dict[str, Any]:
        """The daemon's counters: tiers, catalog, clients, requests."""
        (result,) = self._call(wire.Stats())
        self._raise_first([result])
        return wire.decode_stats(result)

    def verify_store(self) -> dict[str, Any]:
        """Have the daemon read back every flushed tensor's NVMe copy against its checksums,
        while it serves; returns {"tensors", "bytes", "num_corrupted", "corrupted": [[namespace,
        name, what failed], ...], "skipped", "not_on_nvme"} once it has (a store-wide read:
        minutes for a large store). Needs an NVMe tier."""
        (result,) = self._call(wire.Verify(), patient=True)
        self._raise_first([result])
        return wire.decode_verify_summary(result)
