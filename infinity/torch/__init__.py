"""Torch integration: `offload` (a module's parameters in the store, present around their use,
gradients leaving for the store as they are produced) and `Adam` / `AdamW` (optimizer state in
the store, the step in infinityd). `empty_parameters()` builds a model without values for
`offload(..., from_store=True)`. `save_checkpoint` / `load_checkpoint` (`infinity.torch.checkpoint`)
write and read the whole training state as safetensors files; `resume_point` and
`optimizer.resume(scheduler)` (`infinity.torch.restart`) let a killed trainer go on from the
daemon's state without one. `StoredGradientClipping` (a transformers.Trainer callback),
`import_model` / `list_models` (a Hugging Face model folder into the store) and `load_causal_lm` /
`load_tokenizer` (streamed generation from an imported model) are imported on first use, so nothing
else here needs transformers."""

from typing import Any

from infinity.torch.checkpoint import load_checkpoint, save_checkpoint
from infinity.torch.empty import empty_parameters
from infinity.torch.offload import OffloadConfig, OffloadState, offload, offload_state
from infinity.torch.optim import Adam, AdamW
from infinity.torch.restart import resume_point

__all__ = ["Adam", "AdamW", "OffloadConfig", "OffloadState", "StoredGradientClipping",
           "empty_parameters", "import_model", "list_models", "load_causal_lm", "load_checkpoint",
           "load_tokenizer", "offload", "offload_state", "resume_point", "save_checkpoint"]


def __getattr__(name: str) -> Any:
    if name == "StoredGradientClipping":
        from infinity.torch.trainer import StoredGradientClipping

        return StoredGradientClipping
    if name in ("load_causal_lm", "load_tokenizer"):
        from infinity.torch import generation

        return getattr(generation, name)
    if name in ("import_model", "list_models"):
        from infinity.torch import model_store

        return getattr(model_store, name)
    raise AttributeError(f"module 'infinity.torch' has no attribute {name!r}")
