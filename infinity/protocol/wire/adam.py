"""The `adam_step` request's schema: the optimizer step the daemon runs next to the data, its
parameter groups' hyperparameters and its items (the names of one parameter's tensors).

A trainer's step is one or more requests (`parts`, sub-groups of its parameters) sharing a
`step_id`: the daemon applies all of them or none (see `AdamStep`). The last part may carry a
`record`: bytes the daemon writes at the start of a stored uint8 tensor once every item of the
step is applied (the optimizer's step counts and hyperparameters, `infinity.torch.record`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

from infinity.errors import ProtocolError

from .codec import (MAX_BIN_BYTES, MAX_ITEMS, MAX_NAME_CHARS, MAX_NAMESPACE_CHARS, _bool, _bytes,
                    _float, _int, _list, _str)

@dataclass(frozen=True, slots=True)
class AdamGroup:
    """One parameter group's hyperparameters for an `adam_step` (torch.optim.Adam / AdamW's)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool      # AdamW (decay applied to the parameter) or Adam (L2 added to the gradient)
    grad_scale: float    # every gradient is multiplied by this first (1 / loss scale, clipping)

    def to_wire(self) -> list[Any]:
        return [self.lr, self.beta1, self.beta2, self.eps, self.weight_decay, self.decoupled,
                self.grad_scale]

    @classmethod
    def from_wire(cls, value: Any) -> AdamGroup:
        lr, beta1, beta2, eps, decay, decoupled, scale = _list(value, "adam group", 7)
        return cls(_float(lr, "lr"), _float(beta1, "beta1"), _float(beta2, "beta2"),
                   _float(eps, "eps"), _float(decay, "weight_decay"),
                   _bool(decoupled, "decoupled"), _float(scale, "grad_scale"))


@dataclass(frozen=True, slots=True)
class AdamItem:
    """One parameter's step: the names of its tensors in the request's namespace. `master` is
    the fp32 master copy ("" when the parameter itself is fp32 and is the master); `param` is
    then written in the same pass, rounded to its own dtype. `step` counts from 1."""

    param: str
    grad: str
    master: str
    exp_avg: str
    exp_avg_sq: str
    group: int
    step: int

    def to_wire(self) -> list[Any]:
        return [self.param, self.grad, self.master, self.exp_avg, self.exp_avg_sq, self.group,
                self.step]

    @classmethod
    def from_wire(cls, value: Any) -> AdamItem:
        param, grad, master, avg, avg_sq, group, step = _list(value, "adam item", 7)
        return cls(_name(param, "param"), _name(grad, "grad"),
                   _str(master, "master") and _name(master, "master"),
                   _name(avg, "exp_avg"), _name(avg_sq, "exp_avg_sq"),
                   _int(group, "group", maximum=MAX_ITEMS), _int(step, "step", minimum=1))


def _name(value: Any, where: str) -> str:
    name = _str(value, where)
    if not name or len(name) > MAX_NAME_CHARS or "\x00" in name:
        raise ProtocolError(f"malformed adam item: {where} must be a tensor name of 1 to "
                            f"{MAX_NAME_CHARS} characters, without NUL")
    return name


@dataclass(frozen=True, slots=True)
class AdamStep:
    """One optimizer step of Adam / AdamW, run by the daemon next to the data: for each item,
    the parameter (and its master copy) and both moments are updated in place from the gradient,
    under the daemon's own exclusive leases; answered once every item is done, one result per
    item (None, or the error that item met), and one more for the record when it has one. Items
    of one request share `namespace`.

    A step sent as several requests numbers them `part` 0 .. `parts` - 1 under one `step_id`
    (unique within the session; 0: a step of one request). The daemon starts none of them before
    it has all: a session that ends first (the trainer died) has none applied; once it has all
    it applies every one, whether or not the trainer is still there. `record` (at most
    MAX_BIN_BYTES, on the last part only) is written at the start of the uint8 tensor
    `record_name` in `namespace` after every item of the step and of the steps received before
    it that touch its namespaces is done, and before the last part's reply.

    `speculative` (a step of one part, no record): the trainer's guess of a coming step, sent
    during backward as gradients are final. The daemon computes each item's results into fresh
    NVMe extents under shared leases and publishes nothing; a later plain step's item over the
    same tensors, with the same hyperparameters and step number, installs them instead of
    computing, if none of the item's tensors changed since (else they are freed and the item is
    computed as usual). So a guess never changes what a step computes, only when."""

    OP: ClassVar[str] = "adam_step"
    namespace: str
    groups: tuple[AdamGroup, ...]
    items: tuple[AdamItem, ...]
    step_id: int = 0
    part: int = 0
    parts: int = 1
    record_name: str = ""
    record: bytes = b""
    speculative: bool = False

    def body(self) -> list[Any]:
        return [self.namespace, [g.to_wire() for g in self.groups],
                [i.to_wire() for i in self.items],
                [self.step_id, self.part, self.parts, self.record_name, self.record,
                 self.speculative]]

    @classmethod
    def from_body(cls, body: Sequence[Any]) -> AdamStep:
        namespace, groups, items, step = _list(body, "adam_step", 4)
        namespace = _str(namespace, "namespace")
        if not namespace or len(namespace) > MAX_NAMESPACE_CHARS:
            raise ProtocolError(f"malformed adam_step: the namespace must have 1 to "
                                f"{MAX_NAMESPACE_CHARS} characters")
        decoded_groups = tuple(AdamGroup.from_wire(g) for g in _list(groups, "adam groups"))
        decoded_items = tuple(AdamItem.from_wire(i) for i in _list(items, "adam items"))
        if len(decoded_items) > MAX_ITEMS:
            raise ProtocolError(f"malformed adam_step: more than {MAX_ITEMS} items")
        for item in decoded_items:
            if item.group >= len(decoded_groups):
                raise ProtocolError(f"malformed adam_step: item {item.param!r} names group "
                                    f"{item.group} of {len(decoded_groups)}; send every group "
                                    f"the items name, in the order they index them")
        step_id, part, parts, record_name, record, speculative = _list(
            step, "adam_step's step", 6)
        step_id = _int(step_id, "step_id")
        parts = _int(parts, "parts", minimum=1, maximum=MAX_ITEMS)
        part = _int(part, "part", maximum=parts - 1)
        if parts > 1 and not step_id:
            raise ProtocolError("malformed adam_step: a step of several parts needs a step_id")
        record_name, record = _str(record_name, "record_name"), _bytes(record, "record")
        if record_name or record:
            _name(record_name, "record_name")
            if part != parts - 1 or len(record) > MAX_BIN_BYTES:
                raise ProtocolError(f"malformed adam_step: a record (at most {MAX_BIN_BYTES} "
                                    f"bytes) rides on the last part of a step")
        speculative = _bool(speculative, "speculative")
        if speculative and (parts > 1 or step_id or record_name):
            raise ProtocolError("malformed adam_step: a speculative step is one part, with no "
                                "step_id and no record")
        return cls(namespace, decoded_groups, decoded_items, step_id, part, parts, record_name,
                   record, speculative)
