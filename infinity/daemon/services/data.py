"""Data: the requests that lease, write, remove and look up tensors.

get / get_ahead lease versions (waiting for loads from NVMe where needed),
release ends leases, reserve / commit / commit_renew / abort write new
versions, commit_durable and flush_store make them durable, delete, exists
and list look names up, prefetch hints. The catalog keeps what is where; the
tiers move bytes; the scheduler sees each client access through the steps
service's streams.

Requests that need work off the loop are answered later, never waited for: a
`reserve` that needs CPU space (a new segment, or victims being written back)
is parked and resumes where it stopped; a `get` of tensors that are only on
NVMe is answered once their loads completed (concurrent gets share a load);
`commit_durable`, `flush_store` and the `delete` of a flushed tensor once the
index committed.

Checks on what a request may do to a namespace (its mode, its owner) go at the
top of the handler that does it, before the catalog is asked: `get` (an
exclusive lease writes), `reserve` (a put), the commits.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence, cast

from infinity.daemon.arena import SpaceShortage
from infinity.daemon.catalog import Catalog, Reservation, Version
from infinity.daemon.scheduler import AccessKind, Scheduler, StreamKey
from infinity.daemon.namespaces import Namespaces
from infinity.daemon.services.base import DaemonCounters, Deferred, Packed, Routes
from infinity.daemon.services.prefetch import PrefetchPlanner
from infinity.daemon.services.steps import StepService
from infinity.daemon.sessions import Session
from infinity.daemon.tiers import TierManager
from infinity.errors import InfinityError
from infinity.protocol import wire
from infinity.protocol.wire import Placement, ReserveItem

log = logging.getLogger("infinityd")


@dataclass(eq=False, slots=True)
class _ParkedReserve:
    """A reserve request, maybe waiting for the tier to grow; `index` is the item to resume at."""

    session: Session
    items: tuple[ReserveItem, ...]
    results: list[Any]
    index: int = 0
    deferred: Deferred | None = None  # made when it first parks: its reply comes later


def reserved_placement(reservation: Reservation) -> list[Any]:
    """A reservation's slice on the wire (version 0: not published)."""
    cpu = reservation.cpu
    return Placement(-1 if cpu is None else cpu.segment, 0 if cpu is None else cpu.offset,
                     reservation.nbytes, reservation.dtype, reservation.shape, 0).to_wire()


def _stall_end(session: Session, scheduler: Scheduler, stream: StreamKey) -> Callable[[], None]:
    """What ends a client's stall on a get: its reply goes (if it is still there to get it)."""
    def finished() -> None:
        if session.alive:
            scheduler.wait_finished(stream, time.monotonic())
    return finished


class DataService:
    """The tensor requests of `wire`, on the catalog, the tiers and the scheduler."""

    def __init__(self, catalog: Catalog, tiers: TierManager, scheduler: Scheduler | None,
                 steps: StepService, planner: PrefetchPlanner, counters: DaemonCounters,
                 namespaces: Namespaces) -> None:
        self.catalog = catalog
        self.namespaces = namespaces
        self.tiers = tiers
        self.scheduler = scheduler
        # The residency the scheduler asks: a read's size and a deletion go there first.
        self.tensors = tiers.residency.tensors
        self.steps = steps
        self.planner = planner
        self.counters = counters
        self.closing = False  # the daemon stops: parked requests are not resumed

    def routes(self) -> Routes:
        return {
            wire.Get: self.get, wire.GetAhead: self.get_ahead, wire.Release: self.release,
            wire.Reserve: self.reserve, wire.Commit: self.commit,
            wire.CommitRenew: self.commit_renew, wire.CommitDurable: self.commit_durable,
            wire.FlushStore: self.flush_store, wire.Abort: self.abort,
            wire.Prefetch: self.prefetch, wire.Delete: self.delete, wire.Exists: self.exists,
            wire.ListTensors: self.list_tensors,
        }

    def client_gone(self, session: Session) -> str:
        """The session ends: what it holds goes back (a phrase for the log says what)."""
        leases, reservations = self.catalog.drop_client(session.id)
        return f"released {leases} lease(s), discarded {reservations} reservation(s)"

    # --- leases ------------------------------------------------------------------------

    def get_ahead(self, session: Session, request_id: int, message: wire.GetAhead
                  ) -> list[Any] | Packed | Deferred:
        return self.get(session, request_id, message, track=False)

    def get(self, session: Session, request_id: int, message: wire.Get, *, track: bool = True
            ) -> list[Any] | Packed | Deferred:
        """track=False (get_ahead): unseen by the scheduler, and only what the CPU tier holds
        now is leased; an item on NVMe alone is answered nil, neither loaded nor waited for
        (the client would block on a load the scheduler did not plan)."""
        self.namespaces.require_exclusive_gets(session, message.items)  # an exclusive get writes
        # (decoded items are plain tuples: namespace first)
        self.namespaces.admit(session, {item[0] for item in message.items})
        _, outcomes = self.catalog.acquire(session.id, request_id, message.items)
        results: list[Any] = []
        nbytes = 0
        missing: list[int] | None = None  # items only on NVMe: the reply waits for their loads
        scheduler = self.scheduler if track else None
        stream: StreamKey | None = None
        now = 0.0
        plan_now = failed = False
        sizes = self.tensors.sizes  # the last size seen of each read, for the scheduler
        if scheduler is not None:
            now = time.monotonic()
        for outcome in outcomes:
            if type(outcome) is Version:
                if scheduler is not None:
                    # Before any load starts, so that a miss counts as one.
                    stream = self.steps.stream_of(session, outcome.key[0])
                    sizes[outcome.key] = outcome.nbytes
                    kind = scheduler.touched(stream, outcome.key, outcome.nbytes, now)
                    plan_now = plan_now or kind is not AccessKind.RESIDENT_HIT
                if outcome.cpu is None and outcome.nbytes and not track:
                    self.catalog.drop_hold(session.id, request_id, outcome)
                    results.append(None)
                    failed = True  # not all leased: the plain reply, which carries the nils
                    continue
                if outcome.cpu is None and outcome.nbytes:
                    if missing is None:
                        missing = []
                    missing.append(len(results))
                    results.append(None)
                else:
                    results.append(outcome.wire)
                nbytes += outcome.nbytes
            else:
                results.append(self.counters.item_error(session, outcome))  # type: ignore[arg-type]
                failed = True
        if plan_now:
            self.planner.due = True
        elif scheduler is not None:
            self.planner.lazily()
        counters = session.counters
        counters.gets += len(outcomes)
        counters.items += len(outcomes)
        counters.get_bytes += nbytes
        self.counters.items += len(outcomes)
        self.counters.bytes_leased += nbytes
        if missing is None:
            if not failed:  # every item resident and leased: join their packed placements
                return Packed([cast(Version, o).packed for o in outcomes])
            return results
        self.counters.deferred_replies += 1
        deferred = Deferred(results, len(missing) + 1)  # + 1: settled below, once all started
        if scheduler is not None and stream is not None:
            deferred.when_done = _stall_end(session, scheduler, stream)
            scheduler.wait_started(stream, now)
        for i in missing:
            version = cast(Version, outcomes[i])
            try:
                if self.tiers.ensure_resident(version, lambda error, i=i, v=version: (  # type: ignore[misc]
                        self._get_loaded(session, request_id, deferred, i, v, error, loaded=True)),
                        stream=stream):
                    # An earlier item loaded it.
                    self._get_loaded(session, request_id, deferred, i, version, None)
                else:
                    counters.load_waits += 1
            except InfinityError as exc:
                self._get_loaded(session, request_id, deferred, i, version, exc)
        deferred.settle()
        return deferred

    def _get_loaded(self, session: Session, lease_id: int, deferred: Deferred, i: int,
                    version: Version, error: InfinityError | None, *, loaded: bool = False) -> None:
        if error is None:
            deferred.results[i] = version.wire
            self.catalog.handed_out(session.id, version)
            if loaded:
                session.counters.load_bytes += version.nbytes
        else:
            # The item fails; what the lease holds of it goes back now.
            self.catalog.drop_hold(session.id, lease_id, version)
            deferred.results[i] = self.counters.item_error(session, error)
        deferred.settle()

    def release(self, session: Session, request_id: int, message: wire.Release) -> None:
        self.release_ids(session, message.lease_ids)

    def release_ids(self, session: Session, lease_ids: Sequence[int]) -> None:
        """End leases (a release request's, or those riding along another request)."""
        for lease_id in lease_ids:
            try:
                self.catalog.release(session.id, lease_id)
            except InfinityError as exc:  # no reply to carry it: count it
                self.counters.item_error(session, exc)
                log.debug("%s: %s", session.describe(), exc)
        session.counters.releases += len(lease_ids)

    # --- writes ------------------------------------------------------------------------

    def reserve(self, session: Session, request_id: int, message: wire.Reserve
                ) -> list[Any] | Deferred:
        self.namespaces.admit(session, {item.namespace for item in message.items})
        return self._continue_reserve(_ParkedReserve(session, message.items, []))

    def _continue_reserve(self, request: _ParkedReserve) -> list[Any] | Deferred:
        session = request.session
        while request.index < len(request.items):
            item = request.items[request.index]
            try:
                self.namespaces.require_reserve(session, item)  # mode, owner and quota
                reservation = self.catalog.reserve(session.id, item.namespace, item.name,
                                                   item.dtype, item.shape)
            except SpaceShortage:
                # A segment is being created or victims are being written back: resume then.
                self.counters.parked_requests += 1
                if request.deferred is None:
                    request.deferred = Deferred(request.results)
                self.tiers.when_space(lambda error: self._resume_reserve(request, error))
                return request.deferred
            except InfinityError as exc:
                request.results.append(self.counters.item_error(session, exc))
            else:
                request.results.append(reserved_placement(reservation))
                session.counters.reserve_bytes += reservation.nbytes
                self.counters.bytes_reserved += reservation.nbytes
            request.index += 1
        session.counters.reserves += len(request.items)
        session.counters.items += len(request.items)
        self.counters.items += len(request.items)
        if request.deferred is not None:
            request.deferred.settle()
        return request.results

    def _resume_reserve(self, request: _ParkedReserve, error: InfinityError | None) -> None:
        if not request.session.alive or self.closing:
            return  # a dead client's earlier items were already dropped with it
        if error is not None:
            request.results.append(self.counters.item_error(request.session, error))
            request.index += 1
        self._continue_reserve(request)

    def commit(self, session: Session, request_id: int, message: wire.Commit) -> list[Any]:
        results, _ = self._publish(session, message.items)
        return results

    def commit_renew(self, session: Session, request_id: int, message: wire.CommitRenew
                     ) -> list[Any]:
        # Only a name put again gets a spare: a put of a new name (loading a checkpoint, say)
        # may well be its only one, and its spare would sit in the tier until the client left.
        again = [self._exists_quietly(item) for item in message.items]
        results, committed = self._publish(session, message.items)
        for i, version in committed:
            spare = self.catalog.renew(session.id, version) if again[i] else None
            placement = None
            if spare is not None:
                placement = reserved_placement(spare)
                session.counters.spares += 1
            results[i] = [version.stamp, placement]
        return results

    def _exists_quietly(self, item: wire.TensorRef) -> bool:
        try:
            return self.catalog.exists(item.namespace, item.name)
        except InfinityError:
            return False  # a bad name: the commit reports it

    def _publish(self, session: Session, items: Sequence[wire.TensorRef]
                 ) -> tuple[list[Any], list[tuple[int, Version]]]:
        """Commit each item of a commit request: the results (version or error, item by item)
        and the (result index, version) of those that were published. Every commit request
        (commit, commit_renew, commit_durable) publishes here: per-item checks of a commit go
        at the top of the loop."""
        results: list[Any] = []
        committed: list[tuple[int, Version]] = []
        for item in items:
            try:
                self.namespaces.require_writable(session, item.namespace)
                version = self.catalog.commit(session.id, item.namespace, item.name)
            except InfinityError as exc:
                results.append(self.counters.item_error(session, exc))
                continue
            self.steps.wrote(session, version)
            committed.append((len(results), version))
            results.append(version.stamp)
            session.counters.commit_bytes += version.nbytes
            self.counters.bytes_committed += version.nbytes
        session.counters.commits += len(items)
        return results, committed

    def abort(self, session: Session, request_id: int, message: wire.Abort) -> list[Any]:
        results: list[Any] = []
        for item in message.items:
            try:
                self.catalog.abort(session.id, item.namespace, item.name)
                results.append(None)
            except InfinityError as exc:
                results.append(self.counters.item_error(session, exc))
        return results

    # --- durability ----------------------------------------------------------------------

    def commit_durable(self, session: Session, request_id: int, message: wire.CommitDurable
                       ) -> list[Any] | Deferred:
        self.tiers.require_durable()  # before anything is published
        results, committed = self._publish(session, message.items)
        if not committed:
            return results
        self.counters.deferred_replies += 1
        deferred = Deferred(results)

        def durable(errors: list[InfinityError | None]) -> None:
            for (i, version), error in zip(committed, errors):
                if error is not None:
                    results[i] = self.counters.item_error(session, error)
                else:
                    session.counters.durable_bytes += version.nbytes
            deferred.settle()

        self.tiers.make_durable([v for _, v in committed], durable)
        return deferred

    def flush_store(self, session: Session, request_id: int, message: wire.FlushStore
                    ) -> Deferred:
        self.tiers.require_durable()
        versions = list(self.catalog.current_versions())
        self.counters.deferred_replies += 1
        deferred = Deferred([None])
        session.counters.flushes += 1

        def durable(errors: list[InfinityError | None]) -> None:
            failed = [(v, e) for v, e in zip(versions, errors) if e is not None]
            if failed:
                version, error = failed[0]
                deferred.results[0] = self.counters.item_error(session, type(error)(
                    f"{len(failed)} of {len(versions)} tensor(s) were not made durable; the first, "
                    f"{version.key[1]!r} in namespace {version.key[0]!r}: {error}"))
            else:
                total = sum(v.nbytes for v in versions)
                session.counters.durable_bytes += total
                deferred.results[0] = {"tensors": len(versions), "bytes": total}
            deferred.settle()

        self.tiers.make_durable(versions, durable)
        return deferred

    # --- names ---------------------------------------------------------------------------

    def prefetch(self, session: Session, request_id: int, message: wire.Prefetch) -> None:
        # A hint: tensors only on NVMe start loading now (within the tier, by the policy).
        session.counters.prefetches += len(message.items)
        if self.tiers.nvme is None:
            return
        for item in message.items:
            try:
                self.tiers.prefetch(self.catalog.current(item.namespace, item.name))
            except InfinityError as exc:  # no reply to carry it: count it
                self.counters.item_error(session, exc)

    def delete(self, session: Session, request_id: int, message: wire.Delete) -> Deferred:
        results: list[Any] = []
        deferred = Deferred(results)
        for item in message.items:
            try:
                self.namespaces.require_writable(session, item.namespace)
                version = self.catalog.delete(item.namespace, item.name)
            except InfinityError as exc:
                results.append(self.counters.item_error(session, exc))
                continue
            if self.scheduler is not None:
                self.tensors.forget(version.key)
                self.scheduler.forget(version.key)
            results.append(None)
            # A flushed tensor leaves the index too; the reply waits for that commit.
            i = len(results) - 1
            if self.tiers.remove_durable(version.key, lambda error, i=i: (  # type: ignore[misc]
                    self._deleted(session, deferred, i, error))):
                deferred.left += 1
        session.counters.deletes += len(message.items)
        if deferred.left > 1:
            self.counters.deferred_replies += 1
        deferred.settle()
        return deferred

    def _deleted(self, session: Session, deferred: Deferred, i: int,
                 error: InfinityError | None) -> None:
        if error is not None:
            deferred.results[i] = self.counters.item_error(session, error)
        deferred.settle()

    def exists(self, session: Session, request_id: int, message: wire.Exists) -> list[Any]:
        results: list[Any] = []
        for item in message.items:
            try:
                results.append(self.catalog.exists(item.namespace, item.name))
            except InfinityError as exc:
                results.append(self.counters.item_error(session, exc))
        return results

    def list_tensors(self, session: Session, request_id: int, message: wire.ListTensors
                     ) -> list[Any]:
        results: list[Any] = []
        for item in message.items:
            results.append([
                wire.TensorInfo(v.key[0], v.key[1], v.dtype, v.shape, v.nbytes, v.stamp,
                                v.tier).to_wire()
                for v in self.catalog.listing(item.namespace, item.prefix, after=item.after,
                                              limit=wire.LIST_PAGE)])
        return results
