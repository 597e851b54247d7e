"""The optimizer guesses its step during backward: as each sub-group's gradients are stored,
`infinity.torch.AdamW` sends a speculative step, the daemon computes it into fresh NVMe extents,
and `step()` installs each guess that matches (the same gradient, hyperparameters and step
number) instead of computing it again.

The model's three 1000x1000 layers are 4 MB each (guessed: at least GUESS_MIN_BYTES; its last
layer is too small to be), its state about 48 MB behind a 32 MiB CPU tier, so it streams from
NVMe as a large model's does. Each test trains the same model twice, guessing and not, and asks for the same
losses and parameters bit for bit: the guesses are a schedule, not a change of arithmetic. Each
also checks that guesses were made and used or missed as the case wants, so none passes by
never guessing.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch
from torch import nn

import infinity.torch as itorch
from conftest import PREFETCH_SETTINGS, RunningDaemon
from infinity.torch.guesses import GUESS_RETRY_STEPS

WIDTH = 1000
GUESSED = 3  # parameters guessed per step: the three square weights
MiB = 1 << 20


@pytest.fixture
def nvme_daemon(daemon_factory: Callable[..., RunningDaemon]) -> RunningDaemon:
    """An NVMe tier behind a 32 MiB CPU tier: an 8 MiB step window, which holds two staging sets
    of a square layer's step."""
    return daemon_factory(nvme_tier=True, **{**PREFETCH_SETTINGS, "cpu.budget_bytes": 32 * MiB,
                                             "cpu.segment_bytes": 8 * MiB})


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU(),
                         nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, 7))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step % 3)
    return (torch.randn(5, WIDTH, generator=generator),
            torch.randint(0, 7, (5,), generator=generator))


def train(daemon: Any, namespace: str, *, speculate: bool, steps: int, accumulation: int = 1,
          clip: float | None = None, scheduler: bool = False
          ) -> tuple[list[float], dict[str, torch.Tensor], dict[str, int], dict[str, Any]]:
    client = daemon.connect(namespace)
    try:
        model = itorch.offload(build(), client, namespace=namespace)
        optimizer = itorch.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05,
                                 speculate=speculate)
        schedule = None
        if scheduler:
            schedule = torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda s: min(1.0, (s + 1) / 3) * 0.5 * (1 + math.cos(s / steps)))
        losses = []
        for step in range(steps):
            for micro in range(accumulation):
                inputs, labels = batch(step * accumulation + micro)
                loss = nn.functional.cross_entropy(model(inputs), labels) / accumulation
                loss.backward()
                losses.append(float(loss.detach()))
            if clip is not None:
                optimizer.clip_grad_norm_(clip)
            optimizer.step()
            optimizer.zero_grad()
            if schedule is not None:
                schedule.step()
        optimizer.synchronize()
        state = itorch.offload_state(model)
        params = {name: state.parameter(param) for name, param in model.named_parameters()}
        return losses, params, dict(optimizer.guess_counts), client.stats()["optimizer"]
    finally:
        client.close()


def same_training(nvme_daemon: Any, **options: Any) -> tuple[dict[str, int], dict[str, Any]]:
    """Train guessing and not; assert the same losses and parameters, bit for bit; return the
    guessing run's counts (the optimizer's and the daemon's)."""
    plain_losses, plain_params, plain_counts, _ = train(nvme_daemon, "plain", speculate=False,
                                                        **options)
    losses, params, counts, stats = train(nvme_daemon, "guessing", speculate=True, **options)
    assert plain_counts["sent"] == 0
    assert losses == plain_losses
    for name, value in plain_params.items():
        assert torch.equal(params[name], value), f"{name} differs with guesses"
    return counts, stats


def test_guessed_steps_train_bit_for_bit_as_steps_computed_after_backward(
        nvme_daemon: Any) -> None:
    counts, stats = same_training(nvme_daemon, steps=6)
    assert counts["sent"] == 6 * GUESSED and counts["matched"] == 6 * GUESSED and counts["missed"] == 0
    # The daemon installed what it prepared (it prepares none for a parameter it finds all in
    # the CPU tier at the time: the step is done in place there).
    assert stats["speculations_wasted"] == 0
    assert stats["speculations_used"] == stats["speculated_items"] >= GUESSED


def test_guesses_follow_a_learning_rate_schedule(nvme_daemon: Any) -> None:
    counts, _ = same_training(nvme_daemon, steps=5, scheduler=True)
    assert counts["matched"] == 5 * GUESSED and counts["missed"] == 0


def test_with_accumulation_the_guess_is_made_after_the_last_micro_batch(
        nvme_daemon: Any) -> None:
    """The first step's guesses come after the first micro-batch and miss; from then on the
    optimizer guesses after the second, and they match."""
    counts, stats = same_training(nvme_daemon, steps=5, accumulation=2)
    assert counts["missed"] == GUESSED
    assert counts["matched"] == 4 * GUESSED
    assert stats["speculations_used"] > 0


def test_a_clipped_step_misses_its_guess_and_guessing_pauses(nvme_daemon: Any) -> None:
    """A norm over the threshold scales the gradients: the guess (made with none) is not
    installed, and the optimizer stops guessing for GUESS_RETRY_STEPS steps."""
    counts, stats = same_training(nvme_daemon, steps=4, clip=1e-4)
    assert counts["sent"] == GUESSED and counts["missed"] == GUESSED and counts["matched"] == 0
    assert stats["speculations_used"] == 0
    assert GUESS_RETRY_STEPS > 3  # so steps 2-4 sent none
