"""Lease groups: the units of one block (a decoder layer) leased together, in one request.

Every `get_many` is a round trip to the daemon. On a small virtual machine that costs 0.2-0.3 ms
even for tensors already resident (a bare ZeroMQ round trip between two processes measured 170-300
us on the project machine: four thread wake-ups), and a decoder layer of a transformer has 7-9
units (its linear layers and norms), so a 22-layer model generating one token made ~200 of them.
An inference module computing on the CPU instead leases each block's parameters with one request
when the block's forward starts, and its units take their views from that lease (`take`); the
lease ends with the block's forward (`end`). The units a block leases are the ones its previous
forward used (`record`), so a block whose forward skips some units (a mixture of experts) does not
lease them, and the first forward, which has no record, leases unit by unit as before.

A group lease holds a whole block's weights until the block's forward ends, where unit leases
gave each back after its unit: at most one block more is pinned in the CPU tier. A group whose
lease does not fit the tier (`TierFullError`) stops leasing together, for good: its units lease
alone, which always works where it did before.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from infinity.errors import TierFullError

__all__ = ["BorrowedLease", "LeaseGroup"]


class BorrowedLease:
    """A unit's share of its group's lease: its views, and a release that leaves the group's
    lease to the group."""

    __slots__ = ("group", "tensors")

    def __init__(self, group: "LeaseGroup", tensors: list[torch.Tensor]) -> None:
        self.group = group
        self.tensors = tensors

    def release(self) -> None:
        """Nothing to give back: the group's lease ends with the block's forward."""


class LeaseGroup:
    """The units of one block and, while the block computes, the one lease of their tensors.

    `units` hold `names` (what each leases, in the order of its lease's tensors); `lease` is the
    client's `get_many` for these names, `settle` waits for what must finish before a read (the
    optimizer's steps over them) and `release_unit` ends a unit's hold on its views."""

    def __init__(self, name: str, *, lease: Callable[[list[str]], Any],
                 settle: Callable[[Sequence[Any]], None],
                 release_unit: Callable[[Any], None]) -> None:
        self.name = name
        self._lease_names = lease
        self._settle = settle
        self._release_unit = release_unit
        self.enabled = True
        self._members: list[Any] = []  # the units the block's last forward used, in order
        self._seen: list[Any] | None = None  # those this forward used so far (None: idle)
        self._depth = 0  # the block's forwards in progress (a block may be called re-entrantly)
        self._lease: Any = None
        self._views: dict[int, list[torch.Tensor]] = {}  # id(unit) -> its views in the lease

    def begin(self) -> None:
        """The block's forward starts: lease what its last forward used, in one request."""
        self._depth += 1
        if self._depth > 1:
            return
        self._seen = []
        if not self.enabled or not self._members:
            return
        members = self._members
        names = list(dict.fromkeys(name for unit in members for name in unit.names))
        self._settle(members)
        try:
            lease = self._lease_names(names)
        except TierFullError:
            self.enabled = False  # a block larger than the tier has room for: units alone
            return
        by_name = dict(zip(names, lease.tensors))
        self._lease = lease
        self._views = {id(unit): [by_name[name] for name in unit.names] for unit in members}

    def take(self, unit: Any) -> BorrowedLease | None:
        """The unit's views from the group's lease, or None (no lease, or the unit was not in
        the last forward: it leases alone). Records that this forward used the unit."""
        if self._seen is None:
            return None
        if unit not in self._seen:
            self._seen.append(unit)
        views = self._views.get(id(unit))
        return BorrowedLease(self, views) if views is not None else None

    def end(self) -> None:
        """The block's forward ended: units still holding views from the lease let go of them,
        the lease is given back, and the units this forward used are the next one's."""
        self._depth -= 1
        if self._depth > 0:
            return
        lease, self._lease = self._lease, None
        if lease is not None:
            for unit in self._members:
                held = getattr(unit, "lease", None)
                if isinstance(held, BorrowedLease) and held.group is self:
                    self._release_unit(unit)
            self._views = {}
            lease.release()
        if self._seen is not None:
            self._members = self._seen
        self._seen = None
