"""tools/bench_infer.py's Accelerate subject: transformers' disk offload (`device_map` with
`max_memory`), in the peers' venv (tools/peers/setup_peers.sh), driven by worker_protocol.

`init` loads the benchmark's model folder with `max_memory={"cpu": budget}`: what does not fit
is left on "disk", i.e. read back from the safetensors files on every forward, through the page
cache (bound by the memory cgroup the benchmark puts this process in). `generate` times one
greedy generation (generate_common.timed_generate) and counts the bytes this process made the
block layer read.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import generate_common  # noqa: E402
import worker_protocol  # noqa: E402

STATE: Dict[str, Any] = {}


def init(request: Dict[str, Any]) -> Dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        request["model_dir"], torch_dtype=torch.bfloat16, device_map="auto",
        max_memory={"cpu": int(request["budget_bytes"])},
        offload_folder=request["offload_dir"])
    model.eval()
    STATE["model"] = model
    placed = list(getattr(model, "hf_device_map", {}).values())
    return {"load_s": time.perf_counter() - started,
            "modules_on_cpu": sum(1 for p in placed if p == "cpu"),
            "modules_on_disk": sum(1 for p in placed if p == "disk")}


def generate(request: Dict[str, Any]) -> Dict[str, Any]:
    ids = generate_common.prompt_ids(int(request["batch"]), int(request["length"]),
                                     int(request["vocab"]), int(request["seed"]))
    before = worker_protocol.proc_io_bytes()
    answer = generate_common.timed_generate(STATE["model"], ids, int(request["new_tokens"]))
    after = worker_protocol.proc_io_bytes()
    answer["disk_read_bytes"] = after["read_bytes"] - before["read_bytes"]
    return answer


if __name__ == "__main__":
    sys.exit(worker_protocol.serve({"init": init, "generate": generate}))
