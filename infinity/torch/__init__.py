"""Torch integration: `offload` (a module's parameters in the store, present around their use,
gradients leaving for the store as they are produced). The daemon-side optimizer, checkpoints and
streamed generation come next (issues 19-21)."""

from infinity.torch.offload import OffloadConfig, OffloadState, offload, offload_state

__all__ = ["OffloadConfig", "OffloadState", "offload", "offload_state"]
