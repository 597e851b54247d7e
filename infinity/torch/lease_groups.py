"""Lease groups: the units of one block (a decoder layer) leased together, a few requests a block.

Every `get_many` is a round trip to the daemon. On a small virtual machine that costs 0.2-0.3 ms
even for tensors already resident (a bare ZeroMQ round trip between two processes measured 170-300
us on the project machine: four thread wake-ups), and a decoder layer of a transformer has 7-9
units (its linear layers and norms), so a 22-layer model generating one token made ~200 of them.

An inference module computing on the CPU instead splits each block's units into *runs*
(`lease_in_runs`, which `offload` calls, finds the blocks and hooks them): units next to each
other in the order the block's last forward used them (as `take` recorded), as many as fit in
`max_bytes` together (a unit larger than that is a run of its own). The first unit of a run to
compute leases the whole run with one request, and the run's other units take their views from
that lease (`take`). The lease ends when a later run is leased and none of its units holds a view
any more, or with the block's forward (`end`). A block's first forward, which has no record,
leases unit by unit; a unit its last forward did not use (a mixture of experts' expert) leases
alone.

Why runs and not the whole block: a lease pins its tensors in the CPU tier and waits for the
last of them. With a tier that holds a quarter of a bf16 model, one lease per decoder layer
(88 MB of a 537 MB tier) read 2% more a token and was 7% slower than unit leases, where runs of at
most a sixteenth of the tier (`offload` chooses that) keep what is pinned small. Where the tier
holds the model, a run is the whole block.

A run whose lease does not fit the tier (`TierFullError`: other leases hold it, say) is left
out for the rest of the block's forward, its units leasing alone, which works wherever it did
before; after `MAX_REFUSALS` refusals in a row the group stops leasing runs for good.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from infinity.errors import TierFullError

__all__ = ["BorrowedLease", "LeaseGroup", "MAX_REFUSALS", "lease_in_runs"]

# Refusals in a row after which a group leases unit by unit for good (a run the tier can never
# hold), where one refusal may be a moment's crowding of the tier.
MAX_REFUSALS = 3


class BorrowedLease:
    """A unit's share of a run's lease: its views, and a release that leaves the lease to the
    group."""

    __slots__ = ("group", "tensors")

    def __init__(self, group: "LeaseGroup", tensors: list[torch.Tensor]) -> None:
        self.group = group
        self.tensors = tensors

    def release(self) -> None:
        """Nothing to give back: the group ends the run's lease."""


class LeaseGroup:
    """The units of one block, split into runs, and the leases of the runs in use.

    `units` hold `names` (what each leases, in the order of its lease's tensors); `lease` is the
    client's `get_many` for these names, `settle` waits for what must finish before a read (the
    optimizer's steps over them), `release_unit` ends a unit's hold on its views, `size_of`
    gives the bytes a unit leases, and `max_bytes` bounds a run's."""

    def __init__(self, *, lease: Callable[[list[str]], Any],
                 settle: Callable[[Sequence[Any]], None], release_unit: Callable[[Any], None],
                 size_of: Callable[[Any], int], max_bytes: int) -> None:
        self._lease_names = lease
        self._settle = settle
        self._release_unit = release_unit
        self._size_of = size_of
        self.max_bytes = max_bytes
        self.enabled = True
        self._refusals = 0  # runs refused (TierFullError) in a row
        self._refused: set[int] = set()  # runs refused in this forward: their units lease alone
        self._runs: list[list[Any]] = []  # the last forward's units, in order, split into runs
        self._run_of: dict[int, int] = {}  # id(unit) -> its run's index
        self._seen: list[Any] | None = None  # the units this forward used so far (None: idle)
        self._depth = 0  # the block's forwards in progress (a block may be called re-entrantly)
        self._leases: dict[int, Any] = {}  # run index -> its lease, while held
        self._views: dict[int, list[torch.Tensor]] = {}  # id(unit) -> its views in a lease

    def begin(self) -> None:
        """The block's forward starts: record the units it uses."""
        self._depth += 1
        if self._depth == 1:
            self._seen = []
            self._refused = set()

    def take(self, unit: Any) -> BorrowedLease | None:
        """The unit's views from its run's lease (leasing the run if no lease holds it yet), or
        None: the unit leases alone (the block is not computing, the unit was not in the last
        forward, the tier refused its run in this forward, or refused runs too often). Records
        that this forward used the unit."""
        if self._seen is None:
            return None
        if unit not in self._seen:
            self._seen.append(unit)
        index = self._run_of.get(id(unit))
        if index is None or not self.enabled or index in self._refused:
            return None
        if index not in self._leases and not self._lease_run(index):
            return None
        return BorrowedLease(self, self._views[id(unit)])

    def _lease_run(self, index: int) -> bool:
        for held in list(self._leases):
            if not any(self._holds(other) for other in self._runs[held]):
                self._let_go(held)  # done with (a later run computes now)
        run = self._runs[index]
        names = list(dict.fromkeys(name for unit in run for name in unit.names))
        self._settle(run)
        try:
            lease = self._lease_names(names)
        except TierFullError:
            self._refused.add(index)
            self._refusals += 1
            self.enabled = self._refusals < MAX_REFUSALS
            return False
        self._refusals = 0
        self._leases[index] = lease
        by_name = dict(zip(names, lease.tensors))
        for unit in run:
            self._views[id(unit)] = [by_name[name] for name in unit.names]
        return True

    def _holds(self, unit: Any) -> bool:
        held = getattr(unit, "lease", None)
        return isinstance(held, BorrowedLease) and held.group is self

    def _let_go(self, index: int) -> None:
        for unit in self._runs[index]:
            if self._holds(unit):
                self._release_unit(unit)
            self._views.pop(id(unit), None)
        self._leases.pop(index).release()

    def end(self) -> None:
        """The block's forward ended: the runs' leases are given back (units still holding
        views from them let go first), and the units this forward used, split into runs, are
        what the next forward leases."""
        self._depth -= 1
        if self._depth > 0:
            return
        for index in list(self._leases):
            self._let_go(index)
        if self._seen is not None:
            self._split(self._seen)
        self._seen = None

    def _split(self, units: list[Any]) -> None:
        runs: list[list[Any]] = []
        run_bytes = 0
        for unit in units:
            size = self._size_of(unit)
            if not runs or run_bytes + size > self.max_bytes:
                runs.append([])
                run_bytes = 0
            runs[-1].append(unit)
            run_bytes += size
        self._runs = runs
        self._run_of = {id(unit): index for index, run in enumerate(runs) for unit in run}


def lease_in_runs(model: nn.Module, units: Sequence[Any], *, lease: Callable[[list[str]], Any],
                  settle: Callable[[Sequence[Any]], None], release_unit: Callable[[Any], None],
                  size_of: Callable[[Any], int], max_run_bytes: int) -> None:
    """Give each block of `model` (an element of an nn.ModuleList, such as a decoder layer,
    holding two of `units` or more) a `LeaseGroup` whose runs hold at most `max_run_bytes`:
    set as each unit's `group`, begun and ended by hooks on the block. The outermost list's
    blocks win. `units` have `module`, `names` and `lease`; the rest is `LeaseGroup`'s."""
    by_module = {id(unit.module): unit for unit in units}
    grouped: set[int] = set()
    for blocks in model.modules():
        if not isinstance(blocks, nn.ModuleList):
            continue
        for block in blocks:
            members = [by_module[id(module)] for module in block.modules()
                       if id(module) in by_module and id(module) not in grouped]
            if len(members) < 2:
                continue
            group = LeaseGroup(lease=lease, settle=settle, release_unit=release_unit,
                               size_of=size_of, max_bytes=max_run_bytes)
            for unit in members:
                unit.group = group
                grouped.add(id(unit.module))
            block.register_forward_pre_hook(lambda m, a, group=group: group.begin())
            block.register_forward_hook(lambda m, a, o, group=group: group.end(),
                                        always_call=True)
