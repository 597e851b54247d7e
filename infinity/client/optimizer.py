"""Calls for the optimizer that runs in the daemon: Adam / AdamW steps over stored tensors.

`OptimizerCalls` holds them for the Client; `infinity.torch.optim` builds on them. `adam_step`
is one request answered when every parameter has been updated (it may wait for loads from NVMe,
so the client waits as long as the daemon lives). `AdamStepper` sends steps without waiting
(`send` returns a `PendingAdamStep`), so a trainer goes on computing while the daemon steps and
waits only where it needs an updated parameter; the daemon serves the requests in the order they
were sent.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

from infinity.client.channel import Channel
from infinity.client.session import Session
from infinity.errors import InfinityError
from infinity.protocol import wire
from infinity.protocol.wire import ItemError


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

    def adam_stepper(self) -> AdamStepper:
        """A sender of steps answered later (see `AdamStepper`)."""
        return AdamStepper(self)


class AdamStepper:
    """Sends `adam_step` requests and hands their answers back later. It has a socket of its
    own, so its answers may be awaited on any thread (a request sent on a thread's socket could
    be answered only there: autograd may run hooks on threads of its own); a lock keeps that
    socket to one thread at a time. The socket closes with the client."""

    def __init__(self, client: OptimizerCalls) -> None:
        self._client = client
        client._check_usable()
        self._channel: Channel = client._attached_channel()  # now: a send never waits
        self._lock = threading.Lock()

    def send(self, groups: Sequence[wire.AdamGroup], items: Sequence[wire.AdamItem], *,
             namespace: str = "default") -> PendingAdamStep:
        """Send one step over `items` (several requests when they are more than one may
        carry) and return at once."""
        client = self._client
        request_ids: list[int] = []
        with self._lock:
            client._check_usable()
            for start in range(0, len(items), wire.MAX_ITEMS):
                request_id = next(client._request_ids)
                self._channel.send(request_id, wire.AdamStep(
                    namespace, tuple(groups), tuple(items[start:start + wire.MAX_ITEMS])),
                    expect_reply=True, releases=client._take_releases())
                request_ids.append(request_id)
        return PendingAdamStep(self, request_ids)

    def _wait(self, request_id: int) -> tuple[Any, ...]:
        with self._lock:
            self._client._check_usable()
            reply = self._channel.wait(request_id, what="adam_step", patient=True)
        return self._client._results(reply)


class PendingAdamStep:
    """A step sent and not answered yet. `result()` waits for it; until then the daemon may
    still be updating its parameters."""

    __slots__ = ("_stepper", "_request_ids", "_error", "_done")

    def __init__(self, stepper: AdamStepper, request_ids: list[int]) -> None:
        self._stepper = stepper
        self._request_ids = request_ids
        self._error: InfinityError | None = None
        self._done = False

    @property
    def done(self) -> bool:
        """Whether `result()` has been waited for already."""
        return self._done

    def result(self) -> None:
        """Wait until every parameter of the step is updated; raise the first item's error
        (the other items are applied). A second call returns at once, or raises that error
        again."""
        if not self._done:
            try:
                while self._request_ids:
                    results = self._stepper._wait(self._request_ids[0])
                    del self._request_ids[0]
                    for outcome in results:
                        if type(outcome) is ItemError and self._error is None:
                            self._error = outcome.exception()
            except InfinityError as exc:  # the request as a whole (the daemon gone, say)
                self._error = exc
                self._request_ids.clear()
            self._done = True
        if self._error is not None:
            raise self._error
