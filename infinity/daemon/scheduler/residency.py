"""The scheduler's residency view: what the CPU tier holds and what is loading into it, as reported.

This is the only place the scheduler keeps residency. The daemon reports it
through the scheduler's events (loads started and finished, writes,
evictions, the eviction policy's `touched`/`forget`); everything else in the
scheduler asks this view, and the next-use index hears each arrival and
departure through `watch`. What the rest of the scheduler asks of it:

- is `key` resident, and at what size (`resident`); how many are (`len`);
- is a load of `key` in flight, and its size (`inflight`);
- bytes resident, bytes in flight (`resident_bytes`, `inflight_bytes`), and
  resident + in flight per tensor namespace (`namespace_bytes`, for quotas);
- the last size seen of a tensor, resident or not (`sizes`).

Beside the view it keeps two annotations of the scheduler's own, which no
tier owner has: which resident tensors a prefetch brought in and no one has
used yet (`prefetched`, for hit counting and wasted bytes), and per load in
flight whether it is a prefetch, for which stream, and whether a client has
already waited on it (`Load`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Callable

from infinity.daemon.trace import StreamKey, TensorKey

__all__ = ["Load", "Residency"]


@dataclass(slots=True)
class Load:
    """A load from NVMe into the tier, in flight."""

    nbytes: int
    prefetch: bool
    stream: StreamKey | None
    used: bool = False  # accessed while in flight (an in-flight hit): not a prefetch hit later
    reading: bool = True  # its read was submitted (the bandwidth meter counts its time)


def _ignore(key: TensorKey) -> None:
    return None


class Residency:
    """Resident tensors (with their sizes) and loads in flight, with byte totals.

    Read `resident`, `prefetched`, `inflight` and `sizes` directly (the
    planner's loops do); change them only through the methods, which keep the
    totals and tell the watcher.
    """

    __slots__ = ("resident", "prefetched", "inflight", "sizes", "resident_bytes", "inflight_bytes",
                 "_namespace_bytes", "_added", "_dropped")

    def __init__(self) -> None:
        self.resident: dict[TensorKey, int] = {}  # resident tensor -> its size in bytes
        # Resident tensors loaded by a prefetch and not used since -> the stream it was for.
        self.prefetched: dict[TensorKey, StreamKey | None] = {}
        self.inflight: dict[TensorKey, Load] = {}
        self.sizes: dict[TensorKey, int] = {}  # last size seen in any event
        self.resident_bytes = 0
        self.inflight_bytes = 0
        self._namespace_bytes: dict[str, int] = {}  # resident + in flight, per tensor namespace
        self._added: Callable[[TensorKey], None] = _ignore
        self._dropped: Callable[[TensorKey], None] = _ignore

    def watch(self, *, added: Callable[[TensorKey], None], dropped: Callable[[TensorKey], None]) -> None:
        """Call `added(key)` after a tensor becomes resident and `dropped(key)` after it stops
        being resident (the view already says so when they run)."""
        self._added = added
        self._dropped = dropped

    def __len__(self) -> int:
        return len(self.resident)

    def namespace_bytes(self, namespace: str) -> int:
        """Bytes resident or loading in `namespace`."""
        return self._namespace_bytes.get(namespace, 0)

    def namespace_totals(self) -> dict[str, int]:
        """A copy of the bytes resident or loading per namespace (namespaces with none left out)."""
        return dict(self._namespace_bytes)

    # --- changes ---------------------------------------------------------------------

    def add(self, key: TensorKey, nbytes: int, *, prefetched: bool = False,
            prefetched_for: StreamKey | None = None) -> None:
        """`key` is resident at `nbytes`, replacing what the view had of it."""
        if key in self.resident:
            self.drop(key)
        self.resident[key] = nbytes
        if prefetched:
            self.prefetched[key] = prefetched_for
        self.resident_bytes += nbytes
        self._add_namespace_bytes(key, nbytes)
        self._added(key)

    def make_resident(self, key: TensorKey, nbytes: int) -> None:
        """The tier's word that `key` is resident (written, or used): a load in flight for it
        says so itself when it completes, and a tensor known at this size keeps its prefetch mark."""
        if key in self.inflight:
            return
        if self.resident.get(key) == nbytes:
            return
        self.add(key, nbytes)

    def drop(self, key: TensorKey) -> None:
        """`key` is not resident (any more)."""
        nbytes = self.resident.pop(key, None)
        if nbytes is None:
            return
        self.prefetched.pop(key, None)
        self.resident_bytes -= nbytes
        self._add_namespace_bytes(key, -nbytes)
        self._dropped(key)

    def adopt(self, keys: Iterable[TensorKey]) -> bool:
        """The daemon's eviction candidates are resident by definition: add any the view lacks
        (at their last size seen). Returns whether it added any."""
        learnt = False
        for key in keys:
            if key not in self.resident and key not in self.inflight:
                self.add(key, self.sizes.get(key, 0))
                learnt = True
        return learnt

    def start_load(self, key: TensorKey, load: Load) -> None:
        """A load of `key` started; whatever the tier had of it is replaced."""
        if key in self.resident:
            self.drop(key)
        self.inflight[key] = load
        self.inflight_bytes += load.nbytes
        self._add_namespace_bytes(key, load.nbytes)
        self.sizes[key] = load.nbytes

    def end_load(self, key: TensorKey) -> Load | None:
        """The load of `key` ended (done, failed or dropped); None if none was in flight."""
        load = self.inflight.pop(key, None)
        if load is not None:
            self.inflight_bytes -= load.nbytes
            self._add_namespace_bytes(key, -load.nbytes)
        return load

    def forget(self, key: TensorKey) -> None:
        """`key` was deleted: not resident, and its size is no longer known."""
        self.drop(key)
        self.sizes.pop(key, None)

    def _add_namespace_bytes(self, key: TensorKey, delta: int) -> None:
        value = self._namespace_bytes.get(key[0], 0) + delta
        if value:
            self._namespace_bytes[key[0]] = value
        else:
            self._namespace_bytes.pop(key[0], None)
