"""ExtentAllocator: the one allocator of both tiers."""

import pytest

from infinity.errors import InvalidRequestError
from infinity.store.allocator import Extent, ExtentAllocator


def test_allocations_are_aligned_and_disjoint() -> None:
    alloc = ExtentAllocator(1 << 20, alignment_bytes=4096)
    extents = [alloc.allocate(n) for n in (1, 4095, 4097, 12345, 8192)]
    assert all(e is not None and e.offset_bytes % 4096 == 0 for e in extents)
    spans = sorted((e.offset_bytes, e.end_bytes) for e in extents if e)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert [e.length_bytes for e in extents if e] == [4096, 4096, 8192, 16384, 8192]


def test_full_space_returns_none() -> None:
    alloc = ExtentAllocator(3 * 4096)
    assert alloc.allocate(2 * 4096) is not None
    assert alloc.allocate(2 * 4096) is None
    assert alloc.free_bytes == 4096


def test_freed_space_is_reused_and_coalesced() -> None:
    alloc = ExtentAllocator(4 * 4096)
    a, b, c, d = (alloc.allocate(4096) for _ in range(4))
    assert alloc.allocate(4096) is None
    for e in (b, a, c):
        assert e is not None
        alloc.free(e)
    # The three freed neighbours merged into one range that fits three pages.
    assert alloc.largest_free_bytes() == 3 * 4096
    assert alloc.allocate(3 * 4096) == Extent(0, 3 * 4096)


def test_double_free_is_an_error() -> None:
    alloc = ExtentAllocator(4 * 4096)
    e = alloc.allocate(4096)
    assert e is not None
    alloc.free(e)
    with pytest.raises(ValueError):
        alloc.free(e)


def test_reserve_rebuilds_a_known_map() -> None:
    alloc = ExtentAllocator(10 * 4096)
    alloc.reserve(Extent(3 * 4096, 2 * 4096))
    assert alloc.used_bytes == 2 * 4096
    assert alloc.allocate(3 * 4096) == Extent(0, 3 * 4096)
    assert alloc.allocate(4096) == Extent(5 * 4096, 4096)
    with pytest.raises(ValueError):
        alloc.reserve(Extent(0, 4096))


def test_grow_adds_free_tail() -> None:
    alloc = ExtentAllocator(4096)
    assert alloc.allocate(4096) is not None
    alloc.grow(3 * 4096)
    assert alloc.allocate(2 * 4096) == Extent(4096, 2 * 4096)


def test_zero_bytes_is_refused() -> None:
    with pytest.raises(InvalidRequestError):
        ExtentAllocator(4096).allocate(0)


def test_the_free_tail_is_the_free_range_that_ends_at_the_capacity() -> None:
    space = ExtentAllocator(40960)
    assert space.free_tail_bytes() == 40960
    first = space.allocate(8192)
    assert first is not None and space.free_tail_bytes() == 32768
    last = space.allocate(32768)
    assert last is not None and space.free_tail_bytes() == 0
    space.free(first)  # free, but not at the end
    assert space.free_tail_bytes() == 0
    space.grow(45056)
    assert space.free_tail_bytes() == 4096
