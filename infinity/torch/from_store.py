"""What `offload(..., from_store=True)` needs of values already in the store.

A module offloaded from the store (an imported model, a trainer restarting on its namespace)
uploads nothing: `dtypes_in_store` checks that every parameter is stored under its name with its
shape (and the requested dtype) and says in which dtype each computes; `quantized_copies` checks
an inference module's int8 / int4 copies (their shapes, dtypes and tensors); and
`give_values_to_meta_parameters` gives a model built on the meta device (`empty_parameters()`)
parameters over their placeholders, since torch cannot point a meta parameter at memory.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from infinity.errors import InvalidRequestError
from infinity.torch.quantize import QuantizedWeight

__all__ = ["dtypes_in_store", "give_values_to_meta_parameters", "quantized_copies"]

# `config` below is offload's OffloadConfig and `state` its OffloadState, typed Any: importing
# them here would make an import circle (offload imports this module).


def dtypes_in_store(model: nn.Module, client: Any,
                    config: Any) -> dict[str, torch.dtype]:
    """The stored dtype of each of `model`'s parameters (by parameter name), checking that the
    store holds every one of them with its shape (and `config.param_dtype`, if given)."""
    stored = {info.name: info for info in
              client.list(namespace=config.namespace, prefix=config.prefix)}
    dtypes: dict[str, torch.dtype] = {}
    missing: list[str] = []
    mismatched: list[str] = []
    for name, param in model.named_parameters():
        info = stored.get(config.prefix + name)
        if info is None:
            missing.append(config.prefix + name)
            continue
        dtype = getattr(torch, info.dtype, None)
        if (tuple(info.shape) != tuple(param.shape) or not isinstance(dtype, torch.dtype)
                or (config.param_dtype is not None and dtype != config.param_dtype)):
            mismatched.append(f"{config.prefix + name} (stored {info.dtype} "
                              f"{list(info.shape)}, the model's {list(param.shape)})")
            continue
        dtypes[name] = dtype
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5
                                          else "")
        raise InvalidRequestError(
            f"from_store: namespace {config.namespace!r} does not hold {shown}; offload the "
            f"model without from_store to upload its values, or check the namespace and prefix")
    if mismatched:
        wanted = f" as {config.param_dtype}" if config.param_dtype is not None else ""
        raise InvalidRequestError(
            f"from_store: the store holds parameters that do not fit the model{wanted}: "
            f"{'; '.join(mismatched[:5])}; build the model from the config it was stored with")
    return dtypes


def quantized_copies(model: nn.Module, client: Any, config: Any,
                      quantized: Mapping[str, QuantizedWeight], dtype_of: Any, *,
                      from_store: bool) -> dict[int, QuantizedWeight]:
    """The quantized copy each parameter computes with (by id), checked: only for a module
    that infers from values in the store, each copy of the parameter's shape and stored dtype,
    and its codes and scales in the namespace."""
    if not quantized:
        return {}
    if not (from_store and config.inference):
        raise InvalidRequestError(
            "quantized copies are for inference from weights in the store: pass "
            "from_store=True and inference=True with quantized=, or leave quantized out")
    copies: dict[int, QuantizedWeight] = {}
    for name, param in model.named_parameters():
        copy = quantized.get(config.prefix + name)
        if copy is None:
            continue
        if tuple(copy.shape) != tuple(param.shape) or copy.dtype != dtype_of(param):
            raise InvalidRequestError(
                f"the {copy.form} copy of {config.prefix + name} is of {copy.dtype} "
                f"{list(copy.shape)}, but the parameter computes in {dtype_of(param)} "
                f"{list(param.shape)}; import the model again")
        copies[id(param)] = copy
    wanted = {n for copy in copies.values() for n in copy.names}
    held: set[str] = set()
    for prefix in {n[:n.index("/") + 1] for n in wanted}:
        held.update(info.name for info in client.list(namespace=config.namespace, prefix=prefix))
    missing = sorted(wanted - held)
    if missing:
        raise InvalidRequestError(
            f"namespace {config.namespace!r} does not hold {len(missing)} tensors of the "
            f"quantized copies (e.g. {missing[0]!r}); import the model again with the form")
    return copies


def give_values_to_meta_parameters(model: nn.Module, state: Any) -> None:
    """Replace each parameter on the meta device by one over its placeholder, in every module
    slot that holds it (tied ones in each). torch cannot point a meta parameter at memory
    (`.data =` needs the same device type), and a module built without values has nothing a
    user could hold on to yet, so here (only here) the Parameter objects are new."""
    replaced: dict[int, nn.Parameter] = {}
    for entry in state.params:
        if entry.param.is_meta:
            fresh = nn.Parameter(entry.placeholder, requires_grad=entry.param.requires_grad)
            replaced[id(entry.param)] = fresh
            del state._by_param[id(entry.param)]
            state._by_param[id(fresh)] = entry
            entry.param = fresh
    if not replaced:
        return
    for module in model.modules():
        for slot, param in list(module._parameters.items()):
            if param is not None and id(param) in replaced:
                module._parameters[slot] = replaced[id(param)]
