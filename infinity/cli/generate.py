"""`infinity generate --namespace NAME "prompt"`: stream a completion from an imported model.

The model's weights stay in the store (`infinity.torch.generation`), streamed in full precision
or, with `--quantization int8|int4`, as the quantized copies the import made; tokens go to the
terminal as they come, and a last line on stderr says how long the first token took and the
seconds per token after it.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from infinity.config import load_config


class _TimedStreamer:
    """transformers' streamer protocol (`put`, `end`): prints text as it decodes, and notes
    when each token arrived."""

    def __init__(self, tokenizer: Any) -> None:
        from transformers import TextStreamer

        self._text = TextStreamer(tokenizer, skip_prompt=True)
        self._prompt_seen = False
        self.arrivals: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.arrivals.append(time.perf_counter())
        self._prompt_seen = True
        self._text.put(value)

    def end(self) -> None:
        self._text.end()


def run(args: argparse.Namespace) -> int:
    import infinity
    from infinity.torch.generation import load_causal_lm, load_tokenizer

    config = load_config(path=args.config, overrides=args.overrides)
    client = infinity.connect(config=config, name="infinity-generate")
    try:
        tokenizer = load_tokenizer(client, namespace=args.namespace)
        model = load_causal_lm(client, namespace=args.namespace,
                               quantization=args.quantization,
                               quantized_lm_head=args.quantized_lm_head)
        inputs = tokenizer(args.prompt, return_tensors="pt")
        streamer = _TimedStreamer(tokenizer)
        options: dict[str, Any] = dict(max_new_tokens=args.max_new_tokens, streamer=streamer)
        if args.temperature > 0:
            torch.manual_seed(args.seed)
            options.update(do_sample=True, temperature=args.temperature, top_p=args.top_p)
        else:
            options.update(do_sample=False)
        if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
            options["pad_token_id"] = tokenizer.eos_token_id
        sys.stdout.write(args.prompt)
        sys.stdout.flush()
        started = time.perf_counter()
        model.generate(**inputs, **options)
        _report(streamer, started)
    finally:
        client.close()
    return 0


def _report(streamer: _TimedStreamer, started: float) -> None:
    arrivals = streamer.arrivals
    if not arrivals:
        print("no tokens generated", file=sys.stderr)
        return
    first_s = arrivals[0] - started
    line = f"{len(arrivals)} tokens; first after {first_s:.2f} s"
    if len(arrivals) > 1:
        per_token_s = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)
        line += f", then {per_token_s:.3f} s per token"
    print(line, file=sys.stderr)
