"""Writes: reserve fresh slices, fill them, publish them as new versions (commit) or drop them
(abort); put is all three; flush_store makes the whole store durable.

`WriteCalls` holds them for the Client. A put whose name has a spare reservation (see
`spares`) fills it instead of reserving, and its commit asks the daemon for the next spare.
"""

from __future__ import annotations

import contextlib
import time
from typing import Mapping

import torch

from infinity.client.channel import LateReply
from infinity.client.session import PUT_STRIPES, Names, Session, as_names
from infinity.client.tensors import TensorSpec, reserve_spec, storable
from infinity.errors import TierFullError
from infinity.io import copy_into
from infinity.protocol import wire
from infinity.protocol.wire import ItemError, Placement


class WriteCalls(Session):
    """The Client's write calls."""

    def reserve(self, items: Mapping[str, TensorSpec], *, namespace: str = "default"
                ) -> dict[str, torch.Tensor]:
        """Fresh slices to fill at leisure, by name; `commit` publishes them, `abort` drops them.

        Each item is a tensor to mimic (dtype and shape) or a (dtype, shape) pair.
        """
        wanted = [wire.ReserveItem(namespace, name, *reserve_spec(name, spec))
                  for name, spec in items.items()]
        self._check_usable()
        taken, stale = self._spares.take(wanted)
        if stale:
            self._abort_quietly(stale, namespace)  # another dtype or shape, or too old: afresh
        views = {name: spare.view for name, spare in taken.items()}
        request = [item for item in wanted if item.name not in views]
        if not request:
            return views
        try:
            results = self._call(wire.Reserve(tuple(request)), on_late_reply=self._late_reserve_undo(
                namespace, [item.name for item in request]))
        except BaseException:
            self._spares.put_back(namespace, taken)
            raise
        if self._spares.held and any(type(r) is ItemError and r.code == TierFullError.code
                                for r in results):
            # The spares this client holds take room in the tier: give them back and ask
            # again for what did not fit (a spare is only a shortcut for a later put).
            retry = [i for i, r in enumerate(results)
                     if type(r) is ItemError and r.code == TierFullError.code]
            try:
                self._spares.drop_all(self._call)
                asked = [request[i] for i in retry]
                again = dict(zip(retry, self._call(wire.Reserve(tuple(asked)),
                                                   on_late_reply=self._late_reserve_undo(
                                                       namespace, [i.name for i in asked]))))
            except BaseException:
                got = [item.name for item, r in zip(request, results) if type(r) is not ItemError]
                if got:
                    self._abort_quietly(got, namespace)
                self._spares.put_back(namespace, taken)
                raise
            results = tuple(again.get(i, r) for i, r in enumerate(results))
        first_error: ItemError | None = None
        try:
            for item, result in zip(request, results):
                if type(result) is ItemError:
                    first_error = first_error or result
                else:
                    # Detached: a copy that records autograd history into one of them must not
                    # give it to the segment's base, which every later view shares.
                    views[item.name] = self._view(Placement.from_wire(result)).detach()
            if first_error is not None:
                raise first_error.exception()
        except BaseException:
            reserved = [item.name for item, result in zip(request, results)
                        if type(result) is not ItemError]
            if reserved:
                self.abort(reserved, namespace=namespace)
            self._spares.put_back(namespace, taken)
            raise
        return views

    def _late_reserve_undo(self, namespace: str, names: list[str]) -> LateReply:
        """As `_late_lease_undo`, for a reserve: what it reserved is aborted."""
        def undo(reply: wire.Reply) -> None:
            if reply.failure is None:
                granted = [wire.TensorRef(namespace, name)
                           for name, r in zip(names, reply.results) if type(r) is not ItemError]
                if granted:
                    self._send(wire.Abort(tuple(granted)))  # its answer is not waited for
        return undo

    def _commit_renew(self, names: list[str], namespace: str) -> dict[str, int]:
        """`commit`, keeping the spare reservations the daemon leaves for the next puts."""
        refs = tuple(wire.TensorRef(namespace, n) for n in names)
        sent_s = time.monotonic()  # the daemon heard from this session no earlier than this
        results = self._call(wire.CommitRenew(refs))
        versions: dict[str, int] = {}
        first_error: ItemError | None = None
        for name, result in zip(names, results):
            if type(result) is ItemError:
                first_error = first_error or result
                continue
            version, spare = wire.decode_renewed(result)
            versions[name] = version
            if spare is not None:
                self._spares.keep(namespace, name, spare, sent_s)
        if first_error is not None:
            raise first_error.exception()
        return versions

    def commit(self, names: Names, *, namespace: str = "default",
               durable: bool = False) -> dict[str, int]:
        """Publish this client's reservations atomically, each as its name's new version.

        durable=True: return only once they are on NVMe and in the store's index (see the
        module docstring); if that fails, they are published all the same and the error is
        raised (the name's last durable version stays what it was on disk)."""
        self._check_usable()  # before any lock: a forked child's copy may be held by no thread
        listed = as_names(names)
        # A spare this client's puts left and nobody took holds no bytes of the caller's: it must
        # not be published. Dropped, the commit then says the name was not reserved.
        stray = self._spares.forget(namespace, listed)
        if stray:
            self._abort_quietly(stray, namespace)
        refs = tuple(wire.TensorRef(namespace, n) for n in listed)
        results = self._call(wire.CommitDurable(refs) if durable else wire.Commit(refs),
                             patient=durable)
        self._raise_first(results)
        return {name: wire.decode_version(r) for name, r in zip(listed, results)}

    def abort(self, names: Names, *, namespace: str = "default") -> None:
        """Discard this client's reservations (their memory is freed)."""
        self._check_usable()  # before any lock: see `commit`
        listed = as_names(names)
        self._spares.forget(namespace, listed)  # the daemon frees them with the rest
        self._raise_first(self._call(wire.Abort(tuple(wire.TensorRef(namespace, n) for n in listed))))

    def put(self, name: str, tensor: torch.Tensor, *, namespace: str = "default",
            durable: bool = False) -> int:
        """Store a copy of `tensor` as `name`'s new version; returns the version number.
        durable=True: return once it is durable on NVMe (see `commit`)."""
        return self.put_many({name: tensor}, namespace=namespace, durable=durable)[name]

    def put_many(self, tensors: Mapping[str, torch.Tensor], *, namespace: str = "default",
                 durable: bool = False) -> dict[str, int]:
        """Store several tensors: one reserve request, the copies, one commit request
        (durable=True: made durable together, in one index transaction).

        The daemon answers the commit with a spare reservation of each tensor's name, dtype
        and shape where the commit replaced a version and it has free room for one
        (`cpu.spare_fraction`), so putting the same tensors again needs no reserve request:
        one round trip instead of two, from a name's third put on."""
        self._check_usable()  # before any lock: a forked child's copy may be held by no thread
        sources = {name: storable(tensor, name) for name, tensor in tensors.items()}
        if len(sources) == 1:  # the common case, without the stack
            (name,) = sources
            with self._put_stripes[hash((namespace, name)) % PUT_STRIPES]:
                return self._put_sources(sources, namespace=namespace, durable=durable)
        stripes = sorted({hash((namespace, name)) % PUT_STRIPES for name in sources})
        with contextlib.ExitStack() as held:
            for stripe in stripes:  # in one order everywhere: two puts never wait on each other
                held.enter_context(self._put_stripes[stripe])
            return self._put_sources(sources, namespace=namespace, durable=durable)

    def _put_sources(self, sources: Mapping[str, torch.Tensor], *, namespace: str,
                     durable: bool) -> dict[str, int]:
        views = self.reserve(sources, namespace=namespace)
        try:
            for name, tensor in sources.items():  # detached (`storable`), into detached views
                # Streaming stores: this process never reads the slice back, so there is no
                # point loading its old contents into the cache first (what copy_ does).
                copy_into(views[name], tensor)
        except BaseException:
            self.abort(list(views), namespace=namespace)
            raise
        try:
            if durable:
                return self.commit(list(views), namespace=namespace, durable=True)
            return self._commit_renew(list(views), namespace)
        except BaseException:
            # What was not published (a request refused as a whole, e.g. durable without an
            # NVMe tier) is still reserved: drop it. Where an item was published, its name's
            # reservation now is the spare the daemon left, if any: forgotten here, it goes too.
            self._spares.forget(namespace, list(views))
            self._abort_quietly(list(views), namespace)
            raise

    def flush_store(self) -> dict[str, int]:
        """Make every tensor of the store durable, and return once it is: dirty tensors are
        written to NVMe, fdatasync'ed, and the store's index points at all of them in one
        transaction. Returns {"tensors": count, "bytes": total}. Needs an NVMe tier
        (nvme.dirs); a tensor under an exclusive lease is reported (LeaseError) and the rest
        are flushed all the same."""
        (result,) = self._call(wire.FlushStore(), patient=True)
        self._raise_first([result])
        return wire.decode_flush_summary(result)

