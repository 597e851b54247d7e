#!/usr/bin/env python3
"""DeepSpeed's `DeepSpeedCPUAdam` as a subject of tools/bench_adam.py (run with the peers' python).

    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=/var/tmp/infinity-peers/torch_extensions \\
        /var/tmp/infinity-peers/venv/bin/python tools/peers/deepspeed_adam_worker.py

A JSON-lines worker (tools/peers/worker_protocol.py):

- {"op": "init", "numel": N, "threads": T}: builds the same fp32 buffers as bench_adam.py's
  `Buffers` (parameter and gradient drawn from a generator seeded with N, moments zero) and a
  `DeepSpeedCPUAdam` in AdamW mode (lr 1e-4, weight decay 0.01, the bench's settings) holding them
  (its moments, zero, made by its first step, the warm-up); torch's (so OpenMP's) threads set to T.
  Answers {"numel": N, "deepspeed": version, "threads": T}.
- {"op": "step"}: one optimizer step; answers {"seconds": ...}, the step's own time (the pipe's
  round trip is outside it, as the in-process subjects' calls have none).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Dict

import worker_protocol

DEFAULT_PEERS_DIR = "/var/tmp/infinity-peers"
peers_dir = os.environ.get("INFINITY_PEERS_DIR", DEFAULT_PEERS_DIR)
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(peers_dir, "torch_extensions"))

_state: Dict[str, Any] = {}


def init(request: Dict[str, Any]) -> Dict[str, Any]:
    import deepspeed
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    numel = int(request["numel"])
    threads = int(request.get("threads", torch.get_num_threads()))
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    _state.clear()  # one size at a time: free the last one's buffers first
    generator = torch.Generator().manual_seed(numel)
    param = torch.nn.Parameter(torch.randn(numel, generator=generator))
    param.grad = torch.randn(numel, generator=generator)
    optimizer = DeepSpeedCPUAdam([param], lr=1e-4, betas=(0.9, 0.999), eps=1e-8,
                                 weight_decay=0.01, adamw_mode=True)
    _state.update(param=param, optimizer=optimizer)
    optimizer.step()  # warm-up: makes the moments; page faults, the op's first-call setup
    return {"numel": numel, "deepspeed": deepspeed.__version__, "threads": threads}


def step(request: Dict[str, Any]) -> Dict[str, Any]:
    optimizer = _state["optimizer"]
    start = time.perf_counter()
    optimizer.step()
    return {"seconds": time.perf_counter() - start}


if __name__ == "__main__":
    sys.exit(worker_protocol.serve({"init": init, "step": step}))
