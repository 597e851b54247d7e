"""A trainer run in its own process for the memory tests: trains a stack of nn.Linear layers
offloaded to a running infinityd and prints, as JSON, the peak of its resident memory during
the measured steps (the kernel's high-water mark, VmHWM, reset after a warm-up step).

    python offloaded_trainer_rss.py SETTINGS_FILE RUNTIME_DIR WIDTH DEPTH BATCH STEPS
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn


def stack(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def resident_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def main(settings_file: str, runtime_dir: str, width: int, depth: int, batch: int,
         steps: int) -> None:
    import infinity
    import infinity.torch as itorch
    from infinity.config import load_config

    config = load_config(settings_file, env={}, overrides={"daemon.runtime_dir": runtime_dir})
    client = infinity.connect(config=config, name=f"rss-{depth}")
    try:
        model = itorch.offload(stack(width, depth), client, namespace=f"rss{depth}")
        optimizer = itorch.AdamW(model.parameters(), lr=1e-3)
        inputs = torch.randn(batch, width, generator=torch.Generator().manual_seed(1))

        def train_step() -> None:
            model(inputs).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()

        train_step()  # first-use allocations (thread pools, mappings) are the same for any size
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # resets VmHWM to the current resident size
        for _ in range(steps):
            train_step()
        print(json.dumps({"peak_rss_bytes": resident_bytes("VmHWM"),
                          "shared_rss_bytes": resident_bytes("RssShmem"),
                          "parameters": sum(p.numel() for p in model.parameters())}))
    finally:
        client.close()


if __name__ == "__main__":
    settings, runtime, *numbers = sys.argv[1:]
    main(settings, runtime, *(int(n) for n in numbers))
