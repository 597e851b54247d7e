"""`infinity models`: the models imported into the running infinityd's store (its registry,
see `infinity.torch.model_store`), as a table or JSON. It starts no daemon."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from infinity.config import load_config


def run(args: argparse.Namespace) -> int:
    import infinity
    from infinity.torch.model_store import list_models

    client = infinity.connect(config=load_config(args.config, overrides=args.overrides),
                              name="infinity models")
    try:
        models = list_models(client)
    finally:
        client.close()
    if args.json:
        print(json.dumps([dataclasses.asdict(m) for m in models], indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"models imported into infinityd ({len(models)})")
    for column in ("namespace", "state", "type", "tensors", "MiB", "quantized", "mode",
                   "imported", "source"):
        table.add_column(column, justify="right" if column in ("tensors", "MiB") else "left")
    for m in models:
        when = (time.strftime("%Y-%m-%d %H:%M", time.localtime(m.imported_at))
                if m.imported_at else "")
        table.add_row(m.namespace, m.state, m.model_type, str(m.tensors),
                      f"{m.tensor_bytes / (1 << 20):.1f}", ",".join(m.quantized) or "-",
                      "read-only" if m.read_only else "writable", when, m.source)
    Console().print(table)
    return 0
