#!/usr/bin/env python3
"""How much host memory DeepSpeed ZeRO-3 with NVMe offload takes for bench_scale.py's Llama.

    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=/var/tmp/infinity-peers/torch_extensions \\
        /var/tmp/infinity-peers/venv/bin/python tools/peers/deepspeed_scale_probe.py \\
        --layers 2 --swap-dir /var/tmp/ds-scale-probe [--tuned] [--steps 1]

One process, no GPU, no launcher (gloo), in the peers' venv (tools/peers/setup_peers.sh). It
builds tools/bench_scale.py's Llama (its `WIDE` config, `--layers` layers, bf16) under
`deepspeed.zero.Init(remote_device="nvme")`, so the parameters go to NVMe as they are made and
the model never sits whole in RAM, then `deepspeed.initialize` with ZeRO stage 3, `offload_param`
and `offload_optimizer` on NVMe in `--swap-dir`, bf16, and DeepSpeed's AdamW, and trains
`--steps` steps of batch 1, sequence 256. Its last line on stdout (DeepSpeed prints there too) is
JSON: the process's resident memory
after the build, after `initialize` and at its peak (VmHWM), and the host buffers DeepSpeed's
source (0.19.8, `runtime/zero/stage3.py`, `runtime/swap_tensor/*`) allocates for these settings,
so the two can be compared (docs/BENCHMARKS.md, issue 20 part 4):

- the parameter swap buffers: `offload_param.buffer_count` x `buffer_size` (at least the largest
  parameter) in the model's dtype, locked;
- the parameters kept in memory: up to `offload_param.max_in_cpu` elements (default 1e9);
- every parameter's gradient: `grad_partitions_flat_buffer`, N elements of the gradient
  accumulation dtype (the model's: bf16);
- the optimizer swap buffers: `offload_optimizer.buffer_count` (4: master, both moments, the
  gradient) x the largest sub-group (`sub_group_size`, default 1e9 elements) in fp32, locked;
- the fp32 gradient buffer of `initialize_optimizer_states`: one largest sub-group in fp32.

Default settings are DeepSpeed's own, except `buffer_size` (the largest parameter, rounded up to
whole millions; DeepSpeed fails otherwise) and `--param-buffers` (the parameter swap buffers:
bench_train.py needed 56 for GPT-2 124M). `--tuned` lowers what the settings allow: no
parameters kept in memory (`max_in_cpu` 0), sub-groups of 1e8 elements, and
`stage3_max_live_parameters` / `stage3_max_reuse_distance` of 1e8, so fewer parameters stay
gathered (and hold swap buffers) at once.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR",
                      os.path.join(os.environ.get("INFINITY_PEERS_DIR", "/var/tmp/infinity-peers"),
                                   "torch_extensions"))


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ds_config(args: argparse.Namespace, buffer_size: int) -> dict[str, Any]:
    offload_param: dict[str, Any] = {"device": "nvme", "nvme_path": args.swap_dir,
                                     "pin_memory": True, "buffer_count": args.param_buffers,
                                     "buffer_size": buffer_size}
    zero: dict[str, Any] = {"stage": 3, "offload_param": offload_param,
                            "offload_optimizer": {"device": "nvme", "nvme_path": args.swap_dir,
                                                  "pin_memory": True, "buffer_count": 4}}
    if args.tuned:
        offload_param["max_in_cpu"] = 0
        zero |= {"sub_group_size": 100_000_000, "stage3_max_live_parameters": 100_000_000,
                 "stage3_max_reuse_distance": 100_000_000}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "steps_per_print": 1 << 30, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999],
                                                      "eps": 1e-8, "weight_decay": 0.01}},
            "zero_optimization": zero}


def predicted(config: dict[str, Any], parameters: int) -> dict[str, int]:
    """The host buffers DeepSpeed's source allocates for `config` (see the module docstring)."""
    zero = config["zero_optimization"]
    param, optimizer = zero["offload_param"], zero["offload_optimizer"]
    sub_group = min(int(zero.get("sub_group_size", 1_000_000_000)), parameters)
    in_cpu = min(int(param.get("max_in_cpu", 1_000_000_000)), parameters)
    return {"param_swap_buffers": param["buffer_count"] * param["buffer_size"] * 2,
            "params_kept_in_cpu": in_cpu * 2,
            "gradients_all_parameters": parameters * 2,
            "optimizer_swap_buffers": optimizer["buffer_count"] * sub_group * 4,
            "optimizer_gradient_buffer": sub_group * 4}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--swap-dir", required=True)
    parser.add_argument("--param-buffers", type=int, default=56)
    parser.add_argument("--tuned", action="store_true")
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port()))):
        os.environ.setdefault(key, value)
    import deepspeed
    import torch
    from transformers import LlamaForCausalLM

    from bench_scale import WIDE, llama_config, parameters_of

    spec = {**WIDE, "num_hidden_layers": args.layers}
    parameters = parameters_of(spec)
    largest = spec["vocab_size"] * spec["hidden_size"]
    config = ds_config(args, -(-largest // 1_000_000) * 1_000_000)
    os.makedirs(args.swap_dir, exist_ok=True)
    deepspeed.init_distributed(dist_backend="gloo")
    started = time.perf_counter()
    with deepspeed.zero.Init(config_dict_or_path=config, remote_device="nvme", pin_memory=True,
                             dtype=torch.bfloat16):
        model = LlamaForCausalLM(llama_config(spec, 256))
    built_rss = status_bytes("VmRSS")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    initialized = time.perf_counter()
    init_rss = status_bytes("VmRSS")
    losses, seconds = [], []
    try:
        for step in range(args.steps):
            ids = torch.randint(0, spec["vocab_size"], (1, 256),
                                generator=torch.Generator().manual_seed(step))
            begun = time.perf_counter()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            seconds.append(round(time.perf_counter() - begun, 2))
            losses.append(round(float(loss.detach()), 5))
    finally:  # DeepSpeed's swap files (as large as the training state), not the folder given
        shutil.rmtree(os.path.join(args.swap_dir, "zero_stage_3"), ignore_errors=True)
    buffers = predicted(config, parameters)
    print(json.dumps({
        "deepspeed": deepspeed.__version__, "layers": args.layers, "parameters": parameters,
        "tuned": args.tuned, "zero_optimization": config["zero_optimization"],
        "init_s": round(initialized - started, 1), "step_seconds": seconds, "losses": losses,
        "rss_after_build_bytes": built_rss, "rss_after_initialize_bytes": init_rss,
        "peak_rss_bytes": status_bytes("VmHWM"), "locked_bytes": status_bytes("VmLck"),
        "predicted_buffers": buffers, "predicted_total_bytes": sum(buffers.values())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
