"""Namespace records: the `namespace` request (create, info, seal, grant) on `infinity.daemon.namespaces`.

The records themselves (mode, owner, quota) and the checks every write goes through live in
`infinity.daemon.namespaces.Namespaces`, which the data and stream services ask; this service
only answers the request that creates, describes or seals a record.
"""

from __future__ import annotations

from typing import Any

from infinity.daemon.catalog import Catalog
from infinity.daemon.namespaces import Namespaces
from infinity.daemon.services.base import Routes
from infinity.daemon.sessions import Session
from infinity.protocol import wire


class NamespaceService:
    """The `namespace` request of every session."""

    def __init__(self, namespaces: Namespaces, catalog: Catalog) -> None:
        self.namespaces = namespaces
        self.catalog = catalog

    def routes(self) -> Routes:
        return {wire.NamespaceOp: self.namespace}

    def namespace(self, session: Session, request_id: int, message: wire.NamespaceOp
                  ) -> list[Any]:
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
        return [info.to_wire()]
