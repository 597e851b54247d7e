"""The GPU tier: a client-side cache of tensors in device memory, within a byte budget.

Only the process that owns a device can hold its memory, so this tier lives in
the client. `DeviceCache.get(name)` leases the tensor from the daemon as any get
does (one request: it is the step's access that the daemon's trace sees, and it
says which version is current), then answers from device memory when the cached
copy is of that version, else copies the CPU-tier view over. After each get it
brings what comes next into device memory: it asks the daemon what the client's
trace reads next (`Client.upcoming`, once per window, not per get), leases those
of them the CPU tier holds, without making them accesses and without waiting for
loads from NVMe (`Client.resident_requester`: sent at the end of a get, answered
while the caller computes, taken by the next get once it has its own tensor, so a
get waits for one round trip, not two), and starts their copies, within the
budget and without evicting anything needed sooner. `close()` a cache when done
with it (or use it in a `with` block): until then the CPU-tier leases of its last
copies and of its last prefetch request stay held; `settle()` gives them back
and keeps the device copies (before someone must lease those tensors
exclusively), and `discard(names)` drops copies about to be rewritten, so that
prefetch brings the new bytes. A cache dropped without
`close()` is closed when it is garbage-collected, as a file is: its leases go
back then, not at a moment the caller chose.

Copies go through a `DeviceCopier`, the small device-copy interface:
`CudaCopier` copies on a side stream from pinned (registered) shared memory, and
the compute stream waits on an event, never the CPU; `CpuCopier` copies into
ordinary memory at once, so that the budget, eviction and prefetch logic run
and are tested on machines without a GPU.

Eviction: a cached tensor not in use and not being copied, by next use in the
known upcoming order (what is needed last goes first; what is not upcoming,
least recently used first). A tensor handed out by `get` is held until its
`DeviceLease` is released and is never evicted meanwhile.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Collection, Iterable, Protocol

import torch

from infinity.errors import (DaemonUnavailableError, ForkedClientError, InfinityError,
                             InvalidRequestError, ProtocolError, TierFullError, TooLargeError)
from infinity.protocol import wire
from infinity.protocol.wire import MAX_UPCOMING_ENTRIES

if TYPE_CHECKING:
    from infinity.client.client import Client, Lease, PendingResident, ResidentRequester


_QUIET_GETS = 8  # gets before asking again after an empty `upcoming`
_MAX_WINDOW_BYTES = 1 << 62  # what `upcoming` may be asked for at most (the wire's integers)
_OUT_OF_MEMORY = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), MemoryError)
_CUDA_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
# CUDA pins belong to the process, not to one copier: start address -> end of each pinned range.
_pins_lock = threading.Lock()
_pinned: dict[int, int] = {}


@functools.cache
def _cuda_runtime() -> ctypes.CDLL | None:
    """The CUDA runtime library that torch loaded into this process; None if there is none
    to be found (linked statically)."""
    with open("/proc/self/maps") as maps:
        paths = {fields[5].strip() for fields in (line.split(None, 5) for line in maps)
                 if len(fields) == 6}
    for path in sorted(paths):
        if not os.path.basename(path).startswith("libcudart") or path.endswith("(deleted)"):
            continue
        try:
            runtime = ctypes.CDLL(path)
            runtime.cudaGetLastError.restype = ctypes.c_int
        except (OSError, AttributeError):
            continue
        return runtime
    return None


def _clear_cuda_error(device: torch.device) -> None:
    """Consume the error a failed runtime call left as this thread's last error. The runtime
    keeps it until someone reads it, and torch reads it after its next kernel launch, where it
    would surface as that unrelated kernel's failure."""
    runtime = _cuda_runtime()
    if runtime is not None:
        runtime.cudaGetLastError()
        return
    try:  # no runtime library to ask: a launch's own check reads (and so clears) the error
        torch.empty(1, device=device).zero_()
    except RuntimeError:
        pass



def _device_full(exc: BaseException) -> bool:
    """Whether a copy failed for want of device memory: torch's error (its CUDA one is the
    same class since 2.5), or, from torch's CPU allocator (`CpuCopier`), a RuntimeError that
    says so only in words."""
    return isinstance(exc, _OUT_OF_MEMORY) or (
        type(exc) is RuntimeError and "DefaultCPUAllocator" in str(exc))

class DeviceCopier(Protocol):
    """Moves a CPU-tier view into device memory."""

    device: torch.device

    def start(self, src: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """A device tensor like `src`, and a ticket for the copy into it, started now."""
        ...

    def finished(self, ticket: Any) -> bool:
        """Whether the copy is done (then its source may be released); never blocks."""
        ...

    def ready(self, tensor: torch.Tensor, ticket: Any) -> None:
        """Hand `tensor` to the caller's work: what it issues from now on sees the copy's result
        (CUDA: the current stream waits for the copy, and the tensor's memory is not reused
        before that stream is done with it). `ticket` is None once the copy finished."""
        ...

    def synchronize(self, ticket: Any) -> None:
        """Block until the copy is done (before its source lease may go back early)."""
        ...


class CpuCopier:
    """The CPU as the device: a copy into ordinary memory, finished when `start` returns."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def start(self, src: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return src.clone(), None

    def finished(self, ticket: Any) -> bool:
        return True

    def ready(self, tensor: torch.Tensor, ticket: Any) -> None:
        pass

    def synchronize(self, ticket: Any) -> None:
        pass


class CudaCopier:
    """Host-to-device copies on a side stream, overlapping the compute stream.

    `register(ranges)` pins the client's shared-memory segments (cudaHostRegister), so copies
    from them are DMA; unregistered memory still copies, through the driver's staging. The
    device cache calls it before each copy with the segments mapped now: new ones are pinned,
    retired ones unpinned (by segment id, never reused, so a new segment mapped at a retired
    one's address is pinned afresh)."""

    def __init__(self, device: torch.device | str | int = "cuda") -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise InvalidRequestError(f"CudaCopier needs a CUDA device, not {self.device}; "
                                      f"use CpuCopier for the CPU")
        if not torch.cuda.is_available():
            raise InvalidRequestError("CUDA is not available to this process (no GPU, or a "
                                      "CPU-only torch); use CpuCopier")
        self.stream = torch.cuda.Stream(device=self.device)
        self._tried: set[int] = set()  # segments that could not be pinned (ids: never reused)
        self._seen: list[tuple[int, int, int]] = []

    def register(self, ranges: list[tuple[int, int, int]]) -> list[str]:
        """Pin each mapped (segment, start, end) not pinned yet; returns a sentence per range
        that could not be pinned (tried once each). Pins are the process's (`_pinned`), and
        `unpin` drops one before its segment is unmapped (`Client.on_segment_unmap`)."""
        if ranges == self._seen:
            return []  # nothing mapped or retired since the last get
        self._seen = list(ranges)
        failures = []
        cudart = torch.cuda.cudart()
        with torch.cuda.device(self.device), _pins_lock:
            for segment, start, end in ranges:
                if start in _pinned or segment in self._tried:
                    continue
                # 1 = cudaHostRegisterPortable: pinned for every device's context, not just this one.
                status = int(cudart.cudaHostRegister(start, end - start, 1))
                if status != 0:
                    _clear_cuda_error(self.device)
                if status in (0, _CUDA_ALREADY_REGISTERED):
                    _pinned[start] = end
                else:
                    self._tried.add(segment)
                    failures.append(f"segment {segment}: cudaHostRegister returned {status}; its "
                                    f"copies are not DMA from pinned memory")
        return failures

    @staticmethod
    def unpin(start: int, end: int) -> None:
        """Before the range [start, end) is unmapped: drop its pin, or a segment mapped there
        later would be taken for it and copied from the old pages."""
        with _pins_lock:
            if _pinned.pop(start, None) is None:
                return
            if int(torch.cuda.cudart().cudaHostUnregister(start)) != 0:
                _clear_cuda_error(torch.device("cuda"))

    def start(self, src: torch.Tensor) -> tuple[torch.Tensor, Any]:
        event = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            # Allocated on the side stream: memory the compute stream freed is reused only once
            # that stream is past its last use (`ready` records the compute stream's own uses).
            dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            dst.copy_(src, non_blocking=True)
            event.record(self.stream)
        return dst, event

    def finished(self, ticket: Any) -> bool:
        return bool(ticket.query())

    def ready(self, tensor: torch.Tensor, ticket: Any) -> None:
        current = torch.cuda.current_stream(self.device)
        if ticket is not None:
            current.wait_event(ticket)
        tensor.record_stream(current)

    def synchronize(self, ticket: Any) -> None:
        ticket.synchronize()


@dataclass(eq=False)
class _Entry:
    name: str
    revision: tuple[int, int]  # (version, edits) of the copy
    tensor: torch.Tensor
    nbytes: int
    ticket: Any = None  # the copy under way, None once it finished
    source: Any = None  # what the copy reads (a Lease or _SharedLease), until it finished
    holds: int = 0  # DeviceLeases handed out and not released
    last_use: int = 0
    prefetched: bool = False
    orphaned: bool = False  # replaced by a newer revision while held: freed at its last release


@dataclass
class DeviceCacheStats:
    hits: int = 0  # the version was in device memory, its copy finished
    inflight_hits: int = 0  # ... its copy still under way (the caller's stream waits for it)
    misses: int = 0  # copied on demand
    prefetched: int = 0  # copies started ahead of use
    wasted_prefetches: int = 0  # prefetched copies evicted or replaced before any use
    evictions: int = 0
    copied_bytes: int = 0
    used_bytes: int = 0
    max_used_bytes: int = 0
    upcoming_requests: int = 0
    prefetch_errors: int = 0  # prefetch requests refused, or copies with no device memory
    prefetch_not_resident: int = 0  # upcoming tensors not prefetched yet: on NVMe alone

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


class DeviceLease:
    """A tensor in device memory, held (never evicted) until `release` or the end of `with`."""

    def __init__(self, cache: DeviceCache, entry: _Entry) -> None:
        self._cache = cache
        self._entry: _Entry | None = entry
        self.tensor = entry.tensor
        self.version = entry.revision[0]

    def __enter__(self) -> torch.Tensor:
        return self.tensor

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def release(self) -> None:
        if self._entry is not None:
            self._cache._released(self._entry)
            self._entry = None


@dataclass
class _Window:
    """The upcoming reads the daemon named, and how far the client is through them."""

    names: list[str] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=dict)
    position: int = 0  # index of the next expected get in `names`

    def next_use(self, name: str) -> int | None:
        """How many gets from now `name` is needed, by this window; None if not in it."""
        try:
            return self.names.index(name, self.position) - self.position
        except ValueError:
            return None


class DeviceCache:
    """Tensors of one namespace in device memory, at most `budget_bytes` of them.

    `lookahead_entries` bounds how many upcoming tensors one window names. A tensor larger
    than the budget is TooLargeError; a get that finds the budget held by leased tensors is
    TierFullError (release some, or give the cache a larger budget). `prefetch_names`, when
    given, are the only names the cache is meant for: the rest of what the trace names (a
    trainer's gradients, read under exclusive leases) is left out of its windows, so that it
    is neither prefetched into device memory nor leased away from the code that writes it.
    """

    def __init__(self, client: Client, *, budget_bytes: int, copier: DeviceCopier | None = None,
                 namespace: str = "default", lookahead_entries: int = 64,
                 prefetch: bool = True, prefetch_names: Collection[str] | None = None) -> None:
        if budget_bytes <= 0:
            raise InvalidRequestError(f"budget_bytes is {budget_bytes}; give the device cache a "
                                      f"positive number of bytes")
        if not 1 <= lookahead_entries <= MAX_UPCOMING_ENTRIES:
            raise InvalidRequestError(
                f"lookahead_entries is {lookahead_entries}; give 1 to {MAX_UPCOMING_ENTRIES} "
                f"(the most one `upcoming` request may ask the daemon for)")
        self.client = client
        self.budget_bytes = budget_bytes
        self.copier: DeviceCopier = copier if copier is not None else CpuCopier()
        self.namespace = namespace
        self.lookahead_entries = lookahead_entries
        self.prefetch_enabled = prefetch
        self.prefetch_names = frozenset(prefetch_names) if prefetch_names is not None else None
        self.stats = DeviceCacheStats()
        self._entries: dict[str, _Entry] = {}
        self._orphans: list[_Entry] = []  # replaced while held: freed at their last release
        self._uses = itertools.count(1)
        self._window = _Window()
        self._quiet_gets = 0
        self._steps_seen = client.steps_begun
        self._requester: ResidentRequester | None = None
        self._pending: tuple[PendingResident, list[str]] | None = None  # sent, not yet used
        self.registration_failures: list[str] = []
        self._closed = False  # then a DeviceLease's last release frees its tensor at once
        unpin = getattr(self.copier, "unpin", None)
        if unpin is not None:
            client.on_segment_unmap(unpin)
        self._register_segments()
        client.report_devices(self)  # the daemon's telemetry shows this GPU tier

    def device_figures(self) -> wire.DeviceFigures:
        """This cache's figures for the daemon's telemetry (sent with the heartbeats)."""
        s = self.stats
        return wire.DeviceFigures(str(getattr(self.copier, "device", "cpu")), self.budget_bytes,
                                  s.used_bytes, s.max_used_bytes, s.hits, s.inflight_hits,
                                  s.misses, s.prefetched, s.evictions, s.copied_bytes)

    # --- the API ------------------------------------------------------------------

    def get(self, name: str) -> DeviceLease:
        """`name`'s current bytes in device memory; `with cache.get(name) as t:`."""
        if self._closed:
            raise InvalidRequestError("this device cache is closed; make a new DeviceCache")
        self._reap()
        if self._pending is not None and name in self._pending[1]:
            # Its copy was asked for: the answer first, so that copy starts as the prefetch
            # planned it (the nearest name, first in the queue) instead of as a miss.
            self._collect_prefetch(use=True)
        lease = self.client.get(name, namespace=self.namespace)
        try:
            # After the get, which may have mapped new segments and unmapped retired ones: a
            # copy from an address the driver still takes for a retired pinned segment would
            # read that segment's old pages.
            self._register_segments()
            revision = lease.revisions[0]
            entry = self._entries.get(name)
            if entry is not None and entry.revision == revision:
                if entry.ticket is None or self.copier.finished(entry.ticket):
                    self.stats.hits += 1
                else:
                    self.stats.inflight_hits += 1
                entry.prefetched = False
                lease.release()
            else:
                if entry is not None:
                    self._replace(entry)  # an older version, or written in place since
                entry = self._copy(name, revision, lease)
                self.stats.misses += 1
        except BaseException:
            lease.release()
            raise
        entry.holds += 1
        entry.last_use = next(self._uses)
        try:
            # Otherwise the last get's prefetch answer is taken now: after this get's own copy
            # (which must not queue behind copies for later), and with its tensor held.
            self._collect_prefetch(use=True)
            self.copier.ready(entry.tensor, entry.ticket)
            self._advance(name)
            if self.prefetch_enabled:
                self._prefetch()
        except BaseException:
            self._released(entry)
            raise
        return DeviceLease(self, entry)

    def __enter__(self) -> DeviceCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Done with the cache (also the end of `with DeviceCache(...) as cache:`): wait for the
        copies under way, then `clear()`, so that every CPU-tier lease it holds goes back. What
        DeviceLeases still hold stays in device memory until released."""
        self._closed = True
        self.client.report_devices(self, report=False)
        failure: Exception | None = None
        try:
            self._collect_prefetch(use=False)  # no copy reads it: back at once, whatever follows
        finally:
            for entry in [*self._entries.values(), *self._orphans]:
                if entry.ticket is not None:
                    try:
                        self.copier.synchronize(entry.ticket)
                    except Exception as exc:  # a faulted device: its copies run no more
                        failure = failure or exc
                    entry.ticket = None
            self.clear()
        if failure is not None:
            raise failure

    def __del__(self) -> None:
        # A DeviceLease refers to its cache, so none is still held here: every entry can go.
        # Nothing may escape a finalizer, whatever state the client or the process is in.
        try:
            self.close()
        except Exception:
            pass

    def set_prefetch_names(self, names: Collection[str] | None) -> None:
        """Change which names the cache is meant for (see the class docstring) from the next
        prefetch on: the window already read from the trace is dropped."""
        self.prefetch_names = frozenset(names) if names is not None else None
        self._window = _Window()

    def discard(self, names: Iterable[str]) -> None:
        """Drop the cached copies of `names` that nobody holds: a newer revision of them is
        coming (an optimizer step is rewriting them), so the next prefetch copies the new bytes
        ahead of their use, where a get would find the old copy and copy on demand."""
        for name in names:
            entry = self._entries.get(name)
            if entry is not None and entry.holds == 0:
                if entry.prefetched:
                    self.stats.wasted_prefetches += 1
                self._drop(entry)

    def settle(self) -> None:
        """Wait for the copies under way and give back every CPU-tier lease the cache holds
        (its copies' sources, the last prefetch's answer), keeping what is in device memory:
        before another party must lease those tensors exclusively (the daemon's optimizer step
        writes the parameters in place)."""
        try:
            self._collect_prefetch(use=False)
        finally:
            for entry in [*self._entries.values(), *self._orphans]:
                if entry.ticket is not None:
                    self.copier.synchronize(entry.ticket)
                    entry.ticket = None
            self._reap()

    def clear(self) -> None:
        """Drop every cached tensor not held (their device memory goes back to torch), and give
        back the CPU-tier leases of copies that finished and of a prefetch not yet used."""
        try:
            self._collect_prefetch(use=False)
        finally:
            self._reap()
            for entry in list(self._entries.values()):
                if entry.holds == 0 and entry.ticket is None:
                    self._drop(entry)

    def cached(self) -> dict[str, int]:
        """name -> version of what is in device memory now."""
        return {name: entry.revision[0] for name, entry in self._entries.items()}

    def _released(self, entry: _Entry) -> None:
        entry.holds -= 1
        if entry.holds:
            return
        if entry.orphaned:
            self._orphans.remove(entry)
            self._free(entry)
        elif self._closed and self._entries.get(entry.name) is entry:
            self._drop(entry)  # nobody will clear() a closed cache again

    def _register_segments(self) -> None:
        register = getattr(self.copier, "register", None)
        if register is not None:
            self.registration_failures += register(self.client.segment_ranges())

    # --- the window ------------------------------------------------------------------

    def _advance(self, name: str) -> None:
        window = self._window
        needed_in = window.next_use(name)
        if needed_in is None:
            self._window = _Window()  # not what the daemon said (or a repeat it left out): ask again
        else:
            window.position += needed_in + 1

    def _refresh_window(self) -> None:
        if self.client.steps_begun != self._steps_seen:
            self._steps_seen = self.client.steps_begun
            self._quiet_gets = 0  # a new step: its trace may replay now
        if self._quiet_gets:
            self._quiet_gets -= 1  # the daemon had nothing to say lately: do not ask every get
            return
        self.stats.upcoming_requests += 1
        # Further than the budget reaches: names beyond it still order the evictions.
        upcoming = self.client.upcoming(namespace=self.namespace,
                                        max_entries=self.lookahead_entries,
                                        max_bytes=min(4 * self.budget_bytes, _MAX_WINDOW_BYTES))
        if self.prefetch_names is not None:
            upcoming = [(n, size) for n, size in upcoming if n in self.prefetch_names]
        self._window = _Window([n for n, _ in upcoming], dict(upcoming))
        if not upcoming:
            self._quiet_gets = _QUIET_GETS

    # --- prefetch ------------------------------------------------------------------------

    def _prefetch(self) -> None:
        window = self._window
        if window.position >= len(window.names):
            self._refresh_window()
            window = self._window
        wanted: list[str] = []
        planned = 0
        for distance, name in enumerate(window.names[window.position:]):
            nbytes = window.sizes[name]
            if name in self._entries:
                continue
            if planned + nbytes > self.budget_bytes:
                break
            if not self._room(nbytes + planned, before=distance, dry_run=True):
                break
            wanted.append(name)
            planned += nbytes
        if not wanted:
            return
        try:
            # Only what the CPU tier holds now: waiting for a load from NVMe would stall the
            # caller's compute, and the rest is asked for again at the next get, by when the
            # daemon's own prefetch has usually brought it in. Sent now, answered while the
            # caller computes, and used by the next get: no round trip waited for.
            if self._requester is None:
                self._requester = self.client.resident_requester()
            request = self._requester.send(wanted, namespace=self.namespace)
        except (DaemonUnavailableError, ProtocolError, ForkedClientError):
            raise  # the client itself is unusable: the caller must know
        except InfinityError:
            self._prefetch_refused()
            return
        self._pending = (request, wanted)

    def _prefetch_refused(self) -> None:
        # The request as a whole refused: prefetch is an optimisation, so the get that asked
        # for it still succeeds; ask again later.
        self.stats.prefetch_errors += 1
        self._window = _Window()
        self._quiet_gets = _QUIET_GETS

    def _collect_prefetch(self, *, use: bool) -> None:
        """Take the answer to the prefetch request sent by the last get, and start the copies
        of what it leased that is still wanted (use=False: give it all back)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        request, wanted = pending
        try:
            lease, names = request.result()
        except (DaemonUnavailableError, ForkedClientError):
            # A session that is gone took its leases with it; a request given up on (the daemon
            # slow) is released on its socket now, as nothing may read it again, and before
            # the error goes up: nothing else would (close finds no pending request).
            request.give_back()
            if use:
                raise
            return
        except ProtocolError:
            raise
        except InfinityError:
            self._prefetch_refused()
            return
        self.stats.prefetch_not_resident += len(wanted) - len(names)
        if lease is None:
            return
        if not use:
            lease.release()
            return
        started: list[str] = []
        try:
            self._register_segments()  # as in get: before any copy from what it mapped
            window = self._window
            for name, view, revision in zip(names, lease.tensors, lease.revisions):
                if name in self._entries:
                    continue  # the get that was due meanwhile copied it
                needed_in = window.next_use(name)
                if needed_in is None or not self._room(view.numel() * view.element_size(),
                                                       before=needed_in, dry_run=False):
                    break
                try:
                    entry = self._start(name, revision, view, source=None)
                except Exception as exc:
                    if not _device_full(exc):
                        raise
                    self.stats.prefetch_errors += 1  # the device is full: the next get copies
                    break
                entry.prefetched = True
                self.stats.prefetched += 1
                started.append(name)
        finally:
            # One lease covers the batch: it goes back once every copy that reads it is done.
            if not started:
                lease.release()
            else:
                self._entries_sharing(lease, started)

    def _entries_sharing(self, lease: Lease, names: list[str]) -> None:
        shared = _SharedLease(lease, len(names))
        for name in names:
            self._entries[name].source = shared  # type: ignore[assignment]
        self._reap()

    # --- space ---------------------------------------------------------------------------

    def _copy(self, name: str, revision: tuple[int, int], lease: Lease) -> _Entry:
        view = lease.tensor
        nbytes = view.numel() * view.element_size()
        if nbytes > self.budget_bytes:
            raise TooLargeError(
                f"tensor {name!r} has {nbytes} bytes, more than the device cache's budget of "
                f"{self.budget_bytes}; give the cache a larger budget_bytes or keep the tensor "
                f"on the CPU")
        if not self._room(nbytes, before=None, dry_run=False):
            held = sum(e.nbytes for e in [*self._entries.values(), *self._orphans] if e.holds)
            raise TierFullError(
                f"the device cache cannot make room for {name!r} ({nbytes} bytes): {held} of its "
                f"{self.budget_bytes} bytes are held by tensors in use; release DeviceLeases "
                f"sooner or give the cache a larger budget_bytes")
        return self._start(name, revision, view, source=lease)

    def _start(self, name: str, revision: tuple[int, int], view: torch.Tensor, *,
               source: Any) -> _Entry:
        tensor, ticket = self.copier.start(view)
        nbytes = view.numel() * view.element_size()
        entry = _Entry(name, revision, tensor, nbytes, ticket=ticket, source=source)
        self._entries[name] = entry
        stats = self.stats
        stats.copied_bytes += nbytes
        stats.used_bytes += nbytes
        stats.max_used_bytes = max(stats.max_used_bytes, stats.used_bytes)
        if source is not None:
            self._reap_entry(entry)
        return entry

    def _room(self, nbytes: int, *, before: int | None, dry_run: bool) -> bool:
        """Make `nbytes` fit in the budget by evicting what is evictable and, when `before` is
        given (a prefetch needed that many gets from now), needed later than that."""
        free = self.budget_bytes - self.stats.used_bytes
        if free >= nbytes:
            return True
        victims = self._victims(before)
        room = free
        chosen = []
        for entry in victims:
            if room >= nbytes:
                break
            chosen.append(entry)
            room += entry.nbytes
        if room < nbytes:
            return False
        if not dry_run:
            for entry in chosen:
                if entry.prefetched:
                    self.stats.wasted_prefetches += 1
                self._drop(entry)
                self.stats.evictions += 1
        return True

    def _victims(self, before: int | None) -> list[_Entry]:
        """Evictable entries, the best victim first: not upcoming (least recently used first),
        then upcoming, needed last first; with `before`, only those needed later than that.

        Without `before` (a get that must copy now), entries whose copy is still under way come
        last, in the same order: evicting one waits for its copy (its CPU-tier source is
        released only then), which beats refusing the get. A prefetch never waits so."""
        window = self._window
        far: list[_Entry] = []
        upcoming: list[tuple[int, _Entry]] = []
        copying: list[tuple[float, int, _Entry]] = []
        for entry in self._entries.values():
            if entry.holds:
                continue
            distance = window.next_use(entry.name)
            if entry.ticket is not None:
                if before is None:
                    copying.append((-distance if distance is not None else -float("inf"),
                                    entry.last_use, entry))
                continue
            if distance is None:
                far.append(entry)
            elif before is None or distance > before:
                upcoming.append((distance, entry))
        far.sort(key=lambda e: e.last_use)
        upcoming.sort(key=lambda pair: -pair[0])
        copying.sort(key=lambda item: item[:2])
        return far + [entry for _, entry in upcoming] + [entry for _, _, entry in copying]

    def _replace(self, entry: _Entry) -> None:
        """A newer revision comes: the old copy goes now, or at its holder's last release (its
        bytes stay counted until then: the holder still uses that memory)."""
        if entry.prefetched:
            self.stats.wasted_prefetches += 1  # replaced before any use
            entry.prefetched = False
        if entry.holds:
            del self._entries[entry.name]
            entry.orphaned = True
            self._orphans.append(entry)
        else:
            self._drop(entry)

    def _drop(self, entry: _Entry) -> None:
        del self._entries[entry.name]
        self._free(entry)

    def _free(self, entry: _Entry) -> None:
        self.stats.used_bytes -= entry.nbytes
        if entry.source is not None:
            try:
                if entry.ticket is not None:
                    self.copier.synchronize(entry.ticket)  # it still reads the CPU tier
            finally:  # a copy that failed reads nothing more either
                entry.source.release()
                entry.source = None

    # --- copies in flight ------------------------------------------------------------------

    def _reap(self) -> None:
        for entry in [*self._entries.values(), *self._orphans]:
            self._reap_entry(entry)

    def _reap_entry(self, entry: _Entry) -> None:
        if entry.ticket is not None and self.copier.finished(entry.ticket):
            entry.ticket = None
        if entry.ticket is None and entry.source is not None:
            entry.source.release()
            entry.source = None


class _SharedLease:
    """One get_many lease read by several copies: released when the last of them is done."""

    def __init__(self, lease: Lease, users: int) -> None:
        self._lease = lease
        self._users = users

    def release(self) -> None:
        self._users -= 1
        if self._users == 0:
            self._lease.release()
