"""Modules built without parameter values: `empty_parameters()`.

A model whose values are in the store already (an imported model, a trainer restarting on its
namespace) needs only its structure in the process: `offload(..., from_store=True)` points each
parameter at the store's copy. Building it the usual way would allocate and initialise every
parameter first, the whole model in RAM for nothing. Inside `empty_parameters()` each parameter a
module registers goes to the meta device instead (shape and dtype, no bytes), so initialisation
costs nothing; buffers are left real, because many are not stored anywhere and are computed at
construction (rotary embeddings' inverse frequencies, causal masks).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

__all__ = ["empty_parameters"]


@contextlib.contextmanager
def empty_parameters() -> Iterator[None]:
    """Within this block, parameters registered on any module are on the meta device.

    Registration is the one door every parameter passes (`module.weight = nn.Parameter(...)`
    calls `register_parameter`), so wrapping it catches every module class; the tensor a
    constructor allocated before registering is dropped at once (large ones were never
    touched, so they cost no resident memory)."""
    register = nn.Module.register_parameter

    def register_without_values(module: nn.Module, name: str,
                                param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_without_values  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
