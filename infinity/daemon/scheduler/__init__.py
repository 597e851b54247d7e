"""The scheduler: trace-driven prefetch, next-use eviction, fair sharing and per-client accounting.

It owns the decisions the daemon makes about the CPU tier, and none of the
mechanics: it never allocates, reads, writes or sleeps. The daemon's loop
feeds it events with the time it read from its own clock (`now_s`), asks it
what to load next (`plan_prefetch`) and what to evict (`policy`, an
`infinity.daemon.policy.EvictionPolicy` like LruPolicy), and acts. It keeps no
residency of its own: it asks the daemon's (`view.ResidencyView`). That makes
every decision here deterministic and testable with a simulated clock.

The daemon sees one object, `Scheduler` (`core`); behind it each module owns one part:

- `core`: the event API, routing each event to the parts it concerns, and
  the accounting that spans them (where an access found its data, which
  client a load or write-back counts for); `NextUsePolicy`, the scheduler as
  the tier manager's eviction policy;
- `stream`: the per-client records (`Stream`, `Counters`) and what the
  scheduler reports (`AccessKind`, `StepSummary`);
- `steps`: the streams and their steps: recording a trace
  (`infinity.daemon.trace`), replaying it, divergence, waits and stalls;
- `view`: what it asks of residency (`ResidencyView`: what the CPU tier holds
  and is loading, by tensor) and the implementation the daemon's residency
  owns (`TensorResidency`); the scheduler never changes it;
- `simulated`: `SimulatedScheduler`, a scheduler with a simulated tier that
  applies each event to its own view first, for tests and simulations;
- `nextuse`: when each resident tensor is read next, recency, and the eviction order;
- `eviction`: victim choice for demand and prefetch room, with namespace quotas;
- `prefetch`: prefetch planning (lookahead budgets, fair sharing between streams);
- `meter`: the engine's read bandwidth.

Rules it enforces:

- A prefetch never needs the eviction of a tensor whose next use comes
  sooner than the prefetched tensor's own (`plan_prefetch`,
  `victims_for_prefetch`).
- Eviction takes the resident tensor used farthest in the future first; a
  tensor no trace reads next (unknown, or overwritten before it is read) is
  infinitely far, and among those the least recently used goes first, so
  without traces it is exactly LRU. A namespace over its quota loses first.
  Pinned (leased) tensors are never chosen.
- After an access that breaks the trace's order, nothing more is prefetched
  for that client until it is back on the trace; a step that left the trace
  replaces it with its own order (it recorded while replaying), which the
  next step replays.
- Streams share the engine and the tier: every stream that is loading,
  waiting or has something to prefetch competes; none may get more than one
  quantum of bytes ahead of the least served of them (unless the engine
  would idle); each plan interleaves their prefetches by deficit round robin
  over bytes; they share the prefetch bytes in flight and the tier's
  prefetch window evenly, with the same lookahead.
"""

from __future__ import annotations

from infinity.config import SchedulerConfig
from infinity.daemon.scheduler.core import NextUsePolicy, Scheduler
from infinity.daemon.scheduler.stream import AccessKind, StepSummary
from infinity.daemon.trace import StreamKey, TensorKey

__all__ = [
    "AccessKind",
    "NextUsePolicy",
    "Scheduler",
    "SchedulerConfig",
    "StepSummary",
    "StreamKey",
    "TensorKey",
]
