"""NvmeTier: tensors written to and read back from extent files on the real disk."""

from __future__ import annotations

import os

import pytest
import torch

from infinity.config import MiB, NvmeConfig, IOConfig
from infinity.errors import (
    ChecksumError,
    ConfigError,
    DiskFullError,
    IOEngineError,
    OutOfRangeError,
    StoreDirectoryError,
    StoreFullError,
)
from infinity.io import IOEngine
from infinity.store.nvme import (EXTENT_FILE_NAME, NvmeTier, TensorLayout, deal_stripes,
                                 stripe_totals)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int64,
          torch.float64, torch.bool, torch.complex64]


@pytest.fixture
def engine():
    with IOEngine.from_config(IOConfig(num_threads=2, queue_depth=16)) as eng:
        yield eng


def make_tier(engine: IOEngine, *dirs: str, **settings) -> NvmeTier:
    settings.setdefault("file_grow_bytes", 8 * MiB)
    settings.setdefault("stripe_bytes", 1 * MiB)
    return NvmeTier(NvmeConfig(dirs=tuple(dirs), **settings), engine)


def random_tensor(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2).bool()
    return raw.view(dtype)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [1, 7, 1023, 4099, 262_147, 1_000_003])
def test_round_trip_is_bit_exact(engine, disk_tmp, dtype, numel) -> None:
    tier = make_tier(engine, disk_tmp)
    src = random_tensor(numel, dtype, seed=numel)
    layout = tier.write_tensor(src).result()
    out = torch.empty_like(src)
    tier.read_tensor(layout, out)
    assert bitwise_equal(src, out)


def test_many_writes_and_reads_in_flight_at_once(engine, disk_tmp) -> None:
    tier = make_tier(engine, disk_tmp)
    sources = [random_tensor(100_000 + 4097 * i, torch.float32, seed=i) for i in range(48)]
    writes = [tier.write_tensor(s) for s in sources]  # all submitted before any is awaited
    layouts = [w.result() for w in writes]
    from infinity.io import aligned_empty

    outs = [aligned_empty(layout.capacity_bytes) for layout in layouts]
    reads = [tier.read_into(layout, out.data_ptr()) for layout, out in zip(layouts, outs)]
    for future in reads:
        future.result()
    for src, out, layout in zip(sources, outs, layouts):
        assert bitwise_equal(src, out[:layout.nbytes])


def test_padding_to_4k_is_zero_on_disk(engine, disk_tmp) -> None:
    tier = make_tier(engine, disk_tmp)
    # First fill a page with 0xFF and free it, so the padding cannot be zero by accident.
    old = tier.write_tensor(torch.full((4096,), 0xFF, dtype=torch.uint8)).result()
    tier.free(old)
    layout = tier.write_tensor(torch.full((5,), 0xAB, dtype=torch.uint8)).result()
    (d, extent), = layout.extents
    assert extent.offset_bytes == old.extents[0][1].offset_bytes  # the freed page was reused
    with open(os.path.join(disk_tmp, EXTENT_FILE_NAME), "rb") as f:
        f.seek(extent.offset_bytes)
        block = f.read(4096)
    assert block[:5] == b"\xab" * 5 and block[5:] == bytes(4091)


def test_large_tensor_stripes_over_two_directories(engine, disk_tmp) -> None:
    first, second = os.path.join(disk_tmp, "a"), os.path.join(disk_tmp, "b")
    os.mkdir(first)
    os.mkdir(second)
    tier = make_tier(engine, first, second)
    src = random_tensor(5 * MiB + 12345, torch.uint8, seed=3)
    layout = tier.write_tensor(src).result()
    assert sorted(d for d, _ in layout.extents) == [0, 1]
    # Six 1 MiB stripes dealt round robin: three in each directory.
    assert [e.length_bytes for _, e in layout.extents] == [3 * MiB, 2 * MiB + 16384]
    out = torch.empty_like(src)
    tier.read_tensor(layout, out)
    assert bitwise_equal(src, out)


def test_freed_extents_are_reused(engine, disk_tmp) -> None:
    tier = make_tier(engine, disk_tmp, capacity_bytes_per_dir=4 * MiB)
    first = tier.write_tensor(random_tensor(3 * MiB, torch.uint8, seed=1)).result()
    tier.free(first)
    second = tier.write_tensor(random_tensor(3 * MiB, torch.uint8, seed=2)).result()
    assert second.extents == first.extents


def test_layout_survives_the_wire_and_a_reopened_tier(engine, disk_tmp) -> None:
    tier = make_tier(engine, disk_tmp)
    src = random_tensor(2 * MiB + 3, torch.uint8, seed=9)
    wire = tier.write_tensor(src).result().to_wire()
    tier.close()
    reopened = make_tier(engine, disk_tmp)
    layout = TensorLayout.from_wire(wire)
    reopened.adopt(layout)
    out = torch.empty_like(src)
    reopened.read_tensor(layout, out)
    assert bitwise_equal(src, out)
    assert reopened.allocate(4096).extents[0][1].offset_bytes >= layout.extents[0][1].end_bytes


def test_a_store_reopened_under_a_lower_capacity_than_it_holds_says_which_setting(
        engine, disk_tmp) -> None:
    tier = make_tier(engine, disk_tmp, file_grow_bytes=16 * MiB)
    tier.write_tensor(random_tensor(5 * MiB, torch.uint8, seed=3)).result()
    layout = tier.write_tensor(random_tensor(3 * MiB, torch.uint8, seed=4)).result()
    tier.close()
    reopened = make_tier(engine, disk_tmp, capacity_bytes_per_dir=4 * MiB)
    with pytest.raises(StoreDirectoryError, match="past nvme.capacity_bytes_per_dir .4194304.; "
                                                  "raise that setting to at least 8388608"):
        reopened.adopt(layout)


def test_ramfs_falls_back_to_buffered_io(engine, ramfs_dir) -> None:
    tier = make_tier(engine, ramfs_dir)
    assert tier.describe()[0]["direct"] is False
    src = random_tensor(3 * MiB + 5, torch.int16, seed=4)
    out = torch.empty_like(src)
    tier.read_tensor(tier.write_tensor(src).result(), out)
    assert bitwise_equal(src, out)


def test_staged_io_moves_tensors_between_shared_memory_and_disk_bit_exact(engine, disk_tmp) -> None:
    import mmap

    tier = NvmeTier(NvmeConfig(dirs=(disk_tmp,), file_grow_bytes=8 * MiB, stripe_bytes=MiB), engine,
                    staged_reads=True, staged_writes=True)
    sources = [random_tensor(numel, torch.float32, seed=numel) for numel in (1, 1023, 786_433)]
    capacities = [-(-s.numel() * 4 // 4096) * 4096 for s in sources]
    # The CPU tier's kind of memory: a shared memfd mapping, 4 KiB pages here. Written out from
    # its first half, read back into its second.
    size = 2 * sum(capacities)
    fd = os.memfd_create("staged-test")
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE) as mm:
            shared = torch.frombuffer(mm, dtype=torch.uint8)
            half = size // 2
            offsets = [sum(capacities[:i]) for i in range(len(sources))]
            for src, at in zip(sources, offsets):
                shared[at:at + src.numel() * 4].copy_(src.view(torch.uint8))
            before = engine.staged_bytes
            layouts = [tier.write_from(shared.data_ptr() + at, src.numel() * 4).result()
                       for src, at in zip(sources, offsets)]
            for layout, at in zip(layouts, offsets):
                tier.read_into(layout, shared.data_ptr() + half + at).result()
            assert engine.staged_bytes - before == size  # every byte both ways, staged
            for src, at in zip(sources, offsets):
                assert bitwise_equal(src, shared[half + at:half + at + src.numel() * 4].view(torch.float32))
            del shared
    finally:
        os.close(fd)


def test_staged_io_still_reports_a_corrupted_block(engine, disk_tmp) -> None:
    tier = NvmeTier(NvmeConfig(dirs=(disk_tmp,), file_grow_bytes=8 * MiB, stripe_bytes=MiB), engine,
                    staged_reads=True, staged_writes=True)
    layout = tier.write_tensor(random_tensor(3 * MiB, torch.uint8, seed=16)).result()
    _, extent = layout.extents[0]
    with open(os.path.join(disk_tmp, EXTENT_FILE_NAME), "r+b") as f:
        f.seek(extent.offset_bytes + 2 * MiB + 9)
        byte = f.read(1)
        f.seek(extent.offset_bytes + 2 * MiB + 9)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(ChecksumError):
        tier.read_tensor(layout, torch.empty(3 * MiB, dtype=torch.uint8))


def test_missing_directory_is_a_clear_error(engine, disk_tmp) -> None:
    with pytest.raises(StoreDirectoryError, match="does not exist"):
        make_tier(engine, os.path.join(disk_tmp, "missing"))


def test_read_past_the_end_is_refused(engine, disk_tmp) -> None:
    tier = make_tier(engine, disk_tmp)
    layout = tier.write_tensor(random_tensor(3 * MiB, torch.uint8, seed=5)).result()
    with pytest.raises(OutOfRangeError, match="past the end"):
        tier.read_tensor(layout, torch.empty(3 * MiB + 1, dtype=torch.uint8))
    from infinity.io import aligned_empty

    with pytest.raises(OutOfRangeError):
        tier.read_into(layout, aligned_empty(4 * MiB).data_ptr(), offset_bytes=2 * MiB, nbytes=2 * MiB)
    out = torch.empty(3 * MiB, dtype=torch.uint8)
    tier.read_tensor(layout, out)  # the tier still serves


def test_corrupted_block_is_reported_not_served(engine, disk_tmp) -> None:
    tier = make_tier(engine, disk_tmp)
    layout = tier.write_tensor(random_tensor(3 * MiB, torch.uint8, seed=6)).result()
    _, extent = layout.extents[0]
    with open(os.path.join(disk_tmp, EXTENT_FILE_NAME), "r+b") as f:
        f.seek(extent.offset_bytes + MiB + 100)
        byte = f.read(1)
        f.seek(extent.offset_bytes + MiB + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ChecksumError):
        tier.read_tensor(layout, torch.empty(3 * MiB, dtype=torch.uint8))


def test_configured_capacity_full_is_a_typed_error(engine, disk_tmp) -> None:
    tier = make_tier(engine, disk_tmp, capacity_bytes_per_dir=2 * MiB)
    tier.write_tensor(random_tensor(MiB, torch.uint8, seed=7)).result()
    with pytest.raises(StoreFullError, match="no room"):
        tier.write_tensor(random_tensor(2 * MiB, torch.uint8, seed=8))
    tier.write_tensor(random_tensor(MiB, torch.uint8, seed=9)).result()  # what fits still fits


def test_full_file_system_is_a_typed_error(engine, tiny_tmpfs_dir) -> None:
    tier = make_tier(engine, tiny_tmpfs_dir, capacity_bytes_per_dir=64 * MiB, file_grow_bytes=4 * MiB)
    kept = tier.write_tensor(random_tensor(3 * MiB, torch.uint8, seed=10)).result()
    with pytest.raises(DiskFullError, match="no room to grow"):
        tier.write_tensor(random_tensor(16 * MiB, torch.uint8, seed=11))
    out = torch.empty(3 * MiB, dtype=torch.uint8)
    tier.read_tensor(kept, out)
    assert bitwise_equal(random_tensor(3 * MiB, torch.uint8, seed=10), out)


def test_a_nearly_full_file_system_grows_the_file_by_only_what_its_free_end_lacks(
        engine, tiny_tmpfs_dir) -> None:
    # 8 MiB of file system; the 4 MiB file is all free at its end, so a 6 MiB tensor needs
    # 2 MiB more, not 6 (which the file system does not have).
    tier = make_tier(engine, tiny_tmpfs_dir, capacity_bytes_per_dir=64 * MiB, file_grow_bytes=4 * MiB)
    try:
        tier.free(tier.write_tensor(random_tensor(4 * MiB, torch.uint8, seed=12)).result())
        layout = tier.write_tensor(random_tensor(6 * MiB, torch.uint8, seed=13)).result()
        out = torch.empty(6 * MiB, dtype=torch.uint8)
        tier.read_tensor(layout, out)
        assert bitwise_equal(random_tensor(6 * MiB, torch.uint8, seed=13), out)
    finally:
        tier.close()


def test_a_tier_built_from_a_config_the_loader_never_saw_still_checks_it(engine, disk_tmp) -> None:
    with pytest.raises(ConfigError, match="multiple of 4096"):  # it would loop forever
        make_tier(engine, disk_tmp, capacity_bytes_per_dir=MiB + 100)


def test_a_write_that_times_out_keeps_its_extents(engine, disk_tmp) -> None:
    tier = make_tier(engine, disk_tmp, file_grow_bytes=128 * MiB)
    src = random_tensor(64 * MiB, torch.uint8, seed=12)
    write = tier.write_tensor(src)
    with pytest.raises(TimeoutError):
        write.result(timeout_s=0)  # 64 MiB to disk cannot be done at once
    other = tier.allocate(64 * MiB)  # must not be handed the extents still being written
    assert other.extents[0][1].offset_bytes >= write.result().extents[0][1].end_bytes
    out = torch.empty_like(src)
    tier.read_tensor(write.result(), out)
    assert bitwise_equal(src, out)


def test_asking_a_failed_write_again_frees_nothing_more(disk_tmp) -> None:
    engine = IOEngine(IOConfig(num_threads=1, queue_depth=1))
    tier = make_tier(engine, disk_tmp, file_grow_bytes=256 * MiB)
    try:
        tier.write_tensor(torch.zeros(128 * MiB, dtype=torch.uint8))  # takes the one worker
        failed = tier.write_tensor(torch.ones(MiB, dtype=torch.uint8))  # queued behind it
        engine.close()  # cancels what has not started
        with pytest.raises(IOEngineError):
            failed.result()  # gives its extents back
        other = tier.allocate(MiB)  # first fit: those extents
        used = tier.directories[0].allocator.used_bytes
        with pytest.raises(IOEngineError):
            failed.result()
        assert tier.directories[0].allocator.used_bytes == used  # other's extents are still its
        assert other.extents == failed._layout.extents
    finally:
        tier.close()


def test_room_grown_for_an_allocation_and_taken_by_another_thread_is_grown_again(
        engine, disk_tmp) -> None:
    tier = make_tier(engine, disk_tmp, file_grow_bytes=4 * MiB)
    directory = tier.directories[0]
    allocate = directory.allocate
    others: list = []

    def lose_the_room_first(nbytes: int, **kwargs):
        if not others:  # another thread's allocation slips in after the growth (a stand-in)
            others.append(directory.allocator.allocate(directory.allocator.largest_free_bytes()))
        return allocate(nbytes, **kwargs)

    directory.allocate = lose_the_room_first  # type: ignore[method-assign]
    layout = tier.allocate(3 * MiB)  # GrowthNeeded escaped to this caller, which asked to grow
    assert others and others[0] is not None
    assert layout.nbytes == 3 * MiB and not {e for _, e in layout.extents} & set(others)


@pytest.mark.parametrize("capacity_bytes,stripe_bytes,num_slots", [
    (4096, MiB, 3), (MiB, MiB, 2), (5 * MiB + 4096, MiB, 2), (7 * MiB, MiB, 3),
    (3 * 4096, 4096, 5), (10 * MiB - 8192, 2 * MiB, 4)])
def test_stripe_totals_are_what_dealing_the_stripes_gives_each_slot(
        capacity_bytes: int, stripe_bytes: int, num_slots: int) -> None:
    dealt: dict[int, int] = {}
    for slot, _, length in deal_stripes(capacity_bytes, stripe_bytes, num_slots):
        dealt[slot] = dealt.get(slot, 0) + length
    assert stripe_totals(capacity_bytes, stripe_bytes, num_slots) == dealt


def test_a_tensor_larger_than_a_directory_may_ever_hold_is_refused_before_any_work(
        engine, disk_tmp) -> None:
    tier = make_tier(engine, disk_tmp, capacity_bytes_per_dir=4 * MiB)
    with pytest.raises(StoreFullError, match="more than its nvme.capacity_bytes_per_dir"):
        tier.allocate(1 << 50)  # dealt stripe by stripe, this took minutes and gigabytes


def test_a_tensor_goes_to_another_directory_where_the_roomiest_has_its_room_in_pieces(
        engine, disk_tmp) -> None:
    dirs = [os.path.join(disk_tmp, name) for name in ("a", "b")]
    for path in dirs:
        os.mkdir(path)
    tier = make_tier(engine, *dirs, capacity_bytes_per_dir=6 * MiB, stripe_bytes=4 * MiB,
                     file_grow_bytes=6 * MiB)
    try:
        layouts = [tier.allocate(MiB) for _ in range(12)]  # both directories full
        at = {(l.extents[0][0], l.extents[0][1].offset_bytes // MiB): l for l in layouts}
        for place in [(0, 0), (0, 2), (0, 4), (1, 1), (1, 2)]:
            tier.free(at[place])  # a: 3 MiB free in 1 MiB pieces; b: 2 MiB in one piece
        layout = tier.allocate(2 * MiB)
        assert [d for d, _ in layout.extents] == [1]
    finally:
        tier.close()


def test_a_tensor_goes_to_another_directory_where_one_file_system_is_full(
        engine, disk_tmp, tiny_tmpfs_dir) -> None:
    tier = make_tier(engine, tiny_tmpfs_dir, disk_tmp, capacity_bytes_per_dir=64 * MiB,
                     file_grow_bytes=MiB)
    try:
        for seed in range(20):  # single-stripe tensors, half of them more than the 8 MiB tmpfs
            tier.write_tensor(random_tensor(MiB, torch.uint8, seed=seed)).result()
    finally:
        tier.close()


def _flushed_layout_wire() -> dict:
    """A layout as a write of 5 MiB + 1 over two directories in 1 MiB stripes makes it."""
    return {"nbytes": 5 * MiB + 1, "stripe_bytes": MiB,
            "extents": [[0, 0, 3 * MiB], [1, 0, 2 * MiB + 4096]], "crcs": [7] * 6}


@pytest.mark.parametrize("damage, value", [
    ("extents", [[0, 0, 4096], [1, 0, 4096]]),  # shorter than its stripes: bytes handed out twice
    ("extents", [[0, 0, 3 * MiB], [0, 8 * MiB, 2 * MiB + 4096]]),  # one directory twice
    ("extents", [[-1, 0, 3 * MiB], [1, 0, 2 * MiB + 4096]]),
    ("extents", [[0, 100, 3 * MiB], [1, 0, 2 * MiB + 4096]]),  # not 4 KiB-aligned
    ("stripe_bytes", 0),
    ("crcs", [7] * 5),  # fewer checksums than blocks
    ("nbytes", -1),
])
def test_a_layout_no_write_could_have_made_is_refused(damage: str, value: object) -> None:
    assert TensorLayout.from_wire(_flushed_layout_wire()).nbytes == 5 * MiB + 1
    with pytest.raises(ValueError):
        TensorLayout.from_wire({**_flushed_layout_wire(), damage: value})


def test_the_layout_of_a_zero_byte_tensor_is_accepted() -> None:
    empty = TensorLayout.from_wire({"nbytes": 0, "stripe_bytes": MiB, "extents": [], "crcs": []})
    assert empty.extents == () and empty.crcs == ()
