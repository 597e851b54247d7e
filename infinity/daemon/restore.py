"""Restore: rebuilding the catalog from the durable index when infinityd starts.

Every tensor the index names is published as its name's current version, on
NVMe only (a get or a prefetch loads it), and its copy is recorded as what the
index says (`Durability.adopt`), so a later flush or delete orders after it.
Runs once, after the catalog and the tiers are built and before serving.
"""

from __future__ import annotations

from infinity.daemon.catalog import Catalog
from infinity.daemon.diskcopy import DiskCopy
from infinity.daemon.durability import Durability
from infinity.errors import StoreDirectoryError
from infinity.protocol import dtypes


def restore_catalog(catalog: Catalog, durability: Durability) -> int:
    """Publish every tensor of the durable index in `catalog`; returns how many (0 without
    an NVMe tier)."""
    index = durability.index
    if index is None:
        return 0
    records = index.load()
    for record in records:
        key = (record.namespace, record.name)
        nbytes = dtypes.tensor_nbytes(record.dtype, record.shape)
        if nbytes != record.layout.nbytes:
            raise StoreDirectoryError(
                f"the store index {index.path} says tensor {record.name!r} in namespace "
                f"{record.namespace!r} is {record.dtype}{list(record.shape)} ({nbytes} bytes) "
                f"but stores {record.layout.nbytes} bytes; run `infinity verify`")
        copy = DiskCopy(record.layout, indexed=True)
        version = catalog.install(key, record.dtype, record.shape, nbytes, cpu=None,
                                  dirty=False, nvme=copy)
        durability.adopt(version, copy)
    return len(records)
