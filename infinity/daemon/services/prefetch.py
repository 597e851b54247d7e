"""Prefetch planning: once per loop turn with news, start the loads the scheduler plans.

News is anything that may move the plan: an access that missed, a write, a
step marker, a tier change (`TierManager.on_change`). Gets that found all their
data resident plan lazily, within `LAZY_PLAN_DELAY_S`, not after each one.
"""

from __future__ import annotations

from infinity.config import SchedulerConfig
from infinity.daemon.arena import CpuArena
from infinity.daemon.catalog import Catalog
from infinity.daemon.loop import EventLoop
from infinity.daemon.scheduler import Scheduler
from infinity.daemon.tiers import TierManager
from infinity.errors import InfinityError

# How long gets that found everything resident may wait for the next prefetch plan.
LAZY_PLAN_DELAY_S = 0.002


class PrefetchPlanner:
    """Whether a plan is due, and the planning itself (loop thread only)."""

    def __init__(self, config: SchedulerConfig, loop: EventLoop, scheduler: Scheduler | None,
                 catalog: Catalog, tiers: TierManager, arena: CpuArena) -> None:
        self.config = config
        self.loop = loop
        self.scheduler = scheduler
        self.catalog = catalog
        self.tiers = tiers
        self.arena = arena
        self.due = False  # set by whoever has news; read before the loop waits
        self._timer = False  # a lazy plan is scheduled
        self.closing = False
        if scheduler is not None:
            tiers.on_change = self.soon
            loop.before_wait(self.plan)

    def soon(self) -> None:
        self.due = True

    def lazily(self) -> None:
        """After gets that all found their data resident: the plan may have moved on by an entry,
        but it is not urgent. Plan within a few milliseconds, not after every such get (a
        client reading resident tensors in a loop would otherwise pay for a plan each time)."""
        if self._timer or self.due:
            return
        self._timer = True

        def due() -> None:
            self._timer = False
            self.due = True

        self.loop.call_later(LAZY_PLAN_DELAY_S, due)

    def plan(self) -> None:
        """Once per loop turn with news: start the loads the scheduler plans (before waiting)."""
        if not self.due:
            return
        self.due = False
        scheduler = self.scheduler
        if scheduler is None or not self.config.prefetch or self.closing:
            return
        arena = self.arena
        free_bytes = max(0, arena.budget_bytes - arena.used_bytes)
        for key in scheduler.plan_prefetch(free_bytes=free_bytes):
            try:
                version = self.catalog.current(key[0], key[1])
            except InfinityError:
                self.tiers.residency.tensors.forget(key)  # deleted since the trace saw it
                scheduler.forget(key)
                continue
            self.tiers.prefetch(version)
