"""Steps and traces: marking a training step's bounds, and asking what comes next.

The daemon records a client's first step in a namespace as a trace of its accesses and replays
later ones, loading what comes next while the process computes (with an NVMe tier). `StepCalls`
holds the Client's step_begin, step_end, step_abort, step and upcoming; `StepResult` is what
`step()` yields.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

from infinity.client.session import Session
from infinity.errors import InfinityError
from infinity.protocol import wire


@dataclasses.dataclass
class StepResult:
    """What `Client.step()` yields; `report` is filled in when the step ends."""

    report: wire.StepReport | None = None

    @property
    def outcome(self) -> str | None:
        return None if self.report is None else self.report.outcome

    @property
    def counters(self) -> dict[str, Any]:
        return {} if self.report is None else self.report.counters



class StepCalls(Session):
    """The Client's step and trace calls."""

    def upcoming(self, *, namespace: str = "default", max_entries: int = 64,
                 max_bytes: int = 1 << 62) -> list[tuple[str, int]]:
        """What this client will read next in `namespace`, as the daemon's trace of its steps
        says: (name, nbytes) pairs, soonest first, distinct. Empty while no trace replays
        (the first step, after a change of order) and without an NVMe tier."""
        (upcoming,) = self._call(wire.Upcoming(namespace, max_entries, max_bytes))
        return [(str(name), int(nbytes)) for name, nbytes in upcoming]

    def step_begin(self, *, namespace: str = "default") -> wire.StepReport | None:
        """Mark the start of a step (one iteration of a loop that touches the same tensors in
        the same order). The first step is recorded; later ones are replayed: infinityd loads
        what comes next while this process computes. Returns the report of a step this one
        ended (a step left open), else None (always None without an NVMe tier: steps are then
        untracked). The trace is this client name's in `namespace`:
        give `connect(name=...)` a stable name so a restarted process finds its trace."""
        (result,) = self._call(wire.Step(namespace, "begin"))
        self._raise_first([result])
        self.steps_begun += 1
        return None if result is None else wire.StepReport.from_wire(result)

    def step_end(self, *, namespace: str = "default") -> wire.StepReport:
        """Mark the end of the step; returns how it went (outcome, hits, misses, stall)."""
        (result,) = self._call(wire.Step(namespace, "end"))
        self._raise_first([result])
        return wire.StepReport.from_wire(result)

    def step_abort(self, *, namespace: str = "default") -> None:
        """Drop the step under way (it failed halfway): its accesses neither become a trace nor
        count against the one being replayed, which stays."""
        (result,) = self._call(wire.Step(namespace, "abort"))
        self._raise_first([result])

    @contextlib.contextmanager
    def step(self, *, namespace: str = "default") -> Iterator[StepResult]:
        """`with client.step() as step:` marks one step; `step.report` is set when it ends.
        A step whose body raises is aborted (see `step_abort`), and the exception goes on."""
        result = StepResult()
        self.step_begin(namespace=namespace)
        try:
            yield result
        except BaseException:
            try:
                self.step_abort(namespace=namespace)
            except InfinityError:
                pass  # the body's exception is the one that matters (the daemon may be gone)
            raise
        result.report = self.step_end(namespace=namespace)

