"""infinityd when the disk under its NVMe tier fails, each fault caused for real: a store
directory on an ext4 loop device (tests/loopfs.py) whose file system turns read-only (ext4's
own error path, errors=remount-ro), whose device dies (ext4's shutdown: EIO for every I/O), or
that fills up.

What each must give: a typed error to the client that meets it, naming the store directory
and saying what to do; a log line; the daemon serving on what it still has (memory, the other
directories); and nothing that was acknowledged as durable lost once the file system is
repaired. (The write errors of a flaky device, and the failed fdatasync they cause, are in
tests/test_daemon_nvme.py, where they stand for the fdatasync failures.)"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from conftest import RunningDaemon
from loopfs import LoopFs
from test_daemon_nvme import (Store, _store, pattern, push_out_and_forget, same_bytes,
                              tier_of)
from infinity.daemon.prometheus import metric_families
from infinity.errors import DiskFullError, IOEngineError, StoreDirectoryError

MiB = 1024 * 1024


@pytest.fixture
def loop_store(loop_fs: LoopFs) -> Iterator[Store]:
    """A store whose one directory is the loop file system."""
    yield from _store(loop_fs.path)


@pytest.fixture
def split_store(loop_fs: LoopFs) -> Iterator[Store]:
    """A store whose first directory (the index's) is on the real disk; start its daemons with
    `two_dirs(store, loop_fs)`, which adds the loop file system as the second."""
    yield from _store(None)


def two_dirs(store: Store, fs: LoopFs) -> dict[str, Any]:
    return {"nvme.dirs": [store.dir, fs.path]}


def read_back(client: Any, values: dict[str, torch.Tensor]) -> None:
    for name, value in values.items():
        with client.get(name) as view:
            assert same_bytes(view, value), name


def indexed_dirs(store: Store, name: str) -> set[int]:
    """The store directories (by position) a durable tensor's bytes lie in, as the index says."""
    return {d for d, _, _ in store.index_layout(name)["extents"]}


def one_of_each_on(store: Store) -> tuple[RunningDaemon, dict[str, torch.Tensor]]:
    """A daemon on `store` holding a tensor in each state a fault may meet: "on_disk" durable
    and only on NVMe, "kept" durable and in memory too, "dirty" in memory only; their values."""
    daemon = store.start()
    values = {"on_disk": pattern(1, MiB + 4097), "kept": pattern(2, 2 * MiB - 5),
              "dirty": pattern(3, 777_777)}
    with daemon.connect("filler") as client:
        client.put("on_disk", values["on_disk"], durable=True)
        push_out_and_forget(client)
        assert tier_of(client, "on_disk") == "nvme"
        client.put("kept", values["kept"], durable=True)
        client.put("dirty", values["dirty"])
    return daemon, values


def test_a_store_directory_turned_read_only_fails_durable_writes_and_serves_what_it_has(
        loop_store: Store, loop_fs: LoopFs) -> None:
    daemon, values = one_of_each_on(loop_store)
    loop_fs.make_read_only()
    where = re.escape(loop_fs.path)
    with daemon.connect() as client:
        # The index meets it first (SQLite says only "disk I/O error"): a delete not
        # acknowledged, so "kept" is back after the restart.
        with pytest.raises(StoreDirectoryError, match=f"{where} is read-only now.*fsck"):
            client.delete("kept")
        with pytest.raises(StoreDirectoryError, match=f"{where} is read-only now"):
            client.put("after", pattern(4, 1234), durable=True)
        with pytest.raises(StoreDirectoryError, match=f"{where} is read-only now"):
            client.flush_store()
        # memory, and what a read-only file system still reads
        read_back(client, {k: values[k] for k in ("on_disk", "dirty")})
        client.put("scratch", pattern(5, 99))  # what needs no disk goes on
        stats = client.stats()
        assert stats["tiers"]["nvme"]["dirs"][0]["failure"].startswith(
            f"store directory {loop_fs.path} is read-only now")
        (failed,) = [f for f in metric_families(stats) if f.name == "infinity_nvme_failed"]
        assert [(sample.labels["dir"], sample.value) for sample in failed.samples] == [
            (loop_fs.path, 1)]
    daemon.assert_serving()
    log = daemon.log()
    assert "ERROR" in log and f"{loop_fs.path} is read-only now" in log
    assert "internal error" not in log and "Traceback" not in log
    assert daemon.stop() == 0
    loop_fs.repair()
    with loop_store.start().connect() as client:  # what was acknowledged as durable is there
        assert sorted(i.name for i in client.list()) == ["kept", "on_disk"]
        read_back(client, {k: values[k] for k in ("on_disk", "kept")})


def test_a_second_directory_turned_read_only_leaves_new_tensors_to_the_first(
        split_store: Store, loop_fs: LoopFs) -> None:
    # As a tensor goes to another directory where a file system is full, the stripes of new
    # tensors are dealt over the directories left: the write that met the read-only one is
    # written again to the other, and the client sees no error.
    daemon = split_store.start(**two_dirs(split_store, loop_fs))
    values = {"before": pattern(1, 3 * MiB + 3), "dirty": pattern(2, 2 * MiB + 1)}
    with daemon.connect() as client:
        client.put("before", values["before"], durable=True)
        assert indexed_dirs(split_store, "before") == {0, 1}  # striped over both
        client.put("dirty", values["dirty"])
        loop_fs.make_read_only()
        values["after"] = pattern(3, 3 * MiB + 5)
        client.put("after", values["after"], durable=True)
        assert indexed_dirs(split_store, "after") == {0}
        assert client.flush_store()["tensors"] == 3
        assert indexed_dirs(split_store, "dirty") == {0}
        read_back(client, values)
    daemon.assert_serving()
    assert f"{loop_fs.path} is read-only now" in daemon.log()
    assert daemon.stop() == 0
    loop_fs.repair()
    with split_store.start(**two_dirs(split_store, loop_fs)).connect() as client:
        read_back(client, values)


def test_a_flush_that_finds_a_second_directory_read_only_is_made_again_on_the_first(
        split_store: Store, loop_fs: LoopFs) -> None:
    # x's clean copy, written when it was evicted, is striped over both directories but not
    # durable yet; the read-only file system shows only when the flush's fdatasync meets it.
    # That copy can never be made durable: the flush writes x anew, to the first directory.
    daemon = split_store.start(**two_dirs(split_store, loop_fs))
    x = pattern(7, 3 * MiB + 333)
    with daemon.connect() as client:
        client.put("x", x)
        push_out_and_forget(client)
        assert tier_of(client, "x") == "nvme"
        with client.get("x"):  # resident again, its copy on NVMe kept
            pass
        assert tier_of(client, "x") == "cpu+nvme"
        loop_fs.make_read_only()
        assert client.flush_store()["tensors"] == 1
        assert indexed_dirs(split_store, "x") == {0}
    assert "flush goes to the store directories left" in daemon.log()
    assert daemon.stop() == 0
    loop_fs.repair()
    with split_store.start(**two_dirs(split_store, loop_fs)).connect() as client:
        read_back(client, {"x": x})


def test_a_store_directory_whose_device_dies_gives_typed_errors_never_zeros(
        loop_store: Store, loop_fs: LoopFs) -> None:
    # ext4's shutdown (xfstests' "godown") stands in for a device that stops answering: every
    # read, write and fdatasync there is EIO from then on.
    daemon, values = one_of_each_on(loop_store)
    loop_fs.shut_down()
    with daemon.connect() as client:
        where = re.escape(loop_fs.path)
        with pytest.raises(IOEngineError, match=f"'on_disk'.* cannot be read .*{where}"):
            client.get("on_disk")
        with pytest.raises(IOEngineError, match="'on_disk'"):
            client.read_into("on_disk", torch.empty_like(values["on_disk"]))
        with pytest.raises(StoreDirectoryError, match=f"{where} failed .*Input/output error"):
            client.put("after", pattern(4, 1234), durable=True)
        with pytest.raises(StoreDirectoryError, match=f"{where} failed"):
            client.flush_store()
        read_back(client, {k: values[k] for k in ("kept", "dirty")})
        assert client.stats()["counters"]["tiers"]["reload_failures"] >= 1
    daemon.assert_serving()
    log = daemon.log()
    assert f"'on_disk' in namespace 'default' cannot be read from NVMe" in log
    assert "internal error" not in log and "Traceback" not in log
    assert daemon.stop() == 0
    loop_fs.repair()
    with loop_store.start().connect() as client:
        read_back(client, {k: values[k] for k in ("on_disk", "kept")})


def test_a_full_ext4_store_is_disk_full_and_keeps_what_it_acknowledged(
        loop_store: Store, loop_fs: LoopFs) -> None:
    # The tmpfs case (tests/test_daemon_nvme.py) on a real ext4 with its journal, O_DIRECT.
    daemon = loop_store.start()
    acknowledged: dict[str, torch.Tensor] = {}
    with daemon.connect() as client:
        with pytest.raises(DiskFullError, match="free space"):
            for i in range(64):  # 128 MiB into a 64 MiB file system
                value = pattern(i, 2 * MiB + i)
                client.put(f"t{i}", value, durable=True)
                acknowledged[f"t{i}"] = value
        assert len(acknowledged) >= 8
        client.delete("t0")
        del acknowledged["t0"]
        client.put("after", pattern(99, MiB), durable=True)  # room again
        acknowledged["after"] = pattern(99, MiB)
    assert daemon.stop() == 0
    with loop_store.start().connect() as client:
        read_back(client, acknowledged)

