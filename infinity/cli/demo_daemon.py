"""The daemon half of `infinity demo`: one process writes a model's tensors, another reads them in place.

It uses only the public client API, the way a trainer and an inference process
would: start infinityd, `put` a small model's weights from this process, read
them back from a second process through shared memory (no bytes over the
socket), show the daemon's counters, and stop it.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from infinity.config import CpuTierConfig, InfinityConfig, MiB

LAYERS = 12
HIDDEN = 1000  # odd sizes on purpose: nothing here is a multiple of 4 KiB
DEMO_CPU_BUDGET_BYTES = 512 * MiB
DEMO_SEGMENT_BYTES = 64 * MiB


def model_weights() -> dict[str, torch.Tensor]:
    """A small transformer-shaped set of weights, deterministic."""
    g = torch.Generator().manual_seed(7)
    weights = {"embed.weight": torch.randn(5003, HIDDEN, generator=g, dtype=torch.float32).to(torch.bfloat16)}
    for i in range(LAYERS):
        weights[f"layer{i}.attn.qkv"] = torch.randn(HIDDEN, 3 * HIDDEN, generator=g).to(torch.bfloat16)
        weights[f"layer{i}.mlp.up"] = torch.randn(HIDDEN, 4 * HIDDEN, generator=g).to(torch.bfloat16)
        weights[f"layer{i}.norm"] = torch.randn(HIDDEN, generator=g)
    return weights


READER = textwrap.dedent("""
    import json, sys, zlib
    import infinity
    from infinity.config import load_config
    config = load_config(overrides=sys.argv[1:])
    client = infinity.connect(config=config, name="demo-reader")
    names = [info.name for info in client.list(namespace="demo")]
    report = {"tensors": len(names), "crc": {}, "in_shared_memory": True}
    ranges = client.segment_ranges()
    for name in sorted(names):
        with client.get(name, namespace="demo") as t:
            ptr = t.data_ptr()
            report["in_shared_memory"] &= any(lo <= ptr < hi for _, lo, hi in ranges)
            report["crc"][name] = zlib.crc32(t.contiguous().view(-1).view(__import__("torch").uint8).numpy())
    client.close()
    print(json.dumps(report))
""")


def demo_cpu_tier(cpu: CpuTierConfig) -> CpuTierConfig:
    """The demo's CPU tier: smaller than the default (faster to prefault, fits a small
    machine) where the settings leave it at the default; one set by flag, variable or file is
    the user's choice, and the demo's budget is never below the user's segment."""
    defaults = CpuTierConfig()
    tier = dataclasses.replace(
        cpu,
        budget_bytes=(max(DEMO_CPU_BUDGET_BYTES, cpu.segment_bytes)
                      if cpu.budget_bytes == defaults.budget_bytes else cpu.budget_bytes),
        segment_bytes=(min(DEMO_SEGMENT_BYTES, cpu.budget_bytes, DEMO_CPU_BUDGET_BYTES)
                       if cpu.segment_bytes == defaults.segment_bytes else cpu.segment_bytes))
    tier.validate()
    return tier


def daemon_part(config: InfinityConfig, runtime_dir: Path, console: Console) -> dict[str, object]:
    import zlib

    import infinity
    from infinity.client.launch import settings_as_flags

    tier = demo_cpu_tier(config.cpu)
    config = dataclasses.replace(
        config, daemon=dataclasses.replace(config.daemon, runtime_dir=str(runtime_dir)), cpu=tier)
    weights = model_weights()
    console.print(f"starting infinityd in {runtime_dir}")
    client = infinity.connect(config=config, start=True, name="demo-writer")
    try:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("putting the model's weights", total=len(weights))
            for name, tensor in weights.items():
                client.put(name, tensor, namespace="demo")
                progress.advance(task)
        flags = [flag for flag in settings_as_flags(config) if flag != "--set"]
        reader = subprocess.run([sys.executable, "-c", READER, *flags], capture_output=True, text=True,
                                timeout=120)
        if reader.returncode != 0:
            raise RuntimeError(f"the reader process failed: {reader.stderr.strip()[-2000:]}")
        seen = __import__("json").loads(reader.stdout.strip().splitlines()[-1])
        expected = {name: zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
                    for name, t in weights.items()}
        bit_exact = seen["crc"] == expected
        stats = client.stats()
        table = Table(title="infinityd after the demo")
        table.add_column("what")
        table.add_column("value")
        table.add_row("tensors put by process 1", str(len(weights)))
        table.add_row("tensors read by process 2", str(seen["tensors"]))
        table.add_row("bit-exact across processes", "yes" if bit_exact else "[red]NO")
        table.add_row("views inside shared segments", "yes" if seen["in_shared_memory"] else "[red]NO")
        cpu = stats.get("tiers", {}).get("cpu", {})
        if cpu:
            table.add_row("CPU tier used / budget",
                          f"{cpu.get('used_bytes', 0) / MiB:.1f} MiB / {cpu.get('budget_bytes', 0) / MiB:.0f} MiB "
                          f"in {cpu.get('num_segments', '?')} memfd segments")
        table.add_row("clients attached now", str(len(stats.get("clients", ()))))
        console.print(table)
        if not bit_exact or not seen["in_shared_memory"]:
            raise RuntimeError("the reader saw different bytes than were written")
        return {"tensors": len(weights), "bit_exact": bit_exact, "zero_copy": seen["in_shared_memory"],
                "cpu_budget_bytes": cpu.get("budget_bytes")}
    finally:
        client.shutdown_daemon()
        client.close()
