"""`offload` onto a device: parameters copied from the store into a device-memory budget.

Without a GPU the device is the CPU with a `CpuCopier`: every get copies out of shared memory into
the process's own memory, so the device path (the device cache, the saved-tensor hook on device
tensors, gradients through the staging buffer, copies made again after the daemon's step) runs as
on a GPU, only the copy differs. Training must give the losses of plain PyTorch with
torch.optim.AdamW, within the 1e-5 relative bound of tests/test_torch_optim.py (the daemon's
kernel rounds its square root correctly, torch's does not). The CUDA tests at the end run where a
GPU is, and are skipped otherwise.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from torch import nn

import infinity.torch as itorch
from conftest import RunningDaemon
from infinity.client.device import CpuCopier
from infinity.errors import InvalidRequestError
from test_torch_optim import train
from tiny_models import gpt2, llama

RTOL = 1e-5


def linear_stack(seed: int = 3) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(13, 37), nn.GELU(), nn.Linear(37, 29), nn.LayerNorm(29),
                         nn.Linear(29, 7))


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def device_cache(model: nn.Module) -> Any:
    params = itorch.offload_state(model).device_params
    assert params is not None, "the module was offloaded without a device"
    return params.cache


def train_stack(model: nn.Module, optimizer: Any, *, steps: int,
                device: str = "cpu") -> list[float]:
    generator = torch.Generator().manual_seed(23)
    data = [(torch.randn(6, 13, generator=generator), torch.randn(6, 7, generator=generator))
            for _ in range(2)]
    losses = []
    for step in range(steps):
        x, y = (t.to(device) for t in data[step % 2])
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def assert_same_losses(got: list[float], expected: list[float]) -> None:
    for step, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        assert mine == pytest.approx(theirs, rel=RTOL), f"step {step}: {mine} != {theirs}"
    assert got[-1] < got[0], "the loss did not go down: nothing was trained"


# --- the device path, with the CPU as a device that copies -----------------------------------


def test_present_parameters_are_copies_in_device_memory_not_views_of_shared_memory(
        client: Any) -> None:
    model = itorch.offload(linear_stack(), client, namespace="stack", copier=CpuCopier())
    segments = client.segment_ranges()
    seen: list[int] = []

    def record(module: nn.Module, args: Any) -> None:
        pointer = module.weight.data_ptr()
        assert not any(start <= pointer < end for _, start, end in segments), \
            "the parameter points into the store's shared memory"
        seen.append(pointer)

    model[2].register_forward_pre_hook(record)  # after offload's: the parameter is present
    with torch.no_grad():
        model(torch.randn(3, 13))
    assert len(seen) == 1
    for param in model.parameters():
        assert param.untyped_storage().nbytes() == 0, "a parameter kept its copy between uses"


def test_forward_and_stored_gradients_equal_plain_pytorch_through_device_copies(
        client: Any) -> None:
    reference = linear_stack()
    model = itorch.offload(linear_stack(), client, namespace="stack", copier=CpuCopier())
    x = torch.randn(5, 13)
    expected = reference(x).pow(2).mean()
    expected.backward()
    loss = model(x).pow(2).mean()
    loss.backward()
    assert torch.equal(loss.detach(), expected.detach())
    state = itorch.offload_state(model)
    parameters = dict(reference.named_parameters())
    for name, param in state.stored_names():
        assert torch.equal(state.gradient(param), parameters[name].grad), name
        assert param.grad is None, "a gradient stayed in the process after it left for the store"
    # Backward leased the units again and rebuilt the saved weights from the device copies.
    stats = device_cache(model).stats
    assert stats.misses == len(parameters) and stats.hits > 0, stats


def test_a_bfloat16_model_computes_on_bfloat16_copies_and_its_gradients_are_summed_in_fp32(
        client: Any) -> None:
    reference = linear_stack().to(torch.bfloat16)
    model = itorch.offload(linear_stack(), client, namespace="bf16", copier=CpuCopier(),
                           param_dtype=torch.bfloat16)
    x = torch.randn(5, 13, dtype=torch.bfloat16)
    expected = reference(x).float().pow(2).mean()
    expected.backward()
    loss = model(x).float().pow(2).mean()
    loss.backward()
    assert torch.equal(loss.detach(), expected.detach())
    state = itorch.offload_state(model)
    parameters = dict(reference.named_parameters())
    for name, param in state.stored_names():
        got = state.gradient(param)
        assert got.dtype == torch.float32
        assert torch.equal(got, parameters[name].grad.float()), name


def test_a_linear_stack_trains_with_the_losses_of_plain_pytorch(client: Any) -> None:
    reference = linear_stack()
    expected = train_stack(reference, torch.optim.AdamW(reference.parameters(), lr=3e-3,
                                                        foreach=False), steps=12)
    model = itorch.offload(linear_stack(), client, namespace="stack", copier=CpuCopier())
    got = train_stack(model, itorch.AdamW(model.parameters(), lr=3e-3), steps=12)
    assert_same_losses(got, expected)


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
def test_a_transformers_model_trains_with_the_losses_of_plain_pytorch(
        client: Any, build: Callable[[], nn.Module]) -> None:
    pytest.importorskip("transformers")
    reference = build()
    expected = train(reference, torch.optim.AdamW(reference.parameters(), lr=3e-3,
                                                  weight_decay=0.1, foreach=False), steps=8)
    model = itorch.offload(build(), client, namespace="lm", copier=CpuCopier())
    got = train(model, itorch.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1), steps=8)
    assert_same_losses(got, expected)


def test_the_next_micro_batch_finds_the_parameters_in_device_memory(client: Any) -> None:
    model = itorch.offload(linear_stack(), client, namespace="stack", copier=CpuCopier())
    cache = device_cache(model)
    model(torch.randn(4, 13)).sum().backward()
    misses, hits = cache.stats.misses, cache.stats.hits
    model(torch.randn(4, 13)).sum().backward()  # no step between: the same revisions
    assert cache.stats.misses == misses and cache.stats.hits > hits


def test_zero_grad_drops_the_device_copies_of_what_the_step_rewrote(client: Any) -> None:
    """So that the cache prefetches their new values instead of finding the old copies."""
    model = itorch.offload(linear_stack(), client, namespace="stack", copier=CpuCopier())
    cache = device_cache(model)
    model[4](torch.randn(2, 29)).sum().backward()  # gradients of the last layer only
    assert len(cache.cached()) == 2
    itorch.offload_state(model).zero_grad()
    assert cache.cached() == {}
    with torch.no_grad():
        model(torch.randn(2, 13))
    itorch.offload_state(model).zero_grad()  # no gradient since the last: nothing to drop
    assert len(cache.cached()) == len(list(model.parameters()))


def test_a_parameter_the_daemons_step_rewrote_is_copied_again_not_served_stale(
        client: Any) -> None:
    model = itorch.offload(linear_stack(), client, namespace="stack", copier=CpuCopier())
    optimizer = itorch.AdamW(model.parameters(), lr=1e-2)
    state, cache = itorch.offload_state(model), device_cache(model)
    model(torch.randn(4, 13)).sum().backward()
    optimizer.step()  # no zero_grad (which drops the copies): the new revisions must show
    misses = cache.stats.misses
    present: dict[str, torch.Tensor] = {}

    def record(module: nn.Module, args: Any, name: str) -> None:
        present[name] = module.weight.detach().clone()

    for index in (0, 2, 4):
        model[index].register_forward_pre_hook(
            lambda module, args, name=f"{index}.weight": record(module, args, name))
    with torch.no_grad():
        model(torch.randn(4, 13))
    assert cache.stats.misses == misses + len(list(model.parameters()))
    stored = {name: state.parameter(param) for name, param in state.stored_names()}
    for name, value in present.items():
        assert torch.equal(value, stored[name]), name


def test_micro_batches_replayed_with_prefetch_in_a_small_budget_train_like_pytorch(
        nvme_daemon: RunningDaemon) -> None:
    """An NVMe tier, so the daemon replays the step trace and the cache prefetches from it, in a
    budget of a third of the parameters: gradients summed over two micro-batches (read under
    exclusive leases, so never prefetched) and every step's new values."""
    pytest.importorskip("transformers")
    reference = gpt2()
    expected = train(reference, torch.optim.AdamW(reference.parameters(), lr=3e-3,
                                                  weight_decay=0.1, foreach=False),
                     steps=6, accumulation=2, clip=0.5)
    client = nvme_daemon.connect("trainer")
    try:
        budget = parameter_bytes(gpt2()) // 3
        model = itorch.offload(gpt2(), client, namespace="gpt2", copier=CpuCopier(),
                               device_budget_bytes=budget)
        got = train(model, itorch.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1),
                    steps=6, accumulation=2, clip=0.5)
        assert_same_losses(got, expected)
        stats = device_cache(model).stats
        assert stats.prefetched > 0 and stats.evictions > 0, stats
        assert stats.max_used_bytes <= budget, stats
    finally:
        client.close()


def bias_free_stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(31, 31, bias=False) for _ in range(6)])


def test_replayed_training_in_a_small_budget_leaves_the_daemons_step_no_lease_in_its_way(
        nvme_daemon: RunningDaemon) -> None:
    """One tensor per layer and room for two: backward's last get asks for the next step's
    first layer, leasing its CPU-tier copy. Backward's end gives that lease back; held, it
    would make the daemon's step (an exclusive lease of every parameter) a LeaseError."""
    reference = bias_free_stack()
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    client = nvme_daemon.connect("trainer")
    try:
        model = itorch.offload(bias_free_stack(), client, namespace="stack", copier=CpuCopier(),
                               device_budget_bytes=2 * 31 * 31 * 4)
        optimizer = itorch.AdamW(model.parameters(), lr=1e-2)
        generator = torch.Generator().manual_seed(29)
        got, expected = [], []
        for _ in range(5):  # recorded, then replayed: the cache prefetches
            x = torch.randn(3, 31, generator=generator)
            for net, opt, losses in ((reference, reference_opt, expected),
                                     (model, optimizer, got)):
                loss = net(x).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(float(loss.detach()))
        assert_same_losses(got, expected)
        assert device_cache(model).stats.prefetched > 0
    finally:
        client.close()


def test_gradients_read_in_a_replayed_step_are_never_copied_into_device_memory(
        nvme_daemon: RunningDaemon) -> None:
    """A step of two micro-batches and clipping reads every gradient (summed under exclusive
    leases, then their norm): the trace names them, but the device cache is for parameters."""
    client = nvme_daemon.connect("trainer")
    try:
        model = itorch.offload(bias_free_stack(), client, namespace="stack", copier=CpuCopier(),
                               mark_steps=False)
        optimizer = itorch.AdamW(model.parameters(), lr=1e-3)
        cache = device_cache(model)
        for _ in range(4):  # recorded, then replayed: the cache prefetches
            with client.step(namespace="stack"):
                for _ in range(2):
                    model(torch.randn(2, 31)).pow(2).sum().backward()
                optimizer.clip_grad_norm_(1.0)
            assert set(cache.cached()) <= {f"{i}.weight" for i in range(6)}, cache.cached()
            optimizer.step()
            optimizer.zero_grad()
        assert cache.stats.prefetched > 0
    finally:
        client.close()


def test_replayed_inference_in_a_small_budget_holds_no_lease_between_forwards(
        nvme_daemon: RunningDaemon) -> None:
    """A forward's last get sends the prefetch of what the trace names next (the next
    forward's first layers), which leases their CPU-tier copies: the forward's end gives those
    leases back, since nothing else would before the daemon's optimizer step needs them."""
    # One tensor per layer and room for two: the next forward's first layer fits only once
    # the last one is leased, so the last get is what asks for it.
    reference = bias_free_stack()
    client = nvme_daemon.connect("reader")
    try:
        model = itorch.offload(copy.deepcopy(reference), client, namespace="stack",
                               copier=CpuCopier(), device_budget_bytes=2 * 31 * 31 * 4)
        for _ in range(4):  # recorded, then replayed: the cache prefetches
            x = torch.randn(2, 31)
            with client.step(namespace="stack"), torch.no_grad():
                assert torch.equal(model(x), reference(x))
            assert client.stats()["clients"][0]["leases"] == 0
        assert device_cache(model).stats.prefetched > 0
    finally:
        client.close()


def test_inference_through_device_copies_leaves_no_lease(client: Any) -> None:
    reference = linear_stack()
    model = itorch.offload(linear_stack(), client, namespace="stack", copier=CpuCopier())
    x = torch.randn(6, 13)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert client.stats()["clients"][0]["leases"] == 0


@pytest.mark.parametrize("budget", [0, -5, 1.5, True], ids=["zero", "negative", "float", "bool"])
def test_a_device_budget_that_is_not_a_positive_count_of_bytes_is_a_typed_error(
        client: Any, budget: Any) -> None:
    with pytest.raises(InvalidRequestError, match="device_budget_bytes"):
        itorch.offload(linear_stack(), client, namespace="stack", copier=CpuCopier(),
                       device_budget_bytes=budget)
    assert client.list(namespace="stack") == []


def test_a_device_budget_below_the_largest_submodule_is_a_typed_error(client: Any) -> None:
    largest = (29 * 37 + 29) * 4  # the middle Linear's weight and bias
    with pytest.raises(InvalidRequestError, match=f"less than the {largest} bytes"):
        itorch.offload(linear_stack(), client, namespace="stack", copier=CpuCopier(),
                       device_budget_bytes=largest - 1)
    assert client.list(namespace="stack") == []
    itorch.offload(linear_stack(), client, namespace="stack", copier=CpuCopier(),
                   device_budget_bytes=largest)


def test_a_device_budget_for_a_module_computing_on_shared_memory_is_a_typed_error(
        client: Any) -> None:
    with pytest.raises(InvalidRequestError, match="computes on the CPU"):
        itorch.offload(linear_stack(), client, namespace="stack", device_budget_bytes=1 << 20)


def test_a_device_the_copier_does_not_copy_to_is_a_typed_error(client: Any) -> None:
    with pytest.raises(InvalidRequestError, match="copier copies to cpu"):
        itorch.offload(linear_stack(), client, namespace="stack", copier=CpuCopier(),
                       device="cuda")


def test_a_device_that_is_neither_the_cpu_nor_cuda_is_a_typed_error(client: Any) -> None:
    with pytest.raises(InvalidRequestError, match="not on meta"):
        itorch.offload(linear_stack(), client, namespace="stack", device="meta")
    assert client.list(namespace="stack") == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_a_gpu_is_a_typed_error_before_anything_is_stored(client: Any) -> None:
    with pytest.raises(InvalidRequestError, match="CUDA is not available"):
        itorch.offload(linear_stack(), client, namespace="stack", device="cuda")
    assert client.list(namespace="stack") == []


# --- on a real GPU ---------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
def test_on_cuda_a_linear_stack_trains_with_the_losses_of_plain_pytorch(client: Any) -> None:
    reference = linear_stack().cuda()
    expected = train_stack(reference, torch.optim.AdamW(reference.parameters(), lr=3e-3,
                                                        foreach=False), steps=12, device="cuda")
    model = itorch.offload(linear_stack().cuda(), client, namespace="stack")
    assert itorch.offload_state(model).device_params is not None
    got = train_stack(model, itorch.AdamW(model.parameters(), lr=3e-3), steps=12,
                      device="cuda")
    assert_same_losses(got, expected)


def cuda_train(model: nn.Module, optimizer: Any, *, steps: int) -> list[float]:
    """`train` of test_torch_optim with the batches on the GPU."""
    generator = torch.Generator().manual_seed(17)
    pair = [torch.randint(0, 100, (2, 15), generator=generator).cuda() for _ in range(2)]
    losses = []
    for step in range(steps):
        ids = pair[step % 2]
        torch.manual_seed(1000 + step)  # the same dropout masks
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@needs_cuda
@pytest.mark.parametrize("budget_share", [None, 3], ids=["whole-model", "third-of-model"])
def test_on_cuda_gpt2_trains_with_the_losses_of_plain_pytorch(
        nvme_daemon: RunningDaemon, budget_share: int | None) -> None:
    pytest.importorskip("transformers")
    reference = gpt2().cuda()
    expected = cuda_train(reference, torch.optim.AdamW(reference.parameters(), lr=3e-3,
                                                       weight_decay=0.1, foreach=False), steps=8)
    client = nvme_daemon.connect("trainer")
    try:
        budget = parameter_bytes(reference) // budget_share if budget_share else None
        model = itorch.offload(gpt2().cuda(), client, namespace="gpt2",
                               device_budget_bytes=budget)
        for name, param in model.named_parameters():
            assert param.is_cuda and param.untyped_storage().nbytes() == 0, name
        got = cuda_train(model, itorch.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1),
                         steps=8)
        assert_same_losses(got, expected)
        stats = device_cache(model).stats
        if budget is not None:
            assert stats.max_used_bytes <= budget, stats
        assert device_cache(model).registration_failures == []
    finally:
        client.close()


def test_parameters_whose_step_is_in_flight_are_not_prefetched(daemon: RunningDaemon) -> None:
    """The daemon's step leases a parameter exclusively; a prefetch's shared lease taken first
    would make that step fail. So the device cache leaves a parameter out of prefetch from the
    moment its step is sent until the trainer has waited for it. (The daemon is stopped, so
    the step cannot be done before the check.)"""
    import signal

    client = daemon.connect("held")
    try:
        model = itorch.offload(linear_stack(), client, namespace="held", copier=CpuCopier())
        optimizer = itorch.AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(3, 13)).pow(2).mean().backward()
        names = {name for name, _ in itorch.offload_state(model).stored_names()}
        assert device_cache(model).prefetch_names == names
        daemon.process.send_signal(signal.SIGSTOP)
        try:
            optimizer.step()
            assert not device_cache(model).prefetch_names  # every parameter's step is pending
        finally:
            daemon.process.send_signal(signal.SIGCONT)
        optimizer.synchronize()
        assert device_cache(model).prefetch_names == names
    finally:
        client.close()
