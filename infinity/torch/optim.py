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

`delay_update=True` (off by default: it changes the numerics) is ZeRO-Offload's delayed
parameter update: the next forward does not wait for the step at all but computes with the
parameters from before it, so the step overlaps the whole next forward and backward; each
forward then uses parameters one step older than the plain schedule's. Each parameter gets an
fp32 master copy and a second copy of itself (`<name>.next`): the step updates the master and
writes one copy while the module computes with the other, and `step()` (or `synchronize()`)
switches the module to the copy the last step wrote once that step is done.

`param_groups` are read at every step (lr, betas, eps, weight_decay), so
`torch.optim.lr_scheduler` schedulers work; `zero_grad()` makes the next backward replace the
stored gradients; `state_dict()` / `load_state_dict()` carry the moments (read from and written to
the store) and the step counts.

Gradient clipping: torch's `clip_grad_norm_` cannot see gradients that already left the process,
so the optimizer offers `clip_grad_norm_(max_norm)`: the global norm of the stored gradients, and
the factor that scales them applied inside the next step's pass. The norm adds up the sums of
squares that `offload`'s gradient hook recorded as each gradient arrived (`OffloadState.grad_stats`),
so clipping reads no gradient back; only a gradient without figures (written into the store by
something else) is read.

Loss scaling: `torch.amp.GradScaler` works unchanged (`scaler.scale(loss).backward()`, optionally
`scaler.unscale_(optimizer)` and `optimizer.clip_grad_norm_`, `scaler.step(optimizer)`,
`scaler.update()`). The optimizer sets `_step_supports_amp_scaling`, as torch's fused Adam does:
the scaler hands it the scale, and the kernel multiplies the gradients by its inverse inside the
step's pass. The scaler looks for overflows by reading each parameter's `.grad`, which an
offloaded parameter no longer has, so its gradient pass (`GradScaler._unscale_grads_`, which both
`unscale_` and `step` run) is redirected for these optimizers to the recorded figures: a
non-finite gradient sets the scaler's `found_inf`, the whole step is skipped (no parameter,
moment or step count changes) and `scaler.update()` backs the scale off as it does for torch's
optimizers.

Not supported (a clear InvalidRequestError): amsgrad, maximize, a closure, capturable,
differentiable, foreach/fused (the daemon's kernel is the fused implementation), parameters that
were not offloaded.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch
from torch import nn

from infinity.errors import InvalidRequestError
from infinity.protocol import wire
from infinity.torch.offload import (GradStats, OffloadState, _Param, measure_gradient,
                                    state_of_parameter)

__all__ = ["Adam", "AdamW"]

SUBGROUP_BYTES = 8 << 20  # fp32 bytes of parameters per request: the next forward waits for one


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
                 overlap: bool = True, delay_update: bool = False) -> None:
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
        # The delayed update's step in flight, and per offload state the copies it writes
        # (stored name -> the copy's name), which the module computes with once it is done.
        self._delayed: list[Any] = []
        self._written: dict[int, tuple[OffloadState, dict[str, str]]] = {}
        super().__init__(params, defaults)
        self._owners: dict[int, OffloadState] = {}
        self._clip_factor = 1.0    # from clip_grad_norm_, for the next step
        self._unscaled_by = 1.0    # 1 / loss scale, where a GradScaler's unscale_ asked for it
        self._overlap = overlap
        for group in self.param_groups:
            for param in group["params"]:
                self._adopt(param)
        _let_grad_scalers_see_stored_gradients()

    # --- the parameters' state in the store -----------------------------------------------

    def _adopt(self, param: nn.Parameter) -> None:
        state = _require_offloaded(param)
        self._owners[id(param)] = state
        if id(state.client) not in self._steppers:  # its socket is attached now, not mid-step
            self._steppers[id(state.client)] = state.client.adam_stepper()
        entry = state.entry_of(param)
        names = self._names(state, param)
        client, namespace = state.client, state.config.namespace
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
            for param in self.param_groups[-1]["params"]:
                self._adopt(param)

    # --- the step -------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise InvalidRequestError(
                f"{type(self).__name__}.step(closure) is not supported: compute the loss and "
                f"call backward() before step()")
        # A step sent before must be done before this one leases its tensors again (the next
        # forward waited for it already, but for parameters it did not use). The delayed
        # update's last step is published here: the module computes with it from now on.
        self.synchronize()
        grad_scale = self._take_grad_scale()
        if grad_scale is None:
            return  # a loss scaler found an overflow: torch skips the step, so do we
        requests: dict[tuple[int, str], list[tuple[OffloadState, _Param, wire.AdamItem]]] = {}
        groups: list[wire.AdamGroup] = []
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
        for (_, namespace), items in requests.items():
            self._send(groups, _in_forward_order(items), namespace)
        if not self._overlap:
            self.synchronize()

    def _send(self, groups: list[wire.AdamGroup],
              items: list[tuple[OffloadState, _Param, wire.AdamItem]], namespace: str) -> None:
        """Send the items in sub-groups of about SUBGROUP_BYTES, without waiting; each
        parameter's offload state waits for its sub-group before the parameter is used."""
        stepper = self._steppers[id(items[0][0].client)]
        start, nbytes = 0, 0
        for end, (_, entry, _) in enumerate(items, 1):
            nbytes += entry.placeholder.numel() * 4
            if nbytes < SUBGROUP_BYTES and end < len(items):
                continue
            batch, start, nbytes = items[start:end], end, 0
            pending = stepper.send(groups, [item for _, _, item in batch], namespace=namespace)
            if self._delay_update:  # the module goes on with the other copy: nothing waits
                self._delayed.append(pending)
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
        for state in {id(s): s for s in self._owners.values()}.values():
            state.settle_steps()
        if self._delayed or self._written:
            pending, self._delayed = self._delayed, []
            written, self._written = self._written, {}
            for step in pending:
                step.result()  # an error: the module keeps the copies it has (the master
                # copies have the update; the next step writes it into the other copies)
            for state, names in written.values():
                state.read_from(names)

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

    # --- state_dict ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's layout: per parameter its step and both moments (read from the store)."""
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


def _in_forward_order(items: list[tuple[OffloadState, _Param, wire.AdamItem]]
                      ) -> list[tuple[OffloadState, _Param, wire.AdamItem]]:
    """The items sorted by where the last forward of their module first used them (those it
    did not use last, in the optimizer's order)."""
    positions: dict[int, dict[int, int]] = {}
    for state, _, _ in items:
        if id(state) not in positions:
            positions[id(state)] = {id(e): i for i, e in enumerate(state.forward_order)}
    last = len(items) + max((len(p) for p in positions.values()), default=0)

    def position(indexed: tuple[int, tuple[OffloadState, _Param, wire.AdamItem]]) -> int:
        index, (state, entry, _) = indexed
        return positions[id(state)].get(id(entry), last + index)

    return [item for _, item in sorted(enumerate(items), key=position)]
