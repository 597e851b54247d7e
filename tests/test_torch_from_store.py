"""`offload(..., from_store=True)`: a module built without values computes with the store's.

The store is filled the way an import or an earlier trainer leaves it (each parameter under its
name); a second copy of the model, built inside `empty_parameters()`, attaches to those values and
must compute exactly what the original computes in memory.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn

from infinity.client.device import CpuCopier
from infinity.errors import InvalidRequestError
from infinity.torch import empty_parameters, offload, offload_state
from tiny_models import gpt2, llama


def store_values(model: nn.Module, client: Any, namespace: str,
                 dtype: torch.dtype | None = None) -> None:
    """Each parameter under its name (tied ones once), as an import stores a model's tensors."""
    client.put_many({name: param.detach().to(dtype or param.dtype).contiguous()
                     for name, param in model.named_parameters()}, namespace=namespace)


def test_a_module_built_empty_holds_no_values_and_keeps_its_buffers() -> None:
    with empty_parameters():
        model = llama()
    assert all(param.is_meta for param in model.parameters())
    assert all(not buffer.is_meta for buffer in model.buffers())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied


def test_building_empty_leaves_later_modules_with_values() -> None:
    with empty_parameters():
        nn.Linear(3, 5)
    assert not nn.Linear(3, 5).weight.is_meta


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
def test_greedy_generation_from_store_equals_the_model_in_memory(
        client: Any, build: Callable[[], nn.Module]) -> None:
    reference = build().eval()
    store_values(reference, client, "imported")
    with empty_parameters():
        model = build().eval()
    offload(model, client, namespace="imported", from_store=True, inference=True)
    prompt = torch.randint(1, 100, (3, 7), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(prompt)
    expected = reference.generate(prompt, attention_mask=mask, max_new_tokens=9, do_sample=False)
    got = model.generate(prompt, attention_mask=mask, max_new_tokens=9, do_sample=False)
    assert torch.equal(got, expected)
    assert client.stats()["clients"][0]["leases"] == 0


def test_a_model_stored_in_bfloat16_computes_in_bfloat16(client: Any) -> None:
    reference = gpt2().eval()
    store_values(reference, client, "half", torch.bfloat16)
    with empty_parameters():
        model = gpt2().eval()
    offload(model, client, namespace="half", from_store=True, inference=True)
    tokens = torch.randint(1, 100, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = model(tokens).logits
        expected = reference.to(torch.bfloat16)(tokens).logits
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected)


def test_an_inference_module_makes_each_forward_a_step_of_the_trace(client: Any) -> None:
    reference = gpt2().eval()
    store_values(reference, client, "steps")
    with empty_parameters():
        model = gpt2().eval()
    offload(model, client, namespace="steps", from_store=True, inference=True)
    before = client.steps_begun
    prompt = torch.randint(1, 100, (1, 5), generator=torch.Generator().manual_seed(3))
    model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                   do_sample=False, min_new_tokens=6)
    assert client.steps_begun - before == 6  # the prompt's forward and one per later token


def test_a_device_budget_counts_the_stored_dtype_not_the_models(client: Any) -> None:
    # Built in fp32 over bf16 weights: a budget of exactly the largest unit's bf16 bytes must
    # do (counted in the model's fp32 it would be refused as too small).
    reference = gpt2().eval()
    store_values(reference, client, "budget", torch.bfloat16)
    largest_unit_bytes = 2 * max(sum(p.numel() for p in module.parameters(recurse=False))
                                 for module in reference.modules())
    with empty_parameters():
        model = gpt2().eval()
    offload(model, client, namespace="budget", from_store=True, inference=True,
            copier=CpuCopier(), device_budget_bytes=largest_unit_bytes)
    tokens = torch.randint(1, 100, (1, 5), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(model(tokens).logits,
                           reference.to(torch.bfloat16)(tokens).logits)


def test_without_a_budget_a_device_holds_every_stored_byte(client: Any) -> None:
    reference = gpt2()
    store_values(reference, client, "whole", torch.bfloat16)
    with empty_parameters():
        model = gpt2()
    offload(model, client, namespace="whole", from_store=True, inference=True, copier=CpuCopier())
    stored = sum(param.numel() * 2 for param in reference.parameters())
    assert offload_state(model).device_params.cache.budget_bytes == stored  # type: ignore[union-attr]


def test_an_inference_module_is_frozen(client: Any) -> None:
    store_values(gpt2(), client, "frozen")
    with empty_parameters():
        model = gpt2()
    offload(model, client, namespace="frozen", from_store=True, inference=True)
    assert not any(param.requires_grad for param in model.parameters())


def test_a_parameter_missing_from_the_store_is_named(client: Any) -> None:
    reference = gpt2()
    store_values(reference, client, "partial")
    client.delete("transformer.h.1.mlp.c_fc.bias", namespace="partial")
    with empty_parameters():
        model = gpt2()
    with pytest.raises(InvalidRequestError, match=r"transformer\.h\.1\.mlp\.c_fc\.bias"):
        offload(model, client, namespace="partial", from_store=True)


def test_a_stored_shape_that_differs_from_the_models_is_refused(client: Any) -> None:
    store_values(nn.Sequential(nn.Linear(3, 5)), client, "other")
    with empty_parameters():
        model = nn.Sequential(nn.Linear(3, 7))
    with pytest.raises(InvalidRequestError, match=r"0\.weight \(stored float32 \[5, 3\]"):
        offload(model, client, namespace="other", from_store=True)


def test_a_stored_dtype_other_than_the_asked_one_is_refused(client: Any) -> None:
    store_values(nn.Sequential(nn.Linear(3, 5)), client, "dtypes")
    with empty_parameters():
        model = nn.Sequential(nn.Linear(3, 5))
    with pytest.raises(InvalidRequestError, match="as torch.bfloat16"):
        offload(model, client, namespace="dtypes", from_store=True, param_dtype=torch.bfloat16)


def test_a_module_without_values_needs_from_store(client: Any) -> None:
    with empty_parameters():
        model = nn.Sequential(nn.Linear(3, 5))
    with pytest.raises(InvalidRequestError, match="from_store=True"):
        offload(model, client, namespace="novalues")
    assert client.list(namespace="novalues") == []
