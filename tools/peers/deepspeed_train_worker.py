#!/usr/bin/env python3
"""DeepSpeed ZeRO-3 with parameters and optimizer states on NVMe, as a subject of bench_train.py.

    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=/var/tmp/infinity-peers/torch_extensions \\
        /var/tmp/infinity-peers/venv/bin/python tools/peers/deepspeed_train_worker.py

A JSON-lines worker (tools/peers/worker_protocol.py), one process, no GPU, no launcher (gloo):

- {"op": "init", "spec": {...}, "seed": S, "batch": B, "sequence": T, "swap_dir": DIR,
   "buffer_count": 56, "lr": 1e-4, "weight_decay": 0.01}: builds the model of
  train_common.build_model(spec, S) under `deepspeed.zero.Init` (building it outside fails on the
  CPU accelerator with a Float / BFloat16 mismatch, and under it transformers' init runs on the
  already partitioned parameters), then copies the reference model's weights in, one parameter at
  a time under `GatheredParameters`, so DeepSpeed starts from the very weights the other subjects
  do; then `deepspeed.initialize` with ZeRO stage 3, `offload_param` and `offload_optimizer` on
  NVMe in DIR, and DeepSpeed's AdamW (its CPU Adam). `buffer_size` holds the largest parameter
  (the embedding; it must, or the swapper fails) and `buffer_count` defaults to 56: with 5 or 16,
  GPT-2 124M failed at its first step with "Not enough buffers 0 for swapping 1" (see
  /work/shared/PEERS.md). Answers the parameter count and the swap settings.
- {"op": "steps", "first_step": N, "count": K}: train_common.run_steps over `engine(...)`,
  `engine.backward`, `engine.step`; the I/O counters are this process's /proc/self/io
  read_bytes and write_bytes (DeepSpeed's aio threads are threads of this process).
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any, Dict

import train_common
import worker_protocol

DEFAULT_PEERS_DIR = "/var/tmp/infinity-peers"
peers_dir = os.environ.get("INFINITY_PEERS_DIR", DEFAULT_PEERS_DIR)
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(peers_dir, "torch_extensions"))

_state: Dict[str, Any] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ds_config(request: Dict[str, Any], buffer_size: int) -> Dict[str, Any]:
    swap_dir = request["swap_dir"]
    return {
        "train_micro_batch_size_per_gpu": int(request["batch"]),
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1 << 30,
        "optimizer": {"type": "AdamW",
                      "params": {"lr": float(request.get("lr", 1e-4)), "betas": [0.9, 0.999],
                                 "eps": 1e-8, "weight_decay": float(request.get("weight_decay",
                                                                                0.01))}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": swap_dir, "pin_memory": True,
                              "buffer_count": int(request.get("buffer_count", 56)),
                              "buffer_size": buffer_size},
            "offload_optimizer": {"device": "nvme", "nvme_path": swap_dir, "pin_memory": True,
                                  "buffer_count": 4},
        },
    }


def init(request: Dict[str, Any]) -> Dict[str, Any]:
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port()))):
        os.environ.setdefault(key, value)
    import deepspeed
    import torch

    torch.set_num_threads(int(request.get("threads", torch.get_num_threads())))
    spec, seed = request["spec"], int(request["seed"])
    reference = train_common.build_model(spec, seed)
    weights = {name: p.detach().clone() for name, p in reference.named_parameters()}
    largest = max(p.numel() for p in weights.values())
    del reference
    buffer_size = -(-largest // 1_000_000) * 1_000_000  # the largest parameter, in whole millions
    config = ds_config(request, buffer_size)
    os.makedirs(request["swap_dir"], exist_ok=True)
    deepspeed.init_distributed(dist_backend="gloo")
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = train_common.build_model(spec, seed)
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            param.data.copy_(weights[name])
    del weights
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    vocab = train_common.vocab_size(spec)
    batch, sequence = int(request["batch"]), int(request["sequence"])

    def train_step(step: int) -> float:
        ids = train_common.batch_for(step, batch=batch, sequence=sequence, vocab=vocab, seed=seed)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    _state.update(engine=engine, train_step=train_step, swap_dir=request["swap_dir"])
    zero = config["zero_optimization"]
    return {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
            "parameters": sum(int(p.ds_numel) for p in model.parameters()),
            "offload_param": zero["offload_param"], "offload_optimizer": zero["offload_optimizer"],
            "pid": os.getpid()}


def steps(request: Dict[str, Any]) -> Dict[str, Any]:
    result = train_common.run_steps(_state["train_step"], first_step=int(request["first_step"]),
                                    count=int(request["count"]),
                                    io_counters=worker_protocol.proc_counters)
    result["swap_dir_bytes"] = _folder_bytes(_state["swap_dir"])  # what DeepSpeed keeps on disk
    return result


def _folder_bytes(folder: str) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


if __name__ == "__main__":
    sys.exit(worker_protocol.serve({"init": init, "steps": steps}))
