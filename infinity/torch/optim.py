"""`infinity.torch.Adam` and `AdamW`: torch optimizers whose state lives in the store and whose
step runs in infinityd, next to the data.

They take the parameters of a module given to `infinity.torch.offload` (its gradients are in the
store already). At construction each parameter gets its optimizer state in the store, in the
module's namespace: `<name>.exp_avg` and `<name>.exp_avg_sq` (fp32 zeros), and `<name>.master`
(an fp32 copy) when the parameter is kept in a lower precision. State already there (a trainer
restarted on the same namespace) is kept. The daemon updates each parameter, its master copy and
both moments in place with the native kernel (torch's single-tensor Adam arithmetic) and writes
the low-precision parameter in the same pass.

The step overlaps the next forward: `step()` sends the step as several `adam_step` requests
(sub-groups of about `SUBGROUP_BYTES` of parameters, in the order the last forward used them)
and returns without waiting; the daemon serves them in that order, and the next forward waits,
unit by unit, only for the sub-group holding the parameters it is about to use. So the daemon
reads the state from NVMe, steps it and writes it back while the trainer computes, and the
results are exactly those of a step that waited (each parameter is read after its update). An
error of the step is raised where it is waited for (the next forward's use of those parameters,
or `synchronize()`); `state_dict()` and `load_state_dict()` wait for it first. `overlap=False`
makes `step()` wait.

The step also starts during backward (`speculate=True`, the default): the optimizer sends the
daemon guesses of it as gradients are stored, which `step()` installs where they match
(`infinity.torch.guesses`): the step's I/O overlaps backward, and a wrong guess costs only I/O.
`guess_counts` counts the guesses sent and how many the steps matched or missed.

`delay_update=True` (off by default: it changes the numerics) is ZeRO-Offload's delayed
parameter update: the next forward does not wait for the step at all but computes with the
parameters from before it, so the step overlaps the whole next forward and backward; each
forward then uses parameters one step older than the plain schedule's. Each parameter gets an
fp32 master copy and a second copy of itself (`<name>.next`): the step updates the master and
writes one copy while the module computes with the other, and `step()` (or `synchronize()`)
switches the module to the copy the last step wrote once that step is done. A parameter's next
gradient waits for the step over it (`OffloadState._settle_delayed`), which may not have leased
the stored gradient yet.

`param_groups` are read at every step (lr, betas, eps, weight_decay), so
`torch.optim.lr_scheduler` schedulers work; `zero_grad()` makes the next backward replace the
stored gradients; `state_dict()` / `load_state_dict()` carry the moments (read from and written to
the store) and the step counts.

A step is applied all or none, and with it the daemon writes the optimizer's record (step
counts, the groups' hyperparameters, the scheduler's state; `infinity.torch.restart`), so a
trainer killed at any point and started again on the same namespace finds the state of its last
step complete: built again, the optimizer takes its step counts (and, with the delayed update,
which copy of each parameter is current) from the record, and `resume(scheduler)` brings back the
hyperparameters and the scheduler and returns the number of steps taken.

Gradient clipping: torch's `clip_grad_norm_` cannot see gradients that already left the process,
so the optimizer offers `clip_grad_norm_(max_norm)`: the global norm of the stored gradients
(from the sums of squares `offload`'s hook recorded as each arrived: `OffloadState.grad_stats`),
and the factor that scales them applied inside the next step's pass.

Loss scaling: `torch.amp.GradScaler` works unchanged. The optimizer sets
`_step_supports_amp_scaling`, as torch's fused Adam does: the scaler hands it the scale, and the
kernel multiplies the gradients by its inverse inside the step's pass. The scaler's pass over
`.grad` (`GradScaler._unscale_grads_`), which an offloaded parameter no longer has, is
redirected for these optimizers to the recorded figures: a non-finite gradient sets the
scaler's `found_inf`, the whole step is skipped and `scaler.update()` backs the scale off.

Not supported (a clear InvalidRequestError): amsgrad, maximize, a closure, capturable,
differentiable, foreach/fused (the daemon's kernel is the fused implementation), parameters that
were not offloaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from infinity.errors import InvalidRequestError
from infinity.protocol import wire
from infinity.torch.distributed import NodeRanks
from infinity.torch.guesses import StepGuesser
from infinity.torch.offload import (GradStats, OffloadState, _Param, measure_gradient,
                                    state_of_parameter)
from infinity.torch.restart import (RECORD_BYTES, OptimizerRecord, names_digest, plain_groups,
                                    read_record, record_name, restore_groups)

__all__ = ["Adam", "AdamW", "StoredParameter"]

SUBGROUP_BYTES = 8 << 20  # fp32 bytes of parameters per request: the next forward waits for one

_Request = tuple[OffloadState, _Param, wire.AdamItem]  # a parameter's item of a step


@dataclass(frozen=True)
class StoredParameter:
    """One parameter of the optimizer as the store holds it (for checkpoints)."""

    param: nn.Parameter
    state: OffloadState
    name: str                # its stored name
    names: dict[str, str]    # its optimizer state's: exp_avg, exp_avg_sq, master, copy ("": none)
    current: str             # the stored name of its newest values
    previous: str            # delayed update: the copy computed with until the next step, or ""
    step: int


class _StoreAdam(torch.optim.Optimizer):
    """What Adam and AdamW share; `decoupled` says which of the two."""

    decoupled = True
    # torch.amp.GradScaler.step then hands the step its scale and found_inf (as to fused Adam).
    _step_supports_amp_scaling = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, amsgrad: bool = False, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False,
                 differentiable: bool = False, fused: bool | None = None,
                 overlap: bool = True, delay_update: bool = False,
                 speculate: bool = True) -> None:
        unsupported = {"amsgrad": amsgrad, "maximize": maximize, "capturable": capturable,
                       "differentiable": differentiable, "foreach": bool(foreach),
                       "fused": bool(fused)}
        for option, value in unsupported.items():
            if value:
                raise InvalidRequestError(
                    f"{type(self).__name__}({option}=True) is not supported: the step runs in "
                    f"infinityd with its own fused kernel; leave {option} at its default")
        _check_hyper(lr, betas, eps, weight_decay)
        if delay_update and not overlap:
            raise InvalidRequestError(
                f"{type(self).__name__}(delay_update=True, overlap=False): the delayed update "
                f"exists to overlap the step with the next forward and backward; drop one")
        # torch's keys, so code that reads a group (schedulers, Trainer, state_dict users)
        # finds what it expects; the options are fixed, and checked again at each step.
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=False, foreach=None, capturable=False, differentiable=False,
                        fused=None, decoupled_weight_decay=self.decoupled)
        self._steppers: dict[int, Any] = {}  # id(client) -> its AdamStepper
        self._delay_update = delay_update
        # The speculative step (see the module's docstring): guesses sent during backward and
        # not yet matched against a step, the sub-group being gathered per (client, namespace),
        # the micro-batch whose gradients are guessed from (the last step's count), and the
        # step() call from which guessing is on again after a step that did not match.
        self._guesser = StepGuesser(self, subgroup_bytes=SUBGROUP_BYTES,
                                    on=speculate and overlap and not delay_update)
        self.guess_counts = self._guesser.counts
        # The delayed update's step in flight, and per offload state the copies it writes
        # (stored name -> the copy's name), which the module computes with once it is done.
        self._delayed: list[Any] = []
        self._written: dict[int, tuple[OffloadState, dict[str, str]]] = {}
        super().__init__(params, defaults)
        self._owners: dict[int, OffloadState] = {}
        self._clip_factor = 1.0    # from clip_grad_norm_, for the next step
        self._unscaled_by = 1.0    # 1 / loss scale, where a GradScaler's unscale_ asked for it
        self._overlap = overlap
        self._calls = 0            # step() calls, skipped ones included
        self._scheduler: Any = None  # the one given to resume(): its state goes in the record
        self._records: list[Any] = []  # record-only steps sent, not answered yet
        self._waited: set[tuple[int, str]] = set()  # (client, namespace) settled before use
        self._digest = ""          # of the parameters' stored names, in order ("" to compute)
        self._stored: OptimizerRecord | None = None  # a record found in the store, until taken
        self._taken: OptimizerRecord | None = None   # the record this optimizer went on from
        # A rank of a multi-rank job (offload's process_group): the node's leader keeps the
        # state of the parameters its node owns; see `_step_across_ranks`.
        self._ranks: NodeRanks | None = None
        self._owning_node: list[int] = []  # per parameter in the optimizer's order
        self._summed: list[bool] | None = None  # this step's gradients are summed: stepped ones
        for group in self.param_groups:
            for param in group["params"]:
                self._adopt(param)
        if self._ranks is not None:
            self._adopt_across_ranks()
            self._guesser.on = False
        else:
            self._find_record()
        for state in {id(s): s for s in self._owners.values()}.values():
            if self._guesser.on:
                self._guesser.listen(state)
            if delay_update:
                # A unit that finds the CPU tier full waits for the step still running (its
                # staging and leases hold the tier) before it asks again.
                state.daemon_work_waiters.append(self._wait_for_delayed)
        _let_grad_scalers_see_stored_gradients()

    # --- the parameters' state in the store -----------------------------------------------

    def _adopt(self, param: nn.Parameter) -> None:
        state = _require_offloaded(param)
        self._owners[id(param)] = state
        if id(state.client) not in self._steppers:  # its socket is attached now, not mid-step
            self._steppers[id(state.client)] = state.client.adam_stepper()
        if state.ranks is not None or self._ranks is not None:
            if self._ranks is None and len(self._owners) == 1:
                self._ranks = state.ranks
            if state.ranks is not self._ranks:
                raise InvalidRequestError(
                    "the optimizer's parameters come from modules offloaded with different "
                    "process groups (or some with none); offload them all with the same "
                    "process_group")
            if self._delay_update:
                raise InvalidRequestError(
                    f"{type(self).__name__}(delay_update=True) is not supported for a "
                    f"multi-rank job yet; leave delay_update off")
            return  # its state is created by `_adopt_across_ranks`, on its node only
        self._create_state(state, param)

    def _adopt_across_ranks(self) -> None:
        """Partition the parameters between the nodes and create, on each node's leader, the
        state of its part; every rank waits until all nodes have."""
        assert self._ranks is not None
        ranks = self._ranks
        params = self._ordered()
        self._owning_node = ranks.owner_of([param.numel() for param in params])
        if ranks.is_leader:
            for param, node in zip(params, self._owning_node):
                if node == ranks.node:
                    self._create_state(self._owner(param), param)
        ranks.world_barrier()

    def _create_state(self, state: OffloadState, param: nn.Parameter) -> None:
        """Create the parameter's moments (and master copies) in the store, keeping any
        already there."""
        entry = state.entry_of(param)
        names = self._names(state, param)
        client, namespace = state.client, state.config.namespace
        if (id(client), namespace) not in self._waited:
            # A trainer restarted on this namespace: the step its predecessor left running in
            # the daemon is applied before this one reads or creates any state.
            client.wait_for_steps(namespace=namespace)
            self._waited.add((id(client), namespace))
        have = client.exists_many([n for n in names.values() if n], namespace=namespace)
        wanted = dict(zip([k for k, n in names.items() if n], have))
        shape = param.shape
        # Streamed (write_from), so a parameter's state may be larger than the CPU tier.
        if not wanted["exp_avg"]:
            client.write_from(names["exp_avg"], torch.zeros(shape), namespace=namespace)
        if not wanted["exp_avg_sq"]:
            client.write_from(names["exp_avg_sq"], torch.zeros(shape), namespace=namespace)
        if (names["master"] and not wanted["master"]) or (names["copy"] and not wanted["copy"]):
            value = torch.empty(shape, dtype=entry.placeholder.dtype)
            client.read_into(entry.read_name, value, namespace=namespace)
            if names["master"] and not wanted["master"]:
                client.write_from(names["master"], value.float(), namespace=namespace)
            if names["copy"] and not wanted["copy"]:
                client.write_from(names["copy"], value, namespace=namespace)

    def _names(self, state: OffloadState, param: nn.Parameter) -> dict[str, str]:
        """The stored names of a parameter's optimizer state. With the delayed update every
        parameter has an fp32 master copy and a second copy of itself (`.next`): the step
        writes one copy while the module computes with the other."""
        entry = state.entry_of(param)
        delayed = self._delay_update
        master = delayed or entry.placeholder.dtype != torch.float32
        return {"exp_avg": entry.name + ".exp_avg", "exp_avg_sq": entry.name + ".exp_avg_sq",
                "master": entry.name + ".master" if master else "",
                "copy": entry.name + ".next" if delayed else ""}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        adding_later = hasattr(self, "_owners")  # not from torch's __init__
        if adding_later and self._ranks is not None:
            raise InvalidRequestError(
                "add_param_group after construction is not supported for a multi-rank job (the "
                "parameters' partition between nodes is fixed then); pass every group to the "
                "constructor")
        if adding_later:
            # Checked before torch keeps the group: a refused group leaves the optimizer as it
            # was, so the next step still works.
            params = param_group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            param_group = {**param_group, "params": params}
            for param in params:
                _require_offloaded(param)
        super().add_param_group(param_group)
        if adding_later:
            listened = {id(s) for s in self._owners.values()}
            for param in self.param_groups[-1]["params"]:
                self._adopt(param)
                state = self._owners[id(param)]
                if id(state) not in listened:
                    if self._guesser.on:
                        self._guesser.listen(state)
                    if self._delay_update:
                        state.daemon_work_waiters.append(self._wait_for_delayed)
                    listened.add(id(state))
            self._digest = ""
            self._take_record()  # a restarted run whose optimizer had this group added too

    # --- the step -------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise InvalidRequestError(
                f"{type(self).__name__}.step(closure) is not supported: compute the loss and "
                f"call backward() before step()")
        # A step sent before must be done before this one leases its tensors again (the next
        # forward waited for it already, but for parameters it did not use). The delayed
        # update's last step is published here: the module computes with it from now on. The
        # guesses made during backward too: this step's items lease their tensors exclusively.
        guesses = self._guesser.settle()
        self.synchronize()
        self._calls += 1
        grad_scale = self._take_grad_scale()
        if self._ranks is not None:
            assert grad_scale is not None  # no loss scaler: refused for a job's ranks
            self._step_across_ranks(self._ranks, grad_scale)
            return
        if grad_scale is None:
            # A loss scaler found an overflow: torch skips the step, so do we (it still counts
            # as a step of the loop, so the record learns of it).
            self._guesser.judge(guesses, {}, [])
            self._send_record()
            return
        requests: dict[tuple[int, str], list[_Request]] = {}
        groups = self._adam_groups(grad_scale)
        for index, group in enumerate(self.param_groups):
            for param in group["params"]:
                state = self._owner(param)
                if not state.has_gradient(param):
                    continue  # no gradient since zero_grad: torch skips it too
                entry = state.entry_of(param)
                names = self._names(state, param)
                target = entry.name
                if self._delay_update:  # the copy the module does not compute with
                    target = names["copy"] if entry.read_name == entry.name else entry.name
                    self._written.setdefault(id(state), (state, {}))[1][entry.name] = target
                param_state = self.state[param]
                step = int(param_state.get("step", torch.tensor(0.0)).item()) + 1
                param_state["step"] = torch.tensor(float(step))
                key = (id(state.client), state.config.namespace)
                requests.setdefault(key, []).append((state, entry, wire.AdamItem(
                    target, entry.grad_name, names["master"], names["exp_avg"],
                    names["exp_avg_sq"], index, step)))
        home = self._record_home()
        by_client: dict[int, list[tuple[str, list[_Request]]]] = {}
        for (client_id, namespace), items in requests.items():
            by_client.setdefault(client_id, []).append((namespace, _in_forward_order(items)))
        record = self._record()
        self._guesser.judge(guesses, requests, groups)
        for client_id, parts in by_client.items():
            self._send(groups, parts, record if client_id == id(home.client) else None)
        if id(home.client) not in by_client:
            self._send_record(record)
        if not self._overlap:
            self.synchronize()

    def _group_of(self, param: nn.Parameter) -> int | None:
        for index, group in enumerate(self.param_groups):
            for member in group["params"]:
                if member is param:
                    return index
        return None

    def _adam_groups(self, grad_scale: float) -> list[wire.AdamGroup]:
        groups = []
        for index, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            for option in ("amsgrad", "maximize", "capturable", "differentiable"):
                if group.get(option):
                    raise InvalidRequestError(
                        f"parameter group {index} has {option}=True (from a loaded state_dict?); "
                        f"{type(self).__name__} does not support it")
            _check_hyper(group["lr"], (beta1, beta2), group["eps"], group["weight_decay"])
            groups.append(wire.AdamGroup(float(group["lr"]), float(beta1), float(beta2),
                                         float(group["eps"]), float(group["weight_decay"]),
                                         self.decoupled, grad_scale))
        return groups

    def _sum_across_ranks(self, ranks: NodeRanks) -> list[bool]:
        """Which parameters the coming step updates (those with a gradient on any rank), once
        every rank's gradients are in its node's store and each parameter's gradients are summed
        in its owner node's store (every rank calls it; done once per step: clipping does it
        before the step)."""
        if self._summed is not None:
            return self._summed
        params = self._ordered()
        for state in {id(s.client): s for s in self._owners.values()}.values():
            # This rank's released leases reach the daemon now, not with its next request:
            # the step leases the parameters exclusively.
            state.client.flush()
        # Every rank's flags, or'ed: a collective, so past it every backward is done.
        stepped = ranks.any_rank([self._owner(p).has_gradient(p) for p in params])
        if ranks.is_leader and ranks.num_nodes > 1:
            for param, node, has in zip(params, self._owning_node, stepped):
                if has:
                    state = self._owner(param)
                    with state.client.get(state.entry_of(param).grad_name, exclusive=True,
                                          namespace=state.config.namespace) as grad:
                        ranks.sum_to_owner(grad, node)
        self._summed = stepped
        return stepped

    def _step_across_ranks(self, ranks: NodeRanks, grad_scale: float) -> None:
        """The step of a multi-rank job (every rank calls it). Once each parameter's gradients
        are summed in its owner node's store (`_sum_across_ranks`), each owner steps its part in
        its daemon with the gradients averaged over the ranks (as DistributedDataParallel
        averages them) and sends the new values to the other nodes; the other ranks wait."""
        params = self._ordered()
        stepped = self._sum_across_ranks(ranks)
        self._summed = None
        for param, has in zip(params, stepped):
            if has:
                param_state = self.state[param]
                param_state["step"] = torch.tensor(
                    float(param_state.get("step", torch.tensor(0.0)).item()) + 1)
        if ranks.is_leader:
            groups = self._adam_groups(grad_scale / ranks.world_size)
            index_of = {id(p): i for i, group in enumerate(self.param_groups)
                        for p in group["params"]}
            requests: dict[int, list[_Request]] = {}
            for param, node, has in zip(params, self._owning_node, stepped):
                if has and node == ranks.node:
                    state = self._owner(param)
                    entry, names = state.entry_of(param), self._names(state, param)
                    requests.setdefault(id(state.client), []).append((state, entry, wire.AdamItem(
                        entry.name, entry.grad_name, names["master"], names["exp_avg"],
                        names["exp_avg_sq"], index_of[id(param)],
                        int(self.state[param]["step"].item()))))
            for items in requests.values():
                self._send(groups, [(items[0][0].config.namespace, _in_forward_order(items))],
                           None)
            self.wait_for_daemon()
            if ranks.num_nodes > 1:
                for param, node, has in zip(params, self._owning_node, stepped):
                    if has:
                        state = self._owner(param)
                        with state.client.get(state.entry_of(param).name,
                                              namespace=state.config.namespace,
                                              exclusive=node != ranks.node) as value:
                            ranks.send_from_owner(value, node)
        ranks.world_barrier()  # the node's parameters hold the step's values now

    def _norm_across_ranks(self, ranks: NodeRanks) -> float:
        """The 2-norm of the job's averaged gradient (every rank calls it): each node's leader
        measures the summed gradients of the parameters its node owns, the sums of squares are
        added over the nodes, and the average over the ranks divides the norm."""
        stepped = self._sum_across_ranks(ranks)
        total = 0.0
        if ranks.is_leader:
            for param, node, has in zip(self._ordered(), self._owning_node, stepped):
                if has and node == ranks.node:
                    state = self._owner(param)
                    with state.client.get(state.entry_of(param).grad_name,
                                          namespace=state.config.namespace) as grad:
                        total += measure_gradient(grad).sum_of_squares
        return math.sqrt(ranks.sum_over_ranks(total)) / ranks.world_size

    def _refuse_across_ranks(self, what: str) -> None:
        if self._ranks is not None:
            raise InvalidRequestError(
                f"{what} is not supported for a multi-rank job yet (each node holds only its "
                f"part of the optimizer's state); train it in one process for that")

    def _send(self, groups: list[wire.AdamGroup], parts: list[tuple[str, list[_Request]]],
              record: tuple[str, str, bytes] | None) -> None:
        """Send one client's share of the step, the items of each namespace in sub-groups of
        about SUBGROUP_BYTES, as one step the daemon applies all or none (with the record, on
        the client holding it), without waiting; each parameter's offload state waits for its
        sub-group before the parameter is used."""
        stepper = self._steppers[id(parts[0][1][0][0].client)]
        batches: list[tuple[str, list[_Request]]] = []
        for namespace, items in parts:
            start, nbytes = 0, 0
            for end, (_, entry, _) in enumerate(items, 1):
                nbytes += entry.placeholder.numel() * 4
                if nbytes < SUBGROUP_BYTES and end < len(items):
                    continue
                batches.append((namespace, items[start:end]))
                start, nbytes = end, 0
        pendings = stepper.send_step(
            groups, [(namespace, [item for _, _, item in batch]) for namespace, batch in batches],
            record=record)
        for (_, batch), pending in zip(batches, pendings):
            if self._delay_update:  # the module goes on with the other copy: nothing waits
                self._delayed.append(pending)  # but the next gradients (`_settle_delayed`)
                for _, entry, _ in batch:
                    entry.delayed = pending
                continue
            by_state: dict[int, tuple[OffloadState, list[_Param]]] = {}
            for state, entry, _ in batch:
                by_state.setdefault(id(state), (state, []))[1].append(entry)
            for state, entries in by_state.values():
                state.step_sent(entries, pending)

    def synchronize(self) -> None:
        """Wait until the steps sent are applied in the daemon; raise the first error one met
        (the step of the other parameters is applied). With the delayed update, the module
        computes with the last step's parameters from here on."""
        # Taken first: after an error the module keeps the copies it has (the master copies
        # have the update; the next step writes it into the other copies).
        written, self._written = self._written, {}
        self.wait_for_daemon()
        for state, names in written.values():
            state.read_from(names)

    def wait_for_daemon(self) -> None:
        """Wait until the steps and records sent are applied in the daemon, changing nothing
        else: with the delayed update the module goes on with the copies it computes with
        until the next step (a checkpoint saves both, and the run goes on as if unsaved)."""
        for state in {id(s): s for s in self._owners.values()}.values():
            state.settle_steps()
        if self._guesser.busy:
            self._guesser.judge(self._guesser.settle(), {}, [])  # no step took them
        pending, self._delayed = self._delayed, []
        for step in pending:
            step.result()
        records, self._records = self._records, []
        for record in records:
            record.result()

    def _wait_for_delayed(self) -> bool:
        """Wait for the delayed update's steps in flight, switching no copy (the module
        computes with the ones it has until `step()` or `synchronize()`)."""
        pending, self._delayed = self._delayed, []
        for step in pending:
            step.result()
        return bool(pending)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The next backward replaces the stored gradients (they left the process already)."""
        for state in {id(s): s for s in self._owners.values()}.values():
            state.zero_grad()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` for gradients in the store: returns their total
        norm and scales them by max_norm / (norm + 1e-6) when that is below 1, inside the next
        step's pass (the stored gradients are not rewritten, nor read: the norm comes from the
        figures recorded as they arrived). After `GradScaler.unscale_(optimizer)` it is the norm
        of the unscaled gradients, as torch's is."""
        if norm_type != 2.0:
            raise InvalidRequestError("clip_grad_norm_ supports the 2-norm (norm_type=2.0)")
        if self._ranks is not None:
            norm = self._norm_across_ranks(self._ranks)
        else:
            norm = math.sqrt(self._gradient_figures().sum_of_squares) * self._unscaled_by
        coefficient = max_norm / (norm + 1e-6)
        self._clip_factor = min(1.0, coefficient)
        return torch.tensor(norm)

    # --- gradient statistics and loss scaling ------------------------------------------------

    def _gradient_figures(self) -> GradStats:
        """The sum of squares of all gradients the next step applies, and whether any element is
        non-finite: the figures the gradient hooks recorded, a gradient without them read."""
        total, nonfinite = 0.0, False
        for group in self.param_groups:
            for param in group["params"]:
                state = self._owner(param)
                if not state.has_gradient(param):
                    continue
                figures = state.grad_stats(param)
                if figures is None:  # stored by something other than the module's backward
                    figures = measure_gradient(state.gradient(param))
                total += figures.sum_of_squares
                nonfinite = nonfinite or figures.nonfinite
        return GradStats(total, nonfinite)

    def _unscale_for_grad_scaler(self, inv_scale: torch.Tensor,
                                 found_inf: torch.Tensor) -> dict[torch.device, torch.Tensor]:
        """What `GradScaler._unscale_grads_` does for in-process gradients, done for stored
        ones: flag an overflow in `found_inf`, and remember the factor (1 / the loss scale
        from `unscale_`; 1 from the scaler's check before a step) that the next step and
        clipping apply instead of rewriting the gradients."""
        self._refuse_across_ranks("torch.amp.GradScaler")
        if self._gradient_figures().nonfinite:
            found_inf.fill_(1.0)
        self._unscaled_by = float(inv_scale)
        return {found_inf.device: found_inf}

    def _take_grad_scale(self) -> float | None:
        """The factor the kernel multiplies every gradient by in this step (the clipping
        coefficient, and 1 / the loss scale where a GradScaler drives the step), or None where
        the scaler found an overflow and the step is to be skipped; clears both for the next
        step. `grad_scale` and `found_inf` are what `GradScaler.step` sets on the optimizer
        around the call (grad_scale None: `unscale_` was called already)."""
        factor = self._clip_factor * self._unscaled_by
        self._clip_factor = self._unscaled_by = 1.0
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and float(found_inf) > 0:
            return None
        loss_scale = getattr(self, "grad_scale", None)
        if loss_scale is not None:
            factor /= float(loss_scale)
        return factor

    def _owner(self, param: nn.Parameter) -> OffloadState:
        state = self._owners.get(id(param))
        if state is None:
            raise InvalidRequestError("this parameter is not one of the optimizer's; add it with "
                                      "add_param_group after offloading its module")
        return state

    # --- the record: what a restarted trainer finds --------------------------------------

    def resume(self, scheduler: Any = None) -> int:
        """Go on from the training state stored in the namespace; returns how many steps it
        has taken (0 in a fresh namespace): the number of the loop's next step.

        The optimizer found its moments, master copies and step counts when it was built; this
        brings back each group's hyperparameters as the last step left them and `scheduler`'s
        state (build it as the first run did, then call this), and from now on records the
        scheduler's state with each of its steps, so the next restart finds it too. Call it
        before the first step, fresh or restarted (see `infinity.torch.restart`)."""
        self._refuse_across_ranks("resume() (a warm restart)")
        self.wait_for_daemon()  # (no switch of the delayed update's copies: not a step)
        record = self._taken
        if record is None and self._stored is not None:
            raise InvalidRequestError(
                f"the namespace holds the state of {self._stored.optimizer} over other "
                f"parameters (or in another order) than this optimizer's; build the model and "
                f"the optimizer as the run that stored it did, or train in a fresh namespace")
        if record is not None and record.calls == self._calls:
            restore_groups(self.param_groups, record.groups)
            if scheduler is not None:
                if record.scheduler is None:
                    raise InvalidRequestError(
                        "the stored training state holds no scheduler state (the run that "
                        "stored it passed none to resume()); pass no scheduler, or start afresh")
                scheduler.load_state_dict(record.scheduler)
        if scheduler is not None:
            _record_each_step(scheduler)
        self._scheduler = scheduler
        return self._calls

    @property
    def steps_taken(self) -> int:
        """The number of `step()` calls of the run, skipped ones included, counted on from the
        stored state or checkpoint it went on from."""
        return self._calls

    def _record_home(self) -> OffloadState:
        """The offload state whose namespace and prefix hold the record: the first
        parameter's."""
        return self._owner(self.param_groups[0]["params"][0])

    def _ordered(self) -> list[nn.Parameter]:
        return [param for group in self.param_groups for param in group["params"]]

    def _names_digest(self) -> str:
        if not self._digest:
            self._digest = names_digest(
                f"{self._owner(p).config.namespace}/{self._owner(p).entry_of(p).name}"
                for p in self._ordered())
        return self._digest

    def _find_record(self) -> None:
        """Read the record in the store (creating its tensor in a fresh namespace) and take it
        where it is this optimizer's."""
        home = self._record_home()
        client, namespace = home.client, home.config.namespace
        name = record_name(home.config.prefix)
        if not client.exists(name, namespace=namespace):
            client.put(name, torch.zeros(RECORD_BYTES, dtype=torch.uint8), namespace=namespace)
            return
        self._stored = read_record(client, namespace=namespace, prefix=home.config.prefix)
        self._take_record()

    def _take_record(self) -> None:
        """Take the step counts (and the delayed update's copies) of a stored record of an
        optimizer of this class over these parameters in this order."""
        record = self._stored
        if (record is None or self._taken is not None or record.optimizer != type(self).__name__
                or record.names != self._names_digest()):
            return
        params = self._ordered()
        for param, step in zip(params, record.steps):
            if step:
                self.state[param]["step"] = torch.tensor(float(step))
        if self._delay_update and record.reading is not None and record.newest is not None:
            reading: dict[int, tuple[OffloadState, dict[str, str]]] = {}
            for param, read, newest in zip(params, record.reading, record.newest):
                state = self._owner(param)
                entry, copy = state.entry_of(param), self._names(state, param)["copy"]
                reading.setdefault(id(state), (state, {}))[1][entry.name] = (
                    copy if read else entry.name)
                if newest != read:  # the last step wrote the other copy: used from next step
                    self._written.setdefault(id(state), (state, {}))[1][entry.name] = (
                        copy if newest else entry.name)
            for state, names in reading.values():
                state.read_from(names)
        self._calls = record.calls
        self._stored, self._taken = None, record

    def _record(self) -> tuple[str, str, bytes]:
        """The record of the state as this process has it now: (namespace, name, bytes)."""
        params = self._ordered()
        reading = newest = None
        if self._delay_update:
            pending = {name: copy for _, names in self._written.values()
                       for name, copy in names.items()}
            reading, newest = [], []
            for param in params:
                entry = self._owner(param).entry_of(param)
                reading.append(int(entry.read_name != entry.name))
                newest.append(int(pending.get(entry.name, entry.read_name) != entry.name))
        record = OptimizerRecord(
            type(self).__name__, self._calls, self._names_digest(),
            [int(self.state[p]["step"].item()) if "step" in self.state.get(p, {}) else 0
             for p in params],
            plain_groups(self.param_groups),
            None if self._scheduler is None else self._scheduler.state_dict(), reading, newest)
        home = self._record_home()
        return home.config.namespace, record_name(home.config.prefix), record.encode()

    def _send_record(self, record: tuple[str, str, bytes] | None = None) -> None:
        """A step of no items that carries the record only (a skipped step, a scheduler's)."""
        if self._ranks is not None:
            return  # a multi-rank job keeps no record (no warm restart yet)
        stepper = self._steppers[id(self._record_home().client)]
        self._records += stepper.send_step([], [], record=record or self._record())

    # --- checkpoints (infinity.torch.checkpoint) ----------------------------------------

    def stored_parameters(self) -> list[StoredParameter]:
        """What the store holds of each parameter, in the optimizer's order (call
        `wait_for_daemon` first)."""
        self._refuse_across_ranks("a checkpoint")
        pending = {name: copy for _, names in self._written.values()
                   for name, copy in names.items()}
        stored = []
        for param in self._ordered():
            state = self._owner(param)
            entry = state.entry_of(param)
            current = pending.get(entry.name, entry.read_name)
            stored.append(StoredParameter(
                param, state, entry.name, self._names(state, param), current,
                entry.read_name if current != entry.read_name else "",
                int(self.state[param]["step"].item()) if "step" in self.state.get(param, {})
                else 0))
        return stored

    def restore_loop(self, steps: list[int], groups: list[dict[str, Any]], calls: int,
                     pending: list[bool], scheduler: Any = None) -> None:
        """Take a loaded state as this optimizer's own: each parameter's step count (in the
        optimizer's order), the groups' hyperparameters, the number of steps taken, which
        parameters (delayed update) compute with their own stored name until the next step
        and with the second copy after it, and the scheduler to record; then record it."""
        self.wait_for_daemon()
        self._written = {}
        for param, step, switches in zip(self._ordered(), steps, pending):
            if step:
                self.state[param]["step"] = torch.tensor(float(step))
            else:
                self.state[param].pop("step", None)
            state = self._owner(param)
            entry = state.entry_of(param)
            state.read_from({entry.name: entry.name})
            if switches:
                copy = self._names(state, param)["copy"]
                self._written.setdefault(id(state), (state, {}))[1][entry.name] = copy
        restore_groups(self.param_groups, groups)
        self._calls = calls
        if scheduler is not None:
            _record_each_step(scheduler)
        self._scheduler = scheduler
        record = self._record()
        self._stored, self._taken = None, OptimizerRecord.decode(record[2])
        self._send_record(record)
        self.wait_for_daemon()

    # --- state_dict ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's layout: per parameter its step and both moments (read from the store)."""
        self._refuse_across_ranks("state_dict()")
        self.synchronize()
        result = super().state_dict()
        params = [p for group in self.param_groups for p in group["params"]]
        for index, param in enumerate(params):
            if index not in result["state"]:
                continue
            state = self._owner(param)
            names = self._names(state, param)
            client, namespace = state.client, state.config.namespace
            # A copy of torch's per-parameter dict (which is the live state): the moments are
            # the returned dict's alone.
            result["state"][index] = dict(result["state"][index])
            for key in ("exp_avg", "exp_avg_sq"):
                with client.get(names[key], namespace=namespace) as stored:
                    result["state"][index][key] = stored.clone()
        return result

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Steps and hyperparameters as torch loads them; the moments go into the store."""
        self._refuse_across_ranks("load_state_dict()")
        self.synchronize()
        super().load_state_dict(state_dict)
        for param, param_state in list(self.state.items()):
            assert isinstance(param, nn.Parameter)
            state = self._owner(param)
            names = self._names(state, param)
            for key in ("exp_avg", "exp_avg_sq"):
                value = param_state.pop(key, None)
                if value is not None:
                    state.client.put(names[key], value.detach().float().reshape(param.shape),
                                     namespace=state.config.namespace)
        self._send_record()  # a restart from here finds the loaded step counts


class AdamW(_StoreAdam):
    """torch.optim.AdamW with its state in the store and its step in infinityd."""

    decoupled = True


class Adam(_StoreAdam):
    """torch.optim.Adam (L2 weight decay added to the gradient), state in the store, step in
    infinityd."""

    decoupled = False

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, **options: Any) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, **options)


def _require_offloaded(param: Any) -> OffloadState:
    """The offload state holding `param`, or the typed error saying what to do."""
    state = state_of_parameter(param) if isinstance(param, nn.Parameter) else None
    if state is None:
        raise InvalidRequestError(
            "a parameter given to the optimizer is not in the store; call "
            "infinity.torch.offload(model, client, namespace=...) before building the "
            "optimizer (or adding a parameter group), and pass that model's parameters")
    return state


_RECORDING_CLASSES: dict[type, type] = {}


def _record_each_step(scheduler: Any) -> None:
    """Make each `scheduler.step()` send the optimizer's record (the scheduler's new state and
    the lr it set), so a restart finds the scheduler where the loop left it. The scheduler's
    class becomes a subclass whose `step` does that after its own: its `state_dict()` (the
    instance's attributes) stays as it was, which a wrapper stored on the instance would not."""
    base = type(scheduler)
    if base in _RECORDING_CLASSES.values():
        return
    if base not in _RECORDING_CLASSES:
        plain_step = base.step

        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = plain_step(self, *args, **kwargs)
            optimizer = getattr(self, "optimizer", None)
            if isinstance(optimizer, _StoreAdam) and optimizer._scheduler is self:
                optimizer._send_record()
            return result

        _RECORDING_CLASSES[base] = type(base.__name__, (base,), {
            "step": step, "__module__": base.__module__, "__doc__": base.__doc__})
    scheduler.__class__ = _RECORDING_CLASSES[base]


def _let_grad_scalers_see_stored_gradients() -> None:
    """Redirect `torch.amp.GradScaler`'s gradient pass, for our optimizers only, to their
    recorded gradient figures (see the module's docstring); other optimizers keep torch's.
    Installed once, by the first optimizer built; torch's CUDA scaler inherits it."""
    scaler_class = torch.amp.GradScaler
    plain = getattr(scaler_class, "_unscale_grads_", None)
    if plain is None or getattr(plain, "infinity_redirect", False):
        return  # redirected already, or a torch whose scaler is built otherwise

    def unscale_grads(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer,
                      inv_scale: torch.Tensor, found_inf: torch.Tensor,
                      allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        if isinstance(optimizer, _StoreAdam):
            return optimizer._unscale_for_grad_scaler(inv_scale, found_inf)
        return plain(scaler, optimizer, inv_scale, found_inf, allow_fp16)

    unscale_grads.infinity_redirect = True  # type: ignore[attr-defined]
    scaler_class._unscale_grads_ = unscale_grads  # type: ignore[method-assign, assignment]


def _check_hyper(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    if isinstance(lr, torch.Tensor):
        raise InvalidRequestError("a tensor lr is not supported; pass a float")
    if not 0.0 <= float(lr):
        raise InvalidRequestError(f"invalid learning rate {lr}: it must be >= 0")
    if not 0.0 <= float(eps):
        raise InvalidRequestError(f"invalid eps {eps}: it must be >= 0")
    if not (0.0 <= float(betas[0]) < 1.0 and 0.0 <= float(betas[1]) < 1.0):
        raise InvalidRequestError(f"invalid betas {betas}: each must be in [0, 1)")
    if not 0.0 <= float(weight_decay):
        raise InvalidRequestError(f"invalid weight_decay {weight_decay}: it must be >= 0")


def _in_forward_order(items: list[_Request]) -> list[_Request]:
    """The items sorted by where the last forward of their module first used them (those it
    did not use last, in the optimizer's order)."""
    positions: dict[int, dict[int, int]] = {}
    for state, _, _ in items:
        if id(state) not in positions:
            positions[id(state)] = {id(e): i for i, e in enumerate(state.forward_order)}
    last = len(items) + max((len(p) for p in positions.values()), default=0)

    def position(indexed: tuple[int, _Request]) -> int:
        index, (state, entry, _) = indexed
        return positions[id(state)].get(id(entry), last + index)

    return [item for _, item in sorted(enumerate(items), key=position)]
