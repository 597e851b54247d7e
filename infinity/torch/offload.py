"""Module offload: a module's parameters live in the store and are present only around their use.

`offload(model, client, namespace=...)` puts every parameter into the store and leaves the module
as it is otherwise (the way FSDP2's `fully_shard` does): each submodule that owns parameters (a
*unit*) gets a forward pre-hook that leases its parameters and points them at the leased views in
shared memory (no copy on the CPU), and a forward post-hook that gives them back. Between uses a
parameter keeps its shape and dtype over a storage of no bytes, so the process's memory grows with
the largest unit and the activations, not with the model.

Backward needs some parameters again (a linear layer's weight, to compute its input's gradient).
Autograd saves the tensors it needs during forward; a saved-tensor hook recognises a saved
tensor that lies in a leased parameter's memory and saves a small handle instead, and unpacking
the handle in backward leases the unit again and rebuilds the same view. So nothing refers to a
view after its lease ends, and backward reads parameters exactly when it uses them: the daemon
sees these gets in step order and prefetches them as it does forward's.

Gradients leave as they are produced: a hook per parameter runs once its gradient is final (after
autograd summed every use of it, tied weights included), writes it into the store (a put after
`zero_grad()`, else summed in place into the stored gradient under an exclusive lease, so
gradient-accumulation micro-batches add up in shared memory) and drops it from the process. The
unit's lease ends once all of its gradients have left, or at the end of backward.

The same hook records the gradient's statistics (its sum of squares and whether any element is
inf or NaN, from the native SIMD `grad_stats`) as it will be stepped: the gradient put, or after
accumulation the stored sum, measured while it is still in cache under the hook's lease. The
optimizer's clipping and a loss scaler's overflow check add these figures up instead of reading
every gradient back (`grad_stats`).

The module computes where its parameters are (or on `device=`). On the CPU it computes on the
views directly, no copies. On a GPU (`infinity.torch.device_params`) a unit's lease is a lease of
device copies from one `DeviceCache` per module tree, within `device_budget_bytes`: copied on a
side stream from the pinned shared segments, the compute stream waiting on events, prefetched by
the step trace, and copied again once the daemon's optimizer step has written a new revision.
The saved-tensor hook recognises tensors in a present parameter's device memory as it does views,
gradients come back to the host through a staging buffer and go into the store by the same hook,
and the cache's CPU-tier leases go back at the end of backward (the step leases the parameters
exclusively). The module's buffers stay where the user put them. `copier=CpuCopier()` makes the
CPU a device that copies, so this path runs on machines without a GPU.

Quantized weights (inference only, `quantized=`, from an import's int8 or int4 copies: see
`infinity.torch.quantize`): a unit leases a quantized parameter's codes and scales instead of
its full-precision tensor (so the daemon's trace, its prefetch and the device cache see and move
those fewer bytes), and its pre-hook dequantizes them on the compute device into a buffer of the
compute dtype that the parameter points at while the unit computes; the post-hook gives the
buffer back to the module tree's `DequantBuffers`, which hands it to the next weight of its
shape. So what the process holds still grows with the largest unit, not with the model. An
`nn.Linear` computing on the CPU skips the buffer where its input has few rows (a decode step:
at most `FUSED_MAX_ROWS`): its pre-hook keeps the codes and scales leased instead, and the
module's forward (replaced on that instance: `infinity.torch.inference_paths`, which falls back to
`nn.Linear.forward` whenever the weight was dequantized) multiplies from them with the native
kernel (`infinity.torch.quantize.linear`), the weight never written out in full.

An inference unit that is a plain `nn.Embedding` with a weight of its own (not tied to an output
projection), in full precision, computing on the CPU, leases nothing: its forward (replaced on
the instance: `infinity.torch.inference_paths`) reads just the rows its input looks up
(`client.read_rows`) and looks them up in that small table; a decode step reads one 1 MiB block
of the table, not the table.

An inference module computing on the CPU leases each block's units (the elements of an
`nn.ModuleList` holding two units or more, such as decoder layers) in runs, one request for
several units of up to a sixteenth of the CPU tier together, from the block's second forward on
(`infinity.torch.lease_groups`): a round trip to the daemon costs a few tenths of a millisecond,
and a decoder layer has 7-9 units.

Listeners (`gradient_listeners`, `backward_listeners`) hear of each gradient once it is stored
and of each backward's end: the optimizer's speculative step (`infinity.torch.optim`) sends its
guesses from there. A unit whose lease finds the CPU tier full waits for the daemon's work for
this module (guesses, a step's last sub-groups: `settle_daemon_work`) and asks once more.

The optimizer's step may still run in the daemon when the next forward starts
(`infinity.torch.optim`): each parameter's `_Param.step` holds the step updating it, and a
unit's acquire, the gradient hook and the reads below wait for it first (`settle_steps`); on a
device, the cache leaves such parameters out of prefetch until then (the step leases them
exclusively).
"""

from __future__ import annotations

import bisect
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from infinity.client.device import DeviceCopier
from infinity.errors import InfinityError, InvalidRequestError, LeaseError, TierFullError
from infinity.io.native import native
from infinity.torch.device_params import DeviceParams, compute_device, device_budget, device_copier
from infinity.torch.distributed import NodeRanks, node_ranks
from infinity.torch.from_store import (dtypes_in_store, give_values_to_meta_parameters,
                                       quantized_copies)
from infinity.torch.inference_paths import compute_from_codes, fuses, read_embedding_by_rows
from infinity.torch.lease_groups import LeaseGroup, lease_in_runs
from infinity.torch.quantize import DequantBuffers, QuantizedWeight

__all__ = ["GradStats", "OffloadConfig", "OffloadState", "offload", "offload_state"]

_STATES: "weakref.WeakKeyDictionary[nn.Module, OffloadState]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class OffloadConfig:
    """How a module's state is kept in the store."""

    namespace: str
    param_dtype: torch.dtype | None = None   # None: each parameter's own dtype
    grad_dtype: torch.dtype = torch.float32  # gradients are summed in the store in this dtype
    prefix: str = ""                         # put before every stored name
    mark_steps: bool = True                  # each root forward begins a step for the scheduler
    inference: bool = False                  # forwards only (generation): see `offload`

    def __post_init__(self) -> None:
        allowed = (torch.float32, torch.bfloat16, torch.float16)
        if self.param_dtype is not None and self.param_dtype not in allowed:
            raise InvalidRequestError(
                f"param_dtype {self.param_dtype} is not one the store offloads; use "
                f"torch.float32, torch.bfloat16 or torch.float16 (or None: as the model has it)")
        if self.grad_dtype not in allowed:
            raise InvalidRequestError(
                f"grad_dtype {self.grad_dtype} is not supported; use torch.float32, "
                f"torch.bfloat16 or torch.float16")
        if not self.namespace:
            raise InvalidRequestError("namespace is empty; name the namespace the model's state "
                                      "lives in, e.g. offload(model, client, namespace='gpt2')")


@dataclass(frozen=True)
class GradStats:
    """What clipping and a loss scaler need of one stored gradient."""

    sum_of_squares: float  # of its elements, summed in double: inf or NaN where an element is
    nonfinite: bool        # any element inf or NaN


def measure_gradient(grad: torch.Tensor) -> GradStats:
    """The statistics of a gradient in this process's memory: one native SIMD pass over it
    (copied first only where it is not contiguous on the CPU)."""
    grad = grad.detach()
    if not grad.is_contiguous() or grad.device.type != "cpu":
        grad = grad.cpu().contiguous()
    dtype = str(grad.dtype).removeprefix("torch.")
    sum_of_squares, nonfinite = native().grad_stats(grad.data_ptr(), dtype, grad.numel())
    return GradStats(sum_of_squares, nonfinite)


@dataclass(eq=False)
class _Param:
    """One parameter (tied ones once): its stored names and where its data points now."""

    param: nn.Parameter
    name: str
    grad_name: str
    placeholder: torch.Tensor
    holders: list[tuple["_Unit", torch.Tensor]] = field(default_factory=list)
    units: list["_Unit"] = field(default_factory=list)  # the modules that use it (tied: several)
    step: Any = None  # the optimizer step still updating it in the daemon (a PendingAdamStep)
    read_name: str = ""  # what the module computes with: `name`, or the optimizer's second copy
    quantized: QuantizedWeight | None = None  # computes with this copy, dequantized, instead
    micro_batches: int = 0  # gradients stored since the last zero_grad (accumulated ones too)
    guess: Any = None  # the optimizer's speculative step over the stored gradient, unanswered
    delayed: Any = None  # the delayed update's step that reads the stored gradient, unanswered

    def __post_init__(self) -> None:
        self.read_name = self.read_name or self.name

    @property
    def lease_names(self) -> tuple[str, ...]:
        """What a unit leases for it: its quantized copy's codes and scales, or `read_name`."""
        return self.quantized.names if self.quantized is not None else (self.read_name,)


class _SavedParam:
    """What autograd keeps instead of a tensor lying in a leased parameter's memory."""

    __slots__ = ("entry", "offset", "size", "stride")

    def __init__(self, entry: _Param, offset: int, size: torch.Size,
                 stride: tuple[int, ...]) -> None:
        self.entry, self.offset, self.size, self.stride = entry, offset, size, stride


class _Unit:
    """A module that owns parameters: its lease while in use, and the gradients still to come."""

    def __init__(self, state: "OffloadState", module: nn.Module, name: str,
                 entries: list[_Param]) -> None:
        self.state = state
        self.module = module
        self.name = name
        self.entries = entries
        self.names = [name for entry in entries for name in entry.lease_names]
        self.buffers: list[torch.Tensor] = []  # its quantized parameters, dequantized
        # The weight entry of an nn.Linear computing on the CPU from a quantized copy, and while
        # its forward multiplies from the codes, they and the scales (`inference_paths`).
        self.fusable: _Param | None = None
        # The weight of an nn.Embedding that reads only the rows it looks up (set for inference:
        # `inference_paths.read_embedding_by_rows`); such a unit leases nothing.
        self.by_rows: _Param | None = None
        self.fused: tuple[torch.Tensor, torch.Tensor] | None = None
        # The module's own parameter slots as offload found them: a parameter replaced later
        # (module.weight = nn.Parameter(...)) would compute with values the store never saw.
        self.slots = [(slot, param) for slot, param in module._parameters.items()
                      if param is not None]
        self.lease: Any = None
        self.group: LeaseGroup | None = None  # its block's, where it leases with the block
        self.depth = 0              # forward calls in progress (a module may be called twice)
        self.in_backward = False
        self.grads_left = 0

    def acquire(self, *, fused: bool = False) -> None:
        """Lease the unit's parameters and point them at their values; `fused`
        (`inference_paths.fuses`): keep the weight's codes and scales to multiply from instead
        of dequantizing them."""
        if self.lease is not None or self.by_rows is not None:
            return
        self.state.settle_steps(self.entries)  # the values the optimizer's last step wrote
        borrowed = self.group.take(self) if self.group is not None else None
        lease: Any
        if borrowed is not None:
            lease = borrowed  # its block's forward leased it with the block's other units
        elif self.state.device_params is not None:
            lease = self.state.device_params.lease(self.names)  # released as a store lease is
        else:
            try:
                lease = self.state.client.get_many(self.names,
                                                   namespace=self.state.config.namespace)
            except TierFullError:
                # The daemon's work for this trainer (the optimizer's guesses, a step's last
                # sub-groups) may hold the tier for a moment: wait for it, then ask once more.
                if not self.state.settle_daemon_work():
                    raise
                lease = self.state.client.get_many(self.names,
                                                   namespace=self.state.config.namespace)
        self.lease = lease
        views = iter(lease.tensors)
        for entry in self.entries:
            view = next(views)
            if fused and entry is self.fusable:
                self.fused = (view, next(views))  # the parameter keeps its placeholder
                continue
            if entry.quantized is not None:
                view = self.state.dequantized.take(entry.quantized, view, next(views))
                self.buffers.append(view)
            self.state._hold(entry, self, view)
        if len(self.buffers) == len(self.entries):
            # Every parameter computes from its buffer: the codes and scales can go back now,
            # free to be evicted (`release` releases the lease again, which does nothing).
            lease.release()

    def release(self) -> None:
        if self.lease is None:
            return
        for entry in self.entries:
            self.state._unhold(entry, self)
        for buffer in self.buffers:
            self.state.dequantized.give(buffer)
        self.buffers.clear()
        self.fused = None
        lease, self.lease = self.lease, None
        self.in_backward = False
        lease.release()


class OffloadState:
    """The one small state object of an offloaded module tree (see `offload`)."""

    def __init__(self, root: nn.Module, client: Any, config: OffloadConfig) -> None:
        self.root = root
        self.client = client
        self.config = config
        self.units: list[_Unit] = []
        self.params: list[_Param] = []
        self._by_param: dict[int, _Param] = {}
        # Leased memory of present parameters, by the base address of the storage their views
        # share (a segment): sorted starts, and the entries, for the saved-tensor hook.
        self._spans: dict[int, tuple[list[int], list[_Param]]] = {}
        self._fresh_grads: set[str] = set()
        self._grad_stats: dict[str, GradStats] = {}  # by gradient name, since the last zero_grad
        self._saved_hooks: Any = None
        self._end_of_backward_queued = False
        # The parameters in the order the last forward used them first (the optimizer steps
        # them in this order, so the next forward finds the first of them updated soonest).
        self.forward_order: list[_Param] = []
        self._order_seen: set[int] | None = None
        self._steps_pending = 0  # entries whose `step` is set
        # Set by `offload` when the module computes on a device other than the CPU's views.
        self.device_params: DeviceParams | None = None
        self.device_type = "cpu"  # where parameters present are, for the saved-tensor hook
        # Set by `offload` for a rank of a torch.distributed job (see `offload`'s process_group).
        self.ranks: NodeRanks | None = None
        self.batch_limit_bytes = 1  # the most bytes `offload` and `zero_grad` put in one batch
        # Called with each gradient once it is stored, and at the end of each backward (the
        # optimizer's speculative step: `infinity.torch.optim`).
        self.gradient_listeners: list[Callable[["OffloadState", _Param], None]] = []
        self.backward_listeners: list[Callable[["OffloadState"], None]] = []
        # Wait for other work of the optimizer in the daemon (its delayed update's step); each
        # says whether there was any (`settle_daemon_work`).
        self.daemon_work_waiters: list[Callable[[], bool]] = []
        self.dequantized = DequantBuffers()  # for the parameters computing with quantized copies

    # --- presence -------------------------------------------------------------------------

    def _hold(self, entry: _Param, unit: _Unit, view: torch.Tensor) -> None:
        entry.holders.append((unit, view))
        if len(entry.holders) == 1:
            self._point(entry, view)

    def _unhold(self, entry: _Param, unit: _Unit) -> None:
        entry.holders = [(u, v) for u, v in entry.holders if u is not unit]
        self._forget_span(entry)
        if entry.holders:
            self._point(entry, entry.holders[0][1])  # another unit's lease keeps it present
        else:
            entry.param.data = entry.placeholder

    def _point(self, entry: _Param, view: torch.Tensor) -> None:
        self._forget_span(entry)
        entry.param.data = view
        base = view.untyped_storage().data_ptr()
        starts, entries = self._spans.setdefault(base, ([], []))
        at = bisect.bisect_left(starts, view.data_ptr())
        starts.insert(at, view.data_ptr())
        entries.insert(at, entry)

    def _forget_span(self, entry: _Param) -> None:
        for base, (starts, entries) in list(self._spans.items()):
            if entry in entries:
                at = entries.index(entry)
                del starts[at], entries[at]
                if not starts:
                    del self._spans[base]
                return

    # --- hooks ----------------------------------------------------------------------------

    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        # A training step starts with a forward that records for backward; evaluation
        # between steps is left out of the trace. A module that only infers steps per forward.
        if torch.is_grad_enabled() or self.config.inference:
            if self.config.mark_steps:
                self.client.step_begin(namespace=self.config.namespace)
            self.forward_order, self._order_seen = [], set()
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._saved_hooks.__enter__()

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._order_seen = None
        hooks, self._saved_hooks = self._saved_hooks, None
        if hooks is not None:
            hooks.__exit__(None, None, None)
        if not torch.is_grad_enabled():
            self._settle_device()  # no backward follows to do it

    def _pre_forward(self, unit: _Unit, args: tuple[Any, ...]) -> None:
        parameters = unit.module._parameters
        for slot, param in unit.slots:
            if parameters.get(slot) is not param:
                raise InvalidRequestError(
                    f"parameter {slot!r} of module {unit.name or type(unit.module).__name__!r} was "
                    f"replaced after offload(), so the store does not hold it; change parameters "
                    f"before offloading, or offload a freshly built model")
        unit.depth += 1
        if self._order_seen is not None:
            for entry in unit.entries:
                if id(entry) not in self._order_seen:
                    self._order_seen.add(id(entry))
                    self.forward_order.append(entry)
        unit.acquire(fused=fuses(unit, args))

    def _post_forward(self, unit: _Unit) -> None:
        if unit.depth == 0:
            return  # its pre-hook raised (always_call runs this anyway): nothing was taken
        unit.depth -= 1
        if unit.depth == 0 and not unit.in_backward:
            unit.release()

    def _pack(self, tensor: torch.Tensor) -> Any:
        if (not self._spans or tensor.device.type != self.device_type
                or tensor.layout != torch.strided):
            return tensor
        found = self._spans.get(tensor.untyped_storage().data_ptr())
        if found is None:
            return tensor
        starts, entries = found
        at = bisect.bisect_right(starts, tensor.data_ptr()) - 1
        if at < 0:
            return tensor
        entry = entries[at]
        view = entry.param.data
        offset_bytes = tensor.data_ptr() - view.data_ptr()
        if offset_bytes >= view.numel() * view.element_size() or tensor.dtype != view.dtype:
            return tensor
        return _SavedParam(entry, offset_bytes // view.element_size(), tensor.size(),
                           tensor.stride())

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _SavedParam):
            return saved
        entry = saved.entry
        if not entry.holders:
            unit = self._unit_for_backward(entry)
            unit.acquire()
        view = entry.param.data
        return view.as_strided(saved.size, saved.stride, view.storage_offset() + saved.offset)

    def _unit_for_backward(self, entry: _Param) -> _Unit:
        unit = entry.units[0]
        unit.in_backward = True
        unit.grads_left = sum(1 for e in unit.entries if e.param.requires_grad)
        self._queue_end_of_backward()
        return unit

    def _queue_end_of_backward(self) -> None:
        if not self._end_of_backward_queued:
            self._end_of_backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._end_of_backward_queued = False
        for unit in self.units:
            if unit.in_backward and unit.depth == 0:
                unit.release()
        self._settle_device()
        for listener in self.backward_listeners:
            listener(self)

    def _settle_device(self) -> None:
        if self.device_params is not None:
            self.device_params.settle()

    def _gradient_for_store(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient in host memory, as the store sums it (from a device: a staging view,
        valid until the next gradient)."""
        if self.device_params is None:
            return grad.detach().to(self.config.grad_dtype)
        self._queue_end_of_backward()  # to settle the device cache even if nothing unpacked
        return self.device_params.gradient_on_host(grad, self.config.grad_dtype)

    def _gradient_ready(self, param: nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        entry = self._by_param[id(param)]
        namespace = self.config.namespace
        grad = self._gradient_for_store(grad)
        self.settle_steps((entry,))  # a step still reading the stored gradient
        self._settle_delayed(entry)
        if self.ranks is not None:
            self._add_to_node_gradient(entry, grad)
            self._fresh_grads.discard(entry.grad_name)
        elif entry.grad_name in self._fresh_grads:
            try:
                self.client.put(entry.grad_name, grad, namespace=namespace)
            except TierFullError:
                if not self.settle_daemon_work():  # as a unit's lease does (`_Unit.acquire`)
                    raise
                self.client.put(entry.grad_name, grad, namespace=namespace)
            self._fresh_grads.discard(entry.grad_name)
            self._record_grad_stats(entry, grad)
        else:
            self.settle_guess(entry)  # its shared lease would refuse the exclusive one
            with self.client.get(entry.grad_name, namespace=namespace, exclusive=True) as stored:
                stored.add_(grad)
                self._record_grad_stats(entry, stored)  # the sum, while the lease holds it
        param.grad = None  # the gradient lives in the store now, not in this process
        entry.micro_batches += 1
        for listener in self.gradient_listeners:
            listener(self, entry)
        for unit in entry.units:
            if unit.in_backward:
                unit.grads_left -= 1
                if unit.grads_left <= 0 and unit.depth == 0:
                    unit.release()

    def _add_to_node_gradient(self, entry: _Param, grad: torch.Tensor) -> None:
        """Add a gradient into the node's sum in shared memory (the node's other ranks add
        theirs into the same tensor, which the leader cleared at `zero_grad`). The exclusive
        lease makes the additions take turns; one refused because another rank holds the lease
        is asked again until the request timeout."""
        deadline = time.monotonic() + self.client.config.daemon.request_timeout_s
        pause_s = 0.0002
        while True:
            try:
                lease = self.client.get(entry.grad_name, namespace=self.config.namespace,
                                        exclusive=True)
            except LeaseError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(pause_s)  # the other rank's addition takes about as long as ours
                pause_s = min(pause_s * 2, 0.01)
                continue
            with lease as stored:
                stored.add_(grad)
            return

    def _write_zero_gradients(self) -> None:
        """Put zeros as every trainable parameter's stored gradient (the node's leader, at
        `zero_grad`: the node's ranks add into them), in batches as `offload` uploads."""
        batch_limit = self.batch_limit_bytes
        dtype = self.config.grad_dtype
        batch: dict[str, torch.Tensor] = {}
        batch_bytes = 0
        for entry in self.params:
            if not entry.param.requires_grad:
                continue
            zeros = torch.zeros(entry.placeholder.shape, dtype=dtype)
            nbytes = zeros.numel() * zeros.element_size()
            if nbytes > batch_limit:
                self.client.write_from(entry.grad_name, zeros, namespace=self.config.namespace)
                continue
            if batch and (batch_bytes + nbytes > batch_limit or len(batch) >= 64):
                self.client.put_many(batch, namespace=self.config.namespace)
                batch, batch_bytes = {}, 0
            batch[entry.grad_name] = zeros
            batch_bytes += nbytes
        if batch:
            self.client.put_many(batch, namespace=self.config.namespace)

    # --- steps running in the daemon ------------------------------------------------------

    def step_sent(self, entries: list[_Param], pending: Any) -> None:
        """The optimizer sent a step over `entries` (a PendingAdamStep): whatever uses them
        next waits for it first."""
        for entry in entries:
            if entry.step is None:
                self._steps_pending += 1
            entry.step = pending
        if self.device_params is not None:
            self.device_params.hold_back([entry.read_name for entry in entries])

    def settle_steps(self, entries: Iterable[_Param] | None = None) -> None:
        """Wait for the optimizer steps still updating `entries` (all: None); raise the first
        error one of them met (once: the step is forgotten either way)."""
        if not self._steps_pending:
            return
        for entry in self.params if entries is None else entries:
            pending = entry.step
            if pending is None:
                continue
            try:
                pending.result()
            finally:
                done = [other for other in self.params if other.step is pending]
                for other in done:
                    other.step = None
                self._steps_pending -= len(done)
                if self.device_params is not None:
                    self.device_params.let_go([other.read_name for other in done])

    def settle_daemon_work(self) -> bool:
        """Wait for every guess and step the optimizer has running in the daemon over this
        module's parameters (the delayed update's too); False if there were none."""
        waited = bool(self._steps_pending)
        self.settle_steps()
        for entry in self.params:
            if entry.guess is not None:
                waited = True
                self.settle_guess(entry)
        for wait in self.daemon_work_waiters:
            waited = wait() or waited
        return waited

    def _settle_delayed(self, entry: _Param) -> None:
        """Wait until the delayed update's step over `entry` is done: until then the daemon may
        not have leased the stored gradient yet, and a new one put now would be stepped in its
        place. Its error is left for `synchronize()` / the next `step()` to raise."""
        pending, entry.delayed = entry.delayed, None
        _wait_quietly(pending)

    def settle_guess(self, entry: _Param) -> None:
        """Wait for the optimizer's speculative step over `entry`'s stored gradient (its
        outcome does not matter here: a wrong or failed guess is computed again by the step)."""
        guess, entry.guess = entry.guess, None
        _wait_quietly(guess)

    def read_from(self, names: dict[str, str]) -> None:
        """Compute with other stored copies of some parameters from their next use on (stored
        name -> copy's name; the optimizer's delayed update alternates two copies)."""
        for entry in self.params:
            entry.read_name = names.get(entry.name, entry.read_name)
        for unit in self.units:
            unit.names = [name for entry in unit.entries for name in entry.lease_names]

    def _record_grad_stats(self, entry: _Param, grad: torch.Tensor) -> None:
        """Keep the statistics of the gradient the next step applies to `entry` (replacing
        those of an earlier micro-batch: `grad` is the stored sum then)."""
        self._grad_stats[entry.grad_name] = measure_gradient(grad)

    # --- what the optimizer and the user call ------------------------------------------------

    def zero_grad(self) -> None:
        """The next gradients replace the stored ones instead of adding to them. For a rank of
        a job (`offload`'s process_group) a collective of the node's ranks: its leader clears
        the node's stored gradients once all of them got here, and they go on once it has."""
        if self.device_params is not None:
            # Called between a step and the next forward: what had gradients was stepped (on
            # a node, any of them may have been: another rank's gradient counts too).
            self.device_params.stepped([entry.name for entry in self.params
                                        if entry.grad_name not in self._fresh_grads
                                        or self.ranks is not None])
        if self.ranks is not None and not self.config.inference:
            self.ranks.node_barrier()  # every rank of the node is done with the gradients
            if self.ranks.is_leader:
                self._write_zero_gradients()
            self.ranks.node_barrier()
        self._fresh_grads = {entry.grad_name for entry in self.params}
        self._grad_stats.clear()
        for entry in self.params:
            entry.micro_batches = 0

    def grad_stats(self, param: nn.Parameter) -> GradStats | None:
        """The statistics the gradient hook recorded of `param`'s stored gradient since the
        last `zero_grad`; None where it recorded none (no gradient, or one written into the
        store by something other than this module's backward)."""
        return self._grad_stats.get(self._entry(param).grad_name)

    def has_gradient(self, param: nn.Parameter) -> bool:
        """Whether a gradient of `param` reached the store since the last `zero_grad`."""
        return self._entry(param).grad_name not in self._fresh_grads

    def entry_of(self, param: nn.Parameter) -> _Param:
        """The stored names of `param` (InvalidRequestError if it is not this module's)."""
        return self._entry(param)

    def gradient(self, param: nn.Parameter) -> torch.Tensor:
        """A copy of a parameter's accumulated gradient, read from the store."""
        entry = self._entry(param)
        self.settle_steps((entry,))
        with self.client.get(entry.grad_name, namespace=self.config.namespace) as stored:
            return stored.clone()

    def parameter(self, param: nn.Parameter) -> torch.Tensor:
        """A copy of a parameter's value as stored (the copy the module computes with)."""
        entry = self._entry(param)
        self.settle_steps((entry,))
        with self.client.get(entry.read_name, namespace=self.config.namespace) as stored:
            return stored.clone()

    def stored_names(self) -> Iterator[tuple[str, nn.Parameter]]:
        for entry in self.params:
            yield entry.name, entry.param

    def _entry(self, param: nn.Parameter) -> _Param:
        entry = self._by_param.get(id(param))
        if entry is None:
            raise InvalidRequestError(
                "this parameter is not one of the offloaded module's; pass a parameter of the "
                "module given to offload()")
        return entry


def _wait_quietly(pending: Any) -> None:
    """Wait for a PendingAdamStep (None: nothing to wait for) whose error someone else raises."""
    if pending is not None:
        try:
            pending.result()
        except InfinityError:
            pass


def _placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of the parameter's shape and dtype whose storage holds no bytes (as FSDP2 frees
    an unsharded parameter): autograd checks each gradient against the parameter's current
    shape, and any use of the parameter outside its unit's forward fails loudly instead of
    reading stale or zero values."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    tensor.untyped_storage().resize_(0)
    return tensor


def state_of_parameter(param: nn.Parameter) -> OffloadState | None:
    """The offload state whose module holds `param`, or None (for the optimizer)."""
    for state in list(_STATES.values()):
        if id(param) in state._by_param:
            return state
    return None


def offload_state(module: nn.Module) -> OffloadState:
    """The state `offload` attached to a module."""
    state = _STATES.get(module)
    if state is None:
        raise InvalidRequestError("this module was not offloaded; call infinity.torch.offload "
                                  "on it first")
    return state


def offload(model: nn.Module, client: Any, *, namespace: str,
            param_dtype: torch.dtype | None = None, grad_dtype: torch.dtype = torch.float32,
            prefix: str = "", mark_steps: bool = True, device: torch.device | str | None = None,
            device_budget_bytes: int | None = None,
            copier: DeviceCopier | None = None, from_store: bool = False,
            inference: bool = False, process_group: Any = None,
            quantized: Mapping[str, QuantizedWeight] | None = None) -> nn.Module:
    """Move `model`'s parameters into the store under `namespace` and hook it (in place).

    Returns the same module. Parameters are stored as `param_dtype` (default: their own) and
    the module computes in that dtype; gradients are summed in the store as `grad_dtype`.

    `from_store=True` takes the parameters' values from the store instead (an imported model,
    or a trainer restarting on the namespace it trained in): nothing is uploaded, every
    parameter must be stored under its name with its shape, and the module computes in the
    stored dtype (`param_dtype`, if given, must be it). The model may then be built without
    values, its parameters on the meta device (`infinity.torch.empty_parameters()`).

    `inference=True`: the module only computes forwards (generation, with or without
    `torch.no_grad`): its parameters are frozen (`requires_grad=False`), no gradient hooks are
    set, and every root forward is a step of the daemon's trace (one per generated token), so
    the daemon prefetches the next layers' weights across tokens. Without it, only forwards
    that record for backward are steps.

    The module computes on `device` (default: where its parameters are). On the CPU it uses
    the store's shared memory directly; on a CUDA device its parameters are copied into at most
    `device_budget_bytes` of device memory (default: all of them, at most half the device's
    free memory) as they are needed. `copier` chooses how copies are made (a
    `infinity.client.device.CpuCopier` makes the CPU such a copying device).

    `process_group` (`torch.distributed.group.WORLD`, under torchrun) makes this process one
    rank of a job whose ranks on a node share its daemon's one copy of the state
    (`infinity.torch.distributed`): every rank calls `offload` (a collective), the node's
    lowest rank uploads the values (global rank 0's, on every node) and the others attach to
    them (their model may be built with `empty_parameters()`). Gradients are summed in the
    node's shared memory, `zero_grad()` is a collective of the node's ranks, and the
    optimizer (`infinity.torch.AdamW`) sums them across nodes and steps each node's part.

    `quantized` (with `from_store=True, inference=True`): stored name -> the quantized copy of
    that parameter in the same namespace (`infinity.torch.model_store.require_quantized`); each
    such parameter computes with its copy, dequantized before its unit's forward (see the
    module's docstring), the others with their full-precision values.
    """
    config = OffloadConfig(namespace=namespace, param_dtype=param_dtype, grad_dtype=grad_dtype,
                           prefix=prefix, mark_steps=mark_steps, inference=inference)
    if model in _STATES:
        raise InvalidRequestError("this module is offloaded already; offload it once")
    ranks = node_ranks(client, process_group) if process_group is not None else None
    uploads = not from_store and (ranks is None or ranks.is_leader)
    if ranks is not None and not ranks.is_leader:
        ranks.node_barrier()  # the node's leader has uploaded the values (or found them)
    stored_dtypes = dtypes_in_store(model, client, config) if not uploads else {}
    if uploads and any(param.is_meta for param in model.parameters()):
        raise InvalidRequestError(
            "the module's parameters are on the meta device (no values) and from_store is not "
            "set; pass from_store=True to take their values from the store, or build the model "
            "with values")
    computes_on = compute_device(model, device, copier)
    if copier is None and computes_on.type != "cpu":
        copier = device_copier(computes_on)
    if copier is None and device_budget_bytes is not None:
        raise InvalidRequestError(
            "device_budget_bytes bounds device memory, and this module computes on the CPU's "
            "shared memory; leave it out, or offload to a CUDA device")
    stored_dtype = {id(param): stored_dtypes[name] for name, param in model.named_parameters()
                    if name in stored_dtypes}

    def dtype_of(param: nn.Parameter) -> torch.dtype:  # what it computes in, as entries below
        return stored_dtype.get(id(param)) or param_dtype or param.dtype

    copies = quantized_copies(model, client, config, quantized or {}, dtype_of,
                               from_store=from_store)

    def leased_bytes(param: nn.Parameter) -> int:  # what a unit leases for it
        copy = copies.get(id(param))
        return copy.nbytes if copy is not None else param.numel() * dtype_of(param).itemsize

    budget_bytes = (device_budget(model, leased_bytes, computes_on, device_budget_bytes)
                    if copier is not None else 0)
    state = OffloadState(model, client, config)
    state.ranks = ranks
    # Uploaded in batches of at most an eighth of the daemon's CPU tier (a batch's reservations
    # are held together, so one larger than the tier could never be placed); a parameter too
    # large for that goes alone, streamed through the tier in pieces.
    tier_bytes = int(client.stats()["tiers"]["cpu"]["budget_bytes"])
    batch_limit = max(1, tier_bytes // 8)
    state.batch_limit_bytes = batch_limit
    upload: dict[str, torch.Tensor] = {}
    upload_bytes = 0
    for name, param in model.named_parameters():  # tied parameters come once, first name
        dtype = dtype_of(param)
        entry = _Param(param=param, name=prefix + name, grad_name=prefix + name + ".grad",
                       placeholder=_placeholder(param.shape, dtype, computes_on),
                       quantized=copies.get(id(param)))
        state.params.append(entry)
        state._by_param[id(param)] = entry
        if not uploads:
            continue
        value = param.detach().to(device="cpu", dtype=dtype).contiguous()
        if ranks is not None and ranks.num_nodes > 1:
            ranks.send_from_owner(value, 0)  # every node starts from global rank 0's values
        nbytes = value.numel() * value.element_size()
        if nbytes > batch_limit:
            client.write_from(entry.name, value, namespace=namespace)
            continue
        if upload and (upload_bytes + nbytes > batch_limit or len(upload) >= 64):
            client.put_many(upload, namespace=namespace)
            upload.clear()
            upload_bytes = 0
        upload[entry.name] = value
        upload_bytes += nbytes
    if upload:
        client.put_many(upload, namespace=namespace)
    if ranks is not None and ranks.is_leader:
        ranks.node_barrier()  # the values are in: the node's other ranks may attach
    if copier is not None:
        state.device_params = DeviceParams(client, namespace=namespace, copier=copier,
                                           budget_bytes=budget_bytes,
                                           names=[name for entry in state.params
                                                  for name in entry.lease_names])
        state.device_type = computes_on.type
    if not uploads:
        give_values_to_meta_parameters(model, state)
    for entry in state.params:
        if inference:
            entry.param.requires_grad_(False)
        elif entry.param.requires_grad:
            # Once autograd has summed every use of the parameter: its gradient is final.
            entry.param.register_post_accumulate_grad_hook(state._gradient_ready)
        entry.param.data = entry.placeholder
    for module_name, module in model.named_modules():
        entries = [state._by_param[id(p)] for p in module.parameters(recurse=False)]
        if not entries:
            continue
        unit = _Unit(state, module, module_name, entries)
        state.units.append(unit)
        for entry in entries:
            entry.units.append(unit)
        if (inference and computes_on.type == "cpu" and type(module).forward is nn.Linear.forward
                and module._parameters.get("weight") is not None):
            weight = state._by_param[id(module._parameters["weight"])]
            if weight.quantized is not None:
                compute_from_codes(unit, weight)
        module.register_forward_pre_hook(
            lambda m, a, unit=unit: state._pre_forward(unit, a))
        module.register_forward_hook(
            lambda m, a, o, unit=unit: state._post_forward(unit), always_call=True)
    if inference and copier is None and computes_on.type == "cpu":
        for unit in state.units:
            read_embedding_by_rows(unit)
        lease_in_runs(
            model, [unit for unit in state.units if unit.by_rows is None],
            lease=lambda names: client.get_many(names, namespace=namespace),
            settle=lambda units: state.settle_steps([e for unit in units for e in unit.entries]),
            release_unit=_Unit.release,
            size_of=lambda unit: sum(leased_bytes(entry.param) for entry in unit.entries),
            max_run_bytes=max(1, tier_bytes // 16))
    # `model.zero_grad()` (what transformers.Trainer calls) must reset the stored gradients as
    # `optimizer.zero_grad()` does: the module's own method, then the store's.
    plain_zero_grad = model.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        plain_zero_grad(set_to_none)
        state.zero_grad()

    model.zero_grad = zero_grad  # type: ignore[method-assign]
    model.register_forward_pre_hook(state._root_pre_forward, prepend=True)
    model.register_forward_hook(state._root_post_forward, always_call=True)
    state.zero_grad()
    _STATES[model] = state
    return model
