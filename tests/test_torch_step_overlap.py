"""The optimizer step overlaps the next forward: `step()` sends the step to infinityd and
returns; the next forward waits, unit by unit, for the sub-group holding the parameters it is
about to use. The losses stay those of a step that waited (tests/test_torch_optim.py compares
20 steps with plain PyTorch with the overlap on, as it is by default)."""

from __future__ import annotations

import signal
import threading
from typing import Any

import pytest
import torch

import infinity.torch as itorch
from infinity.errors import NotFoundError
from tiny_models import gpt2

RTOL = 1e-5


def batch_of(step: int) -> torch.Tensor:
    return torch.randint(0, 100, (2, 13), generator=torch.Generator().manual_seed(step % 2))


def loss_of(model: Any, step: int = 0) -> torch.Tensor:
    torch.manual_seed(100 + step)  # the same dropout masks in every run
    batch = batch_of(step)
    return model(input_ids=batch, labels=batch).loss


def run_steps(model: Any, optimizer: Any, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        loss = loss_of(model, step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def plain_losses_on(steps: int) -> list[float]:
    model = gpt2()
    return run_steps(model, torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False), steps)


def test_step_returns_while_the_daemon_is_stopped_and_the_next_forward_sees_its_update(
        daemon: Any) -> None:
    client = daemon.connect("overlap")
    try:
        model = itorch.offload(gpt2(), client, namespace="overlap")
        optimizer = itorch.AdamW(model.parameters(), lr=3e-3)
        first = loss_of(model, 0)
        first.backward()
        daemon.process.send_signal(signal.SIGSTOP)  # nothing can be answered from here on
        try:
            returned = threading.Event()

            def step() -> None:
                optimizer.step()
                returned.set()

            stepping = threading.Thread(target=step, daemon=True)
            stepping.start()
            assert returned.wait(60), "step() waited for a daemon that cannot answer"
        finally:
            daemon.process.send_signal(signal.SIGCONT)
        optimizer.zero_grad()
        second = float(loss_of(model, 1).detach())  # waits for the step, sub-group by sub-group
        expected = plain_losses_on(2)
        assert float(first.detach()) == pytest.approx(expected[0], rel=RTOL)
        assert second == pytest.approx(expected[1], rel=RTOL)
    finally:
        client.close()


def test_an_error_of_a_step_is_raised_where_its_parameters_are_used_next(client: Any) -> None:
    model = itorch.offload(gpt2(), client, namespace="broken")
    optimizer = itorch.AdamW(model.parameters(), lr=3e-3)
    loss_of(model).backward()
    client.delete("transformer.h.1.mlp.c_fc.weight.exp_avg", namespace="broken")
    optimizer.step()  # sent; the daemon finds the moment missing
    optimizer.zero_grad()
    with pytest.raises(NotFoundError, match="c_fc.weight.exp_avg"):
        loss_of(model)
    # Raised once: the other parameters were stepped, and the model still computes.
    assert torch.isfinite(loss_of(model))


def test_synchronize_raises_the_error_of_a_step_sent_before(client: Any) -> None:
    model = itorch.offload(gpt2(), client, namespace="sync")
    optimizer = itorch.AdamW(model.parameters(), lr=3e-3)
    loss_of(model).backward()
    client.delete("transformer.wpe.weight.exp_avg_sq", namespace="sync")
    optimizer.step()
    with pytest.raises(NotFoundError, match="wpe.weight.exp_avg_sq"):
        optimizer.synchronize()
    optimizer.synchronize()  # the error was raised; nothing is left to wait for


def test_without_overlap_the_step_is_applied_when_step_returns(client: Any) -> None:
    model = itorch.offload(gpt2(), client, namespace="wait")
    optimizer = itorch.AdamW(model.parameters(), lr=3e-3, overlap=False)
    loss_of(model).backward()
    optimizer.step()
    # The daemon holds a parameter exclusively while it steps it: a plain get succeeds only
    # once every update is done.
    names = [name for name, _ in itorch.offload_state(model).stored_names()]
    with client.get_many(names + [n + ".exp_avg" for n in names], namespace="wait") as views:
        assert len(views) == 2 * len(names)


def test_the_next_forward_uses_parameters_in_the_order_the_step_sends_them(client: Any) -> None:
    """The forward records the order it first uses the parameters in; the optimizer sends the
    step's sub-groups in that order (so the first unit of the next forward waits the least)."""
    model = itorch.offload(gpt2(), client, namespace="order")
    state = itorch.offload_state(model)
    loss_of(model).backward()
    used = [entry.name for entry in state.forward_order]
    assert used[0] == "transformer.wte.weight" and used[1] == "transformer.wpe.weight"
    assert sorted(used) == sorted(name for name, _ in state.stored_names())


def delayed_reference(steps: int) -> list[float]:
    """ZeRO-Offload's delayed parameter update in plain PyTorch: the forward of step t computes
    with the parameters from before step t - 1 (fp32 masters stepped by torch's AdamW)."""
    used, master = gpt2(), gpt2()
    optimizer = torch.optim.AdamW(master.parameters(), lr=3e-3, foreach=False)
    published: list[torch.Tensor] | None = None
    losses = []
    for step in range(steps):
        loss = loss_of(used, step)
        loss.backward()
        for mine, theirs in zip(used.parameters(), master.parameters()):
            theirs.grad, mine.grad = mine.grad, None
        optimizer.step()
        optimizer.zero_grad()
        if published is not None:  # the step before this one's reaches the forward now
            with torch.no_grad():
                for mine, value in zip(used.parameters(), published):
                    mine.copy_(value)
        published = [p.detach().clone() for p in master.parameters()]
        losses.append(float(loss.detach()))
    return losses


def test_the_delayed_update_gives_the_losses_of_zero_offloads_schedule(client: Any) -> None:
    steps = 8
    model = itorch.offload(gpt2(), client, namespace="delayed")
    losses = run_steps(model, itorch.AdamW(model.parameters(), lr=3e-3, delay_update=True),
                       steps)
    expected = delayed_reference(steps)
    assert losses == pytest.approx(expected, rel=RTOL)
    plain = plain_losses_on(steps)
    assert losses[0] == pytest.approx(plain[0], rel=RTOL)  # both start from the same weights
    assert losses[3:] != pytest.approx(plain[3:], rel=1e-3)  # then the update lags one step


def test_the_delayed_update_steps_each_backwards_own_gradients_while_the_daemon_lags(
        daemon_factory: Any) -> None:
    """Each item of a step waits 10 ms in the daemon (a debug setting) and most wait unleased
    in its queue, so the next backward's gradients are ready before the step has read the
    last ones: each step must still apply
    the gradients of its own backward (the trainer waits for the step over a parameter before
    it replaces that parameter's stored gradient)."""
    # A 2 MiB tier: a 512 KiB step window, so many items of a step wait unleased in its queue.
    daemon = daemon_factory(**{"daemon.debug_step_delay_s": 0.01, "cpu.budget_bytes": 2 << 20,
                               "cpu.segment_bytes": 2 << 20})
    client = daemon.connect("lagging")
    try:
        steps = 4
        model = itorch.offload(gpt2(), client, namespace="lagging")
        losses = run_steps(model, itorch.AdamW(model.parameters(), lr=3e-3, delay_update=True),
                           steps)
    finally:
        client.close()
    assert losses == pytest.approx(delayed_reference(steps), rel=RTOL)


def test_after_synchronize_the_delayed_update_computes_with_the_last_steps_parameters(
        client: Any) -> None:
    model = itorch.offload(gpt2(), client, namespace="published")
    optimizer = itorch.AdamW(model.parameters(), lr=3e-3, delay_update=True)
    state = itorch.offload_state(model)
    for _ in range(3):
        loss_of(model).backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    for name, param in state.stored_names():
        with client.get(name + ".master", namespace="published") as master:
            assert torch.equal(state.parameter(param), master), name


def test_the_delayed_update_needs_the_overlap(client: Any) -> None:
    from infinity.errors import InvalidRequestError

    model = itorch.offload(gpt2(), client, namespace="nodelay")
    with pytest.raises(InvalidRequestError, match="delay_update"):
        itorch.AdamW(model.parameters(), delay_update=True, overlap=False)
