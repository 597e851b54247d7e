"""Namespace records: each namespace's mode, owner and quota, and the checks writes pass.

A namespace is a string in every request; most are never created and stay what
every namespace was before records existed: read-write, with no owner and no
quota. `create` (the `namespace` op) gives one a record, before anything is put
into it:

- mode "read-write": anyone writes, as before; the record carries the quota.
- mode "read-only": the creating session (its owner) writes it, e.g. to fill it
  with a model's weights; every other client only reads. Its tensors sit in
  segments of their own class (see `arena`), which the fd channel hands to
  everyone but the owner as read-only fds, so the kernel refuses a reader's
  stray write; a write request from a reader (put, reserve, commit, exclusive
  get, delete, write stream) gets ReadOnlyNamespaceError. The owner may `seal`
  it: from then on nobody writes, the owner included (for good: a namespace is
  never unsealed). When the owner's session ends nobody writes it either: a
  session id is never reused, so no later client becomes its owner.
- quota (bytes, 0 for none): a reserve or write stream that would take the
  namespace's current tensors past it gets QuotaExceededError. A reservation
  counts at its reserve against what is published then (the version it would
  replace not counted), so reservations of several names not yet committed at
  once may take it past its quota by what they hold.

- token (optional, any mode): the namespace is private. Only the sessions
  granted it see or touch it: the creating session, and each session that
  presents the token (the `grant` action; `connect(namespace_tokens=...)`).
  Every request that names it from any other session, reads included (get,
  exists, list, info, step, streams, adam_step), gets NamespaceAccessError as a
  whole, checked once per request by the dispatcher (`check_request`); stats
  leave it out, and a not-found error names no private namespace. A token is
  kept as its SHA-256 only. Grants are per session: a restarted job presents
  the token again. This separates the jobs of the daemon's user from each
  other's mistakes; it is not a wall against a hostile process of that same
  user, which may read the daemon's memory anyway (other users are kept out by
  the runtime folder, the sockets and the secret: see `lifecycle`).

Private records (those with a token) are kept, with an NVMe tier, beside the store's index
(`namespace_file`), so a restored tensor's namespace is private again after a restart; a
create or seal of one is answered once it is saved. The other records live as long as the
daemon: they are not kept in the store's index, so
after a restart a restored namespace is read-write again until created anew.
Loop thread only.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

from infinity.daemon import namespace_file
from infinity.daemon.arena import CpuArena
from infinity.daemon.catalog import NamespaceCounters, Version
from infinity.daemon.sessions import Session, shortened
from infinity.errors import (AlreadyExistsError, LimitExceededError, InvalidRequestError, NamespaceAccessError,
                             QuotaExceededError, ReadOnlyNamespaceError)
from infinity.protocol import dtypes
from infinity.protocol.wire import NamespaceInfo, NamespaceOp, ReserveItem, StreamOpen

log = logging.getLogger("infinityd")

READ_WRITE = "read-write"
READ_ONLY = "read-only"
# Namespace actions that name a namespace not granted yet: check_request lets them through.
_UNGUARDED = ("create", "grant")


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def _not_granted(namespace: str) -> str:
    return (f"namespace {namespace!r} is private and this client was not granted it: present "
            f"its grant token first (client.grant_namespace({namespace!r}, token), or "
            f"infinity.connect(namespace_tokens={{{namespace!r}: token}}))")


class NamespaceUsage(Protocol):
    """What the records need of the catalog (`catalog.Catalog`): the bytes of each namespace's
    current tensors, and each name's current version."""

    namespace_counters: dict[str, NamespaceCounters]
    hidden_namespaces: set[str]

    def exists(self, namespace: str, name: str) -> bool: ...

    def current(self, namespace: str, name: str) -> Version: ...


@dataclass(eq=False, slots=True)
class NamespaceRecord:
    name: str
    mode: str
    owner_client: int  # the creating session's id (session ids are never reused)
    owner_name: str
    owner_pid: int
    quota_bytes: int  # 0: none
    sealed: bool = False
    token_digest: bytes = b""  # a private namespace's grant token, as its SHA-256
    owner_uid: int = -1  # the kernel's word on the owner's uid (its fd channel); -1 not known


class Namespaces:
    """The namespace records and the write checks the request handlers call."""

    def __init__(self, usage: NamespaceUsage, arena: CpuArena, *,
                 session_alive: Callable[[int], bool], records_path: str | None = None,
                 run_in_worker: Callable[[Callable[[], None], Callable[[Future[None]], None]],
                                         None] | None = None,
                 max_records: int = 65536, max_per_client: int = 4096) -> None:
        """`records_path` (with an NVMe tier): where the private records are kept across
        restarts (`namespace_file`), written through `run_in_worker`. `max_records`
        (`daemon.max_namespaces`) bounds the records, `max_per_client`
        (`daemon.max_namespaces_per_client`) the namespaces one session touches."""
        self.max_records = max_records
        self.max_per_client = max_per_client
        self._usage = usage
        self._arena = arena
        self._session_alive = session_alive
        self._records: dict[str, NamespaceRecord] = {}
        self._read_only: dict[str, NamespaceRecord] = {}  # the read-only ones, checked on gets
        self._quotas: dict[str, NamespaceRecord] = {}  # the ones with a quota
        self._private: dict[str, NamespaceRecord] = {}  # the ones with a grant token
        self._records_path = records_path
        self._run_in_worker = run_in_worker
        self._saving = False
        self._save_waiters: list[Callable[[BaseException | None], None]] = []
        if records_path is not None:
            for saved in namespace_file.load(records_path):
                # Its owner's session is gone with the daemon that served it: as when an owner
                # leaves, nobody writes a read-only one; the rest is as created.
                self._install(NamespaceRecord(
                    saved["name"], saved["mode"], 0, "", 0, saved["quota_bytes"],
                    saved["sealed"], bytes.fromhex(saved["token_sha256"]), saved["owner_uid"]))

    # --- the namespace op ------------------------------------------------------------

    def create(self, session: Session, namespace: str, *, mode: str, quota_bytes: int,
               has_tensors: bool, token: str = "") -> NamespaceInfo:
        if namespace in self._records:
            raise AlreadyExistsError(
                f"namespace {namespace!r} was created already; describe it with "
                f"client.namespace_info({namespace!r}), or create one of another name")
        if has_tensors:
            raise InvalidRequestError(
                f"namespace {namespace!r} holds tensors already; create a namespace before "
                f"anything is put into it (delete its tensors first, or use another name)")
        if mode not in (READ_WRITE, READ_ONLY):
            raise InvalidRequestError(f"a namespace is 'read-write' or 'read-only', not "
                                      f"{mode[:80]!r}")
        if len(self._records) >= self.max_records:
            raise LimitExceededError(
                f"the daemon holds {len(self._records)} namespace records, its limit "
                f"(daemon.max_namespaces); use a namespace that exists, or raise the limit")
        record = NamespaceRecord(namespace, mode, session.id, session.name, session.pid,
                                 quota_bytes, token_digest=_digest(token) if token else b"",
                                 owner_uid=-1 if session.peer_uid is None else session.peer_uid)
        self._install(record)
        if token:
            session.granted.add(namespace)
        return self.info(namespace)

    def _install(self, record: NamespaceRecord) -> None:
        namespace = record.name
        self._records[namespace] = record
        if record.token_digest:
            self._private[namespace] = record
            self._hidden.add(namespace)
        if record.mode == READ_ONLY:
            self._read_only[namespace] = record
            self._arena.add_namespace_class(namespace)  # its tensors get segments of their own
        if record.quota_bytes:
            self._quotas[namespace] = record

    # --- private records across restarts -----------------------------------------------

    def kept(self, namespace: str) -> bool:
        """Whether `namespace`'s record is saved for the next start (a private one, with an
        NVMe tier): its create and seal are answered once `save` has written them."""
        return self._records_path is not None and namespace in self._private

    def save(self, done: Callable[[BaseException | None], None]) -> None:
        """Write every private record on a worker thread, then `done(error or None)` on the
        loop. One write at a time, each of everything: a later one never lands first."""
        self._save_waiters.append(done)
        if not self._saving:
            self._start_save()

    def _start_save(self) -> None:
        path, run = self._records_path, self._run_in_worker
        assert path is not None and run is not None
        self._saving = True
        waiters, self._save_waiters = self._save_waiters, []
        records = [{"name": r.name, "mode": r.mode, "quota_bytes": r.quota_bytes,
                    "sealed": r.sealed, "owner_uid": r.owner_uid,
                    "token_sha256": r.token_digest.hex()} for r in self._private.values()]

        def written(future: Future[None]) -> None:
            self._saving = False
            error = future.exception()
            if error is not None:
                log.error("the private namespaces' records could not be saved to %s: %s", path,
                          error)
            for waiter in waiters:
                waiter(error)
            if self._save_waiters:
                self._start_save()

        run(lambda: namespace_file.save(path, records), written)

    def seal(self, session: Session, namespace: str) -> NamespaceInfo:
        record = self._read_only.get(namespace)
        if record is None:
            raise InvalidRequestError(
                f"only a read-only namespace can be sealed, and {namespace!r} is not one; "
                f"create it with mode='read-only' first")
        if record.owner_client != session.id:
            raise ReadOnlyNamespaceError(self._refusal(record, "sealed"))
        record.sealed = True
        return self.info(namespace)

    def _used_bytes(self, namespace: str) -> int:
        counters = self._usage.namespace_counters.get(namespace)
        return 0 if counters is None else counters.bytes

    def info(self, namespace: str) -> NamespaceInfo:
        used = self._used_bytes(namespace)
        record = self._records.get(namespace)
        if record is None:
            return NamespaceInfo(namespace, READ_WRITE, False, 0, "", 0, False, 0, used, False)
        return NamespaceInfo(namespace, record.mode, True, record.owner_client, record.owner_name,
                             record.owner_pid, self._session_alive(record.owner_client),
                             record.quota_bytes, used, record.sealed,
                             bool(record.token_digest), record.owner_uid)

    # --- private namespaces: grants ---------------------------------------------------

    def grant(self, session: Session, namespace: str, token: str) -> NamespaceInfo:
        """Grant `namespace` to `session` if `token` is its grant token; a namespace that is
        not private needs none (every client sees it) and is only described."""
        record = self._private.get(namespace)
        if record is not None and namespace not in session.granted:
            if not hmac.compare_digest(_digest(token), record.token_digest):
                log.warning("%s presented a wrong token for private namespace %r",
                            session.describe(), shortened(namespace))
                raise NamespaceAccessError(
                    f"the token presented for namespace {namespace!r} is not its grant token; "
                    f"ask the job that created it for the token")
            session.granted.add(namespace)
        return self.info(namespace)

    def check_request(self, session: Session, message: Any) -> None:
        """NamespaceAccessError when a request names a private namespace not granted to
        `session`; the dispatcher calls it before every handler (each request of a multi too).
        Nothing to look at (the common case) while no namespace is private."""
        private = self._private
        if not private:
            return
        namespace = getattr(message, "namespace", None)
        if namespace is not None:
            # An adam_step's items are names in its one namespace; create and grant name a
            # namespace the session is not granted yet, and check what they need themselves.
            if (namespace in private and namespace not in session.granted
                    and not (type(message) is NamespaceOp and message.action in _UNGUARDED)):
                raise NamespaceAccessError(_not_granted(namespace))
            return
        items = getattr(message, "items", None)
        if items:
            # A get's items are plain (namespace, name, exclusive) triples (wire.Get).
            for name in {item[0] if type(item) is tuple else item.namespace for item in items}:
                if name in private and name not in session.granted:
                    raise NamespaceAccessError(_not_granted(name))

    def hidden_from(self, session: Session) -> set[str]:
        """The private namespaces `session` was not granted: what its stats leave out."""
        return {name for name in self._private if name not in session.granted}

    def admit(self, session: Session, namespaces: Iterable[str]) -> None:
        """Note the namespaces a get, reserve, stream or step of `session` touches (the monitor
        lists them, and each may give the session a scheduler stream), refusing the request
        with LimitExceededError if they would take it past `max_per_client` of them."""
        touched = session.namespaces
        new = [name for name in namespaces if name not in touched]
        if not new:
            return
        if len(touched) + len(set(new)) > self.max_per_client:
            raise LimitExceededError(
                f"this client has touched {len(touched)} namespaces, and this request names "
                f"{len(set(new))} more, past daemon.max_namespaces_per_client "
                f"({self.max_per_client}); use fewer namespaces, or connect again")
        touched.update(new)

    # --- checks, one call at the top of each write handler's loop ------------------------

    def require_writable(self, session: Session, namespace: str) -> None:
        """ReadOnlyNamespaceError unless `session` may write `namespace`."""
        record = self._read_only.get(namespace)
        if record is not None and (record.sealed or record.owner_client != session.id):
            raise ReadOnlyNamespaceError(self._refusal(record, "written"))

    def require_exclusive_gets(self, session: Session,
                               items: Iterable[tuple[str, str, bool]]) -> None:
        """For a get: an exclusive lease is a write in place, refused as any other write.
        Nothing to look at (the common case) while no namespace is read-only."""
        if self._read_only:
            for namespace, _, exclusive in items:
                if exclusive:
                    self.require_writable(session, namespace)

    def require_reserve(self, session: Session, item: ReserveItem) -> None:
        self.require_writable(session, item.namespace)
        if item.namespace in self._quotas:
            self._require_room(item.namespace, item.name,
                               dtypes.tensor_nbytes(item.dtype, item.shape))

    def require_stream(self, session: Session, message: StreamOpen) -> None:
        """A write stream writes as a reserve does; a read stream is not checked."""
        if message.mode == "write":
            self.require_reserve(session, ReserveItem(message.namespace, message.name,
                                                      message.dtype, message.shape))

    def _require_room(self, namespace: str, name: str, nbytes: int) -> None:
        quota = self._quotas[namespace].quota_bytes
        usage = self._usage
        replaced = usage.current(namespace, name).nbytes if usage.exists(namespace, name) else 0
        after = self._used_bytes(namespace) - replaced + nbytes
        if after > quota:
            raise QuotaExceededError(
                f"tensor {name!r} of {nbytes} bytes would take namespace {namespace!r} to "
                f"{after} bytes, past its quota of {quota}; delete tensors of it first, or put "
                f"this one into another namespace")

    @property
    def _hidden(self) -> set[str]:
        """The private namespaces, which a not-found error's hint never names (the catalog's)."""
        return self._usage.hidden_namespaces

    @staticmethod
    def _refusal(record: NamespaceRecord, verb: str) -> str:
        why = ("it was sealed" if record.sealed else
               f"only its owner, client {record.owner_client} ({record.owner_name!r}, pid "
               f"{record.owner_pid}), writes it")
        return (f"namespace {record.name!r} is read-only and cannot be {verb} by this client: "
                f"{why}; read it with get, or write into a namespace of your own")

    # --- for the arena and the fd channel ------------------------------------------------

    def segment_class(self, namespace: str) -> str | None:
        """The class of the segments a namespace's tensors are placed in: its own for a
        read-only namespace, the default (None) for every other (the arena keeps the classes)."""
        return self._arena.class_for(namespace)

    def may_map_writable(self, session: Session, segment_class: str) -> bool:
        """Whether a session gets a read-write fd for a segment of `segment_class`: only the
        owner of an unsealed read-only namespace does (a read-only one for everyone else)."""
        record = self._read_only.get(segment_class)
        return record is None or (not record.sealed and record.owner_client == session.id)

