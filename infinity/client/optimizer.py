"""Calls for the optimizer that runs in the daemon: one Adam / AdamW step over stored tensors.

`OptimizerCalls` holds them for the Client; `infinity.torch.optim` builds on them. The step is
one request, answered when every parameter has been updated (it may wait for loads from NVMe,
so the client waits as long as the daemon lives).
"""

from __future__ import annotations

from typing import Sequence

from infinity.client.session import Session
from infinity.protocol import wire


class OptimizerCalls(Session):
    """The Client's optimizer calls."""

    def adam_step(self, groups: Sequence[wire.AdamGroup], items: Sequence[wire.AdamItem], *,
                  namespace: str = "default") -> None:
        """Run one Adam / AdamW step in the daemon over each item's stored tensors (see
        `wire.AdamStep`); raises the first item's error once all are done (the others are
        applied)."""
        if not items:
            return
        for start in range(0, len(items), wire.MAX_ITEMS):
            results = self._call(wire.AdamStep(namespace, tuple(groups),
                                               tuple(items[start:start + wire.MAX_ITEMS])),
                                 patient=True)
            self._raise_first(results)
