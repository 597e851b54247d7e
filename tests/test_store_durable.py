"""DurableIndex on its own: publish / remove / load, its completion fd, its lock, its failures."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import sqlite3
import threading
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
import torch

from loopfs import LoopFs
from infinity.config import MiB, NvmeConfig
from infinity.errors import IOEngineError, StoreDirectoryError
from infinity.io import IOEngine
from infinity.store.durable import INDEX_FILE_NAME, MARKER_FILE_NAME, DurableIndex, DurableRecord
from infinity.store.nvme import EXTENT_FILE_NAME, NvmeTier, TensorLayout


@pytest.fixture
def engine() -> Iterator[IOEngine]:
    with IOEngine(num_threads=1, queue_depth=8) as eng:
        yield eng


def make_tier(engine: IOEngine, *dirs: str) -> NvmeTier:
    return NvmeTier(NvmeConfig(dirs=tuple(dirs), stripe_bytes=MiB, file_grow_bytes=4 * MiB), engine)


def write(tier: NvmeTier, seed: int, nbytes: int = 2 * MiB + 5) -> tuple[torch.Tensor, TensorLayout]:
    value = torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(seed))
    return value, tier.write_tensor(value).result()


def record(name: str, layout: TensorLayout) -> DurableRecord:
    return DurableRecord("ns", name, "uint8", (layout.nbytes,), layout)


def wait_done(index: DurableIndex, future: Future[None]) -> None:
    """Wait on the completion fd the way the daemon's loop does, and poll."""
    while not future.done():
        select.select([index.completion_fd], [], [], 10)
        index.poll()
    index.poll()


def test_published_tensors_are_loaded_by_the_next_index_and_their_extents_kept(
        engine: IOEngine, disk_tmp: str) -> None:
    tier = make_tier(engine, disk_tmp)
    value, layout = write(tier, 1)
    index = DurableIndex(tier)
    wait_done(index, index.publish([record("a", layout)]))
    index.close()
    tier.close()

    reopened = make_tier(engine, disk_tmp)
    index = DurableIndex(reopened)
    (loaded,) = index.load()
    assert (loaded.namespace, loaded.name, loaded.layout) == ("ns", "a", layout)
    out = torch.empty_like(value)
    reopened.read_tensor(loaded.layout, out)
    assert torch.equal(out, value)
    # Adopted: fresh space never overlaps what the index points at.
    fresh = reopened.allocate(MiB)
    assert fresh.extents[0][1].offset_bytes >= layout.extents[0][1].end_bytes
    index.close()


def test_on_done_runs_in_poll_on_the_callers_thread_after_the_commit(
        engine: IOEngine, disk_tmp: str) -> None:
    tier = make_tier(engine, disk_tmp)
    index = DurableIndex(tier)
    _, layout = write(tier, 2)
    seen: list[tuple[int, int]] = []

    def on_done(future: Future[None]) -> None:
        rows = sqlite3.connect(index.path).execute("SELECT COUNT(*) FROM tensors").fetchone()[0]
        seen.append((threading.get_ident(), rows))

    future = index.publish([record("a", layout)], on_done=on_done)
    readable, _, _ = select.select([index.completion_fd], [], [], 10)
    assert readable and not seen  # signalled, but nothing runs until poll
    assert index.poll() == 1
    assert seen == [(threading.get_ident(), 1)]  # here, and the row was committed already
    assert future.exception() is None
    index.close()


def test_a_callback_that_raises_does_not_hold_back_the_others(
        engine: IOEngine, disk_tmp: str) -> None:
    tier = make_tier(engine, disk_tmp)
    index = DurableIndex(tier)
    _, first = write(tier, 3)
    _, second = write(tier, 4)
    ran: list[str] = []

    def broken(future: Future[None]) -> None:
        raise RuntimeError("a bug in the first callback")

    index.publish([record("a", first)], on_done=broken)
    index.publish([record("b", second)], on_done=lambda future: ran.append("b"))
    index.remove([]).result(timeout=10)  # jobs run in order: both are finished before it
    with pytest.raises(RuntimeError, match="first callback"):
        index.poll()
    assert ran == ["b"]  # not stranded until some later job's signal
    index.close()
    tier.close()


def test_removed_names_are_gone_after_reopening(engine: IOEngine, disk_tmp: str) -> None:
    tier = make_tier(engine, disk_tmp)
    index = DurableIndex(tier)
    _, first = write(tier, 3)
    _, second = write(tier, 4)
    wait_done(index, index.publish([record("a", first), record("b", second)]))
    wait_done(index, index.remove([("ns", "a")]))
    index.close()
    index = DurableIndex(make_tier(engine, disk_tmp))
    assert [r.name for r in index.load()] == ["b"]
    index.close()


def test_jobs_commit_in_submission_order(engine: IOEngine, disk_tmp: str) -> None:
    tier = make_tier(engine, disk_tmp)
    index = DurableIndex(tier)
    _, old = write(tier, 5)
    _, new = write(tier, 6)
    index.publish([record("a", old)])
    index.publish([record("a", new)])
    last = index.remove([("ns", "b")])
    wait_done(index, last)
    index.close()
    index = DurableIndex(make_tier(engine, disk_tmp))
    assert [r.layout for r in index.load()] == [new]
    index.close()


def test_a_second_index_on_the_same_store_is_refused_until_the_first_closes(
        engine: IOEngine, disk_tmp: str) -> None:
    first = DurableIndex(make_tier(engine, disk_tmp))
    with pytest.raises(StoreDirectoryError, match="in use by another process"):
        DurableIndex(make_tier(engine, disk_tmp))
    first.close()
    first.close()  # idempotent
    DurableIndex(make_tier(engine, disk_tmp)).close()


def test_an_index_written_for_other_directories_is_refused(engine: IOEngine, disk_tmp: str) -> None:
    a, b = os.path.join(disk_tmp, "a"), os.path.join(disk_tmp, "b")
    os.mkdir(a)
    os.mkdir(b)
    DurableIndex(make_tier(engine, a, b)).close()
    with pytest.raises(StoreDirectoryError, match="restore the original nvme.dirs"):
        DurableIndex(make_tier(engine, a))


def _two_dirs(root: str) -> tuple[str, str]:
    a, b = os.path.join(root, "a"), os.path.join(root, "b")
    os.mkdir(a)
    os.mkdir(b)
    return a, b


def _store_with_one_tensor(engine: IOEngine, *dirs: str) -> tuple[torch.Tensor, TensorLayout]:
    """A store on `dirs` holding one published tensor striped over all of them; closed."""
    tier = make_tier(engine, *dirs)
    value, layout = write(tier, 7, 4 * MiB + 5)
    index = DurableIndex(tier)
    wait_done(index, index.publish([record("kept", layout)]))
    index.close()
    tier.close()
    return value, layout


def assert_store_holds(engine: IOEngine, dirs: tuple[str, ...], value: torch.Tensor) -> None:
    """The store on `dirs` opens and holds exactly one tensor, `value`."""
    tier = make_tier(engine, *dirs)
    index = DurableIndex(tier)
    (loaded,) = index.load()
    out = torch.empty_like(value)
    tier.read_tensor(loaded.layout, out)
    assert torch.equal(out, value)
    index.close()
    tier.close()


def test_a_directory_in_use_by_another_store_is_refused_whatever_its_position(
        engine: IOEngine, disk_tmp: str) -> None:
    a, b = _two_dirs(disk_tmp)
    first = DurableIndex(make_tier(engine, a, b))
    with pytest.raises(StoreDirectoryError, match="in use by another process"):
        DurableIndex(make_tier(engine, b))  # a store of its own on the first one's second
    first.close()


@pytest.mark.parametrize("order", ["swapped", "second alone"])
def test_the_directories_of_one_store_are_not_taken_for_a_fresh_store(
        engine: IOEngine, disk_tmp: str, order: str) -> None:
    a, b = _two_dirs(disk_tmp)
    value, layout = _store_with_one_tensor(engine, a, b)
    # The index lives in the first directory: another first one would start a new store,
    # whose writes would land on the old store's extents.
    with pytest.raises(StoreDirectoryError, match="belongs to another store"):
        DurableIndex(make_tier(engine, *((b, a) if order == "swapped" else (b,))))
    assert_store_holds(engine, (a, b), value)


def test_a_directory_replaced_since_is_refused(engine: IOEngine, disk_tmp: str) -> None:
    a, b = _two_dirs(disk_tmp)
    _store_with_one_tensor(engine, a, b)
    c = os.path.join(disk_tmp, "c")
    os.rename(b, c)  # the second drive swapped for an empty one at the same path
    os.mkdir(b)
    with pytest.raises(StoreDirectoryError, match="not position 1 of the store"):
        DurableIndex(make_tier(engine, a, b))


def _unmount_extents(directory: str) -> str:
    """Move a directory's extent file away, as if its drive were not mounted yet; its path."""
    extents = os.path.join(directory, EXTENT_FILE_NAME)
    os.rename(extents, extents + ".away")
    return extents


def _assert_load_refused(engine: IOEngine, dirs: tuple[str, ...], reason: str) -> None:
    tier = make_tier(engine, *dirs)
    index = DurableIndex(tier)
    with pytest.raises(StoreDirectoryError, match=reason):
        index.load()
    index.close()
    tier.close()


def test_a_missing_extent_file_is_refused_not_filled_with_zeros(
        engine: IOEngine, disk_tmp: str) -> None:
    a, b = _two_dirs(disk_tmp)
    _store_with_one_tensor(engine, a, b)
    extents = _unmount_extents(b)
    _assert_load_refused(engine, (a, b), "is missing.*mounted")
    assert os.path.getsize(extents) == 0  # nothing was written where the file should be


def test_a_fresh_store_stopped_while_marking_its_directories_opens_next_time(
        engine: IOEngine, disk_tmp: str, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _two_dirs(disk_tmp)

    def stopped(self: DurableIndex, store_id: str) -> None:  # a kill at that moment, faked:
        real_mark(self, store_id)  # one cannot kill -9 a process between two lines of it
        raise KeyboardInterrupt

    real_mark = DurableIndex._mark_directories
    monkeypatch.setattr(DurableIndex, "_mark_directories", stopped)
    with pytest.raises(KeyboardInterrupt):
        DurableIndex(make_tier(engine, a, b))
    monkeypatch.undo()
    value, _ = _store_with_one_tensor(engine, a, b)
    assert_store_holds(engine, (a, b), value)


def _as_before_markers(*dirs: str) -> None:
    """Make a store look as the code before directory markers wrote it."""
    db = sqlite3.connect(os.path.join(dirs[0], INDEX_FILE_NAME), isolation_level=None)
    db.execute("DELETE FROM meta WHERE key IN ('store_id', 'marking')")
    db.close()
    for directory in dirs:
        os.unlink(os.path.join(directory, MARKER_FILE_NAME))


def test_a_store_from_before_markers_is_marked_only_once_its_files_are_all_found(
        engine: IOEngine, disk_tmp: str) -> None:
    a, b = _two_dirs(disk_tmp)
    value, _ = _store_with_one_tensor(engine, a, b)
    _as_before_markers(a, b)
    extents = _unmount_extents(b)
    _assert_load_refused(engine, (a, b), "is missing")
    assert not os.path.exists(os.path.join(b, MARKER_FILE_NAME))  # the bare mount point stays bare
    os.replace(extents + ".away", extents)  # mounted
    assert_store_holds(engine, (a, b), value)
    assert os.path.exists(os.path.join(b, MARKER_FILE_NAME))


def test_directories_swapped_while_the_store_was_being_marked_are_refused(
        engine: IOEngine, disk_tmp: str) -> None:
    a, b = _two_dirs(disk_tmp)
    _store_with_one_tensor(engine, a, b)
    db = sqlite3.connect(os.path.join(a, INDEX_FILE_NAME), isolation_level=None)
    db.execute("INSERT INTO meta VALUES ('marking', '1')")  # stopped before the row went
    db.close()
    for name in (INDEX_FILE_NAME, "infinity-index.sqlite-wal", "infinity-index.sqlite-shm"):
        if os.path.exists(os.path.join(a, name)):
            os.rename(os.path.join(a, name), os.path.join(b, name))
    os.rename(a, a + ".x")  # the two drives come back at each other's paths
    os.rename(b, a)
    os.rename(a + ".x", b)
    for name in (INDEX_FILE_NAME, "infinity-index.sqlite-wal", "infinity-index.sqlite-shm"):
        if os.path.exists(os.path.join(b, name)):
            os.rename(os.path.join(b, name), os.path.join(a, name))
    with pytest.raises(StoreDirectoryError, match="is position 1 of this store, not 0"):
        DurableIndex(make_tier(engine, a, b))


def test_small_tensors_spread_over_every_directory(engine: IOEngine, disk_tmp: str) -> None:
    a, b = _two_dirs(disk_tmp)
    # A capacity below what the disk has free, so that it, not the shared file system's free
    # space, bounds each directory's room: with the default 64 GiB on a disk with less free, the
    # first directory's room is the file system's less the index's reserve, the second's the
    # whole, and every deal started at the second (seen once the test disk had 63 GiB free).
    tier = NvmeTier(NvmeConfig(dirs=(a, b), stripe_bytes=MiB, file_grow_bytes=4 * MiB,
                               capacity_bytes_per_dir=1 << 30), engine)
    firsts = [tier.allocate(4096 + i).extents[0][0] for i in range(6)]  # one stripe each
    assert sorted(firsts) == [0, 0, 0, 1, 1, 1]
    tier.close()


def test_an_index_of_another_schema_is_refused(engine: IOEngine, disk_tmp: str) -> None:
    DurableIndex(make_tier(engine, disk_tmp)).close()
    db = sqlite3.connect(os.path.join(disk_tmp, INDEX_FILE_NAME), isolation_level=None)
    db.execute("UPDATE meta SET value = '99' WHERE key = 'schema'")
    db.close()
    with pytest.raises(StoreDirectoryError, match="schema"):
        DurableIndex(make_tier(engine, disk_tmp))


# A failing fdatasync, for real: the store on an ext4 loop device whose writes fail at the
# block layer while `fail_writes` lasts (tests/loopfs.py), with buffered I/O, so that the
# tier's writes land in the page cache and their write-back fails under the fdatasync.
def buffered_tier(engine: IOEngine, directory: str) -> NvmeTier:
    return NvmeTier(NvmeConfig(dirs=(directory,), stripe_bytes=MiB, file_grow_bytes=4 * MiB,
                               direct="off"), engine)


def test_a_failing_fdatasync_fails_the_publish_typed_and_commits_nothing(
        engine: IOEngine, loop_fs: LoopFs) -> None:
    tier = buffered_tier(engine, loop_fs.path)
    index = DurableIndex(tier)
    _, layout = write(tier, 7)
    loop_fs.fail_writes()
    future = index.publish([record("a", layout)])
    wait_done(index, future)
    loop_fs.heal()
    assert isinstance(future.exception(), IOEngineError)
    assert "fdatasync" in str(future.exception())
    index.close()
    tier.close()
    reopened = buffered_tier(engine, loop_fs.path)
    index = DurableIndex(reopened)
    assert index.load() == []
    index.close()
    reopened.close()


def test_a_copy_written_before_a_failed_fdatasync_is_refused_by_a_later_successful_one(
        engine: IOEngine, loop_fs: LoopFs) -> None:
    # Linux reports a failed write-back once, so the next fdatasync succeeds whatever was lost:
    # only a copy written after the failure may be published on the strength of it.
    tier = buffered_tier(engine, loop_fs.path)
    index = DurableIndex(tier)
    _, before = write(tier, 11)
    stamp_before = tier.sync_failures
    loop_fs.fail_writes()
    failed = index.publish([record("a", before)])
    wait_done(index, failed)
    loop_fs.heal()
    assert isinstance(failed.exception(), IOEngineError)
    retried = index.publish([dataclasses.replace(record("a", before),
                                                 sync_failures_before=stamp_before)])
    wait_done(index, retried)
    assert isinstance(retried.exception(), IOEngineError)
    assert "written" in str(retried.exception())
    value, after = write(tier, 12)
    fresh = index.publish([dataclasses.replace(record("a", after),
                                               sync_failures_before=tier.sync_failures)])
    wait_done(index, fresh)
    assert fresh.exception() is None
    index.close()
    tier.close()
    loop_fs.repair()  # the page cache goes: what is read next comes from the device
    reopened = buffered_tier(engine, loop_fs.path)
    index = DurableIndex(reopened)
    (loaded,) = index.load()
    assert loaded.layout == after
    out = torch.empty_like(value)
    reopened.read_tensor(after, out)
    assert torch.equal(out, value)
    index.close()
    reopened.close()


def test_a_damaged_entry_is_a_typed_error_naming_the_tensor(engine: IOEngine, disk_tmp: str) -> None:
    DurableIndex(make_tier(engine, disk_tmp)).close()
    db = sqlite3.connect(os.path.join(disk_tmp, INDEX_FILE_NAME), isolation_level=None)
    db.execute("INSERT INTO tensors VALUES ('ns', 'broken', 'uint8', '[4]', ?)",
               (json.dumps({"nbytes": 4}),))
    db.close()
    index = DurableIndex(make_tier(engine, disk_tmp))
    with pytest.raises(StoreDirectoryError, match="'broken'"):
        index.load()
    index.close()
