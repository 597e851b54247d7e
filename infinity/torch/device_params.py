"""The device side of `offload`: parameters that compute on a device other than the CPU's views.

When the module computes on a GPU, a unit's parameters come through a `DeviceCache` (one per
offloaded module tree, within a device-memory budget): each get leases the parameter's CPU-tier
view, whose copy into device memory runs on the copier's side stream from the pinned shared
segments, and the compute stream waits for it on an event. The cache keeps a copy for as long as
its budget allows and its revision is current, so a unit called again (in backward, in the next
micro-batch) finds it in device memory, while a parameter the daemon's optimizer step rewrote
(an exclusive lease, a new revision) is copied again. The daemon's step trace drives the cache's
prefetch, limited to the parameters' names: gradients, read under exclusive leases when
micro-batches add up, are never prefetched. `zero_grad` (between a step and the next forward)
drops the copies of what had gradients, so that the cache prefetches their new values instead of
finding the old copies at the gets and copying on demand. At the end of backward the cache gives
back its CPU-tier leases (a prefetch not yet used, the sources of copies under way), since the
daemon's step must lease the parameters exclusively.

Gradients come back through one host staging buffer (pinned on CUDA, so the copy from the device
is DMA) as large as the largest gradient: the gradient hook gets a view of it and writes it into
the store (a put, or summed in place) before the next gradient needs the buffer.

A parameter that computes with a quantized copy (`offload`'s `quantized=`) comes through the cache
as its codes and scales, the bytes the budget counts; `offload` dequantizes them there, into
buffers of the compute dtype outside the budget (one per weight present, reused by shape).

With a `CpuCopier` the CPU is a device like any other: every get copies out of shared memory into
memory of the process's own, so this path runs and is tested on machines without a GPU.
"""

from __future__ import annotations

from typing import Any, Callable, Collection

import torch
from torch import nn

from infinity.client.device import CudaCopier, DeviceCache, DeviceCopier, DeviceLease
from infinity.errors import InvalidRequestError

__all__ = ["DeviceParams", "compute_device", "device_budget", "device_copier"]


def device_copier(device: torch.device) -> DeviceCopier:
    """The copier that brings parameters into `device`'s memory (only CUDA is one today)."""
    if device.type == "cuda":
        return CudaCopier(device)
    raise InvalidRequestError(
        f"offload computes on the CPU or on a CUDA device, not on {device}; move the model to "
        f"the CPU or to a CUDA device before offloading it")


def compute_device(model: nn.Module, device: torch.device | str | None,
                   copier: DeviceCopier | None) -> torch.device:
    """Where the module computes: `device`, the copier's, or where its parameters are; each
    parameter must be there or on the CPU (the store takes it from either)."""
    # A parameter on the meta device has no values to place (they come from the store).
    placed = {_indexed(param.device) for param in model.parameters() if not param.is_meta}
    if copier is not None:
        chosen = _indexed(copier.device)
        if device is not None and _indexed(torch.device(device)) != chosen:
            raise InvalidRequestError(
                f"device={device} but the copier copies to {copier.device}; give one of them, "
                f"or a copier for that device")
    elif device is not None:
        chosen = _indexed(torch.device(device))
    else:
        off_cpu = {d for d in placed if d.type != "cpu"}
        chosen = off_cpu.pop() if len(off_cpu) == 1 else torch.device("cpu")
    stray = sorted(str(d) for d in placed if d.type != "cpu" and d != chosen)
    if stray:
        raise InvalidRequestError(
            f"the module's parameters are on {', '.join(stray)} but it would compute on "
            f"{chosen}; move the whole model to one device (or the CPU) before offloading it")
    return chosen


def _indexed(device: torch.device) -> torch.device:
    """"cuda" as the CUDA device it means now ("cuda:0"), so that devices compare."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def device_budget(model: nn.Module, nbytes: Callable[[nn.Parameter], int],
                  device: torch.device, budget_bytes: int | None) -> int:
    """The device cache's budget: as given, else every parameter's bytes, at most half the
    device's free memory; never less than the largest unit (it must be present whole).
    `nbytes` gives the bytes a unit leases for each parameter (in the stored dtype, not the
    model's; a quantized copy's codes and scales where it computes with one)."""
    largest = max((sum(nbytes(p) for p in module.parameters(recurse=False))
                   for module in model.modules()), default=0)
    if budget_bytes is None:
        budget_bytes = sum(nbytes(p) for p in model.parameters())
        if device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(device)
            budget_bytes = min(budget_bytes, free_bytes // 2)
        budget_bytes = max(budget_bytes, largest, 1)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise InvalidRequestError(f"device_budget_bytes is {budget_bytes!r}; give a positive "
                                  f"number of bytes of device memory for the parameters")
    if budget_bytes < largest:
        raise InvalidRequestError(
            f"device_budget_bytes is {budget_bytes}, less than the {largest} bytes of the "
            f"module's largest submodule's own parameters, which must be in device memory "
            f"together; give at least that (a few times more lets prefetch work ahead)")
    return budget_bytes


class _UnitLease:
    """A unit's parameters in device memory, held until `release` (as a store lease is)."""

    __slots__ = ("_leases", "tensors")

    def __init__(self, leases: list[DeviceLease]) -> None:
        self._leases = leases
        self.tensors = [lease.tensor for lease in leases]

    def release(self) -> None:
        leases, self._leases = self._leases, []
        self.tensors = []
        for lease in leases:
            lease.release()


class DeviceParams:
    """One offloaded module tree's parameters in device memory, and its gradients' way back."""

    def __init__(self, client: Any, *, namespace: str, copier: DeviceCopier, budget_bytes: int,
                 names: Collection[str]) -> None:
        self.device = copier.device
        self.cache = DeviceCache(client, budget_bytes=budget_bytes, copier=copier,
                                 namespace=namespace, prefetch_names=names)
        self._names = frozenset(names)
        self._held_back: set[str] = set()  # an optimizer step is writing them in the daemon
        self._staging = torch.empty(0, dtype=torch.uint8)

    def lease(self, names: list[str]) -> _UnitLease:
        """The named parameters in device memory, each held until the lease's `release`."""
        leases: list[DeviceLease] = []
        try:
            for name in names:
                leases.append(self.cache.get(name))
        except BaseException:
            for lease in leases:
                lease.release()
            raise
        return _UnitLease(leases)

    def gradient_on_host(self, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`grad` as `dtype`, in host memory: a view of the staging buffer, valid until the next
        call (the caller writes it into the store before then)."""
        grad = grad.detach().to(dtype)
        nbytes = grad.numel() * grad.element_size()
        if self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8,
                                        pin_memory=self.device.type == "cuda")
        host = self._staging[:nbytes].view(dtype).view(grad.shape)
        host.copy_(grad)  # blocking: the bytes are there when it returns
        return host

    def hold_back(self, names: Collection[str]) -> None:
        """Leave these out of prefetch until `let_go`: the daemon's step leases them exclusively
        (a prefetch's shared lease taken first would make that step fail)."""
        self._held_back.update(names)
        self.cache.set_prefetch_names(self._names - self._held_back)

    def let_go(self, names: Collection[str]) -> None:
        """Their step is done: prefetch may copy them again."""
        self._held_back.difference_update(names)
        self.cache.set_prefetch_names(self._names - self._held_back)

    def stepped(self, names: list[str]) -> None:
        """The optimizer step rewrites these parameters: their device copies are stale."""
        self.cache.discard(names)

    def settle(self) -> None:
        """Give back every CPU-tier lease the cache holds, keeping what is in device memory:
        once backward ends, before the daemon's optimizer step leases the parameters
        exclusively to write them."""
        self.cache.settle()

    def close(self) -> None:
        self.cache.close()
