"""One linear layer computed from its quantized copy, three ways, in one run: per-layer time.

    .venv/bin/python tools/bench_quant_linear.py [--shapes 2048x2048,5632x2048] [--rows 1,4]
                                                 [--rounds 15] [--sweep 1,2,4,...] > out.json

For each weight shape (out x in, bf16, seeded random values), each form (int8 block 128, int4
block 64) and each number of input rows (decode: 1 row a sequence), the subjects take turns
within each round (their order rotated each round, so background load falls on all alike):

- `fused`: `infinity.torch.quantize.linear`, the native kernel multiplying from the codes (what
  a streamed quantized model runs on the CPU for at most `FUSED_MAX_ROWS` rows);
- `dequant_matmul`: the weight dequantized natively into a reused bf16 buffer, then torch's
  `functional.linear` (what it runs for more rows, and what it ran for every input before);
- `bf16_matmul`: torch's `functional.linear` on the bf16 weight (a model in memory).

Each subject's call goes round `copies` distinct copies of the weight, together over 96 MiB (3x
the 32 MiB L3 of this project's machine), so each call reads its weight from memory, as a
streamed layer does; a sample is the mean over one pass through the copies. Reported: medians
over rounds in milliseconds per layer, and the ratios of the other two to `fused` (above 1:
fused is faster). `--sweep` adds, for the first shape, the rows at which fused stops being
faster than dequant_matmul (the crossover behind `FUSED_MAX_ROWS`). JSON on stdout, with the
load average before and after, the SIMD path and torch's thread count.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.nn import functional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infinity.io.native import native  # noqa: E402
from infinity.torch.quantize import BLOCK_SIZES, FUSED_MAX_ROWS, dequantize, linear, quantize  # noqa: E402

COPIES_BYTES = 96 << 20  # what the copies of one subject's weight take together, at least


class Layer:
    """`copies` copies of one weight: bf16 values, and one form's codes and scales."""

    def __init__(self, out: int, n: int, form: str, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        weight = (torch.randn(out, n, generator=generator) / math.sqrt(n)).to(torch.bfloat16)
        self.form, self.block = form, BLOCK_SIZES[form]
        codes, scales = quantize(weight, form, self.block)
        copies = max(2, math.ceil(COPIES_BYTES / (codes.numel() + scales.numel() * 2)))
        self.codes = [codes.clone() for _ in range(copies)]
        self.scales = [scales.clone() for _ in range(copies)]
        self.weights = [weight.clone() for _ in range(max(2, math.ceil(COPIES_BYTES / (out * n * 2))))]
        self.buffer = torch.empty(out, n, dtype=torch.bfloat16)

    def fused(self, x: torch.Tensor) -> float:
        start = time.perf_counter()
        for codes, scales in zip(self.codes, self.scales):
            linear(x, codes, scales, self.form, self.block)
        return (time.perf_counter() - start) / len(self.codes)

    def dequant_matmul(self, x: torch.Tensor) -> float:
        start = time.perf_counter()
        for codes, scales in zip(self.codes, self.scales):
            functional.linear(x, dequantize(codes, scales, self.form, self.block, out=self.buffer))
        return (time.perf_counter() - start) / len(self.codes)

    def bf16_matmul(self, x: torch.Tensor) -> float:
        start = time.perf_counter()
        for weight in self.weights:
            functional.linear(x, weight)
        return (time.perf_counter() - start) / len(self.weights)


def medians(layer: Layer, rows: int, rounds: int, names: list[str]) -> dict[str, float]:
    x = torch.randn(rows, layer.buffer.shape[1]).to(torch.bfloat16)
    subjects: dict[str, Callable[[torch.Tensor], float]] = {
        "fused": layer.fused, "dequant_matmul": layer.dequant_matmul,
        "bf16_matmul": layer.bf16_matmul}
    for name in names:  # warm up: first-touch pages, thread pools
        subjects[name](x)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(subjects[name](x))
    return {name: statistics.median(values) * 1e3 for name, values in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="2048x2048,5632x2048", help="out x in, comma-separated")
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--forms", default="int8,int4")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--sweep", default="", help="rows for the crossover, e.g. 1,2,4,8,16,32")
    args = parser.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    result: dict[str, Any] = {
        "load_average_before": os.getloadavg(), "simd": native().quant_linear_implementation(),
        "threads": torch.get_num_threads(), "rounds": args.rounds,
        "fused_max_rows": FUSED_MAX_ROWS, "layers": [], "sweep": []}
    everything = ["fused", "dequant_matmul", "bf16_matmul"]
    for seed, (out, n) in enumerate(shapes):
        for form in args.forms.split(","):
            layer = Layer(out, n, form, seed)
            for rows in (int(r) for r in args.rows.split(",")):
                ms = medians(layer, rows, args.rounds, everything)
                entry = {"shape": [out, n], "form": form, "rows": rows, "median_ms": ms,
                         "dequant_matmul_over_fused": ms["dequant_matmul"] / ms["fused"],
                         "bf16_matmul_over_fused": ms["bf16_matmul"] / ms["fused"]}
                print(json.dumps(entry), file=sys.stderr)
                result["layers"].append(entry)
            if args.sweep and (out, n) == shapes[0]:
                for rows in (int(r) for r in args.sweep.split(",")):
                    ms = medians(layer, rows, max(5, args.rounds // 3), ["fused", "dequant_matmul"])
                    entry = {"shape": [out, n], "form": form, "rows": rows, "median_ms": ms,
                             "dequant_matmul_over_fused": ms["dequant_matmul"] / ms["fused"]}
                    print(json.dumps(entry), file=sys.stderr)
                    result["sweep"].append(entry)
            del layer
    result["load_average_after"] = os.getloadavg()
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
