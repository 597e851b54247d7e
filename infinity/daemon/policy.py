"""Eviction policies: which resident tensors leave the CPU tier when it needs room.

Residency is owned by `infinity.daemon.residency`, and the work is done by
`infinity.daemon.eviction`: it writes dirty tensors back to NVMe, frees their
CPU slices, and never offers a tensor that may not go
(`Residency.candidates`). The policy only keeps an order and answers one
question, "which of these, first?". It never allocates, reads, writes or
blocks, and it is called on the daemon's loop thread only.

`EvictionPolicy` is the interface (a Protocol: any class with these three
methods fits, `LruPolicy` here and the trace-driven policy of
`infinity.daemon.scheduler`); `default_policy()` is what infinityd uses
until the scheduler replaces it. A key is `(namespace, name)`: the tier
manager maps it to that name's current version.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Set
from typing import Protocol

Key = tuple[str, str]  # (namespace, tensor name), as in the catalog


class EvictionPolicy(Protocol):
    """What the tier manager asks of an eviction policy.

    Events (the policy keeps whatever state it needs from them):

    - `touched(key, nbytes)`: the name's current version is in the CPU tier and
      was just used: leased by a get, written by a commit, or loaded from NVMe
      (a demand load or a prefetch). `nbytes` is its size in bytes. Called on
      every such use, so it must be cheap (O(1)).
    - `forget(key)`: the name left the CPU tier (evicted, or its version
      replaced or deleted). It may come back later with another `touched`. A
      policy that learns from history (traces) may keep that; a policy that
      tracks residency drops it.

    Decision:

    - `choose_victims(candidates, need_bytes)`: `candidates` are exactly the
      keys that may be evicted now (resident, current, not leased, no I/O in
      flight); the tier manager passes a `Mapping[key, bytes freed]`, so
      membership tests are O(1) while iterating it is O(resident tensors).
      Return keys drawn from `candidates`, best victim first, whose bytes cover
      `need_bytes` when they can (all of them in order when they cannot; an
      empty list means "evict nothing"). The tier manager evicts them in that
      order until its allocation succeeds: clean ones at once, dirty ones after
      their write-back. It may ask for more than it strictly needs, so that
      cold dirty tensors are written back ahead of time.
    """

    def touched(self, key: Key, nbytes: int) -> None: ...

    def forget(self, key: Key) -> None: ...

    def choose_victims(self, candidates: Iterable[Key], need_bytes: int) -> list[Key]: ...


class LruPolicy:
    """Least recently used first: an ordered dict from the coldest key to the hottest.

    Only keys that are resident are kept (`forget` drops them), so choosing walks
    from the cold end and stops as soon as `need_bytes` is covered: O(victims
    plus the leased or busy keys skipped), not O(resident tensors).
    """

    def __init__(self) -> None:
        self._order: OrderedDict[Key, int] = OrderedDict()  # key -> bytes, coldest first

    def touched(self, key: Key, nbytes: int) -> None:
        order = self._order
        order[key] = nbytes
        order.move_to_end(key)

    def forget(self, key: Key) -> None:
        self._order.pop(key, None)

    def choose_victims(self, candidates: Iterable[Key], need_bytes: int) -> list[Key]:
        pool: Mapping[Key, int] | Set[Key]
        if isinstance(candidates, (Mapping, Set)):
            pool = candidates
        else:
            pool = set(candidates)
        chosen: list[Key] = []
        got = 0
        for key, nbytes in self._order.items():
            if got >= need_bytes:
                break
            if key in pool:
                chosen.append(key)
                got += pool[key] if isinstance(pool, Mapping) else nbytes
        if got < need_bytes:
            # Candidates this policy never saw touched (none, normally): offer them last.
            known = self._order
            chosen.extend(key for key in pool if key not in known)
        return chosen

    def __len__(self) -> int:
        return len(self._order)


def default_policy() -> EvictionPolicy:
    """The policy infinityd starts with (the scheduler replaces it once it knows traces)."""
    return LruPolicy()
