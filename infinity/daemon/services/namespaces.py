"""Namespace records: the `namespace` request (create, info, seal, grant) on
`infinity.daemon.namespaces`.

The records themselves (mode, owner, quota) and the checks every write goes through live in
`infinity.daemon.namespaces.Namespaces`, which the data and stream services ask; this service
only answers the request that creates, describes, seals or grants a record (a private
record's create and seal once it is saved for the next start).
"""

from __future__ import annotations

from typing import Any

from infinity.daemon.catalog import Catalog
from infinity.daemon.namespaces import Namespaces
from infinity.daemon.services.base import Deferred, Routes
from infinity.daemon.sessions import Session
from infinity.errors import StoreDirectoryError
from infinity.protocol import wire
from infinity.protocol.wire import ItemError, NamespaceInfo


class NamespaceService:
    """The `namespace` request of every session."""

    def __init__(self, namespaces: Namespaces, catalog: Catalog) -> None:
        self.namespaces = namespaces
        self.catalog = catalog

    def routes(self) -> Routes:
        return {wire.NamespaceOp: self.namespace}

    def namespace(self, session: Session, request_id: int, message: wire.NamespaceOp
                  ) -> list[Any] | Deferred:
        if message.action == "create":
            info = self.namespaces.create(
                session, message.namespace, mode=message.mode, quota_bytes=message.quota_bytes,
                has_tensors=message.namespace in self.catalog.namespace_counters,
                token=message.token)
        elif message.action == "seal":
            info = self.namespaces.seal(session, message.namespace)
        elif message.action == "grant":
            info = self.namespaces.grant(session, message.namespace, message.token)
        else:
            info = self.namespaces.info(message.namespace)
        if message.action in ("create", "seal") and self.namespaces.kept(message.namespace):
            return self._answer_once_saved(info)
        return [info.to_wire()]

    def _answer_once_saved(self, info: NamespaceInfo) -> Deferred:
        """A private record changed: the answer waits until it is saved for the next start."""
        deferred = Deferred([info.to_wire()], 2)  # + 1: settled once the save is started

        def saved(error: BaseException | None) -> None:
            if error is not None:
                deferred.results[0] = ItemError.of(StoreDirectoryError(
                    f"namespace {info.namespace!r} is {'sealed' if info.sealed else 'private'} "
                    f"now, but its record could not be saved beside the store's index ({error}),"
                    f" so a restart would forget it; make the first nvme.dirs folder writable"))
            deferred.settle()

        self.namespaces.save(saved)
        deferred.settle()
        return deferred
