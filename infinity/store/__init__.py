"""The tensor store below the daemon: the extent allocator and the NVMe tier."""
