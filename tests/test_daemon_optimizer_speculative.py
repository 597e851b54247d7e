"""A speculative `adam_step`: the daemon computes a step's results ahead, publishes nothing, and
the step that follows installs them only if nothing they came from has changed.

The parameter here is larger than the 32 MiB CPU tier (four 12 MB tensors), so its state is
partly on NVMe, as a trainer's is when a guess pays. Each test checks the stored state bit for
bit against the kernel run in this process and against torch.optim.AdamW (tests/
test_daemon_optimizer_pieces.py's `Parameter`): a guess may change when a step's work is done,
never what it computes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conftest import wait_until
from test_daemon_nvme import Store, store  # noqa: F401  (store: the fixture, one per test)
from test_daemon_optimizer import GROUP
from test_daemon_optimizer_pieces import NUMEL, TIER, Parameter, read
from infinity.errors import InvalidRequestError, ProtocolError
from infinity.protocol import wire


def guess(client: Any, param: Parameter, group: wire.AdamGroup = GROUP) -> None:
    client.adam_stepper().send_guess([group], [param.item()], namespace="default").result()


def stored_state(client: Any, param: Parameter) -> dict[str, torch.Tensor]:
    like = param.kernel["param"]
    return {name: read(client, name, like)
            for name in (param.name, f"{param.name}.exp_avg", f"{param.name}.exp_avg_sq")}


def optimizer_stats(client: Any) -> dict[str, Any]:
    return client.stats()["optimizer"]


def test_a_guess_changes_nothing_stored_until_the_step_installs_it(store: Store) -> None:  # noqa: F811
    daemon = store.start(**TIER)
    with daemon.connect("guesser") as client:
        param = Parameter(client, "wte", NUMEL)
        param.new_gradient()
        before = stored_state(client, param)
        guess(client, param)
        after = stored_state(client, param)
        for name, value in before.items():
            assert torch.equal(after[name], value), f"{name} changed before any step"
        assert optimizer_stats(client)["speculations_held"] == 1


def test_a_step_matching_its_guess_installs_it_bit_for_bit_each_step(store: Store) -> None:  # noqa: F811
    daemon = store.start(**TIER)
    with daemon.connect("guesser") as client:
        param = Parameter(client, "wte", NUMEL, seed=1)
        for _ in range(3):
            param.new_gradient()
            guess(client, param)
            client.adam_step([GROUP], [param.item()])
            param.stepped()
            param.check()
        stats = optimizer_stats(client)
        assert stats["speculated_items"] == 3 and stats["speculations_used"] == 3
        # Only the guesses ran the kernel in pieces: each step installed its guess.
        assert stats["items_in_pieces"] == 3
        assert stats["speculations_held"] == 0


@pytest.mark.parametrize("change", ["replaced", "written_in_place"])
def test_a_guess_over_a_gradient_changed_since_is_freed_and_the_step_computes(
        store: Store, change: str) -> None:  # noqa: F811
    daemon = store.start(**TIER)
    with daemon.connect("guesser") as client:
        param = Parameter(client, "wte", NUMEL, seed=2)
        param.new_gradient()
        guess(client, param)
        if change == "replaced":
            param.new_gradient()  # a new version: a put of the next micro-batch's sum, say
        else:  # the accumulation of a micro-batch: added under an exclusive lease
            with client.get("wte.grad", exclusive=True) as stored:
                stored.mul_(0.5)
            param.kernel["grad"].mul_(0.5)  # torch's .grad is this same tensor (fp32)
            assert param.torch_param.grad is param.kernel["grad"]
        client.adam_step([GROUP], [param.item()])
        param.stepped()
        param.check()
        stats = optimizer_stats(client)
        assert stats["speculations_used"] == 0 and stats["speculations_wasted"] == 1


def test_a_guess_with_another_learning_rate_is_not_installed(store: Store) -> None:  # noqa: F811
    daemon = store.start(**TIER)
    with daemon.connect("guesser") as client:
        param = Parameter(client, "wte", NUMEL, seed=3)
        param.new_gradient()
        other = wire.AdamGroup(GROUP.lr / 2, GROUP.beta1, GROUP.beta2, GROUP.eps,
                               GROUP.weight_decay, GROUP.decoupled, GROUP.grad_scale)
        guess(client, param, other)  # a scheduler changed lr between backward and step
        client.adam_step([GROUP], [param.item()])
        param.stepped()
        param.check()
        assert optimizer_stats(client)["speculations_wasted"] == 1


def test_the_guesses_of_a_client_that_goes_away_are_freed(store: Store) -> None:  # noqa: F811
    daemon = store.start(**TIER)
    with daemon.connect("watcher") as watcher:
        guesser = daemon.connect("guesser")
        try:
            param = Parameter(guesser, "wte", NUMEL, seed=4)
            param.new_gradient()
            guess(guesser, param)
            assert optimizer_stats(watcher)["speculations_held"] == 1
        finally:
            guesser.close()
        wait_until(lambda: optimizer_stats(watcher)["speculations_held"] == 0, timeout_s=30,
                   what="the daemon to free the guesses of the client that left")
        assert optimizer_stats(watcher)["speculations_wasted"] == 1


def test_an_item_all_in_the_cpu_tier_is_not_guessed_and_steps_in_place(store: Store) -> None:  # noqa: F811
    daemon = store.start(**TIER)
    with daemon.connect("guesser") as client:
        param = Parameter(client, "bias", 1_001, seed=5)
        param.new_gradient()
        guess(client, param)
        assert optimizer_stats(client)["speculated_items"] == 0
        client.adam_step([GROUP], [param.item()])
        param.stepped()
        param.check()


def test_a_daemon_without_an_nvme_tier_refuses_a_guess_and_serves_on(client: Any) -> None:
    param = Parameter(client, "w", 3_001, seed=6)
    param.new_gradient()
    with pytest.raises(InvalidRequestError, match="NVMe tier"):
        guess(client, param)
    client.adam_step([GROUP], [param.item()])
    param.stepped()
    param.check()


def test_a_speculative_step_of_several_parts_is_malformed() -> None:
    body = wire.AdamStep("ns", (GROUP,), (param_item(),), step_id=7, part=0, parts=2,
                         speculative=True).body()
    with pytest.raises(ProtocolError, match="speculative"):
        wire.AdamStep.from_body(body)


def param_item() -> wire.AdamItem:
    return wire.AdamItem("w", "w.grad", "", "w.exp_avg", "w.exp_avg_sq", 0, 1)
