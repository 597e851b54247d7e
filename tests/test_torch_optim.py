"""`infinity.torch.AdamW` / `Adam`: training with the optimizer state in the store and the step in
infinityd gives the losses of plain PyTorch with torch.optim.AdamW / Adam on the same seed.

The daemon's kernel computes a correctly rounded square root where torch's CPU sqrt is not
(tests/test_native_adam.py), so parameters may differ from torch's by a unit in the last place
after a step; over 20 steps that keeps the losses within 1e-5 relative, the bound the tests use.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import pytest
import torch
from torch import nn

import infinity.torch as itorch
from conftest import rss_growth_during
from tiny_models import gpt2, llama
from infinity.errors import InvalidRequestError

RTOL = 1e-5


def batches(count: int) -> list[torch.Tensor]:
    """Two batches in turn: a model that learns lowers their loss within a few steps."""
    generator = torch.Generator().manual_seed(17)
    pair = [torch.randint(0, 100, (2, 15), generator=generator) for _ in range(2)]
    return [pair[i % 2] for i in range(count)]


def warmup_cosine(optimizer: torch.optim.Optimizer, steps: int) -> Any:
    def factor(step: int) -> float:
        if step < 3:
            return (step + 1) / 3
        return 0.5 * (1 + math.cos(math.pi * (step - 3) / max(1, steps - 3)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train(model: nn.Module, optimizer: Any, *, steps: int, accumulation: int = 1,
          clip: float | None = None, scheduler: Any = None) -> list[float]:
    losses = []
    data = batches(steps * accumulation)
    for step in range(steps):
        total = 0.0
        for micro in range(accumulation):
            ids = data[step * accumulation + micro]
            torch.manual_seed(1000 + step * accumulation + micro)  # the same dropout masks
            loss = model(input_ids=ids, labels=ids).loss / accumulation
            loss.backward()
            total += float(loss.detach())
        if clip is not None:
            if isinstance(optimizer, itorch.AdamW | itorch.Adam):
                optimizer.clip_grad_norm_(clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(total)
    return losses


def compare(client: Any, build: Callable[[], nn.Module], *, steps: int = 20, adam: bool = False,
            **options: Any) -> None:
    torch_class = torch.optim.Adam if adam else torch.optim.AdamW
    ours_class = itorch.Adam if adam else itorch.AdamW
    decay = 0.1
    reference = build()
    reference_opt = torch_class(reference.parameters(), lr=3e-3, weight_decay=decay,
                                foreach=False)
    model = itorch.offload(build(), client, namespace="train")
    optimizer = ours_class(model.parameters(), lr=3e-3, weight_decay=decay)
    schedule = options.pop("schedule", False)
    expected = train(reference, reference_opt, steps=steps,
                     scheduler=warmup_cosine(reference_opt, steps) if schedule else None,
                     **options)
    got = train(model, optimizer, steps=steps,
                scheduler=warmup_cosine(optimizer, steps) if schedule else None, **options)
    for step, (mine, theirs) in enumerate(zip(got, expected)):
        assert mine == pytest.approx(theirs, rel=RTOL), f"step {step}: {mine} != {theirs}"
    assert got[-1] < got[0], "the loss did not go down: nothing was trained"


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
def test_twenty_adamw_steps_give_the_losses_of_plain_pytorch(client: Any, build: Any) -> None:
    compare(client, build)


def test_adam_with_l2_decay_gives_the_losses_of_torch_adam(client: Any) -> None:
    compare(client, gpt2, steps=8, adam=True)


def test_gradient_accumulation_clipping_and_a_warmup_cosine_schedule(client: Any) -> None:
    compare(client, gpt2, steps=10, accumulation=2, clip=0.5, schedule=True)


def test_state_dict_carries_the_moments_and_steps_like_torchs(client: Any) -> None:
    reference = gpt2()
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, foreach=False)
    model = itorch.offload(gpt2(), client, namespace="train")
    optimizer = itorch.AdamW(model.parameters(), lr=3e-3)
    train(reference, reference_opt, steps=2)
    train(model, optimizer, steps=2)
    mine, theirs = optimizer.state_dict(), reference_opt.state_dict()
    for group, expected in zip(mine["param_groups"], theirs["param_groups"]):
        for key in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize",
                    "decoupled_weight_decay", "params"):
            assert group[key] == expected[key], key
    assert mine["state"].keys() == theirs["state"].keys()
    for index, state in theirs["state"].items():
        assert float(mine["state"][index]["step"]) == float(state["step"])
        torch.testing.assert_close(mine["state"][index]["exp_avg"], state["exp_avg"],
                                   rtol=1e-4, atol=1e-7)


def test_load_state_dict_resumes_with_the_same_losses(client: Any) -> None:
    model = itorch.offload(gpt2(), client, namespace="a")
    optimizer = itorch.AdamW(model.parameters(), lr=3e-3)
    train(model, optimizer, steps=3)
    saved = copy.deepcopy(optimizer.state_dict())  # torch's holds live references, ours too
    weights = {n: itorch.offload_state(model).parameter(p)
               for n, p in itorch.offload_state(model).stored_names()}
    expected = train(model, optimizer, steps=3)

    resumed = gpt2()
    with torch.no_grad():
        for name, param in resumed.named_parameters():
            param.copy_(weights[name])
    resumed = itorch.offload(resumed, client, namespace="b")
    resumed_opt = itorch.AdamW(resumed.parameters(), lr=3e-3)
    resumed_opt.load_state_dict(saved)
    got = train(resumed, resumed_opt, steps=3)
    assert got == pytest.approx(expected, rel=RTOL)


@pytest.mark.parametrize("option", ["amsgrad", "maximize", "foreach", "fused", "capturable"])
def test_unsupported_options_are_typed_errors(client: Any, option: str) -> None:
    model = itorch.offload(gpt2(), client, namespace="train")
    with pytest.raises(InvalidRequestError, match=option):
        itorch.AdamW(model.parameters(), **{option: True})


def test_a_closure_is_a_typed_error(client: Any) -> None:
    model = itorch.offload(gpt2(), client, namespace="train")
    optimizer = itorch.AdamW(model.parameters())
    with pytest.raises(InvalidRequestError, match="closure"):
        optimizer.step(lambda: 0.0)


def test_parameters_that_were_not_offloaded_are_a_typed_error(client: Any) -> None:
    with pytest.raises(InvalidRequestError, match="not in the store"):
        itorch.AdamW(nn.Linear(3, 3).parameters())


def test_a_parameter_group_the_store_does_not_know_is_a_typed_error_and_changes_nothing(
        client: Any) -> None:
    model = itorch.offload(gpt2(), client, namespace="groups")
    optimizer = itorch.AdamW(model.parameters(), lr=3e-3)
    with pytest.raises(InvalidRequestError, match="not in the store.*offload"):
        optimizer.add_param_group({"params": nn.Linear(3, 3).parameters(), "lr": 1e-3})
    assert len(optimizer.param_groups) == 1
    losses = train(model, optimizer, steps=3)  # the optimizer steps on as before
    assert losses[-1] < losses[0]


def test_a_parameter_group_of_another_offloaded_module_is_stepped_with_its_own_lr(
        client: Any) -> None:
    model = itorch.offload(gpt2(), client, namespace="main")
    extra = itorch.offload(nn.Linear(4, 4), client, namespace="extra")
    optimizer = itorch.AdamW(model.parameters(), lr=3e-3)
    optimizer.add_param_group({"params": extra.parameters(), "lr": 0.0, "weight_decay": 0.0})
    state = itorch.offload_state(extra)
    before = {name: state.parameter(param) for name, param in state.stored_names()}
    extra(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    for name, param in state.stored_names():  # lr 0: stepped, and unchanged
        assert torch.equal(state.parameter(param), before[name]), name
    assert all(float(optimizer.state[p]["step"]) == 1.0 for p in extra.parameters())


def trainer_losses(model: nn.Module, optimizer: torch.optim.Optimizer, folder: str) -> list[float]:
    from transformers import Trainer, TrainingArguments

    generator = torch.Generator().manual_seed(3)
    data = [{"input_ids": (ids := torch.randint(0, 100, (15,), generator=generator)),
             "labels": ids} for _ in range(10)]
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / 10)
    # max_grad_norm=0: Trainer's clipping reads .grad, which the offloaded model's gradients
    # have left (the optimizer's clip_grad_norm_ is the one that sees them).
    args = TrainingArguments(output_dir=folder, max_steps=5, per_device_train_batch_size=2,
                             max_grad_norm=0, report_to=[], save_strategy="no", logging_steps=1,
                             use_cpu=True, disable_tqdm=True, seed=5)
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      optimizers=(optimizer, schedule))
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_transformers_trainer_runs_with_our_optimizer_and_torchs_losses(client: Any,
                                                                        tmp_path: Any) -> None:
    pytest.importorskip("accelerate")
    reference = gpt2()
    expected = trainer_losses(reference, torch.optim.AdamW(reference.parameters(), lr=3e-3,
                                                           foreach=False), str(tmp_path / "a"))
    model = itorch.offload(gpt2(), client, namespace="trainer")
    got = trainer_losses(model, itorch.AdamW(model.parameters(), lr=3e-3), str(tmp_path / "b"))
    assert len(got) == 5
    assert got == pytest.approx(expected, rel=RTOL)


def test_the_daemons_memory_stays_within_its_cpu_tier_with_state_four_times_larger(
        nvme_daemon: Any) -> None:
    """Training state (parameters, gradients, both moments) 4x the daemon's CPU tier lives on NVMe:
    the daemon's resident memory (its own plus the tier's shared segments it maps) grows by at
    most the tier's budget plus a fixed allowance, sampled every 10 ms while training."""
    budget = nvme_daemon.config.cpu.budget_bytes  # 8 MiB (PREFETCH_SETTINGS)
    torch.manual_seed(0)
    width, depth = 365, 16  # 16 x (365 x 365 + 365) parameters: 34 MB of state in fp32
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    state_bytes = sum(p.numel() for p in model.parameters()) * 4 * 4
    assert state_bytes >= 4 * budget
    client = nvme_daemon.connect("bounded")
    try:
        model = itorch.offload(model, client, namespace="bounded")
        optimizer = itorch.AdamW(model.parameters(), lr=1e-3)

        def train() -> None:
            for _ in range(3):
                model(torch.randn(4, width)).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()

        growth = rss_growth_during(nvme_daemon.process.pid, train, interval_s=0.01)
        allowance = 48 << 20  # the daemon's own buffers: staging, index, Python objects
        assert growth <= budget + allowance, (growth, budget)
        assert client.stats()["counters"]["tiers"]["reload_bytes"] > state_bytes  # it streamed
    finally:
        client.close()


def test_bfloat16_parameters_train_from_float32_master_copies(client: Any) -> None:
    """The optimizer keeps an fp32 master copy of a bf16 parameter and writes the parameter as
    the master rounded to bf16 in the same pass."""
    model = itorch.offload(gpt2(), client, namespace="bf16", param_dtype=torch.bfloat16)
    optimizer = itorch.AdamW(model.parameters(), lr=3e-3)
    state = itorch.offload_state(model)
    losses = train(model, optimizer, steps=6)
    assert losses[-1] < losses[0]
    optimizer.synchronize()  # the last step may still run in the daemon
    for name, param in state.stored_names():
        with client.get(name + ".master", namespace="bf16") as master:
            assert master.dtype == torch.float32
            assert torch.equal(state.parameter(param), master.to(torch.bfloat16)), name


def trainer_peak_rss(daemon: Any, *, width: int, depth: int, batch: int) -> dict[str, int]:
    """Train a stack of `depth` linear layers in a fresh process (so no allocator history is
    shared between runs) and return what it measured: its resident memory's peak during three
    steps after a warm-up step, and its parameter count.

    glibc's malloc raises its mmap threshold to the size of each large block freed, so where
    later blocks land (and whether freeing them gives memory back) depends on the order of
    frees; that moved the peak of two identical runs by 10 MB here. A fixed threshold
    (MALLOC_MMAP_THRESHOLD_) makes the peak what the trainer holds (identical runs then agree
    within 1 MB)."""
    import json
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "offloaded_trainer_rss.py")
    done = subprocess.run(
        [sys.executable, script, os.path.join(daemon.root, "settings.toml"), daemon.runtime_dir,
         str(width), str(depth), str(batch), "3"],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 << 10)})
    assert done.returncode == 0, done.stderr[-3000:]
    measured: dict[str, int] = json.loads(done.stdout.splitlines()[-1])
    return measured


def test_the_trainers_memory_does_not_grow_with_the_model(daemon_factory: Any) -> None:
    """Two stacks of 1024-wide linear layers, 4 and 16 deep (4x the parameters; the larger's
    training state 5.6x the CPU tier, on NVMe): the trainers' resident peaks differ by less than
    the largest layer plus the activations. The allowance: the layer twice (its parameters in
    use and its gradient before it leaves for the store) and what autograd saves of the larger
    model (each layer's input and its ReLU's output). A trainer that held the model would differ
    by the 12 extra layers' 50 MB."""
    from conftest import PREFETCH_SETTINGS

    tier_bytes = 48 << 20  # room for one layer's whole state (4 x 4 MB) several times over
    daemon = daemon_factory(nvme_tier=True, **{**PREFETCH_SETTINGS, "cpu.budget_bytes": tier_bytes,
                                               "cpu.segment_bytes": 8 << 20})
    width, batch = 1024, 8
    small = trainer_peak_rss(daemon, width=width, depth=4, batch=batch)
    large = trainer_peak_rss(daemon, width=width, depth=16, batch=batch)
    assert large["parameters"] >= 4 * small["parameters"]
    assert large["parameters"] * 4 * 4 >= 4 * tier_bytes  # parameter, gradient, both moments
    layer_bytes = (width * width + width) * 4
    activation_bytes = 2 * 16 * batch * width * 4
    allowance = 2 * layer_bytes + activation_bytes
    difference = abs(large["peak_rss_bytes"] - small["peak_rss_bytes"])
    assert difference < allowance, (small, large, allowance)


BF16_ROUNDING = 2.0 ** -9  # bfloat16 keeps 8 significant bits: relative rounding error <= 2^-9


class Bfloat16Reference(torch.optim.Optimizer):
    """Plain PyTorch's bf16 training with fp32 master weights, by hand: the model computes on
    its parameters rounded to bf16, torch.optim.AdamW steps fp32 masters with the bf16
    gradients, and the masters rounded to bf16 go back into the model (what the daemon's kernel
    writes in the same pass)."""

    def __init__(self, model: nn.Module, lr: float, weight_decay: float) -> None:
        params = list(model.parameters())
        self.masters = [p.detach().clone() for p in params]
        for param in params:
            param.data = param.data.to(torch.bfloat16)
        self.inner = torch.optim.AdamW(self.masters, lr=lr, weight_decay=weight_decay,
                                       foreach=False)
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        params = self.param_groups[0]["params"]
        for master, param in zip(self.masters, params):
            master.grad = None if param.grad is None else param.grad.float()
        self.inner.step()
        for master, param in zip(self.masters, params):
            param.copy_(master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.inner.zero_grad(set_to_none)


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
def test_twenty_bfloat16_steps_stay_within_bfloat16_rounding_of_plain_pytorch(
        client: Any, build: Any) -> None:
    """bf16 parameters with fp32 master weights against two plain PyTorch runs, same seed.

    The bound, from bf16 rounding: bf16 keeps 8 significant bits, so a weight and every value
    the bf16 forward computes is the fp32 one times (1 + d) with |d| <= u = 2^-9. The fp32
    master weights keep the updates in fp32 (a step smaller than a bf16 unit is not lost), so
    the bf16 run's weights follow the fp32 run's, each within its rounding, and its loss, a mean
    of log-probabilities over 30 tokens, differs by the rounding of what it is computed from:
    its relative difference stays within u at every step (the independent roundings average
    out rather than add up). Measured here: at most 4.1e-4 (a fifth of u) against plain fp32
    torch.optim.AdamW, over both models.

    The second reference computes exactly as the offloaded model does (bf16 parameters, fp32
    masters stepped by torch.optim.AdamW, rounded back), so its first loss is the same number,
    and it stays within the same bound: the runs part only where the kernel's correctly rounded
    square root (tests/test_native_adam.py) moves a master by a unit in the last place across a
    bf16 rounding boundary (measured: Llama's 20 losses all equal, GPT-2's within 3.1e-4)."""
    decay = 0.1
    plain = build()
    expected = train(plain, torch.optim.AdamW(plain.parameters(), lr=3e-3, weight_decay=decay,
                                              foreach=False), steps=20)
    rounded = build()
    same_scheme = train(rounded, Bfloat16Reference(rounded, lr=3e-3, weight_decay=decay),
                        steps=20)
    model = itorch.offload(build(), client, namespace="bf16", param_dtype=torch.bfloat16)
    got = train(model, itorch.AdamW(model.parameters(), lr=3e-3, weight_decay=decay), steps=20)
    assert got[0] == same_scheme[0]
    for step, (mine, theirs, same) in enumerate(zip(got, expected, same_scheme)):
        assert mine == pytest.approx(theirs, rel=BF16_ROUNDING), f"step {step} vs fp32"
        assert mine == pytest.approx(same, rel=BF16_ROUNDING), f"step {step} vs bf16 torch"
    assert got[-1] < got[0] - 0.5, "the loss did not go down: nothing was trained"


def test_a_daemon_that_dies_during_a_step_is_a_typed_error_for_the_trainer(
        daemon: Any) -> None:
    import signal
    import threading

    from infinity.errors import DaemonUnavailableError

    client = daemon.connect("dies")
    try:
        model = itorch.offload(gpt2(), client, namespace="dies")
        optimizer = itorch.AdamW(model.parameters(), lr=1e-3)
        model(input_ids=torch.ones(1, 5, dtype=torch.long),
              labels=torch.ones(1, 5, dtype=torch.long)).loss.backward()
        # Stopped first, so the step cannot finish before the kill: it is sent to a daemon that
        # never answers, or finds it gone; either way the trainer gets the typed error.
        daemon.process.send_signal(signal.SIGSTOP)
        outcome: list[BaseException | None] = []

        def step() -> None:
            try:
                optimizer.step()
                optimizer.synchronize()  # step() may return before the daemon answers
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - the test inspects it
                outcome.append(exc)

        stepping = threading.Thread(target=step)
        stepping.start()
        daemon.process.kill()
        daemon.process.wait(30)
        stepping.join(60)
        assert not stepping.is_alive(), "the step still waits for a daemon that is gone"
        assert isinstance(outcome[0], DaemonUnavailableError), outcome
    finally:
        client.close()
