"""Checkpoints: `save_checkpoint` / `load_checkpoint` write and read the whole training state as
safetensors files and one JSON file; the round trip is bit-exact, a resumed run has the losses of
one that did not stop, transformers loads the weights, a kill during a save leaves the previous
checkpoint whole, and a folder that does not fit is a typed error.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import pytest
import torch

import infinity.torch as itorch
from infinity.errors import CheckpointError
from conftest import rss_growth_during
from restartable_trainer import builder, train, warmup
from test_torch_warm_restart import read_until, start_trainer

quiet = {"report": lambda **_: None}


def stored_tensors(client: Any, namespace: str) -> dict[str, torch.Tensor]:
    """Every tensor of a namespace's training state but gradients and the optimizer's record."""
    values = {}
    for info in client.list(namespace=namespace):
        if info.name.endswith(".grad") or "@" in info.name:
            continue
        with client.get(info.name, namespace=namespace) as value:
            values[info.name] = value.clone()
    return values


def attached(client: Any, namespace: str, model: str, *, dtype: torch.dtype | None = None,
             delay_update: bool = False) -> tuple[Any, Any, Any]:
    """A freshly built model offloaded to `namespace`, its optimizer and scheduler."""
    module = itorch.offload(builder(model)(), client, namespace=namespace, param_dtype=dtype)
    optimizer = itorch.AdamW(module.parameters(), lr=3e-3, weight_decay=0.1,
                             delay_update=delay_update)
    return module, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)


def reattached(client: Any, namespace: str, model: str) -> tuple[Any, Any, Any]:
    """A model built empty and attached to the training state in `namespace`, as a restarted
    trainer attaches."""
    with itorch.empty_parameters():
        module = builder(model)()
    itorch.offload(module, client, namespace=namespace, from_store=True)
    optimizer = itorch.AdamW(module.parameters(), lr=3e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    optimizer.resume(scheduler)
    return module, optimizer, scheduler


@pytest.mark.parametrize("model,dtype", [("gpt2", torch.float32), ("llama", torch.bfloat16)])
def test_a_round_trip_into_a_fresh_namespace_is_bit_exact(client: Any, tmp_path: Any, model: str,
                                                          dtype: torch.dtype) -> None:
    folder = str(tmp_path / "checkpoint")
    train(client, "saved", model, 3, dtype=dtype, save_at={3: folder}, **quiet)
    module, optimizer, scheduler = attached(client, "loaded", model, dtype=dtype)
    assert itorch.load_checkpoint(folder, module, optimizer, scheduler) == 3
    saved, loaded = stored_tensors(client, "saved"), stored_tensors(client, "loaded")
    assert saved.keys() == loaded.keys()
    assert any(name.endswith(".exp_avg_sq") for name in saved)
    assert (dtype == torch.float32) != any(name.endswith(".master") for name in saved)
    for name, value in saved.items():
        assert value.dtype == loaded[name].dtype and torch.equal(value, loaded[name]), name
    assert {float(s["step"]) for s in optimizer.state.values()} == {3.0}
    assert scheduler.last_epoch == 3
    assert optimizer.param_groups[0]["lr"] == pytest.approx(3e-3 * warmup(3), rel=0, abs=0)


@pytest.mark.parametrize("delay_update", [False, True], ids=["plain", "delay_update"])
def test_a_run_resumed_from_a_checkpoint_has_the_losses_of_one_that_did_not_stop(
        client: Any, tmp_path: Any, delay_update: bool) -> None:
    folder = str(tmp_path / "checkpoint")
    expected = train(client, "plain", "gpt2", 8, delay_update=delay_update, **quiet)
    saving = train(client, "saving", "gpt2", 8, delay_update=delay_update, save_at={4: folder},
                   **quiet)
    assert saving == expected  # a save changes nothing of the run
    resumed = train(client, "resumed", "gpt2", 8, delay_update=delay_update, load_from=folder,
                    **quiet)
    assert resumed == expected[4:]


@pytest.mark.parametrize("model,shard_bytes", [("gpt2", 5 * 10**9), ("llama", 20_000)],
                         ids=["gpt2", "llama-sharded"])
def test_transformers_loads_the_saved_weights(client: Any, tmp_path: Any, model: str,
                                              shard_bytes: int) -> None:
    from transformers import AutoModelForCausalLM

    folder = str(tmp_path / "checkpoint")
    train(client, "trained", model, 2, **quiet)
    module, optimizer, scheduler = reattached(client, "trained", model)
    itorch.save_checkpoint(folder, module, optimizer, scheduler, max_shard_bytes=shard_bytes)
    sharded = os.path.exists(os.path.join(folder, "model.safetensors.index.json"))
    assert sharded == (shard_bytes < 10**9)
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    state = itorch.offload_state(module)
    stored = dict(state.stored_names())
    loaded_parameters = dict(loaded.named_parameters())
    assert loaded_parameters.keys() == stored.keys()
    for name, param in stored.items():
        assert torch.equal(loaded_parameters[name].detach(), state.parameter(param)), name
    if model == "llama":
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_whole(daemon_factory: Any,
                                                                   tmp_path: Any) -> None:
    daemon = daemon_factory(**{"cpu.budget_bytes": 256 << 20})
    folder = str(tmp_path / "checkpoint")
    trainer = start_trainer(daemon, "run", "gpt2-wide", 4, "--save-at", f"2:{folder}",
                            "--save-at", f"4:{folder}")
    read_until(trainer, "saving")  # the first save
    read_until(trainer, "saving")  # the second: kill it as soon as its folder appears
    partial = os.path.join(str(tmp_path), f".checkpoint.partial-{trainer.pid}")
    while not os.path.exists(partial):
        assert trainer.poll() is None, "the trainer ended before its second save began"
        time.sleep(0.001)
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    assert os.path.exists(partial), "the save was over before the kill: the test proves nothing"
    with open(os.path.join(folder, "infinity_checkpoint.json")) as state_file:
        assert json.load(state_file)["optimizer"]["calls"] == 2

    client = daemon.connect("checker")
    reference = train(client, "reference", "gpt2-wide", 2, **quiet)
    module, optimizer, scheduler = attached(client, "loaded", "gpt2-wide")
    assert itorch.load_checkpoint(folder, module, optimizer, scheduler) == 2
    expected, got = stored_tensors(client, "reference"), stored_tensors(client, "loaded")
    assert expected.keys() == got.keys() and reference
    for name, value in expected.items():
        assert torch.equal(value, got[name]), name
    itorch.save_checkpoint(folder, module, optimizer, scheduler)  # takes the leftovers away
    assert sorted(os.listdir(str(tmp_path))) == ["checkpoint"]
    client.close()


def test_loading_a_folder_that_is_not_a_checkpoint_is_a_typed_error(client: Any,
                                                                    tmp_path: Any) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"not really")
    module, optimizer, scheduler = attached(client, "ns", "gpt2")
    with pytest.raises(CheckpointError, match="is not a checkpoint: it has no"):
        itorch.load_checkpoint(str(tmp_path), module, optimizer, scheduler)


@pytest.mark.parametrize("other,problem", [
    ("llama", "GPT2LMHeadModel that does not fit this LlamaForCausalLM .it lacks model.embed"),
    ("gpt2-wide", "other shapes: transformer.wte.weight .saved .101, 32., the model's .2053, 256.")])
def test_a_checkpoint_of_another_model_is_a_typed_error_and_the_store_is_untouched(
        client: Any, tmp_path: Any, other: str, problem: str) -> None:
    folder = str(tmp_path / "gpt2")
    train(client, "gpt2", "gpt2", 1, save_at={1: folder}, **quiet)
    module, optimizer, scheduler = attached(client, "other", other)
    before = stored_tensors(client, "other")
    with pytest.raises(CheckpointError, match=problem):
        itorch.load_checkpoint(folder, module, optimizer, scheduler)
    after = stored_tensors(client, "other")
    assert all(torch.equal(value, after[name]) for name, value in before.items())


def test_saving_over_a_folder_that_is_not_a_checkpoint_is_a_typed_error(client: Any,
                                                                        tmp_path: Any) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    module, optimizer, scheduler = attached(client, "ns", "gpt2")
    with pytest.raises(CheckpointError, match="exists and is not a checkpoint"):
        itorch.save_checkpoint(str(tmp_path), module, optimizer, scheduler)
    assert os.listdir(str(tmp_path)) == ["notes.txt"]



def linear_stack(namespace: str, client: Any) -> tuple[Any, Any]:
    """16 offloaded 365 x 365 linear layers (8.5 MB of parameters) and their optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(365, 365) for _ in range(16)])
    model = itorch.offload(model, client, namespace=namespace)
    return model, itorch.AdamW(model.parameters(), lr=1e-3)


def test_a_state_four_times_the_cpu_tier_round_trips_holding_one_tensor_at_a_time(
        nvme_daemon: Any, tmp_path: Any) -> None:
    """A state of 25 MB (parameters and both moments) lives mostly on NVMe behind an 8 MiB CPU
    tier; saving and loading it grow this process's resident memory (mapped file pages
    included) by far less than the state, sampled every 5 ms."""
    client = nvme_daemon.connect("large")
    folder = str(tmp_path / "checkpoint")
    model, optimizer = linear_stack("saved", client)
    model(torch.randn(4, 365)).pow(2).mean().backward()
    optimizer.step()
    state_bytes = sum(p.numel() for p in model.parameters()) * 4 * 3
    assert state_bytes >= 3 * nvme_daemon.config.cpu.budget_bytes
    fresh, fresh_optimizer = linear_stack("loaded", client)

    def save_and_load() -> None:
        itorch.save_checkpoint(folder, model, optimizer, progress=True)
        assert itorch.load_checkpoint(folder, fresh, fresh_optimizer, progress=True) == 1

    growth = rss_growth_during(os.getpid(), save_and_load, interval_s=0.005)
    assert growth <= state_bytes // 4, (growth, state_bytes)
    saved, loaded = stored_tensors(client, "saved"), stored_tensors(client, "loaded")
    assert saved.keys() == loaded.keys()
    for name, value in saved.items():
        assert torch.equal(value, loaded[name]), name
    client.close()
