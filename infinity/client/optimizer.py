"""Calls for the optimizer that runs in the daemon: Adam / AdamW steps over stored tensors.

`OptimizerCalls` holds them for the Client; `infinity.torch.optim` builds on them. `adam_step`
is one request answered when every parameter has been updated (it may wait for loads from NVMe,
so the client waits as long as the daemon lives). `AdamStepper` sends steps without waiting
(`send` returns a `PendingAdamStep`), so a trainer goes on computing while the daemon steps and
waits only where it needs an updated parameter; the daemon serves the requests in the order they
were sent.

`AdamStepper.send_step` sends one step as several requests (sub-groups, perhaps of several
namespaces) that the daemon applies all or none, with an optional record it writes once the step is
applied (see `wire.AdamStep`); `wait_for_steps` returns once every step the daemon received before
it in a namespace is applied, whoever sent it. `AdamStepper.send_guess` sends a speculative step
(the coming step's guess, during backward), which publishes nothing by itself.
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

    def wait_for_steps(self, *, namespace: str) -> None:
        """Return once every optimizer step the daemon received before this call that touches
        `namespace` is applied, whoever sent it (a restarted trainer waits here for the step its
        predecessor left running)."""
        self._raise_first(self._call(wire.AdamStep(namespace, (), ()), patient=True))

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
        return self.send_step(groups, [(namespace, items)])[0]

    def send_step(self, groups: Sequence[wire.AdamGroup],
                  parts: Sequence[tuple[str, Sequence[wire.AdamItem]]], *,
                  record: tuple[str, str, bytes] | None = None) -> list[PendingAdamStep]:
        """Send one step as `parts` ((namespace, items) each, in the order the daemon is to
        serve them), applied all or none, and return at once: one pending answer per part.
        `record` (namespace, name of a stored uint8 tensor, bytes) is written once the whole
        step is applied; a step of no parts carries only its record (one pending answer)."""
        client = self._client
        requests: list[tuple[int, str, tuple[wire.AdamItem, ...]]] = []  # (part, ns, items)
        for index, (namespace, items) in enumerate(parts):
            for start in range(0, max(1, len(items)), wire.MAX_ITEMS):
                requests.append((index, namespace, tuple(items[start:start + wire.MAX_ITEMS])))
        if not requests:
            if record is None:
                return []
            requests.append((0, record[0], ()))
        if record is not None and record[0] != requests[-1][1]:
            # The record rides on the step's last request, which names one namespace: one of
            # no items in the record's namespace, answered with the last part.
            requests.append((requests[-1][0], record[0], ()))
        request_ids: list[list[int]] = [[] for _ in range(max(1, len(parts)))]
        with self._lock:
            client._check_usable()
            first = next(client._request_ids)  # unique in the session: the step's id
            for number, (index, namespace, items) in enumerate(requests):
                request_id = first if number == 0 else next(client._request_ids)
                last = number == len(requests) - 1
                self._channel.send(request_id, wire.AdamStep(
                    namespace, tuple(groups), items, first if len(requests) > 1 else 0, number,
                    len(requests), record[1] if last and record else "",
                    record[2] if last and record else b""),
                    expect_reply=True, releases=client._take_releases())
                request_ids[index].append(request_id)
        return [PendingAdamStep(self, ids) for ids in request_ids]

    def send_guess(self, groups: Sequence[wire.AdamGroup], items: Sequence[wire.AdamItem], *,
                   namespace: str) -> PendingAdamStep:
        """Send a speculative step over `items` (`wire.AdamStep.speculative`: computed now,
        published only by a later step's matching item) and return at once."""
        client = self._client
        request_ids: list[int] = []
        with self._lock:
            client._check_usable()
            for start in range(0, len(items), wire.MAX_ITEMS):
                request_id = next(client._request_ids)
                self._channel.send(request_id, wire.AdamStep(
                    namespace, tuple(groups), tuple(items[start:start + wire.MAX_ITEMS]),
                    speculative=True), expect_reply=True, releases=client._take_releases())
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
