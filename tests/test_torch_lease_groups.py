"""Lease groups: an inference module leases each block's units (a decoder layer's linear layers
and norms) in runs, one request a run, from its second forward on, and computes exactly what it
did. A run holds at most a sixteenth of the CPU tier: a tiny model's whole layer is one run."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from infinity.errors import TierFullError
from infinity.torch import empty_parameters, offload
from infinity.torch.lease_groups import MAX_REFUSALS, LeaseGroup
from tiny_models import llama

from conftest import PREFETCH_SETTINGS


def count_leases(client: Any) -> list[list[str]]:
    """Record the names of each `get_many` the client makes from now on."""
    calls: list[list[str]] = []
    plain = client.get_many

    def get_many(names: Any, **kwargs: Any) -> Any:
        calls.append(list(names))
        return plain(names, **kwargs)

    client.get_many = get_many
    return calls


def offload_from_store(build: Callable[[], nn.Module], client: Any,
                       namespace: str) -> tuple[nn.Module, nn.Module]:
    """The model in memory, and a copy built empty that computes with the store's values."""
    reference = build().eval()
    for name, param in reference.named_parameters():  # one at a time: a small tier holds each
        client.put(name, param.detach().contiguous(), namespace=namespace)
    with empty_parameters():
        model = build().eval()
    offload(model, client, namespace=namespace, from_store=True, inference=True)
    return reference, model


def layer_names(model: nn.Module, index: int) -> set[str]:
    return {name for name, _ in model.named_parameters()
            if name.startswith(f"model.layers.{index}.")}


def test_from_its_second_forward_each_decoder_layer_leases_its_units_in_one_request(
        client: Any) -> None:
    reference, model = offload_from_store(llama, client, "groups")
    tokens = torch.randint(1, 100, (2, 7), generator=torch.Generator().manual_seed(4))
    calls = count_leases(client)
    with torch.no_grad():
        model(tokens)
        first = len(calls)
        model(tokens)
    second = calls[first:]
    for index in range(2):
        names = layer_names(model, index)
        with_layer = [call for call in second if names & set(call)]
        assert len(with_layer) == 1
        assert set(with_layer[0]) == names
    assert len(second) < first


def test_the_first_forward_leases_unit_by_unit(client: Any) -> None:
    reference, model = offload_from_store(llama, client, "first")
    tokens = torch.randint(1, 100, (1, 5), generator=torch.Generator().manual_seed(5))
    calls = count_leases(client)
    with torch.no_grad():
        model(tokens)
    layer = model.model.layers[0]
    units = [module for module in layer.modules() if list(module.parameters(recurse=False))]
    names = layer_names(model, 0)
    assert len([call for call in calls if names & set(call)]) == len(units) > 2


def test_generation_with_group_leases_equals_the_model_in_memory_and_leaves_no_lease(
        client: Any) -> None:
    reference, model = offload_from_store(llama, client, "generate")
    prompt = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(prompt)
    calls = count_leases(client)
    got = model.generate(prompt, attention_mask=mask, max_new_tokens=7, do_sample=False)
    expected = reference.generate(prompt, attention_mask=mask, max_new_tokens=7,
                                  do_sample=False)
    assert torch.equal(got, expected)
    whole_layer = layer_names(model, 1)
    assert any(set(call) == whole_layer for call in calls)
    assert client.stats()["clients"][0]["leases"] == 0


class Block(nn.Module):
    """Two linear layers; the second is used only while `use_second` is set."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.first = nn.Linear(width, width)
        self.second = nn.Linear(width, width)
        self.use_second = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.first(x))
        return self.second(x) if self.use_second else x


class Stack(nn.Module):
    """Blocks of `kind` (seeded), one after the other."""

    def __init__(self, width: int, num_blocks: int, kind: type[nn.Module] = Block) -> None:
        super().__init__()
        torch.manual_seed(21)
        self.blocks = nn.ModuleList(kind(width) for _ in range(num_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def set_second(model: Stack, used: bool) -> None:
    for block in model.blocks:
        assert isinstance(block, Block)
        block.use_second = used


def test_a_block_leases_only_the_units_its_last_forward_used(client: Any) -> None:
    reference, model = offload_from_store(lambda: Stack(13, 2), client, "skips")
    assert isinstance(model, Stack) and isinstance(reference, Stack)
    x = torch.randn(3, 13, generator=torch.Generator().manual_seed(7))
    calls = count_leases(client)

    def forward(used: bool) -> list[list[str]]:
        set_second(model, used)
        set_second(reference, used)
        start = len(calls)
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))
        return [sorted(call) for call in calls[start:]]

    forward(True)  # unit by unit, recorded
    forward(False)  # the record leases both, the forward uses the first
    first_only = forward(False)
    assert first_only == [["blocks.0.first.bias", "blocks.0.first.weight"],
                          ["blocks.1.first.bias", "blocks.1.first.weight"]]
    again = forward(True)  # the second leases alone, then both are recorded
    assert ["blocks.0.second.bias", "blocks.0.second.weight"] in again
    assert len(forward(True)) == 2
    assert client.stats()["clients"][0]["leases"] == 0


class Triple(nn.Module):
    """Three linear layers, one after the other."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(width, width), nn.Linear(width, width),
                                    nn.Linear(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def test_a_run_holds_at_most_a_sixteenth_of_the_cpu_tier(client: Any) -> None:
    # The test tier is 64 MiB: a run holds at most 4 MiB. Each layer leases 1.96 MB (701 x 699
    # float32 and a bias): two make a run, the third is the next one.
    tier_bytes = client.stats()["tiers"]["cpu"]["budget_bytes"]
    assert 2 * (701 * 700 * 4) <= tier_bytes // 16 < 3 * (701 * 700 * 4)
    reference, model = offload_from_store(lambda: Stack(701, 2, Triple), client, "runs")
    x = torch.randn(3, 701, generator=torch.Generator().manual_seed(9))
    calls = count_leases(client)
    for _ in range(2):
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))
    assert [sorted(call) for call in calls[6:]] == [
        ["blocks.0.layers.0.bias", "blocks.0.layers.0.weight",
         "blocks.0.layers.1.bias", "blocks.0.layers.1.weight"],
        ["blocks.0.layers.2.bias", "blocks.0.layers.2.weight"],
        ["blocks.1.layers.0.bias", "blocks.1.layers.0.weight",
         "blocks.1.layers.1.bias", "blocks.1.layers.1.weight"],
        ["blocks.1.layers.2.bias", "blocks.1.layers.2.weight"]]
    assert client.stats()["clients"][0]["leases"] == 0


def test_a_unit_larger_than_a_run_leases_alone(daemon_factory: Callable[..., Any]) -> None:
    # An 8 MiB tier: runs of at most 512 KiB, and each linear layer leases 4.2 MB.
    daemon = daemon_factory(nvme_tier=True, **PREFETCH_SETTINGS)
    client = daemon.connect("groups")
    try:
        reference, model = offload_from_store(lambda: Stack(1023, 2), client, "large")
        x = torch.randn(2, 1023, generator=torch.Generator().manual_seed(8))
        calls = count_leases(client)
        for _ in range(3):
            with torch.no_grad():
                assert torch.equal(model(x), reference(x))
        assert all(len(call) == 2 for call in calls)  # a weight and its bias
        assert client.stats()["clients"][0]["leases"] == 0
    finally:
        client.close()


class FakeUnit:
    def __init__(self, *names: str) -> None:
        self.names = list(names)
        self.lease: Any = None


def refusing(times: int, asked: list[list[str]]) -> Callable[[list[str]], Any]:
    """A lease function that refuses its first `times` requests with TierFullError, then grants
    leases of nothing (faked: a tier too full for a run but not for its units alone is hard to
    bring about on purpose)."""

    class Granted:
        def __init__(self, names: list[str]) -> None:
            self.tensors = [torch.empty(0) for _ in names]

        def release(self) -> None:
            pass

    def lease(names: list[str]) -> Any:
        asked.append(names)
        if len(asked) <= times:
            raise TierFullError("the CPU tier is full")
        return Granted(names)

    return lease


def two_unit_group(lease: Callable[[list[str]], Any]) -> tuple[LeaseGroup, FakeUnit, FakeUnit]:
    """A group of two units, recorded by one forward: the next forward leases them as a run."""
    group = LeaseGroup(lease=lease, settle=lambda units: None,
                       release_unit=lambda unit: None, size_of=lambda unit: 1, max_bytes=8)
    first, second = FakeUnit("a"), FakeUnit("b")
    group.begin()
    assert group.take(first) is None and group.take(second) is None  # no record yet
    group.end()
    return group, first, second


def test_a_refused_run_leaves_its_units_to_lease_alone_in_that_forward_only() -> None:
    asked: list[list[str]] = []
    group, first, second = two_unit_group(refusing(1, asked))
    group.begin()
    assert group.take(first) is None and group.take(second) is None  # refused: alone
    group.end()
    assert asked == [["a", "b"]]  # asked once in that forward, not again for its second unit
    group.begin()
    assert group.take(first) is not None and group.take(second) is not None
    group.end()
    assert asked == [["a", "b"], ["a", "b"]] and group.enabled


def test_runs_refused_forward_after_forward_make_the_group_lease_unit_by_unit() -> None:
    asked: list[list[str]] = []
    group, first, second = two_unit_group(refusing(MAX_REFUSALS, asked))
    for _ in range(MAX_REFUSALS + 2):
        group.begin()
        assert group.take(first) is None
        group.end()
    assert len(asked) == MAX_REFUSALS and not group.enabled
