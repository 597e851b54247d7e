"""What the scheduler asks about residency (`ResidencyView`), and the one implementation of it.

The scheduler keeps no residency of its own: it is built with a
`ResidencyView` and asks it. In the daemon the view is
`infinity.daemon.residency.Residency.tensors`, owned by the daemon's
residency and changed only by the tiers (and the data and step services,
for a client's writes) as versions arrive, leave and load; a simulation
(`infinity.daemon.scheduler.simulated`) changes one directly. What the
scheduler asks of it:

- is `key` resident, and at what size in tensor bytes (`resident`); how many are;
- is a load of `key` in flight, and its size (`loading`);
- bytes resident, bytes in flight (`resident_bytes`, `loading_bytes`), and
  resident + in flight per tensor namespace (`namespace_bytes`, for quotas);
- the last size seen of a tensor, resident or not (`sizes`);
- and each arrival and departure, through `watch` (the next-use index keeps
  its order by them).

A tensor with a load in flight is not resident in this view, whatever the
tier holds of an older or newer version meanwhile: it arrives when the load
ends. The scheduler's own notes (which resident tensors a prefetch brought
and nobody used yet; per load: prefetch or demand, for which stream) are not
residency and stay in the scheduler.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Callable, Protocol

from infinity.daemon.trace import TensorKey

__all__ = ["ResidencyView", "TensorResidency"]

Watcher = Callable[[TensorKey], None]


def _ignore(key: TensorKey) -> None:
    return None


class ResidencyView(Protocol):
    """Read-only residency by tensor, as the scheduler asks it (see the module docstring).

    Read the maps directly (the planner's loops do); never change them.
    """

    @property
    def resident(self) -> Mapping[TensorKey, int]: ...  # resident tensor -> its size in bytes

    @property
    def loading(self) -> Mapping[TensorKey, int]: ...  # tensor with a load in flight -> its size

    @property
    def sizes(self) -> Mapping[TensorKey, int]: ...  # last size seen, resident or not

    @property
    def resident_bytes(self) -> int: ...

    @property
    def loading_bytes(self) -> int: ...

    def namespace_bytes(self, namespace: str) -> int: ...

    def namespace_totals(self) -> dict[str, int]: ...

    def watch(self, *, added: Watcher, dropped: Watcher) -> None: ...


class TensorResidency:
    """Resident tensors (with their sizes) and loads in flight, with byte totals: a `ResidencyView`.

    Change it only through the methods, which keep the totals and tell the
    watcher (called with the view already changed).
    """

    __slots__ = ("resident", "loading", "sizes", "resident_bytes", "loading_bytes",
                 "_namespace_bytes", "_added", "_dropped")

    def __init__(self) -> None:
        self.resident: dict[TensorKey, int] = {}
        self.loading: dict[TensorKey, int] = {}
        self.sizes: dict[TensorKey, int] = {}  # last size seen in any change (writers may store)
        self.resident_bytes = 0
        self.loading_bytes = 0
        self._namespace_bytes: dict[str, int] = {}  # resident + in flight, per tensor namespace
        self._added: Watcher = _ignore
        self._dropped: Watcher = _ignore

    def watch(self, *, added: Watcher, dropped: Watcher) -> None:
        """Call `added(key)` after a tensor becomes resident and `dropped(key)` after it stops
        being resident (one watcher: the scheduler built on this view)."""
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

    def add(self, key: TensorKey, nbytes: int) -> None:
        """`key` is resident at `nbytes`, replacing what the view had of it."""
        if key in self.resident:
            self.drop(key)
        self.resident[key] = nbytes
        self.resident_bytes += nbytes
        self._add_namespace_bytes(key, nbytes)
        self._added(key)

    def make_resident(self, key: TensorKey, nbytes: int) -> None:
        """The tier's word that `key` is resident at `nbytes` (written, or used): a load in
        flight for it says so itself when it ends, and a tensor known at this size stays as it is."""
        self.sizes[key] = nbytes
        if key in self.loading:
            return
        if self.resident.get(key) == nbytes:
            return
        self.add(key, nbytes)

    def drop(self, key: TensorKey) -> None:
        """`key` is not resident (any more)."""
        nbytes = self.resident.pop(key, None)
        if nbytes is None:
            return
        self.resident_bytes -= nbytes
        self._add_namespace_bytes(key, -nbytes)
        self._dropped(key)

    def start_load(self, key: TensorKey, nbytes: int) -> bool:
        """A load of `key` started; whatever the view had of it is replaced. False (and nothing
        changes) when one is in flight already: the first one stands for both."""
        if key in self.loading:
            return False
        if key in self.resident:
            self.drop(key)
        self.loading[key] = nbytes
        self.loading_bytes += nbytes
        self._add_namespace_bytes(key, nbytes)
        self.sizes[key] = nbytes
        return True

    def end_load(self, key: TensorKey, *, arrived: bool) -> bool:
        """The load of `key` ended (`arrived`: its tensor is resident now, at the load's size;
        else it failed or was dropped). False when none was in flight."""
        nbytes = self.loading.pop(key, None)
        if nbytes is None:
            return False
        self.loading_bytes -= nbytes
        self._add_namespace_bytes(key, -nbytes)
        if arrived:
            self.add(key, nbytes)
        return True

    def forget(self, key: TensorKey) -> None:
        """`key` was deleted: not resident, and its size is no longer known."""
        self.drop(key)
        self.sizes.pop(key, None)

    def adopt(self, keys: Iterable[TensorKey]) -> bool:
        """These tensors are resident (a tier's eviction candidates are): add any the view lacks,
        at their last size seen. Returns whether it added any. For a simulated tier that offers
        candidates it never reported; the daemon's tiers report every arrival."""
        learnt = False
        for key in keys:
            if key not in self.resident and key not in self.loading:
                self.add(key, self.sizes.get(key, 0))
                learnt = True
        return learnt

    def _add_namespace_bytes(self, key: TensorKey, delta: int) -> None:
        value = self._namespace_bytes.get(key[0], 0) + delta
        if value:
            self._namespace_bytes[key[0]] = value
        else:
            self._namespace_bytes.pop(key[0], None)
