"""Gradient statistics recorded as gradients arrive: clipping by global norm without reading the
gradients back, and `torch.amp.GradScaler` (fp16 dynamic loss scaling) with an unmodified loop.

Clipping: `offload`'s gradient hook measures each gradient as it is stored (the stored sum after
accumulation), and `optimizer.clip_grad_norm_` adds these figures up, so its norm must be torch's
`clip_grad_norm_` of the same gradients held in memory, and the daemon must serve no read of a
gradient for it.

Loss scaling: the reference is plain PyTorch doing by hand what the offload does for an fp16
model: an fp16 copy of the model computes forward and backward (so both sides compute on the same
fp16 values with the same kernels), its gradients become the `.grad` of fp32 master parameters
stepped by `torch.optim.AdamW` under the same `GradScaler`, and the masters are rounded back into
the fp16 model after each step (what the daemon's kernel writes in the same pass). That is the
fp16 scheme with fp32 master weights (as apex O2 and DeepSpeed fp16 run it), so both sides meet the
same overflows, skip the same steps and follow the same scale. The two may differ where the
kernel's correctly rounded square root (tests/test_native_adam.py) moves an fp32 master by a unit
in the last place across an fp16 rounding boundary, which moves a weight by one fp16 unit (2^-11
relative); the losses, computed in fp32 from fp16 logits, are compared within 1e-4 relative.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import infinity.torch as itorch
from tiny_models import gpt2

FP16_RTOL = 1e-4


def micro_batches(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(23)
    return [torch.randint(0, 100, (2, 13), generator=generator) for _ in range(count)]


def backward_both(reference: nn.Module, model: nn.Module, accumulation: int) -> None:
    for micro, ids in enumerate(micro_batches(accumulation)):
        for module in (reference, model):
            torch.manual_seed(micro)  # the same dropout masks
            (module(input_ids=ids, labels=ids).loss / accumulation).backward()


@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_clipping_norm_is_torchs_norm_of_the_same_gradients(client: Any,
                                                                 accumulation: int) -> None:
    reference = gpt2()
    model = itorch.offload(gpt2(), client, namespace="norm")
    optimizer = itorch.AdamW(model.parameters())
    backward_both(reference, model, accumulation)
    in_double = sum(float(p.grad.double().pow(2).sum()) for p in reference.parameters()) ** 0.5
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    got = optimizer.clip_grad_norm_(0.05)
    assert got.dtype == expected.dtype == torch.float32
    assert float(got) == pytest.approx(in_double, rel=2.0 ** -24)  # float32 rounding, no more
    assert float(got) == pytest.approx(float(expected), rel=1e-6)
    assert float(got) > 0.05  # so the clipping applies


def daemon_reads(client: Any) -> tuple[int, int]:
    counters = client.stats()["counters"]
    return counters["ops"].get("get", 0), counters["bytes_leased"]


def test_clipping_reads_no_gradient_back_from_the_store(client: Any) -> None:
    model = itorch.offload(gpt2(), client, namespace="noread")
    optimizer = itorch.AdamW(model.parameters())
    backward_both(gpt2(), model, 2)
    before = daemon_reads(client)
    optimizer.clip_grad_norm_(1.0)
    assert daemon_reads(client) == before


def test_a_gradient_without_recorded_figures_is_read_back(client: Any) -> None:
    """The fallback, and the proof that the test above can see a read: figures dropped (as for
    a gradient stored by something else) are replaced by reading the stored gradient."""
    model = itorch.offload(gpt2(), client, namespace="fallback")
    optimizer = itorch.AdamW(model.parameters())
    backward_both(gpt2(), model, 1)
    recorded = float(optimizer.clip_grad_norm_(1.0))
    itorch.offload_state(model)._grad_stats.clear()
    before = daemon_reads(client)
    assert float(optimizer.clip_grad_norm_(1.0)) == pytest.approx(recorded, rel=1e-12)
    gets, leased = daemon_reads(client)
    assert gets > before[0] and leased > before[1]


def test_after_the_scalers_unscale_the_clipping_norm_is_that_of_the_unscaled_gradients(
        client: Any) -> None:
    reference = gpt2()
    model = itorch.offload(gpt2(), client, namespace="unscaled")
    optimizer = itorch.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # a power of 2: scaling is exact
    ids = micro_batches(1)[0]
    torch.manual_seed(0)
    reference(input_ids=ids, labels=ids).loss.backward()
    torch.manual_seed(0)
    scaler.scale(model(input_ids=ids, labels=ids).loss).backward()
    scaler.unscale_(optimizer)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    assert float(optimizer.clip_grad_norm_(0.05)) == pytest.approx(float(expected), rel=1e-6)


# --- fp16 with torch.amp.GradScaler -------------------------------------------------------------


class Fp16Reference:
    """Plain PyTorch's fp16 training with fp32 master weights: an fp16 model computes, AdamW
    steps fp32 masters under the scaler, the masters rounded to fp16 go back into the model."""

    def __init__(self, lr: float) -> None:
        self.model = gpt2().half()
        self.masters = [p.detach().float().clone().requires_grad_()
                        for p in self.model.parameters()]
        self.optimizer = torch.optim.AdamW(self.masters, lr=lr, weight_decay=0.1, foreach=False)

    def backward(self, scaled_loss: torch.Tensor) -> None:
        scaled_loss.backward()
        for master, param in zip(self.masters, self.model.parameters()):
            master.grad = None if param.grad is None else param.grad.float()
            param.grad = None

    def after_step(self) -> None:
        with torch.no_grad():
            for master, param in zip(self.masters, self.model.parameters()):
                param.copy_(master)


def fp16_training(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, *,
                  clip: float | None, backward: Any, after_step: Any,
                  clip_params: Any = None) -> tuple[list[float], list[float]]:
    """The user's loop, unchanged between the two sides: losses and the scale at each step."""
    # Started high, so the first steps overflow in fp16 and are skipped until the scale fits.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    losses, scales = [], []
    data = micro_batches(2)
    for step in range(steps):
        ids = data[step % 2]
        torch.manual_seed(100 + step)
        loss = model(input_ids=ids, labels=ids).loss
        backward(scaler.scale(loss))
        if clip is not None:
            scaler.unscale_(optimizer)
            if isinstance(optimizer, itorch.AdamW):
                optimizer.clip_grad_norm_(clip)
            else:
                torch.nn.utils.clip_grad_norm_(clip_params, clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        after_step()
        losses.append(float(loss.detach()))
        scales.append(scaler.get_scale())
    return losses, scales


@pytest.mark.parametrize("clip", [None, 0.5], ids=["plain", "unscale-and-clip"])
def test_fp16_training_with_torchs_grad_scaler_follows_plain_pytorchs(client: Any,
                                                                      clip: float | None) -> None:
    reference = Fp16Reference(lr=3e-3)
    expected, expected_scales = fp16_training(
        reference.model, reference.optimizer, 20, clip=clip, backward=reference.backward,
        after_step=reference.after_step, clip_params=reference.masters)
    model = itorch.offload(gpt2(), client, namespace="fp16", param_dtype=torch.float16)
    optimizer = itorch.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    got, scales = fp16_training(model, optimizer, 20, clip=clip,
                                backward=lambda loss: loss.backward(), after_step=lambda: None)
    assert scales == expected_scales
    assert scales[0] < 2.0 ** 24, "no step overflowed: the skip path was not exercised"
    for step, (mine, theirs) in enumerate(zip(got, expected)):
        assert mine == pytest.approx(theirs, rel=FP16_RTOL), f"step {step}: {mine} != {theirs}"
    assert got[-1] < got[2], "the loss did not go down: nothing was trained"


def stored_state(client: Any, model: nn.Module, namespace: str) -> dict[str, torch.Tensor]:
    names = [name + suffix for name, _ in itorch.offload_state(model).stored_names()
             for suffix in ("", ".master", ".exp_avg", ".exp_avg_sq")]
    values = {}
    for name in names:
        with client.get(name, namespace=namespace) as stored:
            values[name] = stored.clone()
    return values


def test_an_overflow_skips_the_whole_step_and_backs_the_scale_off(client: Any) -> None:
    model = itorch.offload(gpt2(), client, namespace="overflow", param_dtype=torch.float16)
    optimizer = itorch.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    ids = micro_batches(1)[0]
    scaler.scale(model(input_ids=ids, labels=ids).loss).backward()
    scaler.step(optimizer)  # a finite step first, so there are moments to keep
    scaler.update()
    optimizer.zero_grad()
    optimizer.synchronize()  # the finite step may still run in the daemon
    before = stored_state(client, model, "overflow")
    steps_before = [float(s["step"]) for s in optimizer.state_dict()["state"].values()]
    items_stepped = client.stats()["optimizer"]["items_stepped"]

    loss = model(input_ids=ids, labels=ids).loss * float("inf")
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()

    assert scaler.get_scale() == 128.0
    after = stored_state(client, model, "overflow")
    for name, value in before.items():
        assert torch.equal(after[name], value), f"{name} changed in a skipped step"
    assert [float(s["step"]) for s in optimizer.state_dict()["state"].values()] == steps_before
    optimizer.synchronize()  # the skipped step's record (the loop's step count) is written
    assert client.stats()["optimizer"]["items_stepped"] == items_stepped


def test_a_finite_step_after_an_overflow_updates_again(client: Any) -> None:
    model = itorch.offload(gpt2(), client, namespace="recover", param_dtype=torch.float16)
    optimizer = itorch.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    ids = micro_batches(1)[0]
    scaler.scale(model(input_ids=ids, labels=ids).loss * float("inf")).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    before = stored_state(client, model, "recover")
    scaler.scale(model(input_ids=ids, labels=ids).loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.synchronize()
    after = stored_state(client, model, "recover")
    assert scaler.get_scale() == 128.0  # backed off once, not grown (growth_interval 2000)
    assert not torch.equal(after["transformer.h.0.mlp.c_fc.weight.master"],
                           before["transformer.h.0.mlp.c_fc.weight.master"])
    assert all(float(s["step"]) == 1.0 for s in optimizer.state_dict()["state"].values())
