"""The scheduler's step traces kept in the store's index: saved as they change, restored at start.

A trace is saved in the background (an index transaction off the loop), and
only when it is not the very trace the index holds already. Without an NVMe
tier there is no index and no scheduler: nothing is kept.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

from infinity.daemon.scheduler import Scheduler, StreamKey
from infinity.daemon.tiers import TierManager
from infinity.daemon.trace import Trace
from infinity.errors import InfinityError

log = logging.getLogger("infinityd")


class TraceKeeper:
    """What the index holds of each scheduler stream's trace, and the saving of new ones."""

    def __init__(self, scheduler: Scheduler | None, tiers: TierManager) -> None:
        self.scheduler = scheduler
        self.tiers = tiers
        self._saved: dict[StreamKey, Trace | None] = {}  # what the index holds, by stream
        self.closing = False  # the daemon stops: no new index transactions

    def save(self, stream: StreamKey) -> None:
        """Persist a stream's trace in the store's index (None: forget it), in the background,
        unless the index already holds this very trace."""
        index = self.tiers.index
        if index is None or self.scheduler is None or self.closing:
            return
        trace = self.scheduler.trace_of(stream)
        if self._saved.get(stream) is trace:
            return  # unchanged (or never had one): no index transaction
        self._saved[stream] = trace

        def saved(future: Future[None]) -> None:
            if future.exception() is not None:
                log.warning("the trace of client %r in %r was not saved: %s", stream[1], stream[0],
                            future.exception())

        try:
            index.save_trace(stream[0], stream[1], None if trace is None else trace.to_dict,
                             on_done=saved)
        except InfinityError as exc:
            log.warning("the trace of client %r in %r was not saved: %s", stream[1], stream[0], exc)

    def forget(self, stream: StreamKey) -> None:
        """The stream is gone for good (its trace was deleted from the index)."""
        self._saved.pop(stream, None)

    def restore(self) -> None:
        """Hand the scheduler every trace the index holds (at start)."""
        index = self.tiers.index
        if index is None or self.scheduler is None:
            return
        restored = 0
        for namespace, client, data in index.load_traces():
            try:
                self.scheduler.import_trace((namespace, client), data)
                self._saved[(namespace, client)] = self.scheduler.trace_of((namespace, client))
                restored += 1
            except ValueError as exc:
                log.warning("the stored trace of client %r in %r is not used: %s", client,
                            namespace, exc)
        if restored:
            log.info("scheduler: %d step trace(s) restored from the index", restored)
