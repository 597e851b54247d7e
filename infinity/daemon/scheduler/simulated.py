"""A scheduler with a simulated tier: for tests and simulations that run the scheduler without a daemon.

The scheduler asks a residency view it never changes (`view`). In the
daemon, the tiers change theirs as versions arrive, leave and load, and then
report the same to the scheduler. `SimulatedScheduler` is a `Scheduler` that
owns a `TensorResidency` and applies each event it is told to that view
first, in the order the daemon's tiers do, so that a simulation drives it
through the scheduler's own event API and `policy`:

- a load started / ended / cancelled: the view starts or ends the load (the
  tensor arrives when a load ends well);
- a write, or the policy's `touched`: the tensor is resident at that size
  (after the scheduler's recency for `touched`, as the tiers do);
- `evicted` and the policy's `forget`: the tensor leaves (after the
  scheduler counted a wasted prefetch); `forget` (deleted): the view forgets it first;
- a read: its size is the last one seen.

A simulated tier may also offer eviction candidates it never reported as
resident: they are taken as resident (`TensorResidency.adopt`) when the known
ones do not make the room, as the scheduler used to do by itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set as AbstractSet
from typing import Callable

from infinity.config import SchedulerConfig
from infinity.daemon.scheduler.core import NextUsePolicy, Scheduler
from infinity.daemon.scheduler.stream import AccessKind
from infinity.daemon.scheduler.view import TensorResidency
from infinity.daemon.trace import StreamKey, TensorKey

__all__ = ["SimulatedScheduler"]


class SimulatedScheduler(Scheduler):
    """A `Scheduler` whose residency view (`residency`) follows the events it is told."""

    def __init__(self, config: SchedulerConfig | None = None, *, cpu_tier_bytes: int,
                 is_pinned: Callable[[TensorKey], bool] | None = None) -> None:
        self.residency = TensorResidency()
        super().__init__(config, cpu_tier_bytes=cpu_tier_bytes, residency=self.residency,
                         is_pinned=is_pinned)
        self.policy = _SimulatedPolicy(self)

    def touched(self, stream: StreamKey, key: TensorKey, nbytes: int, now_s: float, *,
                write: bool = False) -> AccessKind:
        if write:
            self.residency.make_resident(key, nbytes)
        else:
            self.residency.sizes[key] = nbytes
        return super().touched(stream, key, nbytes, now_s, write=write)

    def load_started(self, key: TensorKey, nbytes: int, now_s: float, *, prefetch: bool,
                     stream: StreamKey | None = None, reading: bool = True) -> None:
        self.residency.start_load(key, nbytes)
        super().load_started(key, nbytes, now_s, prefetch=prefetch, stream=stream, reading=reading)

    def load_finished(self, key: TensorKey, now_s: float, *, ok: bool = True) -> None:
        self.residency.end_load(key, arrived=ok)
        super().load_finished(key, now_s, ok=ok)

    def load_cancelled(self, key: TensorKey, now_s: float) -> None:
        self.residency.end_load(key, arrived=False)
        super().load_cancelled(key, now_s)

    def evicted(self, key: TensorKey, now_s: float) -> None:
        super().evicted(key, now_s)
        self.residency.drop(key)

    def forget(self, key: TensorKey) -> None:
        self.residency.forget(key)
        super().forget(key)

    def choose_victims(self, candidates: Iterable[TensorKey], need_bytes: int) -> list[TensorKey]:
        allowed = candidates if isinstance(candidates, (AbstractSet, Mapping)) else set(candidates)
        chosen = super().choose_victims(allowed, need_bytes)
        if self._freed(allowed, chosen) < need_bytes and self.residency.adopt(allowed):
            chosen = super().choose_victims(allowed, need_bytes)
        return chosen

    def victims_for_prefetch(self, key: TensorKey, candidates: Iterable[TensorKey],
                             need_bytes: int, *, nbytes: int | None = None
                             ) -> list[TensorKey] | None:
        allowed = candidates if isinstance(candidates, (AbstractSet, Mapping)) else set(candidates)
        victims = super().victims_for_prefetch(key, allowed, need_bytes, nbytes=nbytes)
        if victims is None and self.residency.adopt(allowed):
            victims = super().victims_for_prefetch(key, allowed, need_bytes, nbytes=nbytes)
        return victims

    def _freed(self, allowed: Iterable[TensorKey], chosen: list[TensorKey]) -> int:
        # What the chosen victims free, as the scheduler counted it: a mapping's values, or
        # the sizes the view knows.
        if isinstance(allowed, Mapping):
            return sum(int(allowed[key]) for key in chosen)
        resident = self.residency.resident
        return sum(resident[key] for key in chosen)


class _SimulatedPolicy(NextUsePolicy):
    """The policy as the tiers drive it, the view hearing each change right after the scheduler."""

    def __init__(self, scheduler: SimulatedScheduler) -> None:
        super().__init__(scheduler)
        self._residency = scheduler.residency

    def touched(self, key: TensorKey, nbytes: int) -> None:
        super().touched(key, nbytes)
        self._residency.make_resident(key, nbytes)

    def forget(self, key: TensorKey) -> None:
        super().forget(key)
        self._residency.drop(key)
