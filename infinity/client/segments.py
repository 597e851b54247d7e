"""The client's side of the data plane: the daemon's segments mapped here, and tensor views into them.

At connect the client asks the fd channel for every live segment and maps
each memfd (MAP_SHARED, prefaulted); later, the first reply that points into a
segment it has not mapped triggers one more fd request. A tensor is then a
strided view of a per-(segment, dtype) base tensor: building it is one
`as_strided`, with no copy and no system call. A mapping stays alive as long
as any view of it does (the views hold the mmap), so retiring a segment only
drops this map's references.

A segment of a read-only namespace that this client may not write comes as a
read-only fd (see the daemon's fd server): it is mapped PROT_READ, so a stray
write into one of its views is refused by the kernel (SIGSEGV), not stored.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import select
import socket
import threading
import warnings
from typing import Any, Callable, Sequence

import torch

from infinity.errors import DaemonUnavailableError, InvalidRequestError, ProtocolError
from infinity.protocol import dtypes, fdpass, wire
from infinity.protocol.wire import FdReply, FdRequest, ItemError, Placement

TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in dtypes.DTYPE_ITEMSIZE if hasattr(torch, name)}
_STRIDES: dict[tuple[int, ...], tuple[int, ...]] = {}
_MAX_CACHED_SHAPES = 4096
_MAX_CACHED_VIEWS = 1 << 16
_MAX_CACHED_REPLIES = 1 << 12
_detach = torch.Tensor.detach


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype (InvalidRequestError for one the store does not hold)."""
    name = str(dtype).removeprefix("torch.")
    if name not in TORCH_DTYPES:
        raise InvalidRequestError(
            f"dtype {dtype} cannot be stored; use one of {', '.join(TORCH_DTYPES)}")
    return name


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = _STRIDES.get(shape)
    if strides is None:
        if len(_STRIDES) >= _MAX_CACHED_SHAPES:
            _STRIDES.clear()
        strides = _STRIDES[shape] = dtypes.contiguous_strides(shape)
    return strides


_MADV_POPULATE_WRITE = 23  # Linux 5.14; Python's mmap module does not name it yet


def _map_for_writing(fd: int, size_bytes: int) -> mmap.mmap:
    """Map a segment with its page tables filled for writing, so no view pays a page fault later.

    MAP_POPULATE alone maps a shared mapping's pages read-only, and the first write to each
    page would still fault; MADV_POPULATE_WRITE fills them writable.
    """
    try:
        mm = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        mm.madvise(_MADV_POPULATE_WRITE)
        return mm
    except OSError:
        return mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _map_for_reading(fd: int, size_bytes: int) -> mmap.mmap:
    """Map a segment this client may only read: PROT_READ (the fd is read-only, so the kernel
    would refuse PROT_WRITE, now or later through mprotect)."""
    return mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                     prot=mmap.PROT_READ)


def _is_read_only(fd: int) -> bool:
    return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY


def _frombuffer(mm: mmap.mmap, dtype: torch.dtype, *, read_only: bool) -> torch.Tensor:
    if not read_only:
        return torch.frombuffer(mm, dtype=dtype)
    # torch warns that a tensor over a read-only buffer is writable: here the kernel refuses
    # such writes, which is the point of mapping it read-only.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable", category=UserWarning)
        return torch.frombuffer(mm, dtype=dtype)


class _Mapping:
    __slots__ = ("mm", "size_bytes", "address", "read_only")

    def __init__(self, mm: mmap.mmap, size_bytes: int, *, read_only: bool = False) -> None:
        self.mm = mm
        self.size_bytes = size_bytes
        self.read_only = read_only
        self.address = _frombuffer(mm, torch.uint8, read_only=read_only).data_ptr()


class SegmentMap:
    """Mapped segments and the fd channel that brings new ones. Thread-safe."""

    def __init__(self, path: str, token: bytes, *, timeout_s: float) -> None:
        self._sock = fdpass.seqpacket_socket()
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(path)
        except OSError as exc:
            self._sock.close()
            raise DaemonUnavailableError(
                f"cannot reach infinityd's fd channel {path} ({exc}); is it running? "
                f"(infinityd status)") from None
        self.daemon_pid = fdpass.peer_credentials(self._sock)[0]
        self._token = token
        self._lock = threading.Lock()
        self._mappings: dict[int, _Mapping] = {}
        self._typed: dict[tuple[int, str], torch.Tensor] = {}
        # (version, segment, offset) -> its view: a version evicted to NVMe and loaded again
        # lands elsewhere, so its number alone does not name one place.
        self._views: dict[tuple[int, int, int], torch.Tensor] = {}
        # A get's packed results (`wire.split_reply`) -> (results, views): the same reply again
        # (the same versions in the same places) is answered without decoding it.
        self._replies: dict[bytes, tuple[tuple[Any, ...], list[torch.Tensor]]] = {}
        self._unmap_hooks: list[Callable[[int, int], None]] = []
        self._closed = False
        with self._lock:
            self._fetch(None)

    # --- views ------------------------------------------------------------------

    def view(self, placement: Placement) -> torch.Tensor:
        """The tensor a placement describes, as a view of shared memory (no copy)."""
        dtype = placement.dtype
        if placement.segment < 0:
            return torch.empty(placement.shape, dtype=self._torch_dtype(dtype))
        base = self._typed.get((placement.segment, dtype))
        if base is None:
            base = self._typed_base(placement.segment, dtype)
        return base.as_strided(placement.shape, _strides(placement.shape),
                               placement.offset // dtypes.DTYPE_ITEMSIZE[dtype])

    def cached_reply(self, packed: bytes) -> tuple[tuple[Any, ...], list[torch.Tensor]] | None:
        """(results, fresh views) for a get's packed results (`wire.split_reply`) seen before,
        byte for byte, as `leased_views(..., remember=packed)` kept them; else None."""
        hit = self._replies.get(packed)
        return None if hit is None else (hit[0], list(map(_detach, hit[1])))

    def leased_views(self, results: tuple[Any, ...], *, remember: bytes | None = None
                     ) -> tuple[list[torch.Tensor], ItemError | None]:
        """Views for the results of a get, and the first item error if any.

        The same versions are leased again and again (a model's weights every
        step), and a version does not move while it is resident, so the view of
        each version is kept, keyed by its version number (unique for the
        daemon's life) and place (a version evicted to NVMe and loaded again
        lands elsewhere), and handed out as a `detach()`ed alias: a fresh tensor
        object for the caller at a third of the cost of building the view again.
        A placement seen for the first time is validated in full
        (`Placement.from_wire`) before it is kept.
        """
        views, first_error, cacheable = self._views_of(results)
        if remember is not None and cacheable and first_error is None:
            if len(self._replies) >= _MAX_CACHED_REPLIES:
                self._replies.clear()
            self._replies[remember] = (results, views)
        return list(map(_detach, views)), first_error

    def _views_of(self, results: Sequence[Any]) -> tuple[list[torch.Tensor], ItemError | None, bool]:
        """(views of the results that are placements, first error, whether every view is kept)."""
        cache = self._views
        cacheable = True
        try:
            views = [cache.get((value[5], value[0], value[1])) for value in results]
        except (TypeError, IndexError, KeyError):  # an error or a malformed value: see below
            views = [None] * len(results)
        first_error: ItemError | None = None
        for i, view in enumerate(views):
            if view is not None:
                continue
            value = results[i]
            if type(value) is ItemError:
                first_error = first_error or value
                continue
            placement = Placement.from_wire(value)
            view = views[i] = self.view(placement)
            if placement.segment >= 0 and placement.version > 0:
                if len(cache) >= _MAX_CACHED_VIEWS:
                    cache.clear()
                cache[(placement.version, placement.segment, placement.offset)] = view
            else:
                cacheable = False
        return [view for view in views if view is not None], first_error, cacheable

    @staticmethod
    def _torch_dtype(name: str) -> torch.dtype:
        dtype = TORCH_DTYPES.get(name)
        if dtype is None:
            raise ProtocolError(f"infinityd sent dtype {name!r}, which this client does not know")
        return dtype

    def _typed_base(self, segment: int, dtype: str) -> torch.Tensor:
        torch_dtype = self._torch_dtype(dtype)
        with self._lock:
            mapping = self._mappings.get(segment)
            if mapping is None:
                self._fetch((segment,))
                mapping = self._mappings.get(segment)
                if mapping is None:
                    raise ProtocolError(f"infinityd did not hand over segment {segment}")
            base = _frombuffer(mapping.mm, torch_dtype, read_only=mapping.read_only)
            self._typed[(segment, dtype)] = base
            return base

    def read_only_segments(self) -> set[int]:
        """The mapped segments this client may only read (a read-only namespace's)."""
        return {s for s, m in list(self._mappings.items()) if m.read_only}

    def ranges(self) -> list[tuple[int, int, int]]:
        """(segment, start address, end address) of every mapped segment (checks, pinning)."""
        # Without the lock, which a fetch holds while it waits for the daemon: a copy of the
        # mappings, taken in one step under the GIL, is enough for a list of ranges.
        mappings = list(self._mappings.items())
        return [(s, m.address, m.address + m.size_bytes) for s, m in sorted(mappings)]

    # --- the fd channel -------------------------------------------------------------

    def _fetch(self, want: tuple[int, ...] | None) -> None:
        """Ask for segments and map them; the caller holds the lock."""
        if self._closed:
            raise DaemonUnavailableError("this client is closed; connect again")
        try:
            fdpass.send_message(self._sock, FdRequest(self._token, want).encode())
            while True:
                data, fds = fdpass.recv_message(self._sock, max_fds=FdReply.MAX_FDS_PER_MESSAGE)
                if not data:
                    raise DaemonUnavailableError(
                        "infinityd closed this client's fd channel (it stopped, or it ended the "
                        "session after daemon.client_timeout_s of silence); connect again")
                try:
                    reply = FdReply.decode(data)
                    if reply.error is not None:
                        raise reply.error.exception()
                    if len(fds) != len(reply.segments):
                        raise ProtocolError(f"an fd reply lists {len(reply.segments)} segments "
                                            f"but carries {len(fds)} fds")
                    for info, fd in zip(reply.segments, fds):
                        if _is_read_only(fd):  # a read-only namespace's, which others write
                            self._mappings[info.segment] = _Mapping(
                                _map_for_reading(fd, info.size_bytes), info.size_bytes,
                                read_only=True)
                        else:
                            self._mappings[info.segment] = _Mapping(
                                _map_for_writing(fd, info.size_bytes), info.size_bytes)
                finally:
                    for fd in fds:
                        os.close(fd)  # the mapping keeps the memory; the fd is no longer needed
                for segment in reply.retired:
                    self._forget(segment)
                if not reply.more:
                    return
        except (socket.timeout, TimeoutError):
            # Its answer may still come, and would be read as the answer to the next request:
            # the channel is out of step for good, so it closes (the daemon ends the session).
            self._closed = True
            self._sock.close()
            raise DaemonUnavailableError(
                "infinityd did not hand over shared-memory segments in time "
                "(daemon.request_timeout_s), so this client's session is over; check "
                "`infinityd status` and connect again") from None
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise DaemonUnavailableError(f"infinityd's fd channel broke ({exc}); restart it "
                                         f"and connect again") from None

    def add_unmap_hook(self, hook: Callable[[int, int], None]) -> None:
        """`hook(start, end)` runs before a segment's mapping is dropped (see Client)."""
        with self._lock:
            if hook not in self._unmap_hooks:
                self._unmap_hooks.append(hook)

    def _unmapping(self, mapping: _Mapping) -> None:
        for hook in self._unmap_hooks:
            hook(mapping.address, mapping.address + mapping.size_bytes)

    def _forget(self, segment: int) -> None:
        mapping = self._mappings.pop(segment, None)
        if mapping is not None:
            self._unmapping(mapping)
        self._replies.clear()  # rare (a segment retired): not worth finding the ones it touches
        for key in [k for k in self._typed if k[0] == segment]:
            del self._typed[key]
        if mapping is not None:
            start, end = mapping.address, mapping.address + mapping.size_bytes
            # Other threads add views without the lock (a get builds its views outside it):
            # walk a copy, which list() takes in one step under the GIL.
            for cached, view in list(self._views.items()):
                if start <= view.data_ptr() < end:
                    self._views.pop(cached, None)

    @property
    def closed(self) -> bool:
        """Closed by the client, or after a fetch that timed out (see `_fetch`)."""
        return self._closed

    def daemon_gone(self) -> str | None:
        """Why the daemon is known to be gone (its end of the fd channel closed), or None."""
        if self._closed:
            return "the client was closed"
        poller = select.poll()  # one per call: poll objects refuse concurrent use
        poller.register(self._sock, select.POLLRDHUP)
        for _, events in poller.poll(0):
            if events & (select.POLLHUP | select.POLLRDHUP | select.POLLERR):
                return "it closed this client's fd channel (stopped, or session timed out)"
        return None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._sock.close()
            for mapping in self._mappings.values():
                self._unmapping(mapping)
            self._mappings.clear()
            self._typed.clear()
            self._views.clear()
            self._replies.clear()
