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

import atexit
import builtins
import contextlib
import dataclasses
import itertools
import operator
from collections import deque
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, Union, cast

import psutil
import torch
import zmq

from infinity.client.channel import Channel, LateReply
from infinity.client.segments import SegmentMap, dtype_name
from infinity.config import InfinityConfig, load_config
from infinity.errors import (DaemonUnavailableError, ForkedClientError, InfinityError,
                             InvalidRequestError, LeaseError, TierFullError)
from infinity.io import copy_into
from infinity.protocol import wire
from infinity.protocol.dtypes import tensor_nbytes
from infinity.protocol.paths import RuntimeLayout
from infinity.protocol.wire import ItemError, Placement

# What reserve() accepts per name: a tensor to mimic, or (dtype, shape).
TensorSpec = Union[torch.Tensor, tuple[torch.dtype, Sequence[int]]]
Names = Union[str, Sequence[str]]

_LIVE_CLIENTS: weakref.WeakSet[Client] = weakref.WeakSet()
# Released shared leases wait for the next message up to this many, then go at once.
MAX_PENDING_RELEASES = 4096
_PUT_STRIPES = 64  # locks that puts of one name from several threads take in turn
# Spares aborted per request: well under wire.MAX_ITEMS, and under its size limit with the
# longest names.
_ABORT_BATCH = 2048


@dataclasses.dataclass
class StepResult:
    """What `Client.step()` yields; `report` is filled in when the step ends."""

    report: wire.StepReport | None = None

    @property
    def outcome(self) -> str | None:
        return None if self.report is None else self.report.outcome

    @property
    def counters(self) -> dict[str, Any]:
        return {} if self.report is None else self.report.counters


def _after_fork_in_child() -> None:
    for client in list(_LIVE_CLIENTS):
        client._forked = True


def _close_all_at_exit() -> None:
    for client in list(_LIVE_CLIENTS):
        try:
            client.close()
        except Exception:
            pass


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_close_all_at_exit)


def _names(names: Names) -> list[str]:
    if isinstance(names, str):
        return [names]
    return list(names)


class ResidentRequester:
    """Sends `get_resident` requests and hands back their answers later (`send` returns a
    PendingResident), so a caller computes while the daemon answers. For one user at a time,
    on any thread: it has a socket of its own, because a request sent on a thread's own socket
    could be answered only on that thread, and a socket read by two threads at once loses
    replies. The socket closes with the client."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._channel: Channel | None = None

    def send(self, names: Names, *, namespace: str = "default") -> PendingResident:
        names = _names(names)
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

    def __init__(self, client: Client, channel: Channel, lease_id: int, names: list[str]) -> None:
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

    def __init__(self, client: Client, ids: list[int], tensors: list[torch.Tensor],
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


class Client:
    """A session with infinityd. Create it with `infinity.connect()`."""

    def __init__(self, config: InfinityConfig, layout: RuntimeLayout, *, name: str) -> None:
        self.config = config
        self.layout = layout
        self.name = name
        self._pid = os.getpid()
        self._forked = False
        self._closed = False
        self._timeout_s = config.daemon.request_timeout_s
        self._context = zmq.Context(io_threads=1)
        self._local = threading.local()
        self._channels_lock = threading.Lock()
        # Weak: a thread's channel lives in its thread-local storage and ends with the thread.
        self._channels: weakref.WeakSet[Channel] = weakref.WeakSet()
        self._request_ids = itertools.count(1)
        self._pending_lock = threading.Lock()
        self._pending_releases: list[int] = []  # shared leases released but not yet told
        # Spare reservations the daemon left after this client's puts, by (namespace, name):
        # the next put or reserve of the same dtype and shape fills one instead of asking.
        self._spares_lock = threading.Lock()
        # A put reserves, fills and commits its names, and a session holds one reservation per
        # name: puts of one name from several threads take turns (names share these stripes).
        self._put_stripes = [threading.Lock() for _ in range(_PUT_STRIPES)]
        self._spares: dict[tuple[str, str], _Spare] = {}
        # Spares the heartbeat thread is giving back, and the event set once the daemon has them.
        self._returning: set[tuple[str, str]] = set()
        self._returned = threading.Event()
        self._spare_max_age_s = config.daemon.client_timeout_s / 2  # until the welcome says
        self.steps_begun = 0  # step_begin calls so far (a DeviceCache asks anew at each)
        self._segments: SegmentMap | None = None
        self._heartbeat_stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        try:
            channel = self._new_channel()
            reply = channel.call(next(self._request_ids), wire.Hello(
                wire.PROTOCOL_VERSION, name, os.getpid(), psutil.Process().create_time()))
            welcome = wire.Welcome.from_wire(self._results(reply)[0])
            self._local.channel = channel
            self.client_id = welcome.client_id
            self.daemon_pid = welcome.daemon_pid
            self.daemon_version = welcome.daemon_version
            self._token = welcome.token
            # A spare is ours as long as the session lives: the daemon ends a session only after
            # client_timeout_s without a message, so one granted less than half that ago is safe
            # to write into without asking (an older one might be another tensor's memory by now).
            self._spare_max_age_s = welcome.client_timeout_s / 2
            self._segments = SegmentMap(layout.fds_path, welcome.token, timeout_s=self._timeout_s)
        except BaseException:
            self._teardown(send_bye=False)
            raise
        self._heartbeat = threading.Thread(
            target=self._heartbeat_loop, args=(welcome.heartbeat_interval_s,),
            name=f"infinity-heartbeat-{self.client_id}", daemon=True)
        self._heartbeat.start()
        _LIVE_CLIENTS.add(self)

    # --- plumbing -------------------------------------------------------------------

    def _daemon_gone(self) -> str | None:
        return None if self._segments is None else self._segments.daemon_gone()

    def _new_channel(self) -> Channel:
        channel = Channel(self._context, self.layout.control_endpoint, timeout_s=self._timeout_s,
                          daemon_gone=self._daemon_gone, unsent=self._give_back_releases)
        with self._channels_lock:
            self._channels.add(channel)
        return channel

    def _check_usable(self) -> None:
        if self._forked:
            raise ForkedClientError(
                f"this infinity Client was created in process {self._pid} and cannot be used in "
                f"its forked child {os.getpid()}; call infinity.connect() again in the child")
        if self._closed:
            raise DaemonUnavailableError("this infinity Client is closed; call infinity.connect()")
        if self._segments is not None and self._segments.closed:
            raise DaemonUnavailableError(
                "this infinity Client's session ended when infinityd did not hand over "
                "shared-memory segments in time; call infinity.connect() again")

    def _channel(self) -> Channel:
        channel: Channel | None = getattr(self._local, "channel", None)
        if channel is None:
            channel = self._local.channel = self._attached_channel()
        return channel

    def _attached_channel(self) -> Channel:
        """A new socket, attached to this client's session."""
        channel = self._new_channel()
        self._results(channel.call(next(self._request_ids), wire.Attach(self._token)))
        channel.detach_when_dropped(next(self._request_ids))
        return channel

    def _call(self, message: wire.Request, *, patient: bool = False,
              on_late_reply: LateReply | None = None) -> tuple[Any, ...]:
        """patient: wait as long as the daemon lives (durable writes take as long as the data
        is large), instead of daemon.request_timeout_s. on_late_reply: see `Channel.wait`."""
        self._check_usable()
        channel = self._channel()
        return self._results(channel.call(next(self._request_ids), message,
                                          releases=self._take_releases(), patient=patient,
                                          on_late_reply=on_late_reply))

    def _send(self, message: wire.Request) -> None:
        self._check_usable()
        channel = self._channel()
        channel.send(next(self._request_ids), message, expect_reply=False,
                     releases=self._take_releases())

    def _take_releases(self) -> list[int]:
        if not self._pending_releases:  # the common case, without the lock
            return []
        with self._pending_lock:
            taken, self._pending_releases = self._pending_releases, []
        return taken

    @staticmethod
    def _results(reply: wire.Reply) -> tuple[Any, ...]:
        if reply.failure is not None:
            raise reply.failure.exception()
        return reply.results

    @staticmethod
    def _raise_first(results: Iterable[Any]) -> None:
        for result in results:
            if type(result) is ItemError:
                raise result.exception()

    def _heartbeat_loop(self, interval_s: float) -> None:
        channel: Channel | None = None
        try:
            channel = self._new_channel()
            channel.call(next(self._request_ids), wire.Attach(self._token))
            beat = wire.Heartbeat()
            while not self._heartbeat_stop.wait(interval_s):
                if self._forked:
                    return
                channel.send(next(self._request_ids), beat, expect_reply=False,
                             releases=self._take_releases())
                self._give_back_old_spares(channel)
        except InfinityError:
            pass  # the daemon is gone or the session ended: the next call says so
        except zmq.ZMQError:
            pass  # the context was terminated under us by close()
        finally:
            if channel is not None:
                channel.close()

    # --- leases -----------------------------------------------------------------------

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
        return self._lease(wire.Get.for_names(namespace, _names(names), exclusive),
                           exclusive=exclusive, single=False)

    def get_resident(self, names: Names, *, namespace: str = "default"
                     ) -> tuple[Lease | None, builtins.list[str]]:
        """Lease those of `names` that the CPU tier holds now, in one request, for bringing
        them somewhere ahead of their use (as `DeviceCache` does with what `upcoming` names).

        Unlike `get_many` it never waits: a tensor on NVMe alone is left out, not loaded (the
        daemon's trace-driven prefetch brings it in when it is due), and so is one that cannot
        be leased now (deleted, leased exclusively). Nor are these gets accesses for the
        daemon's scheduler: they do not enter the step's trace. Returns the lease, None when
        it holds nothing, and the names it holds, in the order of its views.
        `resident_requester()` sends such requests to be answered later."""
        names = _names(names)
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

    def _resident_lease(self, lease_id: int, names: builtins.list[str],
                        answer: wire.Reply | bytes) -> tuple[Lease | None, builtins.list[str]]:
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

    def upcoming(self, *, namespace: str = "default", max_entries: int = 64,
                 max_bytes: int = 1 << 62) -> builtins.list[tuple[str, int]]:
        """What this client will read next in `namespace`, as the daemon's trace of its steps
        says: (name, nbytes) pairs, soonest first, distinct. Empty while no trace replays
        (the first step, after a change of order) and without an NVMe tier."""
        (upcoming,) = self._call(wire.Upcoming(namespace, max_entries, max_bytes))
        return [(str(name), int(nbytes)) for name, nbytes in upcoming]

    def _lease(self, request: wire.Get, *, exclusive: bool, single: bool) -> Lease:
        try:
            return self._lease_once(request, exclusive=exclusive, single=single)
        except TierFullError:
            if not self._spares:
                raise
            # The spares this client's puts left take room in the tier, in segments a tensor
            # larger than a segment would need emptied: give them back and ask once more, as
            # `reserve` does (a spare is only a shortcut for a later put). What the first try
            # leased went back with its failure; the release rides with the retry.
            self._drop_all_spares()
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

    def _late_reserve_undo(self, namespace: str, names: builtins.list[str]) -> LateReply:
        """As `_late_lease_undo`, for a reserve: what it reserved is aborted."""
        def undo(reply: wire.Reply) -> None:
            if reply.failure is None:
                granted = [wire.TensorRef(namespace, name)
                           for name, r in zip(names, reply.results) if type(r) is not ItemError]
                if granted:
                    self._send(wire.Abort(tuple(granted)))  # its answer is not waited for
        return undo

    def _view(self, placement: Placement) -> torch.Tensor:
        assert self._segments is not None
        return self._segments.view(placement)

    def _release(self, lease_ids: list[int], *, exclusive: bool) -> None:
        if self._forked or self._closed:
            return  # the daemon drops the session's leases anyway
        if exclusive:  # others may be waiting to read it: say so now
            self._send(wire.Release(tuple(lease_ids)))
            return
        # A shared release rides along with this client's next message (a request from any of
        # its threads, or the next heartbeat): a get + release costs one message, not two. The
        # daemon frees the version then; another process that wants an exclusive lease on it
        # meets it at most daemon.heartbeat_interval_s later, or at once after flush().
        with self._pending_lock:
            self._pending_releases.extend(lease_ids)
            overflowing = len(self._pending_releases) >= MAX_PENDING_RELEASES
        if overflowing:
            self._send(wire.Release(()))

    def _give_back_releases(self, lease_ids: Sequence[int]) -> None:
        """Releases taken for a message that was refused before it was sent: they ride again."""
        if lease_ids:
            with self._pending_lock:
                self._pending_releases[:0] = lease_ids

    def flush(self) -> None:
        """Return once the daemon has served every lease this client released so far (they
        normally reach it with the next request or within daemon.heartbeat_interval_s).
        Call it before another process needs an exclusive lease on what you released.

        This is about leases only; to make tensors durable on NVMe, see `flush_store`."""
        self._call(wire.Exists(()))

    def flush_store(self) -> dict[str, int]:
        """Make every tensor of the store durable, and return once it is: dirty tensors are
        written to NVMe, fdatasync'ed, and the store's index points at all of them in one
        transaction. Returns {"tensors": count, "bytes": total}. Needs an NVMe tier
        (nvme.dirs); a tensor under an exclusive lease is reported (LeaseError) and the rest
        are flushed all the same."""
        (result,) = self._call(wire.FlushStore(), patient=True)
        self._raise_first([result])
        return wire.decode_flush_summary(result)

    # --- writes -----------------------------------------------------------------------

    def reserve(self, items: Mapping[str, TensorSpec], *, namespace: str = "default"
                ) -> dict[str, torch.Tensor]:
        """Fresh slices to fill at leisure, by name; `commit` publishes them, `abort` drops them.

        Each item is a tensor to mimic (dtype and shape) or a (dtype, shape) pair.
        """
        wanted = [wire.ReserveItem(namespace, name, *_reserve_spec(name, spec))
                  for name, spec in items.items()]
        self._check_usable()
        taken, stale = self._take_spares(wanted)
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
            self._return_spares(namespace, taken)
            raise
        if self._spares and any(type(r) is ItemError and r.code == TierFullError.code
                                for r in results):
            # The spares this client holds take room in the tier: give them back and ask
            # again for what did not fit (a spare is only a shortcut for a later put).
            retry = [i for i, r in enumerate(results)
                     if type(r) is ItemError and r.code == TierFullError.code]
            try:
                self._drop_all_spares()
                asked = [request[i] for i in retry]
                again = dict(zip(retry, self._call(wire.Reserve(tuple(asked)),
                                                   on_late_reply=self._late_reserve_undo(
                                                       namespace, [i.name for i in asked]))))
            except BaseException:
                got = [item.name for item, r in zip(request, results) if type(r) is not ItemError]
                if got:
                    self._abort_quietly(got, namespace)
                self._return_spares(namespace, taken)
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
            self._return_spares(namespace, taken)
            raise
        return views

    # --- spare reservations -------------------------------------------------------------

    def _take_spares(self, wanted: list[wire.ReserveItem]
                     ) -> tuple[dict[str, _Spare], list[str]]:
        """The spares that fit `wanted` (taken: they are the caller's now), and the names whose
        spare does not fit or is too old to trust (forgotten: the caller aborts them)."""
        taken: dict[str, _Spare] = {}
        stale: list[str] = []
        with self._spares_lock_for([(item.namespace, item.name) for item in wanted]):
            if not self._spares:
                return taken, stale
            oldest = time.monotonic() - self._spare_max_age_s
            for item in wanted:
                spare = self._spares.pop((item.namespace, item.name), None)
                if spare is None:
                    continue
                if (spare.dtype == item.dtype and spare.shape == item.shape
                        and spare.granted_s >= oldest):
                    taken[item.name] = spare
                else:
                    stale.append(item.name)
        return taken, stale

    def _return_spares(self, namespace: str, taken: Mapping[str, _Spare]) -> None:
        """Spares taken for a reserve that failed: still reserved, still unwritten."""
        with self._spares_lock:
            for name, spare in taken.items():
                self._spares[(namespace, name)] = spare

    def _forget_spares(self, namespace: str, names: Iterable[str]) -> list[str]:
        """Drop the records of these names' spares; returns the names that had one."""
        listed = list(names)
        with self._spares_lock_for([(namespace, name) for name in listed]):
            if not self._spares:
                return []
            return [name for name in listed
                    if self._spares.pop((namespace, name), None) is not None]

    @contextlib.contextmanager
    def _spares_lock_for(self, keys: list[tuple[str, str]]) -> Iterator[None]:
        """`_spares_lock`, taken once none of these (namespace, name)s has a spare on its way
        back to the daemon (`_give_back_old_spares`): until the daemon has it, a reserve of
        the name would meet the spare's reservation, and a commit would publish it."""
        while True:
            self._spares_lock.acquire()
            if not (self._returning and any(key in self._returning for key in keys)):
                break
            returned = self._returned
            self._spares_lock.release()
            returned.wait(self._timeout_s)
        try:
            yield
        finally:
            self._spares_lock.release()

    def _drop_all_spares(self) -> None:
        # Under the lock until the daemon has them back: a put on another thread that finds no
        # spare must not reserve a name whose spare the daemon still holds.
        with self._spares_lock:
            keys, self._spares = list(self._spares), {}
            self._abort_keys(keys, self._call)

    def _give_back_old_spares(self, channel: Channel) -> None:
        """Abort the spares too old for `_take_spares` to hand out: none would ever be written
        into, and a name not put again (a tensor put for the last time, or deleted by another
        client) would otherwise hold its spare's room in the tier until the session ends.
        Runs on the heartbeat thread, over its channel."""
        if not self._spares:  # the common case, without the lock
            return
        with self._spares_lock:
            oldest = time.monotonic() - self._spare_max_age_s
            old = [key for key, spare in self._spares.items() if spare.granted_s < oldest]
            if not old:
                return
            for key in old:
                del self._spares[key]
            # Not under the lock while the daemon answers (a stalled daemon would hold up
            # close() and every put): threads that want these names wait (`_spares_lock_for`).
            self._returning = set(old)
            returned = self._returned = threading.Event()

        def call(message: wire.Request) -> tuple[Any, ...]:
            return self._results(channel.call(next(self._request_ids), message))

        try:
            self._abort_keys(old, call)
        finally:
            with self._spares_lock:
                self._returning = set()
            returned.set()

    def _abort_keys(self, keys: list[tuple[str, str]],
                    call: Callable[[wire.Request], tuple[Any, ...]]) -> None:
        """Abort the reservations of these (namespace, name)s through `call`, in requests of
        at most `_ABORT_BATCH` items; what fails is ignored (a reservation already gone, or the
        session with it)."""
        by_namespace: dict[str, list[str]] = {}
        for namespace, name in keys:
            by_namespace.setdefault(namespace, []).append(name)
        for namespace, names in by_namespace.items():
            for start in range(0, len(names), _ABORT_BATCH):
                refs = tuple(wire.TensorRef(namespace, n) for n in names[start:start + _ABORT_BATCH])
                try:
                    call(wire.Abort(refs))
                except InfinityError:
                    pass  # the daemon or the session is gone, and the spares with it

    def _keep_spare(self, namespace: str, name: str, placement: Placement,
                    granted_s: float) -> None:
        try:
            view = self._view(placement).detach()  # handed out by reserve: see there
        except InfinityError:
            # Only a shortcut for the next put was lost (the commit itself succeeded).
            self._abort_quietly([name], namespace)
            return
        with self._spares_lock:
            self._spares[(namespace, name)] = _Spare(placement.dtype, placement.shape, view,
                                                     granted_s)

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
                self._keep_spare(namespace, name, spare, sent_s)
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
        listed = _names(names)
        # A spare this client's puts left and nobody took holds no bytes of the caller's: it must
        # not be published. Dropped, the commit then says the name was not reserved.
        stray = self._forget_spares(namespace, listed)
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
        listed = _names(names)
        self._forget_spares(namespace, listed)  # the daemon frees them with the rest
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
        sources = {name: _storable(tensor, name) for name, tensor in tensors.items()}
        if len(sources) == 1:  # the common case, without the stack
            (name,) = sources
            with self._put_stripes[hash((namespace, name)) % _PUT_STRIPES]:
                return self._put_sources(sources, namespace=namespace, durable=durable)
        stripes = sorted({hash((namespace, name)) % _PUT_STRIPES for name in sources})
        with contextlib.ExitStack() as held:
            for stripe in stripes:  # in one order everywhere: two puts never wait on each other
                held.enter_context(self._put_stripes[stripe])
            return self._put_sources(sources, namespace=namespace, durable=durable)

    def _put_sources(self, sources: Mapping[str, torch.Tensor], *, namespace: str,
                     durable: bool) -> dict[str, int]:
        views = self.reserve(sources, namespace=namespace)
        try:
            for name, tensor in sources.items():  # detached (`_storable`), into detached views
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
            self._forget_spares(namespace, list(views))
            self._abort_quietly(list(views), namespace)
            raise

    def _abort_quietly(self, names: list[str], namespace: str) -> None:
        try:
            self._call(wire.Abort(tuple(wire.TensorRef(namespace, n) for n in names)))
        except InfinityError:
            pass  # the first error is the one the caller sees

    # --- any size: streams ---------------------------------------------------------------

    def read_into(self, name: str, out: torch.Tensor, *, namespace: str = "default") -> int:
        """Copy tensor `name` into `out`, whatever its size; returns the version read.

        `out` is any contiguous tensor (any device) of exactly the tensor's byte size; its
        dtype and shape are not checked. A resident tensor is copied from its shared slice;
        one only on NVMe is read in chunks of nvme.stream_chunk_bytes through staging slices
        of the CPU tier (CRC32C verified), nvme.stream_depth of them in flight, without
        loading it into the tier. Works for tensors larger than the CPU tier, which `get`
        refuses (TooLargeError).
        """
        flat = _byte_view(out, "out", written=True)
        info = self._open_stream(wire.StreamOpen(namespace, name, "read"))
        try:
            if info.nbytes != flat.numel():
                raise InvalidRequestError(
                    f"tensor {name!r} in namespace {namespace!r} has {info.nbytes} bytes but `out` "
                    f"holds {flat.numel()}; pass an output of exactly that many bytes")
            self._stream_in(info, flat)
        except BaseException:
            self._close_stream(info, commit=False, durable=False, quiet=True)
            raise
        return self._close_stream(info, commit=False, durable=False)

    def write_from(self, name: str, src: torch.Tensor, *, namespace: str = "default",
                   durable: bool = False) -> int:
        """Store a copy of `src` (any contiguous tensor, any size) as `name`'s new version.

        With an NVMe tier, a tensor larger than one chunk goes in chunks through staging
        slices of the CPU tier straight to fresh NVMe extents (its version then lives on NVMe
        only, until a get loads it); a smaller one, or any without an NVMe tier, is a `put`.
        Nothing is published unless every byte was written. durable=True: return once it is
        durable (see `commit`). Returns the version number.
        """
        flat = _byte_view(src, "src", written=False)
        self._check_usable()  # before any lock: see `commit`
        if self._forget_spares(namespace, [name]):
            self._abort_quietly([name], namespace)  # the stream reserves the name itself
        info = self._open_stream(wire.StreamOpen(namespace, name, "write", dtype_name(src.dtype),
                                                 tuple(src.shape)))
        try:
            self._stream_out(info, flat)
        except BaseException:
            self._close_stream(info, commit=False, durable=False, quiet=True)
            raise
        try:
            return self._close_stream(info, commit=True, durable=durable)
        except InfinityError:
            # A close refused as a whole (durable without an NVMe tier) left the stream open.
            self._close_stream(info, commit=False, durable=False, quiet=True)
            raise

    def _open_stream(self, message: wire.StreamOpen) -> wire.StreamInfo:
        (result,) = self._call(message, on_late_reply=self._late_stream_undo)
        self._raise_first([result])
        return wire.StreamInfo.from_wire(result)

    def _late_stream_undo(self, reply: wire.Reply) -> None:
        """As `_late_lease_undo`, for a stream_open given up on: the stream it opened (its
        staging slices, its extents or its read lease) is closed without committing."""
        if reply.failure is None and reply.results and type(reply.results[0]) is not ItemError:
            info = wire.StreamInfo.from_wire(reply.results[0])
            self._send(wire.StreamClose(info.stream_id, False, False))  # its answer not waited for

    def _close_stream(self, info: wire.StreamInfo, *, commit: bool, durable: bool,
                      quiet: bool = False) -> int:
        try:
            (result,) = self._call(wire.StreamClose(info.stream_id, commit, durable),
                                   patient=durable)
            self._raise_first([result])
        except InfinityError:
            if quiet:
                return 0  # already failing: the first error is the one to raise
            raise
        return int(result)

    def _slot_views(self, info: wire.StreamInfo) -> list[torch.Tensor]:
        assert self._segments is not None
        return [self._segments.view(slot) for slot in info.slots]

    def _chunk(self, channel: Channel, info: wire.StreamInfo, slot: int, offset: int,
               nbytes: int) -> int:
        request_id = next(self._request_ids)
        channel.send(request_id, wire.StreamChunk(info.stream_id, slot, offset, nbytes),
                     expect_reply=True, releases=self._take_releases())
        return request_id

    def _chunk_done(self, channel: Channel, request_id: int) -> None:
        self._raise_first(self._results(channel.wait(request_id, what="a stream chunk")))

    def _drain(self, channel: Channel, pending: deque[tuple[int, int, int, int]]) -> None:
        """After a failure: collect the replies still due, so the channel holds no strays."""
        while pending:
            request_id = pending.popleft()[0]
            try:
                channel.wait(request_id, what="a stream chunk")
            except InfinityError:
                return  # the daemon is gone: nothing more will come

    def _stream_in(self, info: wire.StreamInfo, flat: torch.Tensor) -> None:
        if info.direct:
            if info.nbytes:
                flat.copy_(self._slot_views(info)[0][:info.nbytes])
            return
        self._check_usable()
        channel = self._channel()
        slots = self._slot_views(info)
        offsets = iter(range(0, info.nbytes, info.chunk_bytes))
        pending: deque[tuple[int, int, int, int]] = deque()  # (request id, slot, offset, n)

        def issue(slot: int) -> None:
            offset = next(offsets, None)
            if offset is not None:
                n = min(info.chunk_bytes, info.nbytes - offset)
                pending.append((self._chunk(channel, info, slot, offset, n), slot, offset, n))

        try:
            for slot in range(len(slots)):
                issue(slot)
            while pending:
                request_id, slot, offset, n = pending.popleft()
                self._chunk_done(channel, request_id)
                flat[offset:offset + n].copy_(slots[slot][:n])
                issue(slot)
        except BaseException:
            self._drain(channel, pending)
            raise

    def _stream_out(self, info: wire.StreamInfo, flat: torch.Tensor) -> None:
        if info.nbytes != flat.numel():
            raise InvalidRequestError(f"the stream takes {info.nbytes} bytes, not {flat.numel()}")
        if info.direct:
            if info.nbytes:
                copy_into(self._slot_views(info)[0][:info.nbytes], flat)
            return
        self._check_usable()
        channel = self._channel()
        slots = self._slot_views(info)
        free = list(range(len(slots)))
        pending: deque[tuple[int, int, int, int]] = deque()
        try:
            for offset in range(0, info.nbytes, info.chunk_bytes):
                if not free:
                    request_id, slot, _, _ = pending.popleft()
                    self._chunk_done(channel, request_id)
                    free.append(slot)
                slot = free.pop()
                n = min(info.chunk_bytes, info.nbytes - offset)
                # Streaming stores: this process never reads the slice back.
                copy_into(slots[slot][:n], flat[offset:offset + n])
                pending.append((self._chunk(channel, info, slot, offset, n), slot, offset, n))
            while pending:
                self._chunk_done(channel, pending.popleft()[0])
        except BaseException:
            self._drain(channel, pending)
            raise

    # --- the catalog -------------------------------------------------------------------

    def prefetch(self, names: Names, *, namespace: str = "default") -> None:
        """Hint that these tensors are needed soon (no reply, no wait)."""
        self._send(wire.Prefetch(tuple(wire.TensorRef(namespace, n) for n in _names(names))))

    def delete(self, names: Names, *, namespace: str = "default") -> None:
        """Remove names; current readers keep their versions until they release."""
        self._check_usable()  # before any lock: see `commit`
        listed = _names(names)
        spared = self._forget_spares(namespace, listed)
        if spared:
            self._abort_quietly(spared, namespace)  # nothing more to put under these names
        self._raise_first(self._call(wire.Delete(tuple(wire.TensorRef(namespace, n)
                                                        for n in listed))))

    def exists(self, name: str, *, namespace: str = "default") -> bool:
        return self.exists_many([name], namespace=namespace)[0]

    def exists_many(self, names: Names, *, namespace: str = "default") -> list[bool]:
        results = self._call(wire.Exists(tuple(wire.TensorRef(namespace, n) for n in _names(names))))
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

    def step_begin(self, *, namespace: str = "default") -> wire.StepReport | None:
        """Mark the start of a step (one iteration of a loop that touches the same tensors in
        the same order). The first step is recorded; later ones are replayed: infinityd loads
        what comes next while this process computes. Returns the report of a step this one
        ended (a step left open), else None (always None without an NVMe tier: steps are then
        untracked). The trace is this client name's in `namespace`:
        give `connect(name=...)` a stable name so a restarted process finds its trace."""
        (result,) = self._call(wire.Step(namespace, "begin"))
        self._raise_first([result])
        self.steps_begun += 1
        return None if result is None else wire.StepReport.from_wire(result)

    def step_end(self, *, namespace: str = "default") -> wire.StepReport:
        """Mark the end of the step; returns how it went (outcome, hits, misses, stall)."""
        (result,) = self._call(wire.Step(namespace, "end"))
        self._raise_first([result])
        return wire.StepReport.from_wire(result)

    def step_abort(self, *, namespace: str = "default") -> None:
        """Drop the step under way (it failed halfway): its accesses neither become a trace nor
        count against the one being replayed, which stays."""
        (result,) = self._call(wire.Step(namespace, "abort"))
        self._raise_first([result])

    @contextlib.contextmanager
    def step(self, *, namespace: str = "default") -> Iterator[StepResult]:
        """`with client.step() as step:` marks one step; `step.report` is set when it ends.
        A step whose body raises is aborted (see `step_abort`), and the exception goes on."""
        result = StepResult()
        self.step_begin(namespace=namespace)
        try:
            yield result
        except BaseException:
            try:
                self.step_abort(namespace=namespace)
            except InfinityError:
                pass  # the body's exception is the one that matters (the daemon may be gone)
            raise
        result.report = self.step_end(namespace=namespace)

    def stats(self) -> dict[str, Any]:
        """The daemon's counters: tiers, catalog, clients, requests."""
        (result,) = self._call(wire.Stats())
        self._raise_first([result])
        return wire.decode_stats(result)

    # --- namespace records ---------------------------------------------------------------

    def create_namespace(self, name: str, *, mode: str = "read-write",
                         quota_bytes: int = 0) -> wire.NamespaceInfo:
        """Create namespace `name` (before anything is put into it) with this client as its
        owner. mode "read-only": only this client writes it; every other client reads it
        through read-only mappings and gets ReadOnlyNamespaceError for writes. quota_bytes
        (0: none): writes past it get QuotaExceededError."""
        return self._namespace_op(wire.NamespaceOp("create", name, mode, quota_bytes))

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

    def on_segment_unmap(self, callback: Callable[[int, int], None]) -> None:
        """Call `callback(start, end)` before a shared-memory segment of this client is unmapped
        (retired by the daemon, or at close), e.g. to drop a CUDA pin on it. Added once."""
        assert self._segments is not None
        self._segments.add_unmap_hook(callback)

    def segment_ranges(self) -> builtins.list[tuple[int, int, int]]:
        """(segment id, start address, end address) of each shared segment mapped here."""
        assert self._segments is not None
        return self._segments.ranges()

    def shutdown_daemon(self) -> None:
        """Ask infinityd to stop cleanly (what `infinityd stop` does); this client is closed."""
        self._call(wire.Shutdown())
        self._teardown(send_bye=False)

    # --- closing ------------------------------------------------------------------------

    def close(self) -> None:
        """End the session: the daemon drops this client's leases and reservations."""
        if self._forked:
            self._closed = True  # the parent's sockets are not ours to touch
            return
        self._teardown(send_bye=True)

    def _teardown(self, *, send_bye: bool) -> None:
        if self._closed:
            return
        self._closed = True
        _LIVE_CLIENTS.discard(self)
        with self._spares_lock:
            self._spares.clear()  # the daemon discards them with the session
        self._heartbeat_stop.set()
        channel: Channel | None = getattr(self._local, "channel", None)
        if send_bye and channel is not None:
            try:
                channel.send(next(self._request_ids), wire.Bye(), expect_reply=False)
            except InfinityError:
                pass
        with self._channels_lock:
            others = [other for other in self._channels if other is not channel]
        for other in others:
            # The heartbeat thread may be waiting for an answer (giving spares back): its
            # request ends within a tick, not at daemon.request_timeout_s.
            other.shut()
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join(timeout=self._timeout_s)
        with self._channels_lock:
            for other in list(self._channels):
                # Another thread's request under way closes its own socket, within a tick or
                # at the context's termination below, which waits for it.
                other.shut(linger_ms=200 if other is channel else 0)
            self._channels.clear()
        if self._segments is not None:
            self._segments.close()
        self._context.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclasses.dataclass(frozen=True)
class _Spare:
    """A spare reservation held for this client's next put of its name."""

    dtype: str  # the wire's dtype name
    shape: tuple[int, ...]
    view: torch.Tensor
    granted_s: float  # time.monotonic() when the commit that left it was sent


def _byte_view(t: torch.Tensor, what: str, *, written: bool) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 view (no copy); written: the bytes will be written to."""
    _check_dense(t, what)
    if _is_zero_tensor(t):
        if written:
            raise InvalidRequestError(f"`{what}` is a ZeroTensor, which has no memory to write "
                                      f"into; pass a tensor of its own (torch.empty(...))")
        t = _materialized(t)
    if t.is_conj() or t.is_neg():
        raise InvalidRequestError(f"`{what}` is a conjugate or negative view, whose bytes are not "
                                  f"its values; pass {what}.resolve_conj().resolve_neg()")
    if not t.is_contiguous():
        raise InvalidRequestError(f"`{what}` must be contiguous; pass {what}.contiguous() or a "
                                  f"contiguous buffer")
    return t.detach().reshape(-1).view(torch.uint8)


def _check_dense(t: torch.Tensor, what: str) -> None:
    """InvalidRequestError, with advice, for anything but a dense tensor whose memory can be
    read (a ZeroTensor passes: it reads as zeros)."""
    if not isinstance(t, torch.Tensor):
        raise InvalidRequestError(f"`{what}` must be a torch tensor, not {type(t).__name__}")
    if t.is_nested:
        raise InvalidRequestError(f"`{what}` is a nested tensor; store its parts (unbind()) or a "
                                  f"padded tensor (to_padded_tensor(0.0))")
    if t.is_quantized:
        raise InvalidRequestError(f"`{what}` is a quantized tensor, and the store holds plain "
                                  f"dtypes: use {what}.int_repr() (with its scale and zero point) "
                                  f"or {what}.dequantize()")
    if t.layout is not torch.strided:
        raise InvalidRequestError(f"`{what}` is a {t.layout} tensor; the store holds dense ones: "
                                  f"pass {what}.to_dense()")
    if t.device.type == "meta":
        raise InvalidRequestError(f"`{what}` is on the meta device and has no bytes; materialize "
                                  f"it first (torch.empty_like(..., device='cpu'), say)")
    if not t.numel() or _is_zero_tensor(t):
        return
    if type(t) is not torch.Tensor and _is_fake(t):
        address = 0  # whatever device it claims
    elif t.device.type != "cpu":
        return  # on other devices (CUDA, XLA, lazy) copy_ does the work: no address needed
    else:
        try:
            address = t.data_ptr()
        except RuntimeError:  # a tensor inside torch.func transforms (vmap, grad)
            address = 0
    if not address:
        raise InvalidRequestError(
            f"`{what}` has no memory of its own (a FakeTensor, or a tensor inside a "
            f"torch.func transform); pass a real tensor")


def _is_fake(t: torch.Tensor) -> bool:
    """A torch.compile FakeTensor (shape and device, no memory), by torch's own test."""
    try:
        from torch._subclasses.fake_tensor import is_fake  # private in torch, hence the care
    except ImportError:
        return False
    return bool(is_fake(t))


def _is_zero_tensor(t: torch.Tensor) -> bool:
    is_zero = getattr(t, "_is_zerotensor", None)  # private in torch, hence the care
    return bool(is_zero()) if is_zero is not None else False


def _materialized(t: torch.Tensor) -> torch.Tensor:
    """A ZeroTensor (zeros without memory, from autograd) as a real tensor of zeros."""
    return torch.zeros(t.shape, dtype=t.dtype, device=t.device) if _is_zero_tensor(t) else t


def _reserve_spec(name: str, spec: Any) -> tuple[str, tuple[int, ...]]:
    """(wire dtype name, shape) of one `reserve` item: a tensor to mimic or a (dtype, shape)
    pair, checked here (InvalidRequestError) rather than refused by the daemon or msgpack."""
    if isinstance(spec, torch.Tensor):  # only its dtype and shape: meta, fake or sparse will do
        if spec.is_nested:
            raise InvalidRequestError(f"{name!r}: a nested tensor has no single shape to "
                                      f"reserve; reserve its parts")
        return dtype_name(spec.dtype), tuple(spec.shape)  # the daemon checks the sizes
    if isinstance(spec, (tuple, list)) and len(spec) == 2:
        dtype, dims = spec
        if not isinstance(dtype, torch.dtype):
            raise InvalidRequestError(f"{name!r}: a reserve item's dtype must be a torch.dtype, "
                                      f"not {type(dtype).__name__}")
        if isinstance(dims, (str, bytes)) or not isinstance(dims, Iterable):
            raise InvalidRequestError(f"{name!r}: a reserve item's shape is a sequence of sizes "
                                      f"(torch.Size, tuple or list), not {type(dims).__name__}; "
                                      f"one dimension is ({dims!r},)")
        dims = tuple(dims)
        for dim in dims:
            if isinstance(dim, bool) or not hasattr(type(dim), "__index__"):
                raise InvalidRequestError(f"{name!r}: shape {dims!r} has a size that is not an "
                                          f"integer ({dim!r})")
        dims = tuple(operator.index(dim) for dim in dims)
    else:
        raise InvalidRequestError(f"{name!r}: a reserve item is a tensor to mimic or a (dtype, "
                                  f"shape) pair, not {type(spec).__name__}")
    wire_dtype = dtype_name(dtype)
    try:
        tensor_nbytes(wire_dtype, dims)  # sizes in range: the daemon checks the same
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{name!r}: {exc}") from None
    return wire_dtype, dims


def _storable(t: torch.Tensor, name: str) -> torch.Tensor:
    """What `put` copies of `t`: its values as they read (a conjugate or negative view
    resolved), outside autograd; InvalidRequestError for a tensor that has no bytes to store."""
    if not isinstance(t, torch.Tensor):
        raise InvalidRequestError(f"{name!r}: put takes torch tensors, not {type(t).__name__}")
    _check_dense(t, name)
    t = _materialized(t)
    if t.requires_grad:
        t = t.detach()  # the copy is then not part of anyone's graph
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t


def _default_name() -> str:
    """The program's name, with the rank under torch.distributed launchers (RANK), so that each
    process of a job keeps its own step trace across restarts."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    rank = os.environ.get("RANK")
    return f"{name}-rank{rank}" if rank and rank.isdigit() else name


def connect(*, config: InfinityConfig | None = None, start: bool = False,
            name: str | None = None) -> Client:
    """Attach to the infinityd of these settings' runtime folder (starting one if `start`)."""
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
    return Client(config, layout, name=name or _default_name())


__all__ = ["Client", "Lease", "StepResult", "connect"]
