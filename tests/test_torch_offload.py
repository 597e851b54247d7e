"""`infinity.torch.offload`: a module's parameters live in the store, present only around their use.

Every test compares an offloaded model against an identical copy kept in memory (same seed, same
input): forward outputs, and the gradients that leave for the store, must be those of plain
PyTorch, bit for bit on the CPU (the same kernels run on the same values).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from infinity.errors import InvalidRequestError
from infinity.torch.offload import offload, offload_state
from tiny_models import gpt2, llama


def linear_stack(seed: int = 3) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(13, 37), nn.GELU(), nn.Linear(37, 29), nn.LayerNorm(29),
                         nn.Linear(29, 7))


class TiedLanguageModel(nn.Module):
    """An embedding whose weight is also the output projection (as GPT-2's and Llama's can be)."""

    def __init__(self, vocab: int = 51, width: int = 19) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Sequential(nn.Linear(width, width), nn.Tanh())
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens)))


def loss_and_grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    out = model(x)
    loss = out.float().pow(2).mean()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()
                           if p.grad is not None}


def stored_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    state = offload_state(model)
    return {name: state.gradient(param) for name, param in state.stored_names()}


def test_forward_and_gradients_equal_plain_pytorch(client: Any) -> None:
    reference = linear_stack()
    model = offload(linear_stack(), client, namespace="stack")
    x = torch.randn(5, 13)
    expected_loss, expected = loss_and_grads(reference, x)
    out = model(x)
    loss = out.pow(2).mean()
    loss.backward()
    assert torch.equal(loss.detach(), expected_loss)
    got = stored_grads(model)
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_parameters_hold_no_memory_between_uses(client: Any) -> None:
    model = offload(linear_stack(), client, namespace="stack")
    shapes = [param.shape for param in linear_stack().parameters()]
    for param, shape in zip(model.parameters(), shapes):
        assert param.shape == shape and param.untyped_storage().nbytes() == 0
    model(torch.randn(2, 13)).sum().backward()
    for param in model.parameters():
        assert param.untyped_storage().nbytes() == 0, "a parameter kept its view after the step"
        assert param.grad is None, "a gradient stayed in the process after it left for the store"


def test_the_stored_values_are_the_models(client: Any) -> None:
    reference = linear_stack()
    model = offload(linear_stack(), client, namespace="stack")
    state = offload_state(model)
    for (name, param), (_, expected) in zip(state.stored_names(), reference.named_parameters()):
        assert torch.equal(state.parameter(param), expected.detach()), name


def test_tied_weights_are_stored_once_and_their_gradient_is_the_sum_of_both_uses(
        client: Any) -> None:
    reference = TiedLanguageModel()
    model = offload(TiedLanguageModel(), client, namespace="tied")
    tokens = torch.randint(0, 51, (3, 11))
    expected_loss, expected = loss_and_grads(reference, tokens)
    loss = model(tokens).pow(2).mean()
    loss.backward()
    assert torch.equal(loss.detach(), expected_loss)
    names = [name for name, _ in offload_state(model).stored_names()]
    assert "embed.weight" in names and "head.weight" not in names
    got = stored_grads(model)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_gradients_of_micro_batches_are_summed_in_the_store(client: Any) -> None:
    reference = linear_stack()
    model = offload(linear_stack(), client, namespace="stack")
    batches = [torch.randn(4, 13) for _ in range(3)]
    for x in batches:
        reference(x).pow(2).mean().backward()  # torch sums into .grad
        model(x).pow(2).mean().backward()
    got = stored_grads(model)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=1e-6, atol=1e-7)


def test_zero_grad_makes_the_next_backward_replace_the_stored_gradients(client: Any) -> None:
    reference = linear_stack()
    model = offload(linear_stack(), client, namespace="stack")
    model(torch.randn(4, 13)).sum().backward()
    offload_state(model).zero_grad()
    x = torch.randn(4, 13)
    _, expected = loss_and_grads(reference, x)
    model(x).pow(2).mean().backward()
    got = stored_grads(model)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_a_module_called_twice_in_one_forward_gets_both_uses_gradients(client: Any) -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(7)
            self.layer = nn.Linear(9, 9)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(torch.relu(self.layer(x)))

    reference = Twice()
    model = offload(Twice(), client, namespace="twice")
    x = torch.randn(3, 9)
    _, expected = loss_and_grads(reference, x)
    model(x).pow(2).mean().backward()
    got = stored_grads(model)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_inference_needs_no_gradients_and_leaves_no_lease(client: Any) -> None:
    reference = linear_stack()
    model = offload(linear_stack(), client, namespace="stack")
    x = torch.randn(6, 13)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert client.stats()["clients"][0]["leases"] == 0


def test_a_model_offloaded_in_bfloat16_computes_in_bfloat16(client: Any) -> None:
    reference = copy.deepcopy(linear_stack()).to(torch.bfloat16)
    model = offload(linear_stack(), client, namespace="bf16", param_dtype=torch.bfloat16)
    x = torch.randn(5, 13, dtype=torch.bfloat16)
    expected_loss, expected = loss_and_grads(reference, x)
    loss = model(x).float().pow(2).mean()
    loss.backward()
    assert torch.equal(loss.detach(), expected_loss)
    got = stored_grads(model)
    for name in expected:
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], expected[name].float()), name


def test_offloading_a_module_twice_is_a_typed_error(client: Any) -> None:
    model = offload(linear_stack(), client, namespace="stack")
    with pytest.raises(InvalidRequestError, match="offloaded already"):
        offload(model, client, namespace="stack")


def test_an_unsupported_dtype_is_a_typed_error_before_anything_is_stored(client: Any) -> None:
    with pytest.raises(InvalidRequestError, match="param_dtype"):
        offload(linear_stack(), client, namespace="stack", param_dtype=torch.float64)
    assert client.list(namespace="stack") == []


def test_a_plain_module_is_not_offloaded(client: Any) -> None:
    with pytest.raises(InvalidRequestError, match="not offloaded"):
        offload_state(linear_stack())


# --- Hugging Face transformers models, built from a config with seeded weights ---------------


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
def test_a_transformers_model_trains_with_the_loss_and_gradients_of_plain_pytorch(
        client: Any, build: Any) -> None:
    pytest.importorskip("transformers")
    reference, model = build(), offload(build(), client, namespace="lm")
    ids = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(1)  # the same dropout masks on both sides
    expected = reference(input_ids=ids, labels=ids).loss
    expected.backward()
    torch.manual_seed(1)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.equal(loss.detach(), expected.detach())
    parameters = dict(reference.named_parameters())
    state = offload_state(model)
    for name, param in state.stored_names():
        assert torch.equal(state.gradient(param), parameters[name].grad), name


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
def test_generate_works_unchanged_and_gives_the_same_tokens(client: Any, build: Any) -> None:
    pytest.importorskip("transformers")
    reference, model = build().eval(), offload(build().eval(), client, namespace="lm")
    prompt = torch.randint(1, 100, (2, 5), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(prompt)
    expected = reference.generate(prompt, attention_mask=mask, max_new_tokens=7, do_sample=False)
    got = model.generate(prompt, attention_mask=mask, max_new_tokens=7, do_sample=False)
    assert torch.equal(got, expected)
    assert client.stats()["clients"][0]["leases"] == 0


def test_the_modules_own_zero_grad_resets_the_stored_gradients_too(client: Any) -> None:
    reference = linear_stack()
    model = offload(linear_stack(), client, namespace="stack")
    model(torch.randn(4, 13)).sum().backward()
    model.zero_grad()  # what transformers.Trainer calls, rather than the optimizer's
    x = torch.randn(4, 13)
    _, expected = loss_and_grads(reference, x)
    model(x).pow(2).mean().backward()
    got = stored_grads(model)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_a_parameter_replaced_after_offload_is_a_typed_error_not_silently_used(
        client: Any) -> None:
    model = offload(linear_stack(), client, namespace="stack")
    model[0].weight = nn.Parameter(torch.zeros(37, 13))
    with pytest.raises(InvalidRequestError, match="replaced after offload"):
        model(torch.randn(2, 13))
    assert client.stats()["clients"][0]["leases"] == 0  # nothing left held
    assert all(unit.depth == 0 for unit in offload_state(model).units)
