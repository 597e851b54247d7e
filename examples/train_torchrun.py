"""Data-parallel training under torchrun: the ranks of a node share one copy of the model's state
in the node's infinityd, and nodes split the optimizer between them.

One node, two ranks (the first rank of each node starts the node's daemon if none runs):

    .venv/bin/torchrun --nproc-per-node 2 examples/train_torchrun.py [--steps 20]

Two nodes of two ranks, here on one machine (each node has its daemon; on real nodes drop
--runtime-dir and give the first node's address):

    .venv/bin/torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr 127.0.0.1 \\
        --master-port 29511 examples/train_torchrun.py --runtime-dir /tmp/node0 &
    .venv/bin/torchrun --nnodes 2 --node-rank 1 --nproc-per-node 2 --master-addr 127.0.0.1 \\
        --master-port 29511 examples/train_torchrun.py --runtime-dir /tmp/node1

What differs from a one-process loop (examples/train_offloaded.py): `init_process_group`, and
`process_group=` given to `offload`. Each rank trains on its own batches; the gradients are
averaged over the ranks as DistributedDataParallel averages them (summed in the node's shared
memory, then between nodes with gloo), and the optimizer step runs once per node, in its daemon,
for the part of the parameters the node owns. Rank 0 draws the loss curve, averaged over ranks.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.panel import Panel
from transformers import GPT2Config, GPT2LMHeadModel

import infinity
import infinity.torch as itorch
from infinity.cli.plot import line_chart
from infinity.config import load_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--runtime-dir", help="the node daemon's runtime folder (default: one "
                        "per node under the temporary folder)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank, node = int(os.environ["LOCAL_RANK"]), int(os.environ.get("GROUP_RANK", "0"))
    runtime_dir = args.runtime_dir or os.path.join(tempfile.gettempdir(),
                                                   f"infinity-torchrun-node{node}")
    config = load_config(overrides={"daemon.runtime_dir": runtime_dir})
    # The node's first rank starts its daemon; the others attach once it serves.
    client = infinity.connect(config=config, start=True, name=f"rank{rank}") if local_rank == 0 \
        else None
    dist.barrier()
    client = client or infinity.connect(config=config, name=f"rank{rank}")
    try:
        text = (Path(__file__).resolve().parent.parent / "README.md").read_bytes()
        data = torch.tensor(list(text), dtype=torch.long)
        torch.manual_seed(0)  # rank 0's values are every node's anyway
        model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=128, n_embd=128,
                                           n_layer=4, n_head=4, bos_token_id=10,
                                           eos_token_id=10))
        model = itorch.offload(model, client, namespace="torchrun-gpt2",
                               process_group=dist.group.WORLD)
        optimizer = itorch.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3,
                                                        total_steps=args.steps)
        batches = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
        losses = []
        for step in range(args.steps):
            starts = torch.randint(0, len(data) - 65, (4,), generator=batches)
            batch = torch.stack([data[s:s + 64] for s in starts])
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.clip_grad_norm_(1.0)  # of the gradient averaged over all ranks
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / world_size)
        if rank == 0:
            Console().print(Panel(line_chart(losses, label="step"),
                                  title=f"training loss, mean of {world_size} ranks"))
        dist.barrier()  # every rank is done with the daemons
        if local_rank == 0:
            client.shutdown_daemon()
    finally:
        client.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
