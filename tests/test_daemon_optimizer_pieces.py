"""A parameter whose optimizer step does not fit the daemon's step window is stepped in pieces.

Its item (parameter, gradient, both moments, the master copy) is several windows and more than
the whole CPU tier here: the daemon steps it by element ranges through staging slices, writes
the results to fresh NVMe extents and publishes them at the end. Each test checks the stored
result bit for bit against the kernel run whole in this process (the whole-item step's values),
and against torch.optim.AdamW: moments bit for bit, parameters within the few units of float32
rounding by which torch's sqrt differs from IEEE's (see tests/test_native_adam.py). Others check
the daemon's memory while it steps, and what a kill -9 in the middle of such a step leaves.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conftest import rss_growth_during, wait_until
from infinity.errors import TierFullError
from test_daemon_nvme import Store, store  # noqa: F401  (store: the fixture, one per test)
from test_daemon_optimizer import GROUP, item, reference_step

MiB = 1 << 20
# A 32 MiB tier: an 8 MiB step window. One fp32 tensor of 3,000,017 elements is 12 MB, so an
# item is 48 MB: six windows, one and a half tiers.
TIER = {"cpu.budget_bytes": 32 * MiB, "cpu.segment_bytes": 4 * MiB}
NUMEL = 3_000_017


def write(client: Any, name: str, tensor: torch.Tensor) -> None:
    client.write_from(name, tensor)


def read(client: Any, name: str, like: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(like)
    client.read_into(name, out)
    return out


class Parameter:
    """A parameter's state in the store, mirrored by torch's AdamW and by the kernel run whole."""

    def __init__(self, client: Any, name: str, numel: int, *, low: torch.dtype | None = None,
                 seed: int = 0) -> None:
        self.client, self.name, self.low = client, name, low
        self.generator = torch.Generator().manual_seed(seed)
        start = torch.randn(numel, generator=self.generator)
        self.torch_param = start.clone().requires_grad_(True)
        self.torch = torch.optim.AdamW([self.torch_param], lr=GROUP.lr,
                                       betas=(GROUP.beta1, GROUP.beta2), eps=GROUP.eps,
                                       weight_decay=GROUP.weight_decay, foreach=False)
        self.kernel = {"param": start.clone(), "grad": torch.empty(numel),
                       "exp_avg": torch.zeros(numel), "exp_avg_sq": torch.zeros(numel)}
        self.kernel_low = None if low is None else torch.empty(numel, dtype=low)
        if low is None:
            write(client, name, start)
        else:
            write(client, name, start.to(low))
            write(client, f"{name}.master", start)
        write(client, f"{name}.exp_avg", torch.zeros(numel))
        write(client, f"{name}.exp_avg_sq", torch.zeros(numel))
        self.steps = 0

    def new_gradient(self) -> None:
        """A fresh gradient in the store (as a trainer's backward leaves it), not yet stepped."""
        grad = torch.randn(self.kernel["grad"].numel(), generator=self.generator)
        if self.low is not None:
            grad = grad.to(self.low)
        write(self.client, f"{self.name}.grad", grad)
        self.kernel["grad"] = grad.float() if self.low is not None else grad
        self.torch_param.grad = grad.float()

    def item(self) -> Any:
        return item(self.name, step=self.steps + 1, master=self.low is not None)

    def stepped(self) -> None:
        """The daemon applied the step: step the mirrors the same way."""
        self.steps += 1
        self.torch.step()
        reference_step(self.kernel, self.steps, self.kernel_low)

    def check(self) -> None:
        kernel, name = self.kernel, self.name
        state = self.torch.state[self.torch_param]
        stored_avg = read(self.client, f"{name}.exp_avg", kernel["exp_avg"])
        stored_sq = read(self.client, f"{name}.exp_avg_sq", kernel["exp_avg_sq"])
        fp32 = read(self.client, name if self.low is None else f"{name}.master", kernel["param"])
        assert torch.equal(stored_avg, kernel["exp_avg"]) and torch.equal(stored_avg,
                                                                          state["exp_avg"])
        assert torch.equal(stored_sq, kernel["exp_avg_sq"]) and torch.equal(stored_sq,
                                                                            state["exp_avg_sq"])
        assert torch.equal(fp32, kernel["param"]), "not the whole-item step's values"
        # torch's sqrt is off by a unit in the last place for some elements: the update (about lr
        # in size) then differs by a few of its units of rounding, lr * 2**-23 each.
        torch.testing.assert_close(fp32, self.torch_param.detach(), rtol=4e-7,
                                   atol=GROUP.lr * 2.0 ** -21)
        if self.kernel_low is not None:
            low = read(self.client, name, self.kernel_low)
            assert torch.equal(low.view(torch.int16), self.kernel_low.view(torch.int16))


def step(client: Any, *params: Parameter) -> None:
    for param in params:
        param.new_gradient()
    client.adam_step([GROUP], [param.item() for param in params])
    for param in params:
        param.stepped()


def test_a_parameter_of_six_windows_steps_in_pieces_to_torchs_adamw_values(
        store: Store) -> None:  # noqa: F811
    daemon = store.start(**TIER)
    with daemon.connect("pieces") as client:
        param = Parameter(client, "wte", NUMEL)
        for _ in range(3):
            step(client, param)
            param.check()
        stats = client.stats()["optimizer"]
        assert stats["items_in_pieces"] == 3
        assert stats["pieces_stepped"] >= 3 * 12  # 1 MiB pieces of every tensor at most
        assert stats["window_bytes"] == 8 * MiB


def test_a_bfloat16_parameter_steps_in_pieces_from_its_float32_master(
        store: Store) -> None:  # noqa: F811
    daemon = store.start(**TIER)
    with daemon.connect("pieces") as client:
        param = Parameter(client, "emb", 2_500_007, low=torch.bfloat16, seed=1)
        small = Parameter(client, "bias", 1_001, seed=2)  # whole, in the same request
        for _ in range(2):
            step(client, param, small)
            param.check()
            small.check()
        assert client.stats()["optimizer"]["items_in_pieces"] == 2


def test_a_step_in_a_tier_held_by_the_clients_leases_says_how_much_it_needs_and_changes_nothing(
        store: Store) -> None:  # noqa: F811
    daemon = store.start(**TIER)
    with daemon.connect("pieces") as client:
        param = Parameter(client, "wte", NUMEL)
        fillers = {f"held{i}": torch.full((MiB - 5,), i, dtype=torch.int32) for i in range(7)}
        client.put_many(fillers)
        with client.get_many(list(fillers)):  # 28 MiB of the 32 leased: no room for staging
            param.new_gradient()
            with pytest.raises(TierFullError, match="3 times the largest parameter"):
                client.adam_step([GROUP], [param.item()])
        client.adam_step([GROUP], [param.item()])  # released: the same step goes through
        param.stepped()
        param.check()  # one step's values: the refused one changed nothing


def test_tensors_each_larger_than_the_cpu_tier_step_in_pieces(store: Store) -> None:  # noqa: F811
    daemon = store.start(**{"cpu.budget_bytes": 16 * MiB, "cpu.segment_bytes": 4 * MiB})
    with daemon.connect("pieces") as client:
        param = Parameter(client, "huge", 5_000_011, seed=3)  # 20 MB a tensor
        step(client, param)
        param.check()


def test_the_daemons_memory_stays_within_its_cpu_tier_while_a_large_item_steps(
        store: Store) -> None:  # noqa: F811
    """The item is 1.5 tiers: loaded whole it could not even fit. Sampled every 10 ms, the
    daemon's resident memory grows by at most the tier's budget plus the allowance of
    tests/test_torch_optim.py's bounded-memory test."""
    daemon = store.start(**TIER)
    with daemon.connect("pieces") as client:
        param = Parameter(client, "wte", NUMEL, seed=4)
        param.new_gradient()
        growth = rss_growth_during(daemon.process.pid,
                                   lambda: client.adam_step([GROUP], [param.item()]),
                                   interval_s=0.01)
        param.stepped()
        param.check()
        allowance = 48 * MiB  # the daemon's own buffers: staging, index, Python objects
        assert growth <= TIER["cpu.budget_bytes"] + allowance, growth


@pytest.mark.parametrize("pieces_done", [1, 6])
def test_a_kill_during_a_large_items_step_leaves_each_tensor_old_or_new_whole(
        store: Store, pieces_done: int) -> None:  # noqa: F811
    """A step acknowledged and flushed is there after the restart; one under way when the
    daemon is killed is not, and no tensor holds a mix of its old and new ranges."""
    settings = {**TIER, "daemon.debug_step_delay_s": 0.05}  # each piece waits: a kill finds it
    daemon = store.start(**settings)
    client = daemon.connect("pieces")
    names = ["wte", "wte.exp_avg", "wte.exp_avg_sq"]
    try:
        param = Parameter(client, "wte", NUMEL, seed=5)
        step(client, param)
        client.flush_store()
        old = {name: read(client, name, param.kernel["param"]) for name in names}
        param.new_gradient()
        client.flush_store()  # the gradient too: it must be the same after the restart
        client.adam_stepper().send_step([GROUP], [("default", [param.item()])])
        wait_until(lambda: client.stats()["optimizer"]["pieces_stepped"]
                   >= param.steps * 12 + pieces_done, timeout_s=60,
                   what="the daemon to be in the middle of the large item's step")
        daemon.process.kill()
        daemon.process.wait()
    finally:
        client.close()
    param.stepped()  # what the step would have made
    new = {"wte": param.kernel["param"], "wte.exp_avg": param.kernel["exp_avg"],
           "wte.exp_avg_sq": param.kernel["exp_avg_sq"]}
    daemon = store.start(**TIER)
    with daemon.connect("checker") as client:
        for name in names:
            value = read(client, name, old[name])
            assert torch.equal(value, old[name]) or torch.equal(value, new[name]), (
                f"{name} is neither its old nor its new value: torn")
            assert torch.equal(value, old[name]), f"{name}: the unflushed step survived"
        # The store serves on from the old state: the step taken again gives the new one.
        client.adam_step([GROUP], [item("wte", step=param.steps)])
        for name in names:
            assert torch.equal(read(client, name, new[name]), new[name]), name
