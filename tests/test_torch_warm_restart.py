"""Warm restart: a trainer killed with SIGKILL and started again on the same namespace goes on from
the daemon's state, without a checkpoint, with the losses of a run that did not stop; and a step
the daemon was applying when its trainer died is applied whole.

The trainers are `restartable_trainer.py` processes (one script, fresh or restarted); the runs
that do not stop run the same training function in this process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import pytest
import torch

import infinity.torch as itorch
from infinity.errors import InvalidRequestError
from infinity.torch.restart import read_record
from conftest import daemon_settings_file, wait_until
from restartable_trainer import builder, train

SCRIPT = os.path.join(os.path.dirname(__file__), "restartable_trainer.py")


def start_trainer(daemon: Any, namespace: str, model: str, steps: int,
                  *options: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, SCRIPT, daemon_settings_file(daemon.root), daemon.runtime_dir,
         namespace, model, str(steps), *options],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def read_until(process: subprocess.Popen[str], key: str) -> list[dict[str, Any]]:
    """The trainer's reports up to the first with `key`."""
    assert process.stdout is not None
    entries: list[dict[str, Any]] = []
    while not entries or key not in entries[-1]:
        line = process.stdout.readline()
        assert line, f"the trainer exited (code {process.wait()}) before reporting {key!r}"
        entries.append(json.loads(line))
    return entries


def run_to_end(process: subprocess.Popen[str]) -> list[dict[str, Any]]:
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 0, f"the trainer failed with code {process.returncode}"
    return [json.loads(line) for line in out.splitlines()]


def losses_of(entries: list[dict[str, Any]]) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in entries if "step" in entry}


def kill(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait()


def uninterrupted(client: Any, namespace: str, model: str, steps: int,
                  **options: Any) -> dict[int, float]:
    losses = train(client, namespace, model, steps, report=lambda **_: None, **options)
    return dict(enumerate(losses, 1))


def stored_state(client: Any, namespace: str, model: str) -> dict[str, torch.Tensor]:
    """Every parameter's stored value, master copy and moments."""
    values = {}
    names = {info.name for info in client.list(namespace=namespace)}
    for name, _ in builder(model)().named_parameters():
        for stored in (name, f"{name}.master", f"{name}.exp_avg", f"{name}.exp_avg_sq"):
            if stored in names:
                with client.get(stored, namespace=namespace) as value:
                    values[stored] = value.clone()
    return values


@pytest.mark.parametrize("model,delay_update", [("gpt2", False), ("llama", True)],
                         ids=["gpt2", "llama-delay_update"])
def test_a_trainer_killed_at_step_10_goes_on_from_the_store_with_unchanged_losses(
        daemon: Any, client: Any, model: str, delay_update: bool) -> None:
    options = ["--delay-update"] if delay_update else []
    expected = uninterrupted(client, "reference", model, 13, delay_update=delay_update)
    trainer = start_trainer(daemon, "run", model, 13, "--wait-before", "11", *options)
    before = read_until(trainer, "waiting")  # step 11's gradients are in the store by now
    kill(trainer)
    restarted = run_to_end(start_trainer(daemon, "run", model, 13, *options))
    assert before[0] == {"resumed_at": 0}
    assert losses_of(before) == {step: expected[step] for step in range(1, 11)}
    assert restarted[0] == {"resumed_at": 10}
    assert losses_of(restarted) == {step: expected[step] for step in (11, 12, 13)}


def test_a_trainer_killed_during_the_daemons_step_finds_that_step_applied_whole(
        daemon_factory: Any) -> None:
    # Each parameter's step waits 30 ms after the previous one's: a step of the tiny GPT-2's 28
    # parameters takes most of a second, and the kill lands inside it.
    daemon = daemon_factory(**{"daemon.debug_step_delay_s": 0.03})
    client = daemon.connect("observer")
    uninterrupted(client, "reference", "gpt2", 2, dtype=torch.bfloat16)
    after_two = stored_state(client, "reference", "gpt2")
    uninterrupted(client, "reference", "gpt2", 3, dtype=torch.bfloat16)
    after_three = stored_state(client, "reference", "gpt2")
    items = sum(1 for _ in builder("gpt2")().parameters())

    trainer = start_trainer(daemon, "run", "gpt2", 3, "--dtype", "bfloat16",
                            "--wait-before", "3")
    read_until(trainer, "waiting")
    stepped = client.stats()["optimizer"]["items_stepped"]
    assert trainer.stdin is not None
    trainer.stdin.write("go\n")
    trainer.stdin.flush()
    now = wait_until(lambda: (n := client.stats()["optimizer"]["items_stepped"]) > stepped and n,
                     timeout_s=30, what="the daemon to apply a first parameter of step 3")
    kill(trainer)
    assert now < stepped + items, "the step was over before the kill: the test proves nothing"

    client.wait_for_steps(namespace="run")
    assert client.stats()["optimizer"]["items_stepped"] == stepped + items  # all of it
    got = stored_state(client, "run", "gpt2")
    assert got.keys() == after_three.keys()
    for name, value in got.items():
        assert torch.equal(value, after_three[name]), f"{name} is not at step 3"
    record = read_record(client, namespace="run", prefix="")
    assert record is not None and set(record.steps) == {3}
    client.close()


def test_an_optimizer_over_other_parameters_does_not_resume_from_the_record(client: Any) -> None:
    uninterrupted(client, "ns", "gpt2", 2)
    model = itorch.offload(builder("gpt2")(), client, namespace="ns")
    params = list(model.parameters())
    optimizer = itorch.AdamW(params[:-1], lr=1e-3)  # one parameter fewer
    assert all("step" not in optimizer.state[p] for p in params[:-1])
    with pytest.raises(InvalidRequestError, match="over other parameters"):
        optimizer.resume()


def test_a_fresh_namespace_has_no_resume_point_and_resumes_at_zero(client: Any) -> None:
    assert itorch.resume_point(client, namespace="fresh") is None
    model = itorch.offload(builder("gpt2")(), client, namespace="fresh")
    optimizer = itorch.AdamW(model.parameters(), lr=1e-3)
    assert optimizer.resume() == 0
    assert itorch.resume_point(client, namespace="fresh") is None  # nothing stepped yet
