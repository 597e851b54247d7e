"""What an inference unit computing on the CPU does differently from a plain leased forward.

Two fast paths, each set up by `offload` on the module instance (the user's class is left as
it is) and each falling back to the module's own forward where it does not apply:

- **From the codes** (`compute_from_codes`): an `nn.Linear` whose weight has a quantized copy
  multiplies an input of few rows (a decode step: at most `FUSED_MAX_ROWS`) straight from the
  leased codes and scales with the native kernel (`infinity.torch.quantize.linear`), the weight
  never written out in full. `fuses` decides per forward; the unit's pre-hook then keeps the
  codes and scales leased (`_Unit.fused`) instead of dequantizing them.
- **By rows** (`read_embedding_by_rows`): a plain `nn.Embedding` with a weight of its own, in
  full precision, leases nothing: its forward reads the rows its input looks up
  (`client.read_rows`: from NVMe, only the 1 MiB checksum blocks holding them) and looks them up
  in that small table, bit for bit the full lookup.

A unit here is `infinity.torch.offload`'s `_Unit` (its `module`, `entries`, `state`, and the
`fusable`, `fused` and `by_rows` fields these paths set and read).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from infinity.torch.quantize import FUSED_MAX_ROWS, linear

__all__ = ["compute_from_codes", "fuses", "read_embedding_by_rows"]


def fuses(unit: Any, args: tuple[Any, ...]) -> bool:
    """Whether this forward (of `args`) multiplies from the codes: the module's weight has a
    quantized copy on the CPU, and its input is a CPU tensor of the weight's dtype with at most
    FUSED_MAX_ROWS rows that needs no gradient."""
    if unit.fusable is None or not args or not isinstance(args[0], torch.Tensor):
        return False
    x, weight = args[0], unit.fusable.quantized
    assert weight is not None
    return (x.device.type == "cpu" and x.dtype == weight.dtype and x.dim() > 0
            and x.numel() <= FUSED_MAX_ROWS[weight.form] * x.shape[-1]
            and not (x.requires_grad and torch.is_grad_enabled()))


def compute_from_codes(unit: Any, weight_entry: Any) -> None:
    """Let an inference unit that is an nn.Linear with a quantized weight (`weight_entry`)
    multiply from the codes where `fuses` says so."""
    unit.fusable = weight_entry
    unit.module.forward = functools.partial(_linear_forward, unit)


def _linear_forward(unit: Any, x: torch.Tensor) -> torch.Tensor:
    module = unit.module
    if unit.fused is None:
        return nn.Linear.forward(module, x)
    weight = unit.fusable.quantized
    codes, scales = unit.fused
    bias = module.bias
    assert bias is None or isinstance(bias, torch.Tensor)
    return linear(x, codes, scales, weight.form, weight.block, bias)


def read_embedding_by_rows(unit: Any) -> None:
    """Make an inference unit that is a plain nn.Embedding read only the rows it looks up,
    where its weight is its own (not tied to an output projection, which needs the whole table
    anyway), in full precision, and max_norm unset (which rewrites the table)."""
    module = unit.module
    if type(module).forward is not nn.Embedding.forward or len(unit.entries) != 1:
        return
    entry = unit.entries[0]
    if (entry.param is not module._parameters.get("weight") or len(entry.units) != 1
            or entry.quantized is not None or getattr(module, "max_norm", None) is not None):
        return
    unit.by_rows = entry
    module.forward = functools.partial(_embedding_forward, unit)


def _embedding_forward(unit: Any, ids: torch.Tensor) -> torch.Tensor:
    entry = unit.by_rows
    unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
    table = torch.empty((len(unique), *entry.placeholder.shape[1:]),
                        dtype=entry.placeholder.dtype)
    unit.state.client.read_rows(entry.read_name, unique, table,
                                namespace=unit.state.config.namespace)
    return functional.embedding(inverse.view(ids.shape), table)
