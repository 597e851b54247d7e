"""Spare reservations: the fresh slices the daemon leaves a client after a put replaced a
version, held here for the next put of the same name, dtype and shape.

`SpareReservations` owns the records and the rules: which spare a reserve may take (same dtype
and shape, granted less than half the client timeout ago: until then the daemon cannot have
ended the session and reused the slice), which it must abort instead, and giving back the ones
grown too old (from the heartbeat thread). It sends nothing itself: the caller hands it the
function that sends a request, so a request goes over the caller's own channel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from infinity.errors import InfinityError
from infinity.protocol import wire
from infinity.protocol.wire import Placement

# Spares aborted per request: well under wire.MAX_ITEMS, and under its size limit with the
# longest names.
ABORT_BATCH = 2048

Call = Callable[[wire.Request], tuple[Any, ...]]
Key = tuple[str, str]  # (namespace, name)


@dataclasses.dataclass(frozen=True)
class Spare:
    """A spare reservation held for this client's next put of its name."""

    dtype: str  # the wire's dtype name
    shape: tuple[int, ...]
    view: torch.Tensor
    granted_s: float  # time.monotonic() when the commit that left it was sent


class SpareReservations:
    """One client's spares, by (namespace, name); thread-safe. False while it holds none."""

    def __init__(self, *, view: Callable[[Placement], torch.Tensor],
                 abort_quietly: Callable[[list[str], str], None], timeout_s: float,
                 max_age_s: float) -> None:
        self._view = view
        self._abort_quietly = abort_quietly
        self._timeout_s = timeout_s
        # A spare is ours as long as the session lives: the daemon ends a session only after
        # client_timeout_s without a message, so one granted less than half that ago is safe
        # to write into without asking (an older one might be another tensor's memory by now).
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        # Read it freely (unlocked, a hint); change it only through the methods.
        self.held: dict[Key, Spare] = {}
        # Spares the heartbeat thread is giving back, and the event set once the daemon has them.
        self.returning: set[Key] = set()
        self._returned = threading.Event()

    def __bool__(self) -> bool:
        return bool(self.held)

    def take(self, wanted: list[wire.ReserveItem]) -> tuple[dict[str, Spare], list[str]]:
        """The spares that fit `wanted` (taken: they are the caller's now), and the names whose
        spare does not fit or is too old to trust (forgotten: the caller aborts them)."""
        taken: dict[str, Spare] = {}
        stale: list[str] = []
        with self._lock_for([(item.namespace, item.name) for item in wanted]):
            if not self.held:
                return taken, stale
            oldest = time.monotonic() - self.max_age_s
            for item in wanted:
                spare = self.held.pop((item.namespace, item.name), None)
                if spare is None:
                    continue
                if (spare.dtype == item.dtype and spare.shape == item.shape
                        and spare.granted_s >= oldest):
                    taken[item.name] = spare
                else:
                    stale.append(item.name)
        return taken, stale

    def put_back(self, namespace: str, taken: Mapping[str, Spare]) -> None:
        """Spares taken for a reserve that failed: still reserved, still unwritten."""
        with self._lock:
            for name, spare in taken.items():
                self.held[(namespace, name)] = spare

    def forget(self, namespace: str, names: Iterable[str]) -> list[str]:
        """Drop the records of these names' spares; returns the names that had one."""
        listed = list(names)
        with self._lock_for([(namespace, name) for name in listed]):
            if not self.held:
                return []
            return [name for name in listed
                    if self.held.pop((namespace, name), None) is not None]

    def keep(self, namespace: str, name: str, placement: Placement, granted_s: float) -> None:
        """Hold the spare a commit left for `name`."""
        try:
            view = self._view(placement).detach()  # handed out by reserve: see there
        except InfinityError:
            # Only a shortcut for the next put was lost (the commit itself succeeded).
            self._abort_quietly([name], namespace)
            return
        with self._lock:
            self.held[(namespace, name)] = Spare(placement.dtype, placement.shape, view,
                                                  granted_s)

    def clear(self) -> None:
        """Forget every spare without a word to the daemon (it discards them with the session)."""
        with self._lock:
            self.held.clear()

    @contextlib.contextmanager
    def _lock_for(self, keys: list[Key]) -> Iterator[None]:
        """The lock, taken once none of these (namespace, name)s has a spare on its way back to
        the daemon (`give_back_old`): until the daemon has it, a reserve of the name would meet
        the spare's reservation, and a commit would publish it."""
        while True:
            self._lock.acquire()
            if not (self.returning and any(key in self.returning for key in keys)):
                break
            returned = self._returned
            self._lock.release()
            returned.wait(self._timeout_s)
        try:
            yield
        finally:
            self._lock.release()

    def drop_all(self, call: Call) -> None:
        """Give every spare back to the daemon through `call` (the tier is full, say)."""
        # Under the lock until the daemon has them back: a put on another thread that finds no
        # spare must not reserve a name whose spare the daemon still holds.
        with self._lock:
            keys, self.held = list(self.held), {}
            _abort_keys(keys, call)

    def give_back_old(self, call: Call) -> None:
        """Abort the spares too old for `take` to hand out: none would ever be written into,
        and a name not put again (a tensor put for the last time, or deleted by another client)
        would otherwise hold its spare's room in the tier until the session ends. Runs on the
        heartbeat thread; `call` sends over its channel."""
        if not self.held:  # the common case, without the lock
            return
        with self._lock:
            oldest = time.monotonic() - self.max_age_s
            old = [key for key, spare in self.held.items() if spare.granted_s < oldest]
            if not old:
                return
            for key in old:
                del self.held[key]
            # Not under the lock while the daemon answers (a stalled daemon would hold up
            # close() and every put): threads that want these names wait (`_lock_for`).
            self.returning = set(old)
            returned = self._returned = threading.Event()
        try:
            _abort_keys(old, call)
        finally:
            with self._lock:
                self.returning = set()
            returned.set()


def _abort_keys(keys: list[Key], call: Call) -> None:
    """Abort the reservations of these (namespace, name)s through `call`, in requests of at
    most `ABORT_BATCH` items; what fails is ignored (a reservation already gone, or the session
    with it)."""
    by_namespace: dict[str, list[str]] = {}
    for namespace, name in keys:
        by_namespace.setdefault(namespace, []).append(name)
    for namespace, names in by_namespace.items():
        for start in range(0, len(names), ABORT_BATCH):
            refs = tuple(wire.TensorRef(namespace, n) for n in names[start:start + ABORT_BATCH])
            try:
                call(wire.Abort(refs))
            except InfinityError:
                pass  # the daemon or the session is gone, and the spares with it
