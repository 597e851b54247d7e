"""Streamed generation: a transformers causal LM built from an imported model, weights in the store.

`load_causal_lm(client, namespace=...)` builds the model an `infinity import` left in a namespace
(its config from the stored `config.json`), with no parameter values in the process
(`empty_parameters`), and offloads it with `from_store=True, inference=True`: each layer's
weights are leased just before its forward and given back after, and every forward (the prompt's,
then one per new token) is a step of the daemon's trace, so from the second token on the daemon
knows which layer comes next and loads it from NVMe while this one computes. `model.generate()`
is transformers' own, unchanged: greedy, sampling, beams, batches, the KV cache (which lives in
the process: it is activations, not weights).

On the CPU the layers compute on the store's shared memory directly (read-only mappings where the
namespace is read-only: every process of the node reads the same copy). On a CUDA device each
layer is copied into a device-memory budget as `offload` does for training.

`quantization="int8"` (or "int4") streams the block-wise quantized copies an import made
(`infinity import --quantize`) instead of the full-precision weights of the linear layers: half
(or about a quarter) of their bytes a token, from NVMe, through the CPU tier and over to a
device; each layer's copy is dequantized on the compute device just before its forward, into a
buffer of the compute dtype reused by the next layer (`infinity.torch.quantize`). The output is
then close to the full-precision model's, not equal (docs/BENCHMARKS.md measures how close). The
output projection (lm_head) stays in full precision unless `quantized_lm_head=True`: its error
goes straight into the logits, but it is read whole every token (a 1B Llama's is 131 MB in bf16,
11% of what the model streams a token in int8), so a user who accepts that error reads fewer
bytes.

`load_tokenizer` gives the tokenizer stored beside the weights, for `infinity generate`.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from infinity.client.device import DeviceCopier
from infinity.errors import InvalidRequestError
from infinity.torch.empty import empty_parameters
from infinity.torch.model_store import require_model, require_quantized, write_model_files
from infinity.torch.offload import offload

__all__ = ["load_causal_lm", "load_tokenizer"]


def load_causal_lm(client: Any, *, namespace: str, device: torch.device | str | None = None,
                   device_budget_bytes: int | None = None,
                   copier: DeviceCopier | None = None, quantization: str | None = None,
                   quantized_lm_head: bool = False) -> Any:
    """The imported model of `namespace` as a transformers causal LM (a `PreTrainedModel`,
    typed Any here so that importing this module needs no transformers) whose weights stay in the
    store (see the module's docstring). It computes in the dtype its weights were imported in,
    on the CPU unless `device` (or `copier`) says otherwise; `device_budget_bytes` bounds the
    device memory its weights take there. `quantization` ("int8", "int4"; None: full
    precision) streams those quantized copies; QuantizedFormNotFoundError where the import
    made none. `quantized_lm_head` streams the output projection's copy too (with a
    `quantization`; an error where the model's output projection is tied to its input
    embeddings, which leaves it no copy)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    require_model(client, namespace)
    if quantized_lm_head and quantization is None:
        raise InvalidRequestError(
            "quantized_lm_head streams the output projection's quantized copy, so it needs a "
            "quantization (\"int8\" or \"int4\"); pass one, or leave quantized_lm_head off")
    quantized = (require_quantized(client, namespace, quantization,
                                   output_projection=quantized_lm_head)
                 if quantization is not None else None)
    with tempfile.TemporaryDirectory(prefix="infinity-model-") as folder:
        write_model_files(client, namespace, folder)
        config = AutoConfig.from_pretrained(folder)
        try:
            generation_config = GenerationConfig.from_pretrained(folder)
        except OSError:  # no generation_config.json: the config's own defaults
            generation_config = GenerationConfig.from_model_config(config)
    dtype = _weights_dtype(config)
    try:
        with empty_parameters():
            # Built in the weights' dtype, as from_pretrained(torch_dtype=...) builds it, so that
            # buffers computed at construction come out the same.
            model = AutoModelForCausalLM.from_config(config, **{_dtype_keyword(): dtype})
    except ValueError as exc:  # a config transformers has no causal LM class for
        raise InvalidRequestError(
            f"namespace {namespace!r} holds a model transformers cannot build as a causal LM "
            f"({exc}); streamed generation needs a causal language model") from None
    model.generation_config = generation_config
    model.eval()
    offload(model, client, namespace=namespace, from_store=True, inference=True, device=device,
            device_budget_bytes=device_budget_bytes, copier=copier, quantized=quantized)
    return model


def load_tokenizer(client: Any, *, namespace: str) -> Any:
    """The tokenizer imported with the model of `namespace` (InvalidRequestError if none was)."""
    from transformers import AutoTokenizer

    require_model(client, namespace)
    with tempfile.TemporaryDirectory(prefix="infinity-tokenizer-") as folder:
        write_model_files(client, namespace, folder)
        try:
            return AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError) as exc:
            raise InvalidRequestError(
                f"namespace {namespace!r} holds no tokenizer transformers can load ({exc}); "
                f"import the model from a folder that has its tokenizer files") from None


def _dtype_keyword() -> str:
    """transformers 4.56 renamed `torch_dtype` to `dtype` (the old name warns)."""
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _weights_dtype(config: Any) -> torch.dtype:
    """The dtype the model's weights were saved in (its config says), else float32."""
    # `dtype` since transformers 4.56 (reading `torch_dtype` there warns), `torch_dtype` before.
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32
