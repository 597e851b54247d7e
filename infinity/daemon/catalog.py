"""The catalog: named tensors in namespaces, their versions, leases and reservations.

It knows nothing about sockets or processes: a client is an integer id. Where
the bytes live is the business of the `Storage` below it (the tier manager,
`infinity.daemon.tiers`, built before the catalog): the catalog asks it for
fresh slices, and tells it when a version becomes or stops being its name's
current one, when it was written in place, and when the catalog let go of a
version (not current, no lease), so that its CPU slice and NVMe copy are freed
once no I/O is on it. Rules it enforces:

- `commit` publishes a reservation as the name's new version in one step;
  readers of the old version keep it (and its bytes) until they release.
- A version under a lease is never freed or moved. A shared lease excludes an
  exclusive one on the same version and the other way round.
- Counters (tensors, bytes, leases, per namespace) are kept as work happens,
  never recomputed by walking the catalog.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

from infinity.daemon.arena import CpuSlice
from infinity.daemon.diskcopy import DiskCopy
from infinity.errors import (InfinityError, InvalidRequestError, LeaseError, LimitExceededError,
                             NotFoundError)
from infinity.protocol import dtypes
from infinity.protocol.wire import MAX_NAME_CHARS, MAX_NAMESPACE_CHARS, Placement, pack_result

# A not-found error names at most this many other namespaces holding the name, found among at
# most this many namespaces.
HINT_MAX_NAMESPACES_NAMED = 3
HINT_MAX_NAMESPACES_LOOKED = 256

Key = tuple[str, str]  # (namespace, name)


def version_clock() -> Iterator[int]:
    """The increasing numbers that stamp versions, and order a delete's index update after
    every version stamped before it: built first, handed to the catalog and the tiers."""
    return itertools.count(1)


class Storage(Protocol):
    """What the catalog needs of the tiers below it (implemented by `tiers.TierManager`)."""

    def allocate(self, nbytes: int, *, what: str, segment_class: str | None = None) -> CpuSlice:
        """A fresh CPU slice; may raise SpaceShortage (wait and retry) or a typed error."""
        ...

    def allocate_spare(self, nbytes: int, *, what: str,
                       segment_class: str | None = None) -> CpuSlice | None:
        """A fresh CPU slice from room the tier already has, or None: never by evicting or
        waiting (a spare reservation is worth less than any tensor). Where the budget allows,
        it starts the tier's growth for the next spare."""
        ...

    def free(self, piece: CpuSlice) -> None:
        """An aborted reservation's slice."""
        ...

    def published(self, version: Version) -> None:
        """`version` just became its name's current version."""
        ...

    def unpublished(self, version: Version) -> None:
        """`version` is no longer current (replaced or deleted); it may still be held."""
        ...

    def written(self, version: Version) -> None:
        """An exclusive lease ended: the bytes may have changed (dirty)."""
        ...

    def released(self, version: Version) -> None:
        """The catalog holds `version` no more (not current, no lease): free its CPU slice and
        NVMe copy, once no I/O is on it."""
        ...

    def kept_versions(self) -> tuple[int, int]:
        """(versions, bytes) published and not freed yet."""
        ...


@dataclass(eq=False, slots=True)
class Version:
    """One immutable-by-contract copy of a tensor: written once through a reservation, then published.

    Its bytes are in the CPU tier (`cpu`), on NVMe (`nvme`, a clean copy), or
    both; `cpu` and `nvme` are both None only for a tensor of zero bytes.
    `dirty` means the CPU copy has no clean NVMe copy yet. These placement slots
    are set here when the version is installed and changed after that only by
    the tier modules (`infinity.daemon.residency` keeps the index of resident
    versions over them); they stay on the version so that a get reads its
    placement without a lookup. What the tiers keep of a version besides
    (loads, write-backs) is theirs, keyed by the version.
    """

    key: Key
    stamp: int  # catalog-wide increasing version number
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    cpu: CpuSlice | None
    current: bool = True
    shared: int = 0
    exclusive: int = 0  # client id of the exclusive holder, 0 if none
    # The exclusive holder was sent the placement, so it may have written: only then does the
    # lease's end make the NVMe copy stale (one ended while the tensor loaded wrote nothing).
    exclusive_handed: bool = False
    dirty: bool = True  # written in place (exclusive lease) or never written back
    # The placement's wire form and its packed reply item (`wire.pack_result`), built when the
    # version lands in the CPU tier (`set_placement`): every get of this version answers with
    # them as they are. Empty while it is not resident.
    wire: list[Any] = field(default_factory=list)
    packed: bytes = b""
    nvme: DiskCopy | None = None
    edits: int = 0  # exclusive leases granted so far: a write-back that saw fewer is stale
    released: bool = False  # not current and unheld: handed to the tiers to be freed

    @property
    def tier(self) -> str:
        """Where its bytes are: "cpu", "nvme" or "cpu+nvme"."""
        if self.cpu is None:
            return "nvme" if self.nvme is not None else "cpu"
        return "cpu+nvme" if self.nvme is not None and not self.dirty else "cpu"


def set_placement(version: Version) -> None:
    """Record where a version now is (its `cpu` slice; segment -1: zero bytes) in the forms
    gets answer with; `clear_placement` when it leaves the CPU tier."""
    cpu = version.cpu
    version.wire = Placement(-1 if cpu is None else cpu.segment, 0 if cpu is None else cpu.offset,
                             version.nbytes, version.dtype, version.shape, version.stamp,
                             version.edits).to_wire()
    version.packed = pack_result(version.wire)


def clear_placement(version: Version) -> None:
    version.wire = []
    version.packed = b""


@dataclass(eq=False, slots=True)
class Lease:
    """The versions one get request leased: released together, by the get's request id."""

    id: int  # unique per client, not across clients
    client: int
    holds: list[tuple[Version, bool]]  # (version, exclusive)


@dataclass(eq=False, slots=True)
class Reservation:
    id: int
    client: int
    key: Key
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    cpu: CpuSlice | None
    # Made by `renew` for the client's next put of the name, not asked for: a plain `commit`
    # from the client takes it all the same (the client library hands it out from `reserve`).
    spare: bool = False


@dataclass(slots=True)
class NamespaceCounters:
    tensors: int = 0
    bytes: int = 0


@dataclass(eq=False, slots=True)
class _Holdings:
    """What one client holds, so that a dead client is cleaned up without a scan."""

    leases: dict[int, Lease] = field(default_factory=dict)
    reservations: dict[Key, Reservation] = field(default_factory=dict)
    held_bytes: int = 0  # of the versions its leases hold (one held twice counts twice)
    num_held: int = 0  # versions its leases hold (one held twice counts twice)
    reserved_bytes: int = 0  # of its reservations (spares included)


def check_key(namespace: str, name: str) -> None:
    if not namespace or len(namespace) > MAX_NAMESPACE_CHARS or "\x00" in namespace:
        raise InvalidRequestError(
            f"namespace {namespace[:80]!r} is not valid: use 1 to {MAX_NAMESPACE_CHARS} "
            f"characters without NUL")
    if not name or len(name) > MAX_NAME_CHARS or "\x00" in name:
        raise InvalidRequestError(
            f"tensor name {name[:80]!r} is not valid: use 1 to {MAX_NAME_CHARS} characters "
            f"without NUL")


class Catalog:
    """Names, versions, leases and reservations. Loop thread only (not thread-safe)."""

    def __init__(self, storage: Storage, *, clock: Iterator[int] | None = None,
                 spare_budget_bytes: int = 0,
                 segment_class_of: Callable[[str], str | None] = lambda namespace: None,
                 max_tensors: int = 1 << 20, max_leased_per_client: int = 1 << 20) -> None:
        """`clock`: the stamp counter shared with the tiers (`version_clock()`).
        `segment_class_of`: the class of the segments a namespace's slices come from (the
        arena's `class_for`). `max_tensors` (`daemon.max_tensors`) bounds the tensors and
        reservations, `max_leased_per_client` (`daemon.max_leased_per_client`) the versions
        one client's leases hold: what a budget or quota does not bound (a tensor of no
        elements takes no tier bytes, and a lease none of its own)."""
        self.max_tensors = max_tensors
        self.max_leased_per_client = max_leased_per_client
        self._space = storage
        self.spare_budget_bytes = spare_budget_bytes
        self.segment_class_of = segment_class_of
        self._namespaces: dict[str, dict[str, Version]] = {}
        self._holdings: dict[int, _Holdings] = {}
        self._ids = itertools.count(1)
        self._internal_lease_ids = itertools.count(1)  # leases held as DAEMON_CLIENT_ID
        self._stamps = clock if clock is not None else version_clock()
        # Counters, kept as work happens.
        self.namespace_counters: dict[str, NamespaceCounters] = {}
        # Private namespaces (see `namespaces`): a not-found error's hint never names them.
        self.hidden_namespaces: set[str] = set()
        self.num_tensors = 0
        self.tensor_bytes = 0  # current versions
        self.num_exclusive = 0
        self.num_leases = 0
        self.num_held = 0  # tensors held under leases (a lease holds one or more)
        self.leased_bytes = 0  # of the versions held by any lease, each counted once
        self.num_reservations = 0
        self.reserved_bytes = 0
        self.num_spares = 0  # of the reservations, those `renew` made
        self.spare_bytes = 0

    # --- lookups ------------------------------------------------------------------

    def _current(self, namespace: str, name: str) -> Version:
        entries = self._namespaces.get(namespace)
        version = entries.get(name) if entries is not None else None
        if version is None:
            check_key(namespace, name)
            raise NotFoundError(f"no tensor {name!r} in namespace {namespace!r}"
                                f"{self._elsewhere_hint(name)}")
        return version

    def _elsewhere_hint(self, name: str) -> str:
        """Where else the name exists, for a not-found error: a few namespaces, from a bounded
        look (on the loop thread, once per missing item: a store of many namespaces must not
        make a batch of misses slow, nor its errors large)."""
        elsewhere: list[str] = []
        for looked, (namespace, names) in enumerate(self._namespaces.items()):
            if looked == HINT_MAX_NAMESPACES_LOOKED or len(elsewhere) > HINT_MAX_NAMESPACES_NAMED:
                break
            if name in names and namespace not in self.hidden_namespaces:
                elsewhere.append(namespace)
        if not elsewhere:
            return "; put or reserve+commit it first"
        named = ", ".join(repr(n) for n in elsewhere[:HINT_MAX_NAMESPACES_NAMED])
        more = " and others" if len(elsewhere) > HINT_MAX_NAMESPACES_NAMED else ""
        return f"; it exists in namespace(s) {named}{more}"

    def current(self, namespace: str, name: str) -> Version:
        """The name's current version; NotFoundError (with a hint) when there is none."""
        return self._current(namespace, name)

    def current_versions(self) -> Iterator[Version]:
        """Every name's current version (a walk: for rare, store-wide requests such as flush)."""
        for entries in list(self._namespaces.values()):
            yield from list(entries.values())

    def internal_lease_id(self) -> int:
        """A fresh lease id for work the daemon does for itself (held as `DAEMON_CLIENT_ID`):
        one counter for every part of the daemon, so their leases never share an id."""
        return next(self._internal_lease_ids)

    def next_stamp(self) -> int:
        """A number above every version stamp handed out so far (orders index updates)."""
        return next(self._stamps)

    def exists(self, namespace: str, name: str) -> bool:
        check_key(namespace, name)
        entries = self._namespaces.get(namespace)
        return entries is not None and name in entries

    def listing(self, namespace: str, prefix: str, *, after: str = "",
                limit: int | None = None) -> list[Version]:
        """The current versions of `namespace` whose names start with `prefix` and sort after
        `after`, in name order, at most `limit`."""
        entries = self._namespaces.get(namespace, {})
        names = sorted(n for n in entries if n.startswith(prefix) and n > after)
        return [entries[n] for n in (names if limit is None else names[:limit])]

    def holder_of(self, client: int) -> _Holdings:
        holdings = self._holdings.get(client)
        if holdings is None:
            holdings = self._holdings[client] = _Holdings()
        return holdings

    def client_counts(self, client: int) -> tuple[int, int]:
        """(leases, reservations) a client holds."""
        holdings = self._holdings.get(client)
        return (0, 0) if holdings is None else (len(holdings.leases), len(holdings.reservations))

    def client_bytes(self, client: int) -> tuple[int, int]:
        """(bytes its leases hold, bytes it has reserved): what the client keeps in the CPU
        tier, kept as leases and reservations come and go."""
        holdings = self._holdings.get(client)
        return (0, 0) if holdings is None else (holdings.held_bytes, holdings.reserved_bytes)

    # --- leases -------------------------------------------------------------------

    def acquire(self, client: int, lease_id: int, items: Sequence[tuple[str, str, bool]]
                ) -> tuple[Lease | None, list[Version | InfinityError]]:
        """Lease each (namespace, name, exclusive) under the lease `lease_id` (the get's request
        id); an item that cannot be leased gets its error in place. The lease is None when no
        item could be leased."""
        holdings = self.holder_of(client)
        if lease_id in holdings.leases:
            error: InfinityError = LeaseError(
                f"lease {lease_id} is still held: a get's request id names its lease, so "
                f"request ids must not be reused")
            return None, [error] * len(items)
        # The daemon's own leases (a negative id) are bounded by its work, not by this.
        if client > 0 and holdings.num_held + len(items) > self.max_leased_per_client:
            error = LimitExceededError(
                f"this client holds {holdings.num_held} tensors under leases and asked for "
                f"{len(items)} more, past daemon.max_leased_per_client "
                f"({self.max_leased_per_client}); release what it is done with (drop the "
                f"tensors a get returned) first")
            return None, [error] * len(items)
        lease: Lease | None = None
        results: list[Version | InfinityError] = []
        namespaces = self._namespaces
        held = 0
        for namespace, name, exclusive in items:
            entries = namespaces.get(namespace)
            version = entries.get(name) if entries is not None else None
            try:
                if version is None:
                    version = self._current(namespace, name)  # raises the right error
                if version.exclusive:
                    raise LeaseError(
                        f"tensor {name!r} in namespace {namespace!r} is leased exclusively by "
                        f"client {version.exclusive}; wait until it releases, or write a new "
                        f"version with reserve+commit")
                if exclusive and version.shared:
                    raise LeaseError(
                        f"tensor {name!r} in namespace {namespace!r} has {version.shared} shared "
                        f"lease(s); an exclusive lease needs none; write a new version with "
                        f"reserve+commit instead")
            except InfinityError as exc:
                # Kept without its traceback: the traceback holds this frame, whose `results`
                # holds the error, a cycle per failed item that only the daemon's rare full
                # collections would free (a batch of 65,536 missing names grew it 12 MiB).
                results.append(exc.with_traceback(None))
                continue
            if lease is None:
                lease = Lease(lease_id, client, [])
            if not version.shared and not version.exclusive:
                self.leased_bytes += version.nbytes
            held += version.nbytes
            if exclusive:
                version.exclusive = client
                self.num_exclusive += 1
                version.edits += 1  # a write-back under way no longer describes what will be there
                if version.wire:  # resident: its placement carries the new count from this get on
                    set_placement(version)
                    version.exclusive_handed = True  # in this get's reply
            else:
                version.shared += 1
            lease.holds.append((version, exclusive))
            results.append(version)
        if lease is not None:
            holdings.leases[lease_id] = lease
            holdings.held_bytes += held
            holdings.num_held += len(lease.holds)
            self.num_leases += 1
            self.num_held += len(lease.holds)
        return lease, results

    def release(self, client: int, lease_id: int) -> None:
        holdings = self._holdings.get(client)
        lease = holdings.leases.pop(lease_id, None) if holdings is not None else None
        if lease is None:
            raise LeaseError(f"lease {lease_id} is not held by this client (released twice?)")
        self.num_leases -= 1
        self.num_held -= len(lease.holds)
        holdings.num_held -= len(lease.holds)  # type: ignore[union-attr]
        for version, exclusive in lease.holds:
            holdings.held_bytes -= version.nbytes  # type: ignore[union-attr]
            self._unhold(version, exclusive)

    def _unhold(self, version: Version, exclusive: bool) -> None:
        if exclusive:
            version.exclusive = 0
            self.num_exclusive -= 1
            if version.exclusive_handed:
                version.exclusive_handed = False
                self._space.written(version)  # written in place: the NVMe copy is stale
        else:
            version.shared -= 1
        if not version.shared and not version.exclusive:
            self.leased_bytes -= version.nbytes
        self._maybe_free(version)

    def handed_out(self, client: int, version: Version) -> None:
        """The version's placement goes to the client in a reply now (a get that waited for
        its load): if the client holds it exclusively, it may write from now on."""
        if version.exclusive == client:
            version.exclusive_handed = True

    def drop_hold(self, client: int, lease_id: int, version: Version) -> None:
        """Take one version out of a lease (its load failed, so the get reports an error for it);
        a lease left empty ends. Nothing happens if the lease is gone (the client went away)."""
        holdings = self._holdings.get(client)
        lease = holdings.leases.get(lease_id) if holdings is not None else None
        if lease is None:
            return
        for i, (held, exclusive) in enumerate(lease.holds):
            if held is version:
                del lease.holds[i]
                self.num_held -= 1
                holdings.num_held -= 1  # type: ignore[union-attr]
                holdings.held_bytes -= version.nbytes  # type: ignore[union-attr]
                if not lease.holds:
                    del holdings.leases[lease_id]  # type: ignore[union-attr]
                    self.num_leases -= 1
                if exclusive:  # nothing was written: it was never handed out
                    version.exclusive = 0
                    version.exclusive_handed = False
                    self.num_exclusive -= 1
                    self.leased_bytes -= version.nbytes  # an exclusive hold is the only one
                    self._maybe_free(version)
                else:
                    self._unhold(version, False)
                return

    # --- writes ---------------------------------------------------------------------

    def reserve(self, client: int, namespace: str, name: str, dtype: str,
                shape: tuple[int, ...]) -> Reservation:
        """A fresh slice for the client to fill. May raise SpaceShortage from the space provider."""
        check_key(namespace, name)
        nbytes = dtypes.tensor_nbytes(dtype, shape)
        key = (namespace, name)
        holdings = self.holder_of(client)
        if key in holdings.reservations:
            raise LeaseError(
                f"this client already holds a reservation for {name!r} in namespace "
                f"{namespace!r}; commit or abort it first")
        self.check_room_for(key)
        cpu = self._space.allocate(nbytes, what=f"tensor {name!r}",
                                   segment_class=self.segment_class_of(namespace)) if nbytes else None
        reservation = Reservation(next(self._ids), client, key, dtype, shape, nbytes, cpu)
        holdings.reservations[key] = reservation
        holdings.reserved_bytes += nbytes
        self.num_reservations += 1
        self.reserved_bytes += nbytes
        return reservation

    def check_room_for(self, key: Key) -> None:
        """Refuse a new tensor (a name with no current version) past `max_tensors` tensors and
        reservations together, and any reservation past `max_tensors` reservations: so a
        store at the limit still rewrites what it holds, and tensors stay below twice the
        limit even when a reserved name is deleted before its commit. Spare reservations
        (`renew`) do not count: they are never of zero bytes, so the spare budget bounds them."""
        entries = self._namespaces.get(key[0])
        new = entries is None or key[1] not in entries
        reservations = self.num_reservations - self.num_spares
        if (reservations >= self.max_tensors
                or (new and self.num_tensors + reservations >= self.max_tensors)):
            raise LimitExceededError(
                f"the store holds {self.num_tensors} tensors and {reservations} "
                f"reservations, its limit (daemon.max_tensors = {self.max_tensors}); delete "
                f"tensors it no longer needs, or raise the limit")

    def renew(self, client: int, version: Version) -> Reservation | None:
        """A spare reservation of `version`'s name, dtype and shape for the client's next put of
        it, made right after the client published `version`; None when the client already
        holds a reservation of the name, the spare budget is spent or the tier has no free room."""
        holdings = self.holder_of(client)
        nbytes = version.nbytes
        # Charged at what the slice takes (4 KiB-rounded), or small tensors would hold far
        # more of the tier than the budget says. Zero-byte tensors get none: nothing to save.
        charge = -(-nbytes // 4096) * 4096
        if (not nbytes or version.key in holdings.reservations
                or self.spare_bytes + charge > self.spare_budget_bytes):
            return None
        cpu = self._space.allocate_spare(nbytes, what=f"a spare slice of {version.key[1]!r}",
                                         segment_class=self.segment_class_of(version.key[0]))
        if cpu is None:
            return None
        reservation = Reservation(next(self._ids), client, version.key, version.dtype,
                                  version.shape, nbytes, cpu, spare=True)
        holdings.reservations[version.key] = reservation
        holdings.reserved_bytes += nbytes
        self.num_reservations += 1
        self.reserved_bytes += nbytes
        self.num_spares += 1
        self.spare_bytes += cpu.length
        return reservation

    def _take_reservation(self, client: int, namespace: str, name: str) -> Reservation:
        holdings = self._holdings.get(client)
        reservation = holdings.reservations.pop((namespace, name), None) if holdings else None
        if reservation is None:
            check_key(namespace, name)
            raise LeaseError(
                f"this client holds no reservation for {name!r} in namespace {namespace!r}; "
                f"reserve it first")
        self.num_reservations -= 1
        self.reserved_bytes -= reservation.nbytes
        holdings.reserved_bytes -= reservation.nbytes  # type: ignore[union-attr]
        if reservation.spare:
            assert reservation.cpu is not None  # spares are never of zero bytes
            self.num_spares -= 1
            self.spare_bytes -= reservation.cpu.length
        return reservation

    def commit(self, client: int, namespace: str, name: str) -> Version:
        reservation = self._take_reservation(client, namespace, name)
        return self.install(reservation.key, reservation.dtype, reservation.shape,
                            reservation.nbytes, cpu=reservation.cpu, dirty=True)

    def install(self, key: Key, dtype: str, shape: tuple[int, ...], nbytes: int, *,
                cpu: CpuSlice | None, dirty: bool, nvme: DiskCopy | None = None) -> Version:
        """Publish a new version of `key` whose bytes are already in place: a committed
        reservation (CPU), a streamed write (NVMe), or a flushed tensor found at start-up."""
        namespace, name = key
        check_key(namespace, name)
        version = Version(key, next(self._stamps), dtype, shape, nbytes, cpu, dirty=dirty,
                          nvme=nvme)
        if cpu is not None or not nbytes:  # on NVMe only: placed when a load brings it in
            set_placement(version)
        entries = self._namespaces.setdefault(namespace, {})
        counters = self.namespace_counters.setdefault(namespace, NamespaceCounters())
        old = entries.get(name)
        entries[name] = version
        counters.tensors += 1
        counters.bytes += version.nbytes
        self.num_tensors += 1
        self.tensor_bytes += version.nbytes
        self._space.published(version)
        if old is not None:
            self._unpublish(old)
        return version

    def abort(self, client: int, namespace: str, name: str) -> None:
        reservation = self._take_reservation(client, namespace, name)
        if reservation.cpu is not None:
            self._space.free(reservation.cpu)

    def delete(self, namespace: str, name: str) -> Version:
        version = self._current(namespace, name)
        entries = self._namespaces[namespace]
        del entries[name]
        if not entries:
            del self._namespaces[namespace]
        self._unpublish(version)
        return version

    def _unpublish(self, version: Version) -> None:
        """The version is no longer its name's current one; free it unless someone holds it."""
        version.current = False
        self._space.unpublished(version)
        namespace = version.key[0]
        counters = self.namespace_counters[namespace]
        counters.tensors -= 1
        counters.bytes -= version.nbytes
        if not counters.tensors:
            del self.namespace_counters[namespace]
        self.num_tensors -= 1
        self.tensor_bytes -= version.nbytes
        self._maybe_free(version)

    def _maybe_free(self, version: Version) -> None:
        if version.current or version.shared or version.exclusive or version.released:
            return
        version.released = True
        self._space.released(version)

    @property
    def num_versions(self) -> int:
        """Versions not freed yet: current, superseded but leased, or with I/O on them."""
        return self._space.kept_versions()[0]

    @property
    def version_bytes(self) -> int:
        return self._space.kept_versions()[1]

    # --- clients going away ------------------------------------------------------------

    def drop_client(self, client: int) -> tuple[int, int]:
        """Release every lease and discard every reservation of a client; returns their counts."""
        holdings = self._holdings.get(client)
        if holdings is None:
            return 0, 0
        counts = len(holdings.leases), len(holdings.reservations)
        for lease_id in list(holdings.leases):
            self.release(client, lease_id)
        for key in list(holdings.reservations):
            self.abort(client, *key)
        del self._holdings[client]
        return counts

    def stats(self) -> dict[str, object]:
        return {
            "num_tensors": self.num_tensors,
            "tensor_bytes": self.tensor_bytes,
            "num_versions": self.num_versions,
            "version_bytes": self.version_bytes,
            "num_leases": self.num_leases,
            "num_leased_tensors": self.num_held,
            "leased_bytes": self.leased_bytes,
            "num_exclusive_leases": self.num_exclusive,
            "num_reservations": self.num_reservations,
            "reserved_bytes": self.reserved_bytes,
            "num_spare_reservations": self.num_spares,
            "spare_bytes": self.spare_bytes,
            "namespaces": {ns: {"tensors": c.tensors, "bytes": c.bytes}
                           for ns, c in sorted(self.namespace_counters.items())},
        }
