"""Infinity: a per-node daemon that keeps PyTorch tensors in a tiered GPU / CPU / NVMe store."""

__version__ = "0.1.0"
