"""The generation half of `infinity demo`: the trained model, imported, writes with its weights
streamed from NVMe.

It uses only the public API, as a user would: `infinity.torch.import_model` loads the folder the
training half saved (config and safetensors) into a fresh daemon's store, read-only; the daemon's
CPU tier holds a quarter of the weights, the rest stays on NVMe. `infinity.torch.load_causal_lm`
builds the model with no weights in the process, and transformers' own `generate()` samples the
same line the trainer's model wrote (same weights, same seed), byte by byte as it comes, while
the daemon streams the layers in the order the previous tokens taught it.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from rich.console import Console

from infinity.cli.demo_train import nvme_bytes, private_daemon_config
from infinity.config import InfinityConfig, MiB


class _ByteStreamer:
    """transformers' streamer protocol: prints each new byte as it is generated."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.arrivals: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.arrivals.append(time.perf_counter())
        text = bytes(value.flatten().tolist()).decode("utf-8", "replace")
        self.console.print(text, end="", style="bold", markup=False, highlight=False)

    def end(self) -> None:
        self.console.print()


def generate_part(config: InfinityConfig, base: Path, console: Console, *, model_dir: Path,
                  prompt: bytes, max_new_tokens: int, sample_seed: int) -> dict[str, object]:
    import infinity
    import infinity.torch as itorch

    weight_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    budget = max(8 * MiB, weight_bytes // 4 // (2 * MiB) * (2 * MiB))
    store = base / "generate-store"
    config = private_daemon_config(config, store=store, runtime_dir=base / "generate-run",
                                   budget_bytes=budget, segment_bytes=2 * MiB)
    console.rule("[bold]Generating with the weights in infinityd")
    client = infinity.connect(config=config, start=True, name="demo-generate")
    try:
        report = itorch.import_model(client, str(model_dir), namespace="demo-lm")
        console.print(f"imported {report.tensors} tensors ({report.tensor_bytes / MiB:.0f} MiB) "
                      f"into namespace demo-lm, read-only; the daemon's CPU tier holds "
                      f"{budget / MiB:.0f} MiB, the rest streams from NVMe in {store}")
        model = itorch.load_causal_lm(client, namespace="demo-lm")
        streamer = _ByteStreamer(console)
        before, _ = nvme_bytes(client.stats())
        ids = torch.tensor([list(prompt)])
        console.print(prompt.decode(), end="", markup=False, highlight=False)
        torch.manual_seed(sample_seed)
        started = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), streamer=streamer,
                             max_new_tokens=max_new_tokens, do_sample=True, top_k=8,
                             temperature=0.8)
        read = nvme_bytes(client.stats())[0] - before
        text = bytes(out[0].tolist()).decode("utf-8", "replace")
        arrivals = streamer.arrivals
        per_token_s = ((arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)
                       if len(arrivals) > 1 else None)
        first_s = arrivals[0] - started if arrivals else None
        console.print(f"{len(arrivals)} tokens; the first after {first_s or 0:.2f} s, then "
                      f"{per_token_s or 0:.3f} s per token; {read / MiB:.0f} MiB read from NVMe")
        return {"weight_bytes": weight_bytes, "cpu_budget_bytes": budget,
                "tokens": len(arrivals), "first_token_s": round(first_s or 0, 3),
                "per_token_s": round(per_token_s or 0, 4), "nvme_read_bytes": read,
                "generated": text}
    finally:
        client.shutdown_daemon()
        client.close()


