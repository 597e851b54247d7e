"""Calls about namespace records: create one (mode, owner, quota, grant token), describe it,
seal it, present its token.

`NamespaceCalls` holds them for the Client; each is one request. A namespace never created is
read-write with no owner and no quota (see `infinity.daemon.namespaces`).
"""

from __future__ import annotations

from infinity.client.session import Session
from infinity.protocol import wire


class NamespaceCalls(Session):
    """The Client's namespace-record calls."""

    def create_namespace(self, name: str, *, mode: str = "read-write",
                         quota_bytes: int = 0, token: str = "") -> wire.NamespaceInfo:
        """Create namespace `name` (before anything is put into it) with this client as its
        owner. mode "read-only": only this client writes it; every other client reads it
        through read-only mappings and gets ReadOnlyNamespaceError for writes. quota_bytes
        (0: none): writes past it get QuotaExceededError. token (at least 16 characters, e.g.
        `secrets.token_hex()`): the namespace is private; only clients that present the token
        (`grant_namespace`) see or touch it, others get NamespaceAccessError."""
        return self._namespace_op(wire.NamespaceOp("create", name, mode, quota_bytes, token))

    def grant_namespace(self, name: str, token: str) -> wire.NamespaceInfo:
        """Present the grant token of private namespace `name`: from then on this client sees
        and touches it as its creator set (mode, quota). A wrong token is NamespaceAccessError;
        a namespace that is not private needs no token."""
        return self._namespace_op(wire.NamespaceOp("grant", name, token=token))

    def namespace_info(self, name: str) -> wire.NamespaceInfo:
        """The record of namespace `name` (one never created: read-write, no owner, no quota)."""
        return self._namespace_op(wire.NamespaceOp("info", name))

    def seal_namespace(self, name: str) -> wire.NamespaceInfo:
        """Stop all writes to a read-only namespace this client owns, its own included, for good."""
        return self._namespace_op(wire.NamespaceOp("seal", name))

    def _namespace_op(self, message: wire.NamespaceOp) -> wire.NamespaceInfo:
        (result,) = self._call(message)
        self._raise_first([result])
        return wire.NamespaceInfo.from_wire(result)
