"""Warm restart: what a trainer that died finds of its optimizer in the store, and `resume_point`.

The stored tensors (parameters, master copies, moments) are the daemon's and outlive the trainer;
what else the optimizer needs to go on as if it had not stopped is small and is kept beside them,
in one *record* per optimizer: a uint8 tensor `<prefix>@optimizer` (the prefix of the offloaded
module of the optimizer's first parameter, in its namespace) holding a JSON document:

- `calls`: how many times `step()` was called (skipped steps of a loss scaler included): the
  number of the step a restarted loop begins with;
- `steps`: each parameter's step count, in the optimizer's order (run-length coded), and `names`,
  a digest of the parameters' stored names in that order, so a record is only taken by an
  optimizer over the same parameters in the same order;
- `groups`: each parameter group's hyperparameters as the last step or scheduler step left them
  (lr, betas, eps, weight_decay, initial_lr and any other key of plain values);
- `scheduler`: the LR scheduler's `state_dict()`, where `optimizer.resume(scheduler)` was called;
- `reading` / `newest` (delay_update only): which copy of each parameter the module computes with
  now and which one the last step wrote (1: `<name>.next`).

The daemon writes the record as part of each step's commit (`wire.AdamStep`): after every item of
the step is applied, never before, so the record and the tensors always describe the same step.
A step the trainer had not sent completely when it died is applied not at all, one it had sent is
applied completely (the daemon does not care that its sender is gone): either way the record
agrees. A scheduler's step sends a step of no items that carries only the new record.

A script that works both fresh and restarted:

    client = infinity.connect(name="trainer")
    done = infinity.torch.resume_point(client, namespace="run")  # None: nothing stored yet
    with infinity.torch.empty_parameters() if done is not None else contextlib.nullcontext():
        model = build_model()
    infinity.torch.offload(model, client, namespace="run", from_store=done is not None)
    optimizer = infinity.torch.AdamW(model.parameters(), lr=3e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    for step in range(optimizer.resume(scheduler), total_steps):
        ...  # the batch of `step`: the data order is the script's

The optimizer finds its moments, master copies and step counts when it is built; `resume` brings
back the rest (the groups' hyperparameters, the scheduler) and says where to go on.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from infinity.errors import InvalidRequestError, NotFoundError
from infinity.protocol.wire import MAX_BIN_BYTES

__all__ = ["OptimizerRecord", "RECORD_BYTES", "record_name", "resume_point"]

RECORD_BYTES = MAX_BIN_BYTES  # the stored tensor's size: a step request carries it whole
FORMAT = 1
_LENGTH_BYTES = 4  # the JSON's length, little-endian, before it


def record_name(prefix: str) -> str:
    """The record's stored name for an offloaded module stored under `prefix` (not a name a
    parameter can have: module attributes hold no '@')."""
    return prefix + "@optimizer"


@dataclass
class OptimizerRecord:
    """What the record holds (see the module's docstring)."""

    optimizer: str
    calls: int
    names: str
    steps: list[int]
    groups: list[dict[str, Any]]
    scheduler: dict[str, Any] | None = None
    reading: list[int] | None = None
    newest: list[int] | None = None

    def encode(self) -> bytes:
        """The bytes the daemon writes: length, then the JSON document."""
        document = {"format": FORMAT, "optimizer": self.optimizer, "calls": self.calls,
                    "names": self.names, "steps": _run_lengths(self.steps),
                    "groups": self.groups, "scheduler": self.scheduler,
                    "reading": None if self.reading is None else _run_lengths(self.reading),
                    "newest": None if self.newest is None else _run_lengths(self.newest)}
        try:
            text = json.dumps(document, separators=(",", ":"), allow_nan=True).encode()
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(
                f"the optimizer's record cannot hold the scheduler's state_dict as JSON ({exc}); "
                f"use a scheduler whose state is plain numbers, strings and lists, or do not "
                f"pass it to resume()") from None
        data = len(text).to_bytes(_LENGTH_BYTES, "little") + text
        if len(data) > RECORD_BYTES:
            raise InvalidRequestError(
                f"the optimizer's record takes {len(data)} bytes, more than the {RECORD_BYTES} "
                f"it may; the scheduler's state_dict or the parameter groups hold too much")
        return data

    @classmethod
    def decode(cls, data: bytes) -> OptimizerRecord | None:
        """The record in a stored tensor's bytes; None for one never written (zeros)."""
        length = int.from_bytes(data[:_LENGTH_BYTES], "little")
        if not length:
            return None
        try:
            document = json.loads(data[_LENGTH_BYTES:_LENGTH_BYTES + length])
            if document.get("format") != FORMAT:
                raise ValueError(f"format {document.get('format')!r}")
            return cls(str(document["optimizer"]), int(document["calls"]),
                       str(document["names"]), _expand(document["steps"]),
                       list(document["groups"]), document.get("scheduler"),
                       _expand(document["reading"]) if document.get("reading") else None,
                       _expand(document["newest"]) if document.get("newest") else None)
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidRequestError(
                f"the optimizer's record in the store cannot be read ({exc}); it was not written "
                f"by this version of infinity.torch: start the optimizer in a fresh namespace"
            ) from None


def names_digest(names: Iterable[str]) -> str:
    """A digest of stored names in order (the record keeps it, not the names)."""
    digest = hashlib.sha256()
    for name in names:
        digest.update(name.encode() + b"\x00")
    return digest.hexdigest()[:32]


def plain_groups(param_groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each group's keys but `params` whose values JSON keeps exactly (numbers, strings, None,
    and lists or tuples of them); the others are left out."""
    return [{key: list(value) if isinstance(value, tuple) else value
             for key, value in group.items() if key != "params" and _plain(value)}
            for group in param_groups]


def restore_groups(param_groups: Sequence[dict[str, Any]], saved: Sequence[dict[str, Any]]
                   ) -> None:
    """Put the saved hyperparameters back into the optimizer's groups (tuples stay tuples)."""
    if len(saved) != len(param_groups):
        raise InvalidRequestError(
            f"the stored optimizer state has {len(saved)} parameter groups and this optimizer "
            f"{len(param_groups)}; build it with the same groups as the run that stored it")
    for group, values in zip(param_groups, saved):
        for key, value in values.items():
            group[key] = tuple(value) if isinstance(value, list) else value


def read_record(client: Any, *, namespace: str, prefix: str) -> OptimizerRecord | None:
    """The record stored for modules under `prefix` in `namespace`, or None (none yet)."""
    try:
        with client.get(record_name(prefix), namespace=namespace) as stored:
            data = bytes(stored.view(torch.uint8).numpy().tobytes())
    except NotFoundError:
        return None
    return OptimizerRecord.decode(data)


def resume_point(client: Any, *, namespace: str, prefix: str = "") -> int | None:
    """How many steps the training state stored in `namespace` has taken (the optimizer's
    `step()` calls), or None when no optimizer has stepped there yet: a fresh run.

    Call it before building the model, to choose between building it with values and
    offloading it, or building it inside `empty_parameters()` and offloading it with
    `from_store=True`. It first waits for any step the daemon is still applying there (the
    last one of a trainer that died), so what it says is what the store then holds."""
    client.wait_for_steps(namespace=namespace)
    record = read_record(client, namespace=namespace, prefix=prefix)
    return None if record is None else record.calls


def _plain(value: Any) -> bool:
    """A value JSON gives back as it was (a tuple comes back as a list, turned back above)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, (list, tuple)) and all(
        v is None or isinstance(v, (bool, int, float, str)) for v in value)


def _run_lengths(values: Sequence[int]) -> list[list[int]]:
    """[[value, count], ...] of consecutive equal values (step counts are mostly one value)."""
    runs: list[list[int]] = []
    for value in values:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([int(value), 1])
    return runs


def _expand(runs: Sequence[Sequence[int]]) -> list[int]:
    return [int(value) for value, count in runs for _ in range(int(count))]

