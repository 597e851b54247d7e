"""The one extent allocator: aligned ranges of a linear space, first fit, freed space coalesced.

Both the NVMe tier (ranges of a directory's extent file) and the daemon's CPU
tier (ranges of a shared-memory segment) hand out space through
`ExtentAllocator`. It knows nothing about files or memory; it only tracks which
[offset, offset + length) ranges of a space of `capacity_bytes` are in use.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from infinity.errors import InvalidRequestError


@dataclass(frozen=True, order=True)
class Extent:
    """A range of a space: `length_bytes` from `offset_bytes`, both multiples of the alignment."""

    offset_bytes: int
    length_bytes: int

    @property
    def end_bytes(self) -> int:
        return self.offset_bytes + self.length_bytes


class ExtentAllocator:
    """First-fit allocator over [0, capacity_bytes) with `alignment_bytes` granularity.

    Not thread-safe: its owner serializes calls (the daemon's loop, or a lock).
    """

    def __init__(self, capacity_bytes: int, *, alignment_bytes: int = 4096) -> None:
        if alignment_bytes <= 0 or alignment_bytes & (alignment_bytes - 1):
            raise ValueError(f"alignment_bytes must be a power of two, not {alignment_bytes}")
        self.alignment_bytes = alignment_bytes
        self.capacity_bytes = 0
        # Free ranges kept sorted by offset, as two parallel lists for bisect.
        self._free_offsets: list[int] = []
        self._free_lengths: list[int] = []
        self.used_bytes = 0
        self.grow(capacity_bytes)

    def round_up(self, nbytes: int) -> int:
        a = self.alignment_bytes
        return (nbytes + a - 1) // a * a

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def largest_free_bytes(self) -> int:
        return max(self._free_lengths, default=0)

    def free_tail_bytes(self) -> int:
        """The free range that ends at the capacity (0 if none): what growing extends."""
        if self._free_offsets and self._free_offsets[-1] + self._free_lengths[-1] == self.capacity_bytes:
            return self._free_lengths[-1]
        return 0

    def grow(self, new_capacity_bytes: int) -> None:
        """Extend the space (a store file grew); the new tail is free."""
        new_capacity_bytes = new_capacity_bytes // self.alignment_bytes * self.alignment_bytes
        if new_capacity_bytes < self.capacity_bytes:
            raise ValueError("an extent space can grow but not shrink")
        if new_capacity_bytes > self.capacity_bytes:
            self._insert_free(self.capacity_bytes, new_capacity_bytes - self.capacity_bytes)
            self.capacity_bytes = new_capacity_bytes

    def allocate(self, nbytes: int) -> Extent | None:
        """The first free range that fits `nbytes` (rounded up), or None when none does."""
        if nbytes <= 0:
            raise InvalidRequestError(f"cannot allocate {nbytes} bytes; ask for at least one byte")
        length = self.round_up(nbytes)
        for i, free_length in enumerate(self._free_lengths):
            if free_length >= length:
                offset = self._free_offsets[i]
                if free_length == length:
                    del self._free_offsets[i]
                    del self._free_lengths[i]
                else:
                    self._free_offsets[i] = offset + length
                    self._free_lengths[i] = free_length - length
                self.used_bytes += length
                return Extent(offset, length)
        return None

    def free(self, extent: Extent) -> None:
        """Return a range; it merges with free neighbours. Freeing twice is an error."""
        if extent.offset_bytes % self.alignment_bytes or extent.length_bytes % self.alignment_bytes:
            raise ValueError(f"{extent} is not aligned to {self.alignment_bytes}")
        if extent.end_bytes > self.capacity_bytes:
            raise ValueError(f"{extent} lies beyond the capacity {self.capacity_bytes}")
        self._insert_free(extent.offset_bytes, extent.length_bytes)
        self.used_bytes -= extent.length_bytes

    def reserve(self, extent: Extent) -> None:
        """Mark a known range as used (rebuilding the map from a catalog at restart)."""
        i = bisect.bisect_right(self._free_offsets, extent.offset_bytes) - 1
        if i < 0 or self._free_offsets[i] + self._free_lengths[i] < extent.end_bytes:
            raise ValueError(f"{extent} is not free; the catalog names overlapping extents")
        start, length = self._free_offsets[i], self._free_lengths[i]
        del self._free_offsets[i]
        del self._free_lengths[i]
        if extent.offset_bytes > start:
            self._insert_at(i, start, extent.offset_bytes - start)
            i += 1
        tail = start + length - extent.end_bytes
        if tail:
            self._insert_at(i, extent.end_bytes, tail)
        self.used_bytes += extent.length_bytes

    def _insert_at(self, i: int, offset: int, length: int) -> None:
        self._free_offsets.insert(i, offset)
        self._free_lengths.insert(i, length)

    def _insert_free(self, offset: int, length: int) -> None:
        i = bisect.bisect_left(self._free_offsets, offset)
        end = offset + length
        if i < len(self._free_offsets) and self._free_offsets[i] < end:
            raise ValueError(f"range at {offset} (+{length}) is already free")
        if i > 0 and self._free_offsets[i - 1] + self._free_lengths[i - 1] > offset:
            raise ValueError(f"range at {offset} (+{length}) is already free")
        merge_left = i > 0 and self._free_offsets[i - 1] + self._free_lengths[i - 1] == offset
        merge_right = i < len(self._free_offsets) and self._free_offsets[i] == end
        if merge_left and merge_right:
            self._free_lengths[i - 1] += length + self._free_lengths[i]
            del self._free_offsets[i]
            del self._free_lengths[i]
        elif merge_left:
            self._free_lengths[i - 1] += length
        elif merge_right:
            self._free_offsets[i] = offset
            self._free_lengths[i] += length
        else:
            self._insert_at(i, offset, length)
