"""One tensor's bytes on NVMe (`DiskCopy`): the record a version's `nvme` slot points at.

A leaf module (it imports nothing of the daemon), so that the catalog can name
the type of `Version.nvme` and the tier modules can share it without an import
circle. The record is written by the tier modules: `infinity.daemon.eviction`
makes one when a write-back ends, `infinity.daemon.durability` marks it indexed,
`infinity.daemon.growth` frees its extents once nothing refers to it.
"""

from __future__ import annotations

from dataclasses import dataclass

from infinity.store.nvme import TensorLayout


@dataclass(eq=False, slots=True)
class DiskCopy:
    """One tensor's bytes on NVMe: written once, never modified, freed when nothing refers to it."""

    layout: TensorLayout
    owned: bool = True  # the clean copy of a live version
    indexed: bool = False  # the durable index points its name at it
    publishing: int = 0  # index transactions in flight (or about to be) that will point at it
    # The version's `edits` when these bytes were read from it: of two copies of one version
    # (written in place between them), the index must end at the later one.
    edits: int = 0
    indexed_order: tuple[int, int] = (0, 0)  # (stamp, edits) of the index row pointing here
    # The NVMe tier's `sync_failures` when these bytes began to be written: if an fdatasync
    # failed since, they may never reach the disk, and only a fresh copy can be made durable.
    sync_failures_before: int = 0
