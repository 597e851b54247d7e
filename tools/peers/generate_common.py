"""What every generation subject of tools/bench_infer.py shares (torch and transformers only, so
the peers' venv can import it): the benchmark's model, its prompts, and a timed `generate`.

The model is a Llama built from a config with seeded weights (nothing from a hub) and saved with
`save_pretrained` in bf16; every subject loads that same folder. Prompts are seeded token ids.
A generation is timed by a streamer (transformers' `put`/`end` protocol): the first `put` is the
prompt, each later one a new token, so the time to the first token and the seconds per token
after it come from the same run, and the tokens come back to compare between subjects.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List

import torch

# About 1.1B parameters (the shape of TinyLlama-1.1B): 2.2 GB of bf16 weights.
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                max_position_embeddings=2048, tie_word_embeddings=False)
# For --quick smoke runs: its figures mean nothing.
LLAMA_TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                  max_position_embeddings=256, tie_word_embeddings=False)


def save_model(spec: Dict[str, Any], folder: str, *, seed: int, shard_bytes: int) -> int:
    """Build the Llama of `spec` with seeded weights, save it in bf16; returns its weight bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**spec, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size=shard_bytes)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def prompt_ids(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=generator)


class TokenTimes:
    """A streamer that notes when the prompt went in and when each new token came out."""

    def __init__(self) -> None:
        self.times: List[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def timed_generate(model: Any, ids: torch.Tensor, new_tokens: int) -> Dict[str, Any]:
    """Greedy generation of exactly `new_tokens` tokens; the time to the first and per token."""
    streamer = TokenTimes()
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             pad_token_id=0, streamer=streamer)
    finished = time.perf_counter()
    answer: Dict[str, Any] = {"tokens": out[:, ids.shape[1]:].tolist(),
                              "total_s": finished - started}
    arrivals = streamer.times[1:]  # the first put is the prompt
    if arrivals:
        answer["first_token_s"] = arrivals[0] - started
        if len(arrivals) > 1:
            answer["per_token_s"] = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)
    return answer
