"""A training script that works the same fresh and restarted, run in its own process by the warm
restart and checkpoint tests (which kill it with SIGKILL) and in the test's process for the runs
that do not stop.

    python restartable_trainer.py SETTINGS_FILE RUNTIME_DIR NAMESPACE MODEL STEPS [options]

It asks the store where the run stands (`resume_point`), builds the tiny model empty or with
values accordingly, offloads it, builds AdamW and a warm-up schedule, and trains from the step
`resume` returns. The batch of a step, and its dropout mask, follow from the step's number. It
prints one JSON object a line: {"resumed_at": n}, then {"step": n, "loss": x} after each step,
{"saved": n} after each checkpoint, and {"waiting": n} where --wait-before stops it.

Options: --dtype bfloat16 (parameters stored so, fp32 masters), --wait-before N (after the
forward and backward of step N, wait for a line on stdin before its optimizer step: the test
kills it there), --save-at N:PATH (save a checkpoint after step N, reporting {"saving": N}
first; repeatable), --delay-update (the optimizer's delayed parameter update).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any, Callable

import torch
from torch import nn

BATCH_SHAPE = (2, 13)


def batch(step: int, vocab: int) -> torch.Tensor:
    return torch.randint(1, vocab - 2, BATCH_SHAPE, generator=torch.Generator().manual_seed(
        1000 + step))


def warmup(step: int) -> float:
    """A warm-up, then a decay: the lr of every step differs from its neighbours'."""
    return min(1.0, (step + 1) / 4) / (1 + 0.1 * step)


def wide_gpt2() -> nn.Module:
    """A GPT-2 whose state (about 30 MB with the moments) takes a save long enough to kill."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(7)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=2053,
                                      n_positions=64, eos_token_id=2052, bos_token_id=2052))


def builder(model: str) -> Callable[[], nn.Module]:
    import tiny_models

    return {"gpt2": tiny_models.gpt2, "llama": tiny_models.llama, "gpt2-wide": wide_gpt2}[model]


def report(**entry: Any) -> None:
    print(json.dumps(entry), flush=True)


def train(client: Any, namespace: str, model_name: str, steps: int, *,
          dtype: torch.dtype | None = None, wait_before: int | None = None,
          save_at: dict[int, str] | None = None, load_from: str | None = None,
          delay_update: bool = False, report: Callable[..., None] = report) -> list[float]:
    """Train until `steps` steps are done (from wherever the namespace's state is, or from the
    checkpoint `load_from`); returns the losses of the steps this call ran."""
    import infinity.torch as itorch

    done = itorch.resume_point(client, namespace=namespace)
    with itorch.empty_parameters() if done is not None else contextlib.nullcontext():
        model = builder(model_name)()
    model.train()
    itorch.offload(model, client, namespace=namespace, from_store=done is not None,
                   param_dtype=dtype)
    optimizer = itorch.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1,
                             delay_update=delay_update)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    if load_from is not None:
        start = itorch.load_checkpoint(load_from, model, optimizer, scheduler)
    else:
        start = optimizer.resume(scheduler)
    report(resumed_at=start)
    vocab = model.config.vocab_size
    losses = []
    for step in range(start + 1, steps + 1):  # steps count from 1
        ids = batch(step, vocab)
        torch.manual_seed(2000 + step)  # the same dropout mask whenever this step runs
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == wait_before:
            report(waiting=step)
            sys.stdin.readline()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(float(loss.detach()))
        report(step=step, loss=losses[-1])
        if save_at and step in save_at:
            report(saving=step)
            itorch.save_checkpoint(save_at[step], model, optimizer, scheduler)
            report(saved=step)
    optimizer.synchronize()
    return losses


def main() -> None:
    import infinity
    from infinity.config import load_config

    parser = argparse.ArgumentParser()
    parser.add_argument("settings_file")
    parser.add_argument("runtime_dir")
    parser.add_argument("namespace")
    parser.add_argument("model", choices=["gpt2", "llama", "gpt2-wide"])
    parser.add_argument("steps", type=int)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--wait-before", type=int)
    parser.add_argument("--save-at", action="append", default=[])
    parser.add_argument("--delay-update", action="store_true")
    args = parser.parse_args()
    config = load_config(args.settings_file, env={},
                         overrides={"daemon.runtime_dir": args.runtime_dir})
    client = infinity.connect(config=config, name=f"trainer-{args.namespace}")
    save_at = {int(step): path for step, _, path in
               (entry.partition(":") for entry in args.save_at)}
    try:
        train(client, args.namespace, args.model, args.steps, dtype=getattr(torch, args.dtype),
              wait_before=args.wait_before, save_at=save_at, delay_update=args.delay_update)
    finally:
        client.close()


if __name__ == "__main__":
    main()
