"""The optimizer's speculative step: guesses of a step, sent to infinityd during backward.

A guess is a speculative `adam_step` (`wire.AdamStep.speculative`): the daemon computes it into
fresh NVMe extents and publishes nothing; the step's item that follows installs it if the daemon
finds the same gradient (unchanged since), hyperparameters, scale and step number, and frees it
otherwise, so a step's reads, arithmetic and writes overlap backward and a wrong guess costs only
its I/O, never a different value. Why guesses rather than the step itself during backward: the
clipping factor, a loss scaler's verdict and whether this was the last micro-batch are known
only after backward, and a guess published only on a match needs no undo.

`StepGuesser` belongs to one `infinity.torch.Adam` / `AdamW`. It listens to each offloaded
module's gradients as they are stored (`OffloadState.gradient_listeners`) and to each
backward's end; it gathers the parameters of at least GUESS_MIN_BYTES into sub-groups and sends
each as a speculative `adam_step` (`AdamStepper.send_guess`) with the groups' hyperparameters
as they are, no clipping or loss scale, and the next step number. `step()` waits for the guesses (`settle`) before it sends its
own items, and then `judge` counts which of them it matched, learns the micro-batch the step
came after, and after a miss pauses guessing for GUESS_RETRY_STEPS steps. The daemon is the
judge of what it installs; the counts here only steer when to guess.
"""

from __future__ import annotations

from typing import Any

import torch

from infinity.errors import InfinityError, InvalidRequestError
from infinity.protocol import wire
from infinity.torch.offload import OffloadState, _Param

__all__ = ["GUESS_MIN_BYTES", "GUESS_RETRY_STEPS", "StepGuesser"]

GUESS_MIN_BYTES = 1 << 20  # smaller parameters are not guessed: their step is a small one anyway
GUESS_RETRY_STEPS = 16  # after a step that did not match its guess, steps without guessing

_Request = tuple[OffloadState, _Param, wire.AdamItem]  # a parameter's item of a step
# A guess sent: the parameter, its item and group, and the micro-batch it was made after.
Guess = tuple[_Param, wire.AdamItem, wire.AdamGroup, int]


class StepGuesser:
    """The guesses of one optimizer (`optimizer`: its `_calls`, `_group_of`, `_names`,
    `_adam_groups`, `_steppers` and `state`)."""

    def __init__(self, optimizer: Any, *, subgroup_bytes: int, on: bool) -> None:
        self.optimizer = optimizer
        self.subgroup_bytes = subgroup_bytes
        self.on = on
        self.pending: list[tuple[Any, list[Guess]]] = []  # sent, not yet waited for
        # The sub-group being gathered per (client, namespace): its requests and bytes.
        self.gathering: dict[tuple[int, str], tuple[OffloadState, list[_Request], int]] = {}
        self.micro_batches = 1  # guesses are made after this micro-batch (the last step's)
        self.from_call = 0  # the step() call from which guessing is on again after a miss
        self.counts = {"sent": 0, "matched": 0, "missed": 0}

    @property
    def busy(self) -> bool:
        return bool(self.pending or self.gathering)

    def listen(self, state: OffloadState) -> None:
        state.gradient_listeners.append(self.on_gradient)
        state.backward_listeners.append(self.on_backward_end)

    def on_gradient(self, state: OffloadState, entry: _Param) -> None:
        """A gradient is stored (`offload`'s hook): guess its step if this is the micro-batch
        the step is expected after, gathering sub-groups of about `subgroup_bytes`."""
        optimizer = self.optimizer
        if not self.on or optimizer._calls < self.from_call:
            return
        if entry.micro_batches != self.micro_batches:
            return
        nbytes = entry.placeholder.numel() * 4
        if nbytes < GUESS_MIN_BYTES:
            return
        param = entry.param
        index = optimizer._group_of(param)
        if index is None:
            return  # another optimizer's parameter of the same module
        names = optimizer._names(state, param)
        step = int(optimizer.state[param].get("step", torch.tensor(0.0)).item()) + 1
        item = wire.AdamItem(entry.name, entry.grad_name, names["master"], names["exp_avg"],
                             names["exp_avg_sq"], index, step)
        key = (id(state.client), state.config.namespace)
        _, gathered, gathered_bytes = self.gathering.get(key, (state, [], 0))
        gathered.append((state, entry, item))
        gathered_bytes += nbytes
        self.gathering[key] = (state, gathered, gathered_bytes)
        if gathered_bytes >= self.subgroup_bytes:
            self._send(key)

    def on_backward_end(self, state: OffloadState) -> None:
        for key in [key for key in self.gathering if key[0] == id(state.client)]:
            self._send(key)

    def _send(self, key: tuple[int, str]) -> None:
        state, gathered, _ = self.gathering.pop(key)
        if not gathered:
            return
        try:
            groups = self.optimizer._adam_groups(1.0)
        except InvalidRequestError:
            return  # the step will say what is wrong with the groups
        pending = self.optimizer._steppers[id(state.client)].send_guess(
            groups, [item for _, _, item in gathered], namespace=state.config.namespace)
        for _, entry, _ in gathered:
            entry.guess = pending
        self.pending.append((pending, [(entry, item, groups[item.group], entry.micro_batches)
                                       for _, entry, item in gathered]))
        self.counts["sent"] += len(gathered)

    def settle(self) -> list[Guess]:
        """Send what is gathered and wait for every guess: a step's item leases exclusively
        what a guess still holds shared. A guess's error is no step's: the step computes that
        item itself (a daemon that refuses guesses, with no NVMe tier, gets none again)."""
        for key in list(self.gathering):
            self._send(key)
        guessed: list[Guess] = []
        guesses, self.pending = self.pending, []
        for pending, items in guesses:
            try:
                pending.result()
            except InvalidRequestError:
                self.on = False
            except InfinityError:
                pass
            for entry, *_ in items:
                if entry.guess is pending:
                    entry.guess = None
            guessed.extend(items)
        return guessed

    def judge(self, guessed: list[Guess], requests: dict[tuple[int, str], list[_Request]],
              groups: list[wire.AdamGroup]) -> None:
        """Count which guesses this step's items match (the daemon installs those; it checks
        again itself), learn the micro-batch the step came after, and after a miss (clipping,
        a loss scale, an lr set between backward and step) guess again only after
        GUESS_RETRY_STEPS steps."""
        sent = {id(entry): item for items in requests.values() for _, entry, item in items}
        counts = [entry.micro_batches for items in requests.values() for _, entry, _ in items]
        learned = False  # the step came after another micro-batch than the guesses expected
        if counts and max(counts) != self.micro_batches:
            self.micro_batches, learned = max(counts), True
        missed = 0
        for entry, item, group, micro_batch in guessed:
            actual = sent.get(id(entry))
            if (actual is None or actual != item or groups[actual.group] != group
                    or entry.micro_batches != micro_batch):
                missed += 1
        self.counts["matched"] += len(guessed) - missed
        self.counts["missed"] += missed
        if missed and not learned:
            self.from_call = self.optimizer._calls + GUESS_RETRY_STEPS
