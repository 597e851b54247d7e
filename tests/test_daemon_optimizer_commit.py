"""A trainer's step of several `adam_step` requests is applied all or none, and its record after it.

The daemon holds the parts of a step until all have come: a client that leaves before sending
the last has none of its step applied; once all are there, the step is applied whether or not its
client is still there, and the record it carries is written only after every item of it. A step of
no items is a barrier behind every step received before it in its namespace.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from infinity.errors import NotFoundError
from infinity.protocol import wire
from conftest import wait_until
from test_daemon_optimizer import GROUP, item, read, reference_step, store_state

RECORD = "@optimizer"


def send_part(client: Any, stepper: Any, part: int, parts: int, items: list[wire.AdamItem], *,
              step_id: int = 77) -> None:
    """One request of a step of `parts`, sent and not waited for (as a trainer that dies
    between two parts leaves it)."""
    stepper._channel.send(next(client._request_ids),
                          wire.AdamStep("default", (GROUP,), tuple(items), step_id, part, parts),
                          expect_reply=True, releases=client._take_releases())


def test_a_step_whose_client_left_before_its_last_part_is_not_applied(daemon: Any) -> None:
    owner = daemon.connect("observer")
    state = store_state(owner, "w", 257)
    trainer = daemon.connect("trainer")
    send_part(trainer, trainer.adam_stepper(), 0, 2, [item("w")])
    wait_until(lambda: owner.stats()["optimizer"]["steps_assembling"] == 1, timeout_s=10,
               what="the daemon to hold the first part")
    trainer.close()
    wait_until(lambda: owner.stats()["optimizer"]["steps_assembling"] == 0, timeout_s=10,
               what="the daemon to drop the step of the client that left")
    owner.wait_for_steps(namespace="default")
    assert torch.equal(read(owner, "w"), state["param"])
    assert torch.equal(read(owner, "w.exp_avg"), state["exp_avg"])
    assert owner.stats()["optimizer"]["items_stepped"] == 0
    owner.close()


def test_the_parts_of_a_step_wait_for_each_other_and_then_all_apply(client: Any) -> None:
    first, second = store_state(client, "a", 33, seed=1), store_state(client, "b", 65, seed=2)
    stepper = client.adam_stepper()  # one socket: the daemon reads the parts in order
    send_part(client, stepper, 0, 2, [item("a")], step_id=5)
    wait_until(lambda: client.stats()["optimizer"]["steps_assembling"] == 1, timeout_s=10,
               what="the daemon to hold the first part")
    assert torch.equal(read(client, "a"), first["param"])  # not started alone
    send_part(client, stepper, 1, 2, [item("b")], step_id=5)
    wait_until(lambda: (stats := client.stats()["optimizer"])["items_stepped"] == 2
               and not stats["steps_unsettled"], timeout_s=10, what="both parts to be applied")
    reference_step(first, 1)
    reference_step(second, 1)
    assert torch.equal(read(client, "a"), first["param"])
    assert torch.equal(read(client, "b"), second["param"])


def test_the_record_is_written_after_every_item_of_its_step(client: Any) -> None:
    states = {name: store_state(client, name, 1000 + i, seed=i)
              for i, name in enumerate(["x", "y", "z"])}
    client.put(RECORD, torch.zeros(64, dtype=torch.uint8))
    stepper = client.adam_stepper()
    pending = stepper.send_step([GROUP], [("default", [item("x"), item("y")]),
                                          ("default", [item("z")])],
                                record=("default", RECORD, b"step 1"))
    for answer in pending:
        answer.result()
    assert bytes(read(client, RECORD)[:6].tolist()) == b"step 1"
    for name, state in states.items():
        reference_step(state, 1)
        assert torch.equal(read(client, name), state["param"]), name
    assert client.stats()["optimizer"]["records_written"] == 1


def test_a_record_in_a_tensor_that_is_not_there_is_a_typed_error_and_the_step_applies(
        client: Any) -> None:
    state = store_state(client, "w", 31)
    [pending] = client.adam_stepper().send_step([GROUP], [("default", [item("w")])],
                                                record=("default", "nowhere", b"x"))
    with pytest.raises(NotFoundError):
        pending.result()
    reference_step(state, 1)
    assert torch.equal(read(client, "w"), state["param"])
    assert client.stats()["catalog"]["num_leases"] == 0


def test_waiting_for_steps_waits_for_another_clients_step_in_the_namespace(
        daemon_factory: Any) -> None:
    daemon = daemon_factory(**{"daemon.debug_step_delay_s": 0.05})
    trainer, other = daemon.connect("trainer"), daemon.connect("restarted")
    states = {f"p{i}": store_state(trainer, f"p{i}", 100 + i, seed=i) for i in range(6)}
    trainer.adam_stepper().send([GROUP], [item(name) for name in states])
    # The step went on the stepper's own socket, which nothing orders with `other`'s: wait
    # until the daemon has it (queued, running or done), then ask.

    def step_received() -> bool:
        figures = other.stats()["optimizer"]
        return sum(figures[key] for key in ("requests_queued", "items_running",
                                            "items_stepped", "steps_unsettled")) > 0

    wait_until(step_received, timeout_s=10, what="the daemon to receive the trainer's step")
    other.wait_for_steps(namespace="default")  # about 0.3 s of items behind it
    for name, state in states.items():
        reference_step(state, 1)
        assert torch.equal(read(other, name), state["param"]), name
    trainer.close()
    other.close()
