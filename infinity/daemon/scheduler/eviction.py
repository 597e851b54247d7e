"""Victim choice: which resident tensors make room, for a demand and for a prefetch, with quotas.

Rules (the eviction order itself comes from `NextUseIndex.eviction_order`):

- A namespace over its quota loses first, until it is back under; then the
  farthest next use, then the least recently used. Pinned (leased) tensors
  are never chosen (the order leaves them out).
- Room for a prefetch may only come from tensors whose next use is later
  than the prefetched tensor's own, and the prefetch must fit its
  namespace's quota; else the prefetch is skipped.

`VictimPool` is that rule over one pass of the order, shared with the
prefetch planner (`infinity.daemon.scheduler.prefetch`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Set as AbstractSet
from typing import Any, Iterable, Iterator

from infinity.config import SchedulerConfig
from infinity.daemon.scheduler.nextuse import NextUseIndex
from infinity.daemon.scheduler.view import ResidencyView
from infinity.daemon.trace import TensorKey

__all__ = ["Eviction", "VictimPool", "later"]

Candidates = AbstractSet[TensorKey] | Mapping[TensorKey, Any]


def later(next_use_s: float, need_s: float) -> bool:
    """May a tensor next used at `next_use_s` make room for one needed at `need_s`?

    Strictly later only. A tensor no trace needs (infinite) may make room for
    anything, including a tensor whose need is unknown (infinite too): that is
    plain LRU among the untraced.
    """
    if math.isinf(next_use_s):
        return True
    return next_use_s > need_s


class VictimPool:
    """Evictable resident tensors in eviction order, pulled lazily, for one planning pass.

    Most plans fit in free space and never build it; one that needs room
    pulls only as many tensors from the eviction order as it takes.
    """

    __slots__ = ("_order", "_seen", "_taken")

    def __init__(self, order: Iterator[tuple[float, TensorKey, int]]) -> None:
        self._order = order
        self._seen: list[tuple[float, TensorKey, int]] = []
        self._taken: set[TensorKey] = set()

    def _items(self) -> Iterator[tuple[float, TensorKey, int]]:
        index = 0
        while True:
            if index == len(self._seen):
                item = next(self._order, None)
                if item is None:
                    return
                self._seen.append(item)
            yield self._seen[index]
            index += 1

    def pick(self, need_bytes: int, *, later_than_s: float, namespace: str | None = None,
             exclude: frozenset[TensorKey] = frozenset()) -> list[tuple[TensorKey, int]] | None:
        """Victims covering `need_bytes` whose next use is after `later_than_s`; None if impossible."""
        if need_bytes <= 0:
            return []
        picked: list[tuple[TensorKey, int]] = []
        got = 0
        for next_use_s, key, nbytes in self._items():
            if not later(next_use_s, later_than_s):
                break  # farthest first: nothing after this one qualifies either
            if key in self._taken or key in exclude or (namespace is not None and key[0] != namespace):
                continue
            picked.append((key, nbytes))
            got += nbytes
            if got >= need_bytes:
                return picked
        return None

    def take(self, victims: Iterable[tuple[TensorKey, int]]) -> None:
        self._taken.update(key for key, _ in victims)


def _as_set(candidates: Iterable[TensorKey]) -> Candidates:
    # A set, a dict or a keys view is used as it is: no copy of a large candidate list.
    if isinstance(candidates, (AbstractSet, Mapping)):
        return candidates
    return set(candidates)


class Eviction:
    """Chooses victims among the daemon's candidates (resident, unleased tensors).

    A candidate mapping's values are the CPU bytes evicting each frees (its
    slice, rounded up to the arena's alignment); a plain set frees the sizes
    the residency view knows.
    """

    def __init__(self, config: SchedulerConfig, residency: ResidencyView, nextuse: NextUseIndex) -> None:
        self._config = config
        self._residency = residency
        self._nextuse = nextuse

    def _over_quota(self) -> dict[str, int]:
        over: dict[str, int] = {}
        for namespace, quota in self._config.namespace_quota_bytes:
            excess = self._residency.namespace_bytes(namespace) - quota
            if excess > 0:
                over[namespace] = excess
        return over

    def choose_victims(self, candidates: Iterable[TensorKey], need_bytes: int) -> list[TensorKey]:
        """Which of the (unleased, resident) candidates to evict to free `need_bytes`.

        A namespace over its quota loses first (until it is back under), then
        the farthest next use, then the least recently used. When the
        candidates cannot cover `need_bytes`, all of them are returned in that
        order and the daemon decides (TierFullError). Pinned ones never are.
        """
        return self._choose(_as_set(candidates), need_bytes)

    def _allowed_order(self, allowed: Candidates) -> Iterator[tuple[float, TensorKey, int]]:
        """The eviction order restricted to the candidates, with the bytes each frees."""
        freed = allowed if isinstance(allowed, Mapping) else None
        for next_use_s, key, nbytes in self._nextuse.eviction_order():
            if key in allowed:
                yield next_use_s, key, (int(freed[key]) if freed is not None else nbytes)

    def _choose(self, allowed: Candidates, need_bytes: int) -> list[TensorKey]:
        chosen: list[TensorKey] = []
        picked: set[TensorKey] = set()
        got = 0
        over = self._over_quota()
        if over:
            resident = self._residency.resident
            for _, key, nbytes in self._allowed_order(allowed):
                if got >= need_bytes or not any(excess > 0 for excess in over.values()):
                    break
                if over.get(key[0], 0) > 0:
                    chosen.append(key)
                    picked.add(key)
                    got += nbytes
                    over[key[0]] -= resident[key]  # the namespace's unit, not the slice's
        if got < need_bytes:
            for _, key, nbytes in self._allowed_order(allowed):
                if got >= need_bytes:
                    break
                if key not in picked:
                    chosen.append(key)
                    got += nbytes
        return chosen

    def victims_for_prefetch(self, key: TensorKey, candidates: Iterable[TensorKey],
                             need_bytes: int, *, nbytes: int | None = None
                             ) -> list[TensorKey] | None:
        """Victims to make `need_bytes` of room for prefetching `key`, or None: skip that prefetch.

        Only tensors whose next use is after `key`'s may go, and the prefetch
        must also fit its namespace's quota. `nbytes`: the tensor's size, where
        the caller knows it (the scheduler may not have seen the tensor yet: a restart).
        """
        return self._prefetch_victims(key, _as_set(candidates), need_bytes, nbytes)

    def _prefetch_victims(self, key: TensorKey, allowed: Candidates,
                          need_bytes: int, nbytes: int | None) -> list[TensorKey] | None:
        need_s = self._nextuse.need_s(key)
        victims: list[tuple[TensorKey, int]] = []
        quota = self._config.quota_bytes(key[0])
        if quota is not None:
            residency = self._residency
            # A load under way counts in its namespace already (load_started): not twice.
            own = 0 if key in residency.loading else (
                nbytes if nbytes is not None else residency.sizes.get(key, 0))
            excess = residency.namespace_bytes(key[0]) + own - quota
            # In tensor bytes, as the namespace counts them: the candidates' values are the CPU
            # bytes each frees, its slice rounded up to the arena's alignment, and victims counted
            # at that size could leave the namespace over its quota by the difference.
            in_tensor_bytes = (item for item in self._nextuse.eviction_order() if item[1] in allowed)
            picked = VictimPool(in_tensor_bytes).pick(excess, later_than_s=need_s,
                                                      namespace=key[0])
            if picked is None:
                return None
            victims += picked
        freed = allowed if isinstance(allowed, Mapping) else None  # CPU bytes, for the room
        short = need_bytes - sum(int(freed[k]) if freed is not None else n for k, n in victims)
        # A walk of its own; the one above is left half-way and never resumed, so the heaps
        # this one prunes at its start cannot change under it.
        pool = VictimPool(self._allowed_order(allowed))
        picked = pool.pick(short, later_than_s=need_s, exclude=frozenset(k for k, _ in victims))
        if picked is None:
            return None
        return [k for k, _ in victims + picked]
