"""Namespaces as records: a read-only namespace is written by its owner and only read by every
other client, through mappings the kernel keeps read-only; quotas; namespaces never created
behave as before."""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing
import signal
from multiprocessing.connection import Connection
from typing import Any, Callable

import pytest
import torch

import infinity
from infinity.errors import (AlreadyExistsError, InvalidRequestError, ProtocolError,
                             QuotaExceededError, ReadOnlyNamespaceError)
from infinity.protocol import wire

SPAWN = multiprocessing.get_context("spawn")
MiB = 1 << 20
WEIGHTS = torch.arange(4096, dtype=torch.float32)


def _mapping_of(address: int) -> tuple[str, str]:
    """(permissions, path) of the mapping of this process that holds `address`."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[1], " ".join(fields[5:])
    raise AssertionError(f"address {address:#x} is not mapped")


def _segment_of(client: Any, address: int) -> int:
    for segment, start, end in client.segment_ranges():
        if start <= address < end:
            return int(segment)
    raise AssertionError(f"address {address:#x} lies in no segment of the client")


@pytest.fixture
def owner(daemon: Any) -> Any:
    """A client that created the read-only namespace "weights" and put WEIGHTS in it as "w"."""
    client = daemon.connect("importer")
    client.create_namespace("weights", mode="read-only")
    client.put("w", WEIGHTS, namespace="weights")
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def reader(daemon: Any, owner: Any) -> Any:
    client = daemon.connect("reader")
    try:
        yield client
    finally:
        client.close()


def _assert_still_serving(daemon: Any, owner: Any, reader: Any) -> None:
    daemon.assert_serving()
    with reader.get("w", namespace="weights") as view:
        assert torch.equal(view, WEIGHTS)
    reader.put("mine", torch.ones(8))  # its own namespaces are as writable as ever
    owner.put("w2", torch.zeros(16), namespace="weights")


# --- children (spawned: they import this module) -------------------------------------------

def _write_into_read_only_view(config: Any, conn: Connection) -> None:
    with infinity.connect(config=config, name="stray-writer") as client:
        lease = client.get("w", namespace="weights")
        view = lease.tensor
        page = view.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
        libc = ctypes.CDLL(None, use_errno=True)
        upgraded = libc.mprotect(ctypes.c_void_p(page), ctypes.c_size_t(mmap.PAGESIZE),
                                 mmap.PROT_READ | mmap.PROT_WRITE)
        conn.send((torch.equal(view, WEIGHTS), _mapping_of(view.data_ptr())[0],
                   upgraded, ctypes.get_errno()))
        view.fill_(3.0)  # the kernel refuses: the child dies here
        conn.send("wrote")


def _run_child(target: Callable[..., None], *args: Any, timeout_s: float = 60) -> int:
    process = SPAWN.Process(target=target, args=args)
    process.start()
    process.join(timeout_s)
    if process.is_alive():
        process.kill()
        raise AssertionError(f"{target.__name__} did not finish in {timeout_s}s")
    assert process.exitcode is not None
    return process.exitcode


# --- tests ----------------------------------------------------------------------------------

@pytest.mark.parametrize("body", [
    ["drop", "ns", "read-write", 0, ""],  # no such action
    ["create", "ns", "write-only", 0, ""],  # no such mode
    ["create", "ns", "read-only", -1, ""],  # a quota is not negative
    ["create", "", "read-only", 0, ""],  # a namespace has a name
    ["create", "ns", "read-only", 0, "short"],  # a grant token has 16 characters or more
    ["grant", "ns", "read-write", 0, ""],  # a grant presents a token
    ["info", "ns"],  # five fields
    ["info", "ns", "read-write", 0],  # five fields since protocol version 9
])
def test_a_malformed_namespace_request_is_a_protocol_error(body: list[Any]) -> None:
    with pytest.raises(ProtocolError):
        wire.NamespaceOp.from_body(body)


def test_a_namespace_record_round_trips_through_its_schema() -> None:
    info = wire.NamespaceInfo("model", "read-only", True, 3, "importer", 4242, True, 1 << 30,
                              4096, False, True, 1000)
    assert wire.NamespaceInfo.from_wire(info.to_wire()) == info


def test_a_namespace_never_created_is_read_write_with_no_owner(client: Any) -> None:
    client.put("t", torch.ones(10), namespace="plain")
    info = client.namespace_info("plain")
    assert (info.mode, info.created, info.owner_client, info.quota_bytes) == ("read-write", False,
                                                                              0, 0)
    assert info.used_bytes == 40


def test_creating_a_namespace_records_its_mode_owner_and_quota(daemon: Any, client: Any) -> None:
    info = client.create_namespace("model", mode="read-only", quota_bytes=1 << 20)
    assert info.created and info.mode == "read-only" and info.quota_bytes == 1 << 20
    assert info.owner_client == client.client_id and info.owner_name == "pytest"
    assert info.owner_alive and not info.sealed
    with daemon.connect("other") as other:
        assert other.namespace_info("model") == info


def test_a_namespace_is_created_once_and_before_anything_is_put_into_it(
        daemon: Any, client: Any) -> None:
    client.create_namespace("once")
    with pytest.raises(AlreadyExistsError):
        client.create_namespace("once", mode="read-only")
    client.put("t", torch.ones(4), namespace="used")
    with pytest.raises(InvalidRequestError):
        client.create_namespace("used", mode="read-only")
    assert client.namespace_info("used").mode == "read-write"


def test_a_read_only_tensor_is_read_by_another_client_as_its_owner_wrote_it(
        owner: Any, reader: Any) -> None:
    with reader.get("w", namespace="weights") as view:
        assert torch.equal(view, WEIGHTS)
        permissions, path = _mapping_of(view.data_ptr())
        assert permissions.startswith("r-") and "memfd:infinity-seg" in path


def test_the_owner_maps_its_read_only_namespace_writable_and_writes_it(owner: Any) -> None:
    with owner.get("w", namespace="weights", exclusive=True) as view:
        assert _mapping_of(view.data_ptr())[0].startswith("rw")
        view.add_(1)
    with owner.get("w", namespace="weights") as view:
        assert torch.equal(view, WEIGHTS + 1)
    owner.delete("w", namespace="weights")
    assert not owner.exists("w", namespace="weights")


def test_a_readers_write_into_a_read_only_view_is_refused_by_the_kernel(
        daemon: Any, owner: Any) -> None:
    parent_end, child_end = SPAWN.Pipe()
    exitcode = _run_child(_write_into_read_only_view, daemon.config, child_end)
    matched, permissions, upgraded, errno_ = parent_end.recv()
    assert matched and permissions.startswith("r-")
    assert upgraded == -1 and errno_ != 0  # no mprotect makes the reader's mapping writable
    assert exitcode in (-signal.SIGSEGV, -signal.SIGBUS)
    assert not parent_end.poll()  # it never got past the write
    with owner.get("w", namespace="weights") as view:
        assert torch.equal(view, WEIGHTS)
    daemon.assert_serving()


def test_a_put_into_a_read_only_namespace_by_another_client_is_refused(
        daemon: Any, owner: Any, reader: Any) -> None:
    with pytest.raises(ReadOnlyNamespaceError):
        reader.put("w", torch.zeros(4096), namespace="weights")
    with pytest.raises(ReadOnlyNamespaceError):
        reader.put("new", torch.zeros(8), namespace="weights")
    _assert_still_serving(daemon, owner, reader)


def test_a_reserve_in_a_read_only_namespace_by_another_client_is_refused(
        daemon: Any, owner: Any, reader: Any) -> None:
    with pytest.raises(ReadOnlyNamespaceError):
        reader.reserve({"new": (torch.float32, (8,))}, namespace="weights")
    _assert_still_serving(daemon, owner, reader)


def test_an_exclusive_get_in_a_read_only_namespace_by_another_client_is_refused(
        daemon: Any, owner: Any, reader: Any) -> None:
    with pytest.raises(ReadOnlyNamespaceError):
        reader.get("w", namespace="weights", exclusive=True)
    _assert_still_serving(daemon, owner, reader)


def test_a_delete_in_a_read_only_namespace_by_another_client_is_refused(
        daemon: Any, owner: Any, reader: Any) -> None:
    with pytest.raises(ReadOnlyNamespaceError):
        reader.delete("w", namespace="weights")
    assert reader.exists("w", namespace="weights")
    _assert_still_serving(daemon, owner, reader)


def test_a_write_stream_into_a_read_only_namespace_by_another_client_is_refused(
        daemon: Any, owner: Any, reader: Any) -> None:
    with pytest.raises(ReadOnlyNamespaceError):
        reader.write_from("streamed", torch.ones(1024), namespace="weights")
    out = torch.empty_like(WEIGHTS)
    reader.read_into("w", out, namespace="weights")  # reading through a stream is fine
    assert torch.equal(out, WEIGHTS)
    _assert_still_serving(daemon, owner, reader)


def test_a_sealed_namespace_refuses_its_owners_writes_too(
        daemon: Any, owner: Any, reader: Any) -> None:
    with pytest.raises(ReadOnlyNamespaceError):
        reader.seal_namespace("weights")  # only the owner seals
    assert owner.seal_namespace("weights").sealed
    with pytest.raises(ReadOnlyNamespaceError):
        owner.put("w", torch.zeros(4096), namespace="weights")
    with pytest.raises(ReadOnlyNamespaceError):
        owner.get("w", namespace="weights", exclusive=True)
    with owner.get("w", namespace="weights") as view:
        assert torch.equal(view, WEIGHTS)


def test_only_a_read_only_namespace_can_be_sealed(client: Any) -> None:
    client.create_namespace("rw")
    with pytest.raises(InvalidRequestError):
        client.seal_namespace("rw")


def test_read_only_tensors_never_share_a_segment_with_read_write_ones(
        owner: Any, reader: Any) -> None:
    owner.put("plain", torch.ones(4096))
    with owner.get("plain") as plain, owner.get("w", namespace="weights") as weights:
        assert _segment_of(owner, plain.data_ptr()) != _segment_of(owner, weights.data_ptr())
    with reader.get("plain") as plain:
        assert _mapping_of(plain.data_ptr())[0].startswith("rw")  # read-write as before
    cpu = reader.stats()["tiers"]["cpu"]
    assert cpu["num_read_only_segments"] == 1


def test_an_idle_read_only_segment_never_takes_a_read_write_tensor(daemon: Any) -> None:
    with daemon.connect("importer") as owner:
        owner.create_namespace("big", mode="read-only")
        owner.put("w", torch.zeros(5 * MiB - 3, dtype=torch.int32), namespace="big")  # 20 MiB
        owner.delete("w", namespace="big")  # its dedicated segment stays, idle, of class "big"
        assert owner.stats()["tiers"]["cpu"]["num_idle_dedicated_segments"] == 1
        created = owner.stats()["counters"]["tiers"]["segments_created"]
        value = torch.arange(5 * MiB - 3, dtype=torch.int32)
        owner.put("plain", value)  # the same size, read-write: a segment of its own class
        assert owner.stats()["counters"]["tiers"]["segments_created"] == created + 1
        with owner.get("plain") as view:
            assert _mapping_of(view.data_ptr())[0].startswith("rw")
            assert torch.equal(view, value)


def test_when_the_owner_leaves_nobody_writes_its_read_only_namespace(
        daemon: Any, owner: Any, reader: Any) -> None:
    owner.close()
    info = reader.namespace_info("weights")
    assert info.mode == "read-only" and not info.owner_alive
    with pytest.raises(ReadOnlyNamespaceError):
        reader.put("w", torch.zeros(4096), namespace="weights")
    with reader.get("w", namespace="weights") as view:
        assert torch.equal(view, WEIGHTS)


def test_a_read_write_namespace_created_by_one_client_is_written_by_any(
        daemon: Any, client: Any) -> None:
    client.create_namespace("open")
    with daemon.connect("other") as other:
        other.put("t", torch.full((64,), 2.0), namespace="open")
        with other.get("t", namespace="open", exclusive=True) as view:
            view.add_(1)
    with client.get("t", namespace="open") as view:
        assert torch.equal(view, torch.full((64,), 3.0))
    client.delete("t", namespace="open")


def test_a_put_past_a_namespaces_quota_is_refused_and_a_replacement_within_it_is_not(
        daemon: Any, client: Any) -> None:
    client.create_namespace("small", quota_bytes=8192)
    client.put("a", torch.zeros(1024), namespace="small")  # 4096 bytes
    client.put("a", torch.ones(1024), namespace="small")  # replaces them: still 4096
    client.put("b", torch.zeros(1024), namespace="small")  # 8192: at the quota
    with pytest.raises(QuotaExceededError):
        client.put("c", torch.zeros(1), namespace="small")
    with pytest.raises(QuotaExceededError):
        client.write_from("c", torch.zeros(16), namespace="small")
    client.delete("b", namespace="small")
    client.put("c", torch.zeros(16), namespace="small")
    assert client.namespace_info("small").used_bytes == 4096 + 64
    daemon.assert_serving()


def test_a_read_only_tensor_loaded_back_from_nvme_lands_in_a_read_only_segment(
        nvme_daemon: Any) -> None:
    with nvme_daemon.connect("importer") as owner, nvme_daemon.connect("reader") as reader:
        owner.create_namespace("weights", mode="read-only")
        owner.put("w", WEIGHTS, namespace="weights")
        for i in range(8):  # 8 MiB through a CPU tier of 8 MiB: "w" goes to NVMe
            owner.put(f"fill{i}", torch.full((256 * 1024,), float(i)))
        with reader.get("w", namespace="weights") as view:
            assert torch.equal(view, WEIGHTS)
            assert _mapping_of(view.data_ptr())[0].startswith("r-")
        assert reader.stats()["counters"]["tiers"]["reloads"] >= 1
