"""What every subject of tools/bench_train.py shares: the model, the data and the timed loop.

Imported by bench_train.py's own workers (the project's venv) and by DeepSpeed's worker (the peers'
venv, tools/peers/deepspeed_train_worker.py), so it needs only torch and transformers: every
subject builds the same GPT-2 from the same seed and trains on the same batches.

- `build_model(spec, seed)`: `GPT2LMHeadModel(GPT2Config(**spec))` under `torch.manual_seed(seed)`,
  nothing from a hub. Dropout is off in every spec: its random draws differ between processes,
  and without it every subject computes the same losses from the same weights and batches, which
  the benchmark reports as the check that they train the same thing.
- `batch_for(step, ...)`: the token ids of a step, drawn from a generator seeded by (seed, step).
- `run_steps(train_step, ...)`: `count` steps timed start to start, then one more (the tail, not
  timed: it ends the last timed step's interval, so an optimizer step that returns before its
  work is done is still counted in full), then `settle()`; the I/O counters are read at the start
  of the first timed step and of the tail, so the bytes are those of the `count` timed steps.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict

import torch

GPT2_124M: Dict[str, Any] = {}  # GPT2Config's defaults: 12 layers, 768 wide, 50257 tokens, 1024 positions
TINY: Dict[str, Any] = {"n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 512,
                        "n_positions": 256}
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def build_model(spec: Dict[str, Any], seed: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**{**spec, **NO_DROPOUT}))
    model.train()
    return model


def vocab_size(spec: Dict[str, Any]) -> int:
    return int(spec.get("vocab_size", 50257))


def batch_for(step: int, *, batch: int, sequence: int, vocab: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, vocab, (batch, sequence), generator=generator)


def run_steps(train_step: Callable[[int], float], *, first_step: int, count: int,
              io_counters: Callable[[], Dict[str, int]],
              settle: Callable[[], None] = lambda: None) -> Dict[str, Any]:
    """Run `count` timed steps (numbered from `first_step`) plus the untimed tail; see the module
    docstring. `train_step(n)` runs step n and returns its loss."""
    starts = []
    losses = []
    before = after = None
    for index in range(count + 1):
        starts.append(time.perf_counter())
        if index == 0:
            before = io_counters()
        if index == count:
            after = io_counters()
        losses.append(train_step(first_step + index))
    settle()
    assert before is not None and after is not None
    return {"seconds": [starts[i + 1] - starts[i] for i in range(count)],
            "losses": losses[:count],
            "io": {key: after[key] - before.get(key, 0) for key in after}}
