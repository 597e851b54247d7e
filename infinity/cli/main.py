"""The `infinity` command: one subcommand per module of infinity.cli, dispatched here."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable, Sequence

from infinity.cli.sizes import DEMO_TENSOR_BYTES, TUNE_OP_BYTES
from infinity.errors import InfinityError


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML config file (default: $INFINITY_CONFIG, then "
                        "~/.config/infinity/infinity.toml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE",
                        help="override one setting, e.g. --set io.queue_depth=64 (repeatable)")


def _bytes_at_least(minimum: int, why: str) -> Callable[[str], int]:
    """An argparse type: a whole number of bytes, at least `minimum` (`why` says why)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of bytes") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is less than {minimum} ({why})")
        return value
    return parse


def _quantized_forms(text: str) -> list[str]:
    """An argparse type: a comma-separated list of quantized forms (int8, int4)."""
    forms = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [form for form in forms if form not in ("int8", "int4")]
    if unknown or not forms:
        raise argparse.ArgumentTypeError(f"{text!r} names no quantized form Infinity makes; use "
                                         f"int8, int4 or int8,int4")
    return forms


# Subcommand -> the module of infinity.cli whose `run(args)` carries it out.
COMMAND_MODULES = {"doctor": "doctor", "tune": "tune", "demo": "demo", "verify": "verify",
                   "import": "model_import", "models": "models", "generate": "generate"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infinity", description="Infinity: tiered tensor store tools")
    sub = parser.add_subparsers(dest="command", required=True)

    doctor = sub.add_parser("doctor", help="check this machine and the configured store directories")
    _add_config_flags(doctor)
    doctor.add_argument("dirs", nargs="*", help="extra directories to check (besides nvme.dirs)")
    doctor.add_argument("--json", action="store_true", help="print JSON instead of a table")

    tune = sub.add_parser("tune", help="sweep I/O settings on a directory and write the best into [io]")
    _add_config_flags(tune)
    tune.add_argument("dir", help="a directory on the drive to tune for")
    tune.add_argument("--file-bytes", type=_bytes_at_least(TUNE_OP_BYTES, "one 64 MiB probe op"),
                      default=256 << 20, help="bytes moved per setting tried, in whole 64 MiB "
                      "ops (default 256 MiB)")
    tune.add_argument("--quick", action="store_true", help="try only a few settings (for tests)")
    tune.add_argument("--dry-run", action="store_true", help="print the best settings, write nothing")

    demo = sub.add_parser("demo", help="start infinityd and run a demonstration through it")
    _add_config_flags(demo)
    demo.add_argument("--dir", default=".infinity-demo",
                      help="folder for the demo's store and runtime files (default ./.infinity-demo)")
    demo.add_argument("--io-bytes", type=_bytes_at_least(DEMO_TENSOR_BYTES, "one 64 MiB tensor"),
                      default=1 << 30, help="bytes the I/O part writes and reads back (default "
                      "1 GiB, at least 64 MiB)")
    demo.add_argument("--train-steps", type=int, default=30,
                      help="steps of the training part, a small GPT-2 with its state on NVMe "
                      "(default 30; 0 leaves it out)")

    verify = sub.add_parser("verify", help="check every flushed tensor's checksums (offline, or "
                            "by the infinityd serving the store); exit status 1 if any is "
                            "corrupted")
    _add_config_flags(verify)
    verify.add_argument("--json", action="store_true", help="print a JSON report")

    model_import = sub.add_parser("import", help="load a Hugging Face model folder (config.json, "
                                  "safetensors) into the running infinityd's store")
    _add_config_flags(model_import)
    model_import.add_argument("path", help="the model's folder, as save_pretrained wrote it")
    model_import.add_argument("--namespace", required=True,
                              help="the namespace to hold the model (its name in `infinity models`)")
    model_import.add_argument("--writable", action="store_true",
                              help="leave the namespace writable (default: read-only, sealed)")
    model_import.add_argument("--quantize", action="append", default=[], type=_quantized_forms,
                              metavar="FORM[,FORM]",
                              help="keep block-wise quantized copies of the linear layers' "
                              "weights beside them: int8, int4, or int8,int4 (repeatable; "
                              "default none); an unchanged model imported before gets the "
                              "forms it lacks added")

    models = sub.add_parser("models", help="list the models imported into the running infinityd")
    _add_config_flags(models)
    models.add_argument("--json", action="store_true", help="print JSON instead of a table")

    generate = sub.add_parser("generate", help="stream a completion from an imported model "
                              "whose weights stay in the store")
    _add_config_flags(generate)
    generate.add_argument("prompt", help="the text to complete")
    generate.add_argument("--namespace", required=True, help="the namespace the model was "
                          "imported into (`infinity import PATH --namespace NAME`)")
    generate.add_argument("--max-new-tokens", type=int, default=64,
                          help="tokens to generate at most (default 64)")
    generate.add_argument("--temperature", type=float, default=0.0,
                          help="sample at this temperature (default 0: greedy)")
    generate.add_argument("--top-p", type=float, default=1.0,
                          help="nucleus sampling's probability mass, with --temperature")
    generate.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    generate.add_argument("--quantization", choices=("int8", "int4"), default=None,
                          help="stream the weights' quantized copies (imported with --quantize) "
                          "instead of the full-precision ones: fewer bytes a token, dequantized "
                          "layer by layer before use (default: full precision)")
    generate.add_argument("--quantized-lm-head", action="store_true",
                          help="with --quantization, stream the output projection's quantized "
                          "copy too: fewer bytes a token, its error straight in the logits "
                          "(default: the output projection in full precision)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        # Each subcommand's module is imported only when it runs: `infinity doctor` must not
        # pay for torch and transformers.
        module = importlib.import_module(f"infinity.cli.{COMMAND_MODULES[args.command]}")
        return int(module.run(args))
    except InfinityError as exc:
        print(f"infinity {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
