"""The daemon's `adam_step`: Adam / AdamW updates of stored tensors, run next to the data.

Each test stores a parameter's state, asks the daemon for steps, and checks the stored result
against the native kernel run in this process on copies (the plain reference for the kernel
itself is torch, in tests/test_native_adam.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from infinity import _native
from infinity.errors import InvalidRequestError, NotFoundError, ProtocolError
from infinity.protocol.wire import AdamGroup, AdamItem

GROUP = AdamGroup(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True,
                  grad_scale=1.0)


def store_state(client: Any, name: str, numel: int, *, dtype: torch.dtype = torch.float32,
                seed: int = 0, namespace: str = "default") -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    state = {"param": torch.randn(numel, generator=generator),
             "grad": torch.randn(numel, generator=generator),
             "exp_avg": torch.zeros(numel), "exp_avg_sq": torch.zeros(numel)}
    tensors = {f"{name}.grad": state["grad"], f"{name}.exp_avg": state["exp_avg"],
               f"{name}.exp_avg_sq": state["exp_avg_sq"]}
    if dtype == torch.float32:
        tensors[name] = state["param"]
    else:
        tensors[name] = state["param"].to(dtype)
        tensors[f"{name}.master"] = state["param"]
    for key, tensor in tensors.items():
        if tensor.numel() * tensor.element_size() > 1 << 20:
            client.write_from(key, tensor, namespace=namespace)
        else:
            client.put(key, tensor, namespace=namespace)
    return state


def item(name: str, *, step: int = 1, master: bool = False) -> AdamItem:
    return AdamItem(name, f"{name}.grad", f"{name}.master" if master else "", f"{name}.exp_avg",
                    f"{name}.exp_avg_sq", 0, step)


def reference_step(state: dict[str, torch.Tensor], step: int, low: torch.Tensor | None = None
                   ) -> None:
    _native.adam_step(state["param"].data_ptr(), state["grad"].data_ptr(), "float32",
                      state["exp_avg"].data_ptr(), state["exp_avg_sq"].data_ptr(),
                      0 if low is None else low.data_ptr(),
                      "none" if low is None else str(low.dtype)[6:], state["param"].numel(),
                      lr=GROUP.lr, beta1=GROUP.beta1, beta2=GROUP.beta2, eps=GROUP.eps,
                      weight_decay=GROUP.weight_decay, step=step, decoupled=True)


def read(client: Any, name: str) -> torch.Tensor:
    with client.get(name) as view:
        return view.clone()


def test_a_step_updates_the_parameter_and_both_moments_in_the_store(client: Any) -> None:
    state = store_state(client, "w", 3001)
    for step in (1, 2, 3):
        client.adam_step([GROUP], [item("w", step=step)])
        reference_step(state, step)
    assert torch.equal(read(client, "w"), state["param"])
    assert torch.equal(read(client, "w.exp_avg"), state["exp_avg"])
    assert torch.equal(read(client, "w.exp_avg_sq"), state["exp_avg_sq"])
    stepped = client.stats()["optimizer"]
    assert stepped["items_stepped"] == 3 and stepped["parameters_stepped"] == 3 * 3001


def test_a_bfloat16_parameter_is_written_from_its_float32_master_in_the_same_pass(
        client: Any) -> None:
    state = store_state(client, "w", 1025, dtype=torch.bfloat16)
    client.adam_step([GROUP], [item("w", master=True)])
    low = torch.empty(1025, dtype=torch.bfloat16)
    reference_step(state, 1, low)
    assert torch.equal(read(client, "w.master"), state["param"])
    assert torch.equal(read(client, "w").view(torch.int16), low.view(torch.int16))


def test_many_parameters_larger_than_one_chunk_step_in_one_request(client: Any) -> None:
    states = {f"p{i}": store_state(client, f"p{i}", numel, seed=i)
              for i, numel in enumerate([1, 17, (1 << 20) + 33, 4099])}
    client.adam_step([GROUP], [item(name) for name in states])
    for name, state in states.items():
        reference_step(state, 1)
        assert torch.equal(read(client, name), state["param"]), name


def test_a_failed_item_is_reported_and_the_others_are_applied(client: Any) -> None:
    state = store_state(client, "good", 33)
    store_state(client, "short", 33)
    client.put("short.exp_avg", torch.zeros(31))  # of the wrong size
    with pytest.raises(InvalidRequestError, match="exp_avg of parameter 'short' has 31"):
        client.adam_step([GROUP], [item("short"), item("good")])
    reference_step(state, 1)
    assert torch.equal(read(client, "good"), state["param"])
    with pytest.raises(NotFoundError):
        client.adam_step([GROUP], [item("missing")])
    client.adam_step([GROUP], [item("good", step=2)])  # the daemon serves on, leases all given back
    assert client.stats()["catalog"]["num_leases"] == 0


def test_an_item_naming_a_group_the_request_lacks_is_a_typed_error_and_the_daemon_serves_on(
        client: Any) -> None:
    state = store_state(client, "w", 17)
    stray = AdamItem("w", "w.grad", "", "w.exp_avg", "w.exp_avg_sq", 3, 1)
    with pytest.raises(ProtocolError, match="names group 3 of 1; send every group"):
        client.adam_step([GROUP], [stray])
    assert torch.equal(read(client, "w"), state["param"])  # nothing was applied
    client.adam_step([GROUP], [item("w")])
    reference_step(state, 1)
    assert torch.equal(read(client, "w"), state["param"])
    assert client.stats()["catalog"]["num_leases"] == 0


def test_a_low_precision_parameter_without_a_master_copy_is_refused(client: Any) -> None:
    store_state(client, "w", 64, dtype=torch.float16)
    with pytest.raises(InvalidRequestError, match="no float32 master copy"):
        client.adam_step([GROUP], [item("w")])


def test_a_parameter_leased_by_a_reader_is_not_written_under_it(client: Any) -> None:
    store_state(client, "w", 64)
    with client.get("w"):
        with pytest.raises(Exception, match="shared lease"):
            client.adam_step([GROUP], [item("w")])


def test_state_larger_than_the_cpu_tier_steps_through_nvme(nvme_daemon: Any) -> None:
    client = nvme_daemon.connect("optimizer")
    try:
        # 8 MiB tier; 6 parameters x 4 tensors x 1 MiB = 24 MiB of state.
        states = {f"p{i}": store_state(client, f"p{i}", 1 << 18, seed=i) for i in range(6)}
        for step in (1, 2):
            client.adam_step([GROUP], [item(name, step=step) for name in states])
            for state in states.values():
                reference_step(state, step)
        for name, state in states.items():
            out = torch.empty(1 << 18)
            client.read_into(name, out)
            assert torch.equal(out, state["param"]), name
            client.read_into(f"{name}.exp_avg_sq", out)
            assert torch.equal(out, state["exp_avg_sq"]), name
    finally:
        client.close()


def test_a_parameter_of_tensors_over_half_a_segment_steps_in_a_tier_they_would_fragment(
        daemon_factory: Any) -> None:
    """Four tensors of 0.53 of a segment each (an embedding's parameter, gradient and moments):
    in standard segments each would strand the rest of its segment, so a tier of 3.25
    segments could hold only three of them at once, and the step needs all four. Each gets a
    segment of its own instead (rounded to 2 MiB: 6 MiB), and four fit."""
    mib = 1 << 20
    daemon = daemon_factory(nvme_tier=True, **{"cpu.segment_bytes": 8 * mib,
                                                "cpu.budget_bytes": 26 * mib})
    client = daemon.connect("fragment")
    try:
        numel = 1_050_001  # 4.2 MB
        state = store_state(client, "wte", numel, seed=3)
        client.adam_step([GROUP], [item("wte")])
        reference_step(state, 1)
        out = torch.empty(numel)
        client.read_into("wte", out)
        assert torch.equal(out, state["param"])
        assert client.stats()["tiers"]["cpu"]["num_dedicated_segments"] >= 1
    finally:
        client.close()



def test_a_large_parameter_steps_though_the_clients_spare_slices_are_in_the_way(
        daemon_factory: Any) -> None:
    """A trainer's gradient puts leave it spare slices (for the next put of each), spread over
    the standard segments. A large parameter's step needs each of its tensors in a segment of
    its own, so a standard segment must be emptied for the last of them; spares cannot be
    evicted. The allocation waits for them to be used or given back (new spares paused
    meanwhile) instead of failing with the tier far from full."""
    import infinity.torch as itorch
    from torch import nn

    mib = 1 << 20
    daemon = daemon_factory(nvme_tier=True, **{"cpu.segment_bytes": 4 * mib,
                                                "cpu.budget_bytes": 32 * mib})
    client = daemon.connect("spares")
    try:
        torch.manual_seed(0)
        # A 4.4 MB embedding (its four tensors: 24 MiB of dedicated segments), small layers.
        model = nn.Sequential(nn.Embedding(1100, 1000), nn.Linear(1000, 200),
                              *[nn.Linear(200, 200) for _ in range(8)])
        model = itorch.offload(model, client, namespace="spares")
        optimizer = itorch.AdamW(model.parameters(), lr=1e-3, overlap=False)
        ids = torch.randint(0, 1100, (4, 7))
        for _ in range(3):
            model(ids).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        client.close()
