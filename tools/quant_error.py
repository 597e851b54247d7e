"""The error of the quantized copies (int8, int4) against full precision, on a model folder.

    .venv/bin/python tools/quant_error.py MODEL_FOLDER [--prompts 8] [--prompt-tokens 32]
                                          [--new-tokens 16] [--forms int8,int8+lm_head,int4]
                                          > error.json
    .venv/bin/python tools/quant_error.py --tiny-llama     # the tests' seeded tiny Llama

Over a fixed prompt set (`--prompts` seeded random prompts of `--prompt-tokens` token ids, the
same every run), for each form:

- logits, teacher-forced (every position of every prompt, one forward): the largest and the mean
  absolute difference from full precision's, and both relative to full precision's largest
  |logit|;
- the share of those positions whose greedy token (the argmax) changes, beside the median lead
  of full precision's greedy token over the next one (an error of that size changes it);
- the share of greedy tokens that change when generating `--new-tokens` from each prompt
  (position by position: after a first change the continuations usually part).

The quantized model is the folder's model in memory with each linear layer's weight replaced by
what its copy dequantizes to (`infinity.torch.quantize.round_trip`, on the weights
`linear_weight_names` picks, as an import does; the output projection's too in a form
"FORM+lm_head", as `load_causal_lm(quantized_lm_head=True)` streams it): streamed generation
from the copies computes exactly that, bit for bit (tests/test_quantized_generation.py), so no
daemon is needed here.
JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
SEED = 0


def fixed_prompts(count: int, length: int, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(SEED)
    return torch.randint(3, vocab, (count, length), generator=generator)


def load(folder: str, form: str | None) -> Any:
    """The folder's model in memory, its linear layers' weights round-tripped through `form`
    ("int8+lm_head": the output projection's too, where it is not tied)."""
    from transformers import AutoModelForCausalLM

    from infinity.torch.quantize import linear_weight_names, round_trip

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    if form is not None:
        base, _, head = form.partition("+")
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name in linear_weight_names(folder, params,
                                            with_output_projection=head == "lm_head"):
                params[name].copy_(round_trip(params[name], base))
    return model


def outputs(model: Any, prompts: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    """Teacher-forced logits (float32) and greedy continuations of each prompt."""
    mask = torch.ones_like(prompts)
    with torch.no_grad():
        logits = model(input_ids=prompts, attention_mask=mask).logits.float()
        tokens = model.generate(prompts, attention_mask=mask, do_sample=False,
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                pad_token_id=0)[:, prompts.shape[1]:]
    return logits, tokens


def measure(folder: str, *, forms: list[str], prompts: int, prompt_tokens: int,
            new_tokens: int) -> dict[str, Any]:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(folder).vocab_size
    ids = fixed_prompts(prompts, prompt_tokens, vocab)
    started = time.perf_counter()
    exact_logits, exact_tokens = outputs(load(folder, None), ids, new_tokens)
    scale = exact_logits.abs().max().item()
    top2 = exact_logits.topk(2, dim=-1).values
    result: dict[str, Any] = {"folder": folder, "prompts": prompts, "prompt_tokens": prompt_tokens,
                              "new_tokens": new_tokens, "logit_scale": scale,
                              # How far full precision's greedy token leads the next one: an
                              # error of this size changes it (small for seeded random weights).
                              "top2_margin_median": (top2[..., 0] - top2[..., 1]).median().item(),
                              "forms": {}}
    for form in forms:
        logits, tokens = outputs(load(folder, form), ids, new_tokens)
        difference = (logits - exact_logits).abs()
        result["forms"][form] = {
            "logits_max_abs_diff": difference.max().item(),
            "logits_mean_abs_diff": difference.mean().item(),
            "logits_max_rel": difference.max().item() / scale,
            "logits_mean_rel": difference.mean().item() / scale,
            "argmax_changed_share": (logits.argmax(-1) != exact_logits.argmax(-1))
            .float().mean().item(),
            "generated_changed_share": (tokens != exact_tokens).float().mean().item(),
            "prompts_with_a_change": int((tokens != exact_tokens).any(-1).sum().item()),
        }
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def tiny_llama_folder(root: str) -> str:
    """The tests' seeded tiny Llama (tests/tiny_models.py), saved into `root`."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import llama

    folder = os.path.join(root, "tiny-llama")
    llama().save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", help="a model folder (save_pretrained)")
    parser.add_argument("--tiny-llama", action="store_true",
                        help="measure the tests' seeded tiny Llama instead of a folder")
    parser.add_argument("--forms", default="int8,int8+lm_head,int4")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    if (args.folder is None) == (not args.tiny_llama):
        parser.error("give a model folder or --tiny-llama")
    options = dict(forms=[f for f in args.forms.split(",") if f], prompts=args.prompts,
                   prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens)
    if args.tiny_llama:
        with tempfile.TemporaryDirectory(prefix="quant-error-") as root:
            result = measure(tiny_llama_folder(root), **options)  # type: ignore[arg-type]
        result["folder"] = "tests/tiny_models.py llama()"
    else:
        result = measure(args.folder, **options)  # type: ignore[arg-type]
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
