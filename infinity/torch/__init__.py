"""Torch integration: module hooks and the offloaded optimizer (see the roadmap)."""
