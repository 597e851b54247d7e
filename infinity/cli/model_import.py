"""`infinity import PATH --namespace NAME [--quantize int8,int4]`: load a Hugging Face model
folder into the store of the running infinityd (see `infinity.torch.model_store`), with
quantized copies of its linear layers' weights if asked, with a progress bar on a terminal, and
say what was stored. It starts no daemon: without one it says so (exit status 2)."""

from __future__ import annotations

import argparse

from infinity.config import load_config


def _size(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB" if nbytes >= 1 << 20 else f"{nbytes} bytes"


def run(args: argparse.Namespace) -> int:
    import infinity
    from infinity.torch.model_store import import_model

    client = infinity.connect(config=load_config(args.config, overrides=args.overrides),
                              name="infinity import")
    try:
        report = import_model(client, args.path, namespace=args.namespace,
                              read_only=not args.writable,
                              quantize=[form for forms in args.quantize for form in forms])
    finally:
        client.close()
    mode = "read-only" if report.read_only else "writable"
    kept = "durable on NVMe" if report.durable else "in the CPU tier only (no NVMe tier)"
    if report.skipped:
        print(f"{report.source} is already in namespace {report.namespace!r} ({mode}), "
              f"unchanged: nothing written")
    elif report.added:
        print(f"{report.source} is already in namespace {report.namespace!r} ({mode}), "
              f"unchanged: added its {' and '.join(report.added)} copies in "
              f"{report.seconds:.1f} s")
    else:
        print(f"imported {report.tensors} tensors ({_size(report.tensor_bytes)}) and "
              f"{len(report.files)} files from {report.source} into namespace "
              f"{report.namespace!r} ({mode}, {kept}) in {report.seconds:.1f} s")
    if report.quantized:
        print(f"  quantized copies: {', '.join(report.quantized)}")
    for left in report.left_out:
        print(f"  left out: {left}")
    return 0
