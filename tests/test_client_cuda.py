"""The CUDA copier on a real GPU: pinned shared segments, stream ordering, the device budget.

Skipped without a CUDA GPU (CI has none). The device cache's budget, prefetch and eviction
logic is tested on the CPU in test_client_device.py; these tests cover what only a GPU can
show: that the segments are really page-locked for the driver, that compute issued right after
a get sees every byte of a copy still running on the side stream, and that the device memory
torch holds for the cache stays within the budget.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable

import pytest
import torch

from conftest import RunningDaemon
from infinity.client import device
from infinity.client.device import CudaCopier, DeviceCache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MiB = 1024 * 1024


@pytest.fixture
def big_daemon(daemon_factory: Callable[..., RunningDaemon]) -> RunningDaemon:
    """Room for a few tensors of tens of MiB, so that one copy outlasts a kernel launch."""
    return daemon_factory(**{"cpu.budget_bytes": 512 * MiB, "cpu.segment_bytes": 128 * MiB})


def test_the_cache_pins_the_shared_segments_it_copies_from(big_daemon: RunningDaemon) -> None:
    client = big_daemon.connect("trainer")
    client.put("w", torch.arange(1001, dtype=torch.float32))
    with client.get("w") as view:
        assert not view.is_pinned()  # plain shared memory until a CUDA cache registers it
    cache = DeviceCache(client, budget_bytes=MiB, copier=CudaCopier("cuda"))
    assert cache.registration_failures == []
    with client.get("w") as view:
        assert view.is_pinned()
    with cache.get("w") as t:
        assert t.is_cuda and torch.equal(t.cpu(), torch.arange(1001, dtype=torch.float32))


def test_closing_the_client_unpins_its_segments(big_daemon: RunningDaemon) -> None:
    client = big_daemon.connect("trainer")
    client.put("w", torch.ones(333))
    DeviceCache(client, budget_bytes=MiB, copier=CudaCopier("cuda"))
    starts = [start for _, start, _ in client.segment_ranges()]
    assert starts and all(start in device._pinned for start in starts)
    client.close()
    # A segment mapped later at one of these addresses must be pinned afresh, not taken for
    # the old one.
    assert not any(start in device._pinned for start in starts)


def test_compute_issued_right_after_a_get_sees_the_whole_copy(big_daemon: RunningDaemon) -> None:
    # 48 MiB + 12 bytes each: a copy of milliseconds, far longer than launching the sum, so a
    # compute stream that did not wait for the side stream would sum a partial copy.
    numel = 12 * MiB + 3
    client = big_daemon.connect("trainer")
    for i in range(4):
        client.put(f"t{i}", torch.full((numel,), i + 1, dtype=torch.int32))
    cache = DeviceCache(client, budget_bytes=2 * 4 * numel, copier=CudaCopier("cuda"),
                        prefetch=False)
    sums = []
    for _ in range(2):
        for i in range(4):  # a budget of two: every get copies
            with cache.get(f"t{i}") as t:
                sums.append(t.sum(dtype=torch.int64))  # queued on the current stream, no sync
    assert [int(s) for s in sums] == [(i + 1) * numel for i in range(4)] * 2
    assert cache.stats.misses == 8


def test_a_range_that_cannot_be_pinned_is_reported_and_cuda_keeps_working() -> None:
    # An address range that is mapped no more: the driver refuses to pin it.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = 2 * mmap.PAGESIZE
    start = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE,
                      mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert start not in (None, ctypes.c_void_p(-1).value)
    assert libc.munmap(start, size) == 0
    copier = CudaCopier("cuda")
    failures = copier.register([(99, start, start + size)])
    assert len(failures) == 1 and "segment 99" in failures[0]
    # The refused registration must not surface later as an error of some unrelated kernel.
    assert float((torch.ones(10, device="cuda") * 2).sum()) == 20.0


def test_device_memory_held_by_the_cache_stays_within_its_budget(
        nvme_daemon: RunningDaemon) -> None:
    # Whole multiples of torch's 512-byte allocation granule, so the budget compares exactly.
    shape, layer_bytes, num_layers = (128, 1024), 128 * 1024 * 4, 12
    client = nvme_daemon.connect("trainer")
    for i in range(num_layers):
        client.write_from(f"layer{i}", torch.full(shape, float(i)))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    cache = DeviceCache(client, budget_bytes=3 * layer_bytes, copier=CudaCopier("cuda"))
    peak = 0
    for _ in range(3):
        with client.step():
            for i in range(num_layers):
                with cache.get(f"layer{i}") as t:
                    assert t[0, 0].item() == i and t[-1, -1].item() == i
                    peak = max(peak, torch.cuda.memory_allocated() - base)
    assert 0 < peak <= cache.budget_bytes
    assert cache.stats.prefetched > 0 and cache.stats.hits + cache.stats.inflight_hits > 0

