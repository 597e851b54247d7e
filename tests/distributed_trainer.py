"""A data-parallel training script run by the multi-rank tests: under torchrun as ranks sharing
node daemons, or alone as the one process they are compared with.

    python -m torch.distributed.run ... distributed_trainer.py SETTINGS RUNTIME_DIR OUT [options]
    python distributed_trainer.py SETTINGS RUNTIME_DIR OUT --micro-batches M [options]

It trains the tiny Llama (tied embeddings) on a global batch of GLOBAL_BATCH sequences per step.
Under torchrun, rank r of W takes rows [r * B, (r + 1) * B) (B = GLOBAL_BATCH / W) and offloads
with `process_group=WORLD`; alone, it runs the global batch as M micro-batches of as many rows
(gradient accumulation, each loss divided by M), so M = W sums the same per-slice gradients
in the same order. Gradients are clipped to MAX_NORM (below their norm, so it scales them).
Every slice's loss of every step, and the gradient norm clipping saw, go into OUT (JSON, written
by global rank 0): {"slice_losses": [[...], ...], "grad_norms": [...], "cpu_used_bytes": n,
"world_size": W}. One thread each (a thread count changes the order of torch's sums, and so
the last bits).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

GLOBAL_BATCH = 4
SEQUENCE = 13
STEPS = 4
MAX_NORM = 0.5


def rows(step: int, vocab: int) -> torch.Tensor:
    return torch.randint(1, vocab - 2, (GLOBAL_BATCH, SEQUENCE),
                         generator=torch.Generator().manual_seed(500 + step))


def main() -> None:
    import infinity
    import infinity.torch as itorch
    import tiny_models
    from infinity.config import load_config

    parser = argparse.ArgumentParser()
    parser.add_argument("settings_file")
    parser.add_argument("runtime_dir")
    parser.add_argument("out")
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--namespace", default="job")
    args = parser.parse_args()
    torch.set_num_threads(1)
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    config = load_config(args.settings_file, env={},
                         overrides={"daemon.runtime_dir": args.runtime_dir})
    client = infinity.connect(config=config, name=f"rank{rank}")
    try:
        model = tiny_models.llama()
        model.train()
        itorch.offload(model, client, namespace=args.namespace,
                       process_group=dist.group.WORLD if distributed else None)
        # eps is as large as the gradients' small elements here, so the update depends on the
        # gradients' scale too (Adam is otherwise blind to it): an average over the ranks
        # taken wrongly shows in the losses.
        optimizer = itorch.AdamW(model.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
        vocab = model.config.vocab_size
        slices = world_size * args.micro_batches
        per_slice = GLOBAL_BATCH // slices
        losses: list[list[float]] = []
        norms: list[float] = []
        for step in range(STEPS):
            batch = rows(step, vocab)
            step_losses = []
            for micro in range(args.micro_batches):
                first = (rank * args.micro_batches + micro) * per_slice
                ids = batch[first:first + per_slice]
                loss = model(input_ids=ids, labels=ids).loss
                (loss / args.micro_batches).backward()
                step_losses.append(float(loss.detach()))
            norms.append(float(optimizer.clip_grad_norm_(MAX_NORM)))
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            if distributed:
                gathered: list[list[float]] = [[] for _ in range(world_size)]
                dist.all_gather_object(gathered, step_losses)
                step_losses = [loss for part in gathered for loss in part]
            losses.append(step_losses)
        cpu_used = int(client.stats()["tiers"]["cpu"]["used_bytes"])
        if rank == 0:
            with open(args.out, "w") as f:
                json.dump({"slice_losses": losses, "grad_norms": norms, "cpu_used_bytes": cpu_used,
                           "world_size": world_size}, f)
        if distributed:
            dist.barrier()
    finally:
        client.close()
        if distributed:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
