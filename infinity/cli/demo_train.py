"""The training half of `infinity demo`: fine-tune a small GPT-2 whose state lives on NVMe.

It uses only the public API, as a user's script would (examples/train_offloaded.py is the same
loop without the display): a transformers GPT-2 built from a config (nothing is downloaded),
`infinity.torch.offload` to keep its parameters in infinityd's store, `infinity.torch.AdamW` to
keep the Adam states there and run the step in the daemon, and a torch LR scheduler. The daemon
runs with an NVMe tier and a CPU tier of a quarter of the training state, so the state streams
from and to the disk every step. A progress bar shows the loss, the step time and the bytes moved
to and from NVMe; at the end the loss curve is drawn and the model writes a line of text.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from infinity.cli.plot import line_chart
from infinity.config import InfinityConfig, MiB

PROMPT = b"Infinity is "
SAMPLE_SEED = 0
SAMPLE_TOKENS = 48
SEQUENCE = 64
BATCH = 8


def corpus() -> torch.Tensor:
    """The bytes the model learns: this package's own docstrings and README, shipped with it."""
    root = Path(__file__).resolve().parent.parent.parent
    parts = [root / "README.md", root / "docs" / "ARCHITECTURE.md"]
    text = b"\n".join(p.read_bytes() for p in parts if p.exists())
    if len(text) < 4 * SEQUENCE:  # an installed package without the repository's files
        import infinity

        text = (infinity.__doc__ or "Infinity offloads tensors.").encode() * 64
    return torch.tensor(list(text), dtype=torch.long)


def build_model() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=SEQUENCE * 2, n_embd=256,
                                      n_layer=6, n_head=8, bos_token_id=10, eos_token_id=10))


def private_daemon_config(config: InfinityConfig, *, store: Path, runtime_dir: Path,
                          budget_bytes: int, segment_bytes: int) -> InfinityConfig:
    """The settings of a demo part's own daemon: its runtime folder, one store folder (made
    here) and a CPU tier of `budget_bytes`."""
    store.mkdir(parents=True, exist_ok=True)
    config = dataclasses.replace(
        config,
        daemon=dataclasses.replace(config.daemon, runtime_dir=str(runtime_dir)),
        nvme=dataclasses.replace(config.nvme, dirs=(str(store),)),
        cpu=dataclasses.replace(config.cpu, budget_bytes=budget_bytes,
                                segment_bytes=segment_bytes))
    config.cpu.validate()
    return config


def nvme_bytes(stats: dict[str, Any]) -> tuple[int, int]:
    tiers = stats.get("counters", {}).get("tiers", {})
    read = tiers.get("reload_bytes", 0) + tiers.get("stream_read_bytes", 0)
    written = tiers.get("writeback_bytes", 0) + tiers.get("stream_write_bytes", 0)
    return read, written


def train_part(config: InfinityConfig, base: Path, console: Console, *,
               steps: int, save_dir: Path | None = None) -> dict[str, object]:
    """Train; with `save_dir`, save the trained model there as transformers saves one."""
    import infinity
    import infinity.torch as itorch

    model = build_model()
    num_params = sum(p.numel() for p in model.parameters())
    state_bytes = num_params * 16  # parameter, gradient and two moments, fp32
    budget = max(16 * MiB, state_bytes // 4 // (2 * MiB) * (2 * MiB))
    store = base / "train-store"
    config = private_daemon_config(config, store=store, runtime_dir=base / "train-run",
                                   budget_bytes=budget, segment_bytes=4 * MiB)
    console.rule("[bold]Training with the state in infinityd")
    console.print(f"GPT-2 from a config: {num_params / 1e6:.1f}M parameters, "
                  f"{state_bytes / MiB:.0f} MiB of training state; the daemon's CPU tier holds "
                  f"{budget / MiB:.0f} MiB, the rest is on NVMe in {store}")
    data = corpus()
    generator = torch.Generator().manual_seed(1)
    client = infinity.connect(config=config, start=True, name="demo-trainer")
    losses: list[float] = []
    step_times: list[float] = []
    try:
        model = itorch.offload(model, client, namespace="demo-gpt2")
        optimizer = itorch.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3, total_steps=steps,
                                                        pct_start=0.2)
        read0, written0 = nvme_bytes(client.stats())
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[step]}"),
                   TextColumn("NVMe read {task.fields[read]} written {task.fields[written]}"),
                   TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("training", total=steps, loss="-", step="", read="-",
                                     written="-")
            for _ in range(steps):
                start = time.perf_counter()
                starts = torch.randint(0, len(data) - SEQUENCE - 1, (BATCH,), generator=generator)
                batch = torch.stack([data[s:s + SEQUENCE] for s in starts])
                loss = model(input_ids=batch, labels=batch).loss
                loss.backward()
                optimizer.clip_grad_norm_(1.0)
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
                step_times.append(time.perf_counter() - start)
                losses.append(float(loss.detach()))
                read, written = nvme_bytes(client.stats())
                progress.update(task, advance=1, loss=f"{losses[-1]:.3f}",
                                step=f"{step_times[-1]:.2f} s/step",
                                read=f"{(read - read0) / MiB:.0f} MiB",
                                written=f"{(written - written0) / MiB:.0f} MiB")
        console.print(Panel(line_chart(losses, label="step"), title="training loss",
                            expand=False))
        model.eval()
        prompt = torch.tensor([list(PROMPT)])
        torch.manual_seed(SAMPLE_SEED)  # the same line every run
        with torch.no_grad():
            # Sampled (top-k): after a few dozen steps a byte-level model's single most likely
            # next byte is a space, so greedy decoding would print nothing but spaces.
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt),  # type: ignore[operator]
                                 max_new_tokens=SAMPLE_TOKENS, do_sample=True, top_k=8,
                                 temperature=0.8)
        text = bytes(out[0].tolist()).decode("utf-8", "replace")
        console.print(f"the trained model, sampled, from {PROMPT.decode()!r}: [bold]{text!r}")
        if save_dir is not None:
            # The weights as the store holds them, one at a time (the process holds none).
            state = itorch.offload_state(model)
            weights = {name: state.parameter(param) for name, param in state.stored_names()}
            from transformers.utils import logging as transformers_logging

            transformers_logging.disable_progress_bar()  # the demo draws its own
            model.save_pretrained(str(save_dir), state_dict=weights)  # type: ignore[operator]
        read, written = nvme_bytes(client.stats())
        return {"steps": steps, "parameters": num_params, "state_bytes": state_bytes,
                "cpu_budget_bytes": budget, "first_loss": round(losses[0], 4),
                "last_loss": round(losses[-1], 4),
                "median_step_s": round(sorted(step_times)[len(step_times) // 2], 3),
                "nvme_read_bytes": read - read0, "nvme_written_bytes": written - written0,
                "generated": text}
    finally:
        client.shutdown_daemon()
        client.close()
