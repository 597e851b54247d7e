"""Fine-tune a small GPT-2 with its parameters and Adam states in infinityd's store.

    .venv/bin/python examples/train_offloaded.py [--steps 30] [--nvme-dir DIR]

What a user copies: a transformers model, `infinity.torch.offload`, `infinity.torch.AdamW`, a torch
LR scheduler, an ordinary loop. The model is built from a config (no hub here) and learns the
bytes of this repository's README. With --nvme-dir the daemon keeps the state on NVMe behind a
CPU tier of a quarter of it; without, in the CPU tier.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import infinity
import infinity.torch as itorch
from infinity.config import load_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--nvme-dir", help="keep the training state on NVMe in this folder")
    args = parser.parse_args()

    # Byte-level language modelling of a text shipped with the repository.
    text = (Path(__file__).resolve().parent.parent / "README.md").read_bytes()
    data = torch.tensor(list(text), dtype=torch.long)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=128, n_embd=128, n_layer=4,
                                       n_head=4, bos_token_id=10, eos_token_id=10))

    state_bytes = sum(p.numel() for p in model.parameters()) * 4 * 4  # param, grad, 2 moments
    settings = {"daemon.runtime_dir": tempfile.mkdtemp(prefix="infinity-example-")}
    if args.nvme_dir:
        os.makedirs(args.nvme_dir, exist_ok=True)
        settings |= {"nvme.dirs": [args.nvme_dir],
                     "cpu.budget_bytes": max(16 << 20, state_bytes // 4 // (2 << 20) * (2 << 20)),
                     "cpu.segment_bytes": 4 << 20}
    client = infinity.connect(config=load_config(overrides=settings), start=True, name="example")
    try:
        model = itorch.offload(model, client, namespace="example-gpt2")
        optimizer = itorch.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3,
                                                        total_steps=args.steps)
        for step in range(args.steps):
            starts = torch.randint(0, len(data) - 65, (8,))
            batch = torch.stack([data[s:s + 64] for s in starts])
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.clip_grad_norm_(1.0)  # the gradients are in the store, not in .grad
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            print(f"step {step + 1:3d}  loss {loss.item():.3f}")
        model.eval()
        prompt = torch.tensor([list(b"Infinity ")])
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                 max_new_tokens=60, do_sample=False)
        print(bytes(out[0].tolist()).decode("utf-8", "replace"))
    finally:
        client.shutdown_daemon()
        client.close()


if __name__ == "__main__":
    main()
