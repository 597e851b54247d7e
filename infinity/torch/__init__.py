"""Torch integration: `offload` (a module's parameters in the store, present around their use,
gradients leaving for the store as they are produced) and `Adam` / `AdamW` (optimizer state in
the store, the step in infinityd). Checkpoints and streamed generation come next (issues 20-21)."""

from infinity.torch.offload import OffloadConfig, OffloadState, offload, offload_state
from infinity.torch.optim import Adam, AdamW

__all__ = ["Adam", "AdamW", "OffloadConfig", "OffloadState", "offload", "offload_state"]
