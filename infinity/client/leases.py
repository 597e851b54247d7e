"""Leases: getting tensors as views of shared memory, and giving them back.

`LeaseCalls` holds the Client's get, get_many, get_resident and flush; `Lease` the views a get
hands out (released at the end of a `with` block); `ResidentRequester` and `PendingResident`
a get_resident sent now and answered later. A get's request id names its lease; releasing a
shared lease rides with the client's next message (see `Session._release`).
"""

from __future__ import annotations

from typing import Any, Sequence, cast

import torch

from infinity.client.channel import Channel, LateReply
from infinity.client.session import Names, Session, as_names
from infinity.errors import InfinityError, InvalidRequestError, LeaseError, TierFullError
from infinity.protocol import wire
from infinity.protocol.wire import ItemError, Placement


class ResidentRequester:
    """Sends `get_resident` requests and hands back their answers later (`send` returns a
    PendingResident), so a caller computes while the daemon answers. For one user at a time,
    on any thread: it has a socket of its own, because a request sent on a thread's own socket
    could be answered only on that thread, and a socket read by two threads at once loses
    replies. The socket closes with the client."""

    def __init__(self, client: LeaseCalls) -> None:
        self._client = client
        self._channel: Channel | None = None

    def send(self, names: Names, *, namespace: str = "default") -> PendingResident:
        names = as_names(names)
        client = self._client
        client._check_usable()
        if self._channel is None:
            self._channel = client._attached_channel()
        lease_id = next(client._request_ids)
        self._channel.send(lease_id, wire.GetAhead.for_names(namespace, names, False),
                           expect_reply=True, releases=client._take_releases())
        return PendingResident(client, self._channel, lease_id, names)


class PendingResident:
    """A `get_resident` request sent and not answered yet: until `result()` is called, what the
    daemon leased for it stays held (until the client closes)."""

    __slots__ = ("_client", "_channel", "_lease_id", "_names", "_done")

    def __init__(self, client: LeaseCalls, channel: Channel, lease_id: int, names: list[str]) -> None:
        self._client = client
        self._channel = channel
        self._lease_id = lease_id
        self._names = names
        self._done = False

    def result(self) -> tuple[Lease | None, list[str]]:
        """Wait for the answer (once; again: an error): the lease, None when it holds
        nothing, and the names it holds, in the order of its views."""
        if self._done:
            raise InvalidRequestError("this get_resident was answered already; its lease was "
                                      "handed out by the first result()")
        self._done = True
        self._client._check_usable()
        answer = self._channel.call_packed_reply(
            self._lease_id, what="get_ahead",
            on_late_reply=self._client._late_lease_undo(self._lease_id))
        return self._client._resident_lease(self._lease_id, self._names, answer)

    def give_back(self) -> None:
        """After `result()` gave up waiting: release what the daemon leases for the request
        now, on the request's own socket (so after it, in order), not when its answer is read,
        which a requester not used again never does."""
        if not self._channel.forget_abandoned(self._lease_id):
            return
        try:
            self._client._check_usable()
            self._channel.send(next(self._client._request_ids), wire.Release((self._lease_id,)),
                               expect_reply=False)
        except InfinityError:
            pass  # the session is gone, and its leases with it


class Lease:
    """Leased views; released on `release()` or when a `with` block ends.

    Using a view after release is undefined: the daemon may free or reuse its
    memory (with `daemon.poison_released` it is overwritten with 0xFF bytes).
    Releasing a shared lease is told to the daemon with the client's next message
    (see `Client.flush`); an exclusive one at once.
    """

    __slots__ = ("_client", "_ids", "tensors", "_results", "_single", "_exclusive", "_released")

    def __init__(self, client: Session, ids: list[int], tensors: list[torch.Tensor],
                 results: Sequence[Any], *, single: bool, exclusive: bool) -> None:
        self._client = client
        self._ids = ids
        self.tensors = tensors
        self._results = results
        self._single = single
        self._exclusive = exclusive
        self._released = False

    @property
    def tensor(self) -> torch.Tensor:
        self._check_held()
        return self.tensors[0]

    def _check_held(self) -> None:
        if self._released:
            raise LeaseError("this lease was released, and its views with it; call get() again")

    @property
    def versions(self) -> list[int]:
        """The version number of each leased tensor, in order."""
        return [Placement.from_wire(result).version for result in self._results]

    @property
    def version(self) -> int:
        return self.versions[0]

    @property
    def revisions(self) -> list[tuple[int, int]]:
        """(version, edits) of each leased tensor: equal revisions have the same bytes (a
        version's bytes change in place only under an exclusive lease, which counts an edit)."""
        return [(p.version, p.edits) for p in map(Placement.from_wire, self._results)]

    def __enter__(self) -> Any:
        self._check_held()
        return self.tensors[0] if self._single else self.tensors

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.tensors = []
            self._client._release(self._ids, exclusive=self._exclusive)



class LeaseCalls(Session):
    """The Client's lease calls."""

    def get(self, name: str, *, namespace: str = "default", exclusive: bool = False) -> Lease:
        """Lease one tensor; `with client.get(name) as t:` releases it at the end of the block.

        A shared lease is for reading (and excludes exclusive ones); an exclusive
        lease lets the holder write in place, with no other lease at the same time.
        """
        return self._lease(wire.Get((wire.GetItem(namespace, name, exclusive),)),
                           exclusive=exclusive, single=True)

    def get_many(self, names: Names, *, namespace: str = "default",
                 exclusive: bool = False) -> Lease:
        """Lease several tensors in one request; `with` yields the list of views, in order
        (a single name, as a string, is a list of one)."""
        return self._lease(wire.Get.for_names(namespace, as_names(names), exclusive),
                           exclusive=exclusive, single=False)

    def get_resident(self, names: Names, *, namespace: str = "default"
                     ) -> tuple[Lease | None, list[str]]:
        """Lease those of `names` that the CPU tier holds now, in one request, for bringing
        them somewhere ahead of their use (as `DeviceCache` does with what `upcoming` names).

        Unlike `get_many` it never waits: a tensor on NVMe alone is left out, not loaded (the
        daemon's trace-driven prefetch brings it in when it is due), and so is one that cannot
        be leased now (deleted, leased exclusively). Nor are these gets accesses for the
        daemon's scheduler: they do not enter the step's trace. Returns the lease, None when
        it holds nothing, and the names it holds, in the order of its views.
        `resident_requester()` sends such requests to be answered later."""
        names = as_names(names)
        self._check_usable()
        channel = self._channel()
        lease_id = next(self._request_ids)
        channel.send(lease_id, wire.GetAhead.for_names(namespace, names, False),
                     expect_reply=True, releases=self._take_releases())
        return PendingResident(self, channel, lease_id, names).result()

    def resident_requester(self) -> ResidentRequester:
        """Something that sends `get_resident` requests now and takes their answers later, on
        a socket of its own (see ResidentRequester)."""
        return ResidentRequester(self)

    def _resident_lease(self, lease_id: int, names: list[str],
                        answer: wire.Reply | bytes) -> tuple[Lease | None, list[str]]:
        assert self._segments is not None
        results = (wire.decode_results(answer) if type(answer) is bytes
                   else self._results(cast(wire.Reply, answer)))
        held = [i for i, result in enumerate(results)
                if result is not None and type(result) is not ItemError]
        if not held:
            return None, []  # the daemon keeps no lease that holds nothing
        kept = tuple(results[i] for i in held)
        try:
            tensors, _ = self._segments.leased_views(kept)
        except BaseException:
            self._release([lease_id], exclusive=False)
            raise
        return (Lease(self, [lease_id], tensors, kept, single=False, exclusive=False),
                [names[i] for i in held])

    def _lease(self, request: wire.Get, *, exclusive: bool, single: bool) -> Lease:
        try:
            return self._lease_once(request, exclusive=exclusive, single=single)
        except TierFullError:
            if not self._spares.held:
                raise
            # The spares this client's puts left take room in the tier, in segments a tensor
            # larger than a segment would need emptied: give them back and ask once more, as
            # `reserve` does (a spare is only a shortcut for a later put). What the first try
            # leased went back with its failure; the release rides with the retry.
            self._spares.drop_all(self._call)
            return self._lease_once(request, exclusive=exclusive, single=single)

    def _lease_once(self, request: wire.Get, *, exclusive: bool, single: bool) -> Lease:
        self._check_usable()
        assert self._segments is not None
        channel = self._channel()
        lease_id = next(self._request_ids)  # a get's request id names its lease
        answer = channel.call_packed(lease_id, request, releases=self._take_releases(),
                                     on_late_reply=self._late_lease_undo(lease_id))
        packed: bytes | None = None
        if type(answer) is bytes:
            hit = self._segments.cached_reply(answer)
            if hit is not None:
                return Lease(self, [lease_id], hit[1], hit[0], single=single, exclusive=exclusive)
        else:
            results = self._results(cast(wire.Reply, answer))  # a failed request leased nothing
        leased = True  # until the results say otherwise
        try:
            if type(answer) is bytes:
                packed, results = answer, wire.decode_results(answer)
            leased = any(type(result) is not ItemError for result in results)
            tensors, first_error = self._segments.leased_views(results, remember=packed)
            if first_error is not None:
                raise first_error.exception()
        except BaseException:
            if leased:
                self._release([lease_id], exclusive=exclusive)  # whatever it got goes back
            raise
        return Lease(self, [lease_id], tensors, results, single=single, exclusive=exclusive)

    def _late_lease_undo(self, lease_id: int) -> LateReply:
        """What to do with the answer to a get this client gave up waiting for, should it come
        (the daemon was slow, not gone): its lease holds versions nobody will release."""
        def undo(reply: wire.Reply) -> None:
            if reply.failure is None and any(r is not None and type(r) is not ItemError
                                             for r in reply.results):
                # Sent now, not with the next message: that may be a retry of this very get,
                # which the lease (exclusive, say) would refuse.
                self._send(wire.Release((lease_id,)))
        return undo

    def flush(self) -> None:
        """Return once the daemon has served every lease this client released so far (they
        normally reach it with the next request or within daemon.heartbeat_interval_s).
        Call it before another process needs an exclusive lease on what you released.

        This is about leases only; to make tensors durable on NVMe, see `flush_store`."""
        self._call(wire.Exists(()))

