"""What clients send cannot make the daemon's memory or open files grow without bound: failed
items leave nothing behind, client-chosen strings are shortened in its log, and sessions,
streams, pending requests, tensors, namespaces and leases have limits."""

from __future__ import annotations

import os
from typing import Any

import psutil
import pytest
import torch
import zmq

from conftest import wait_until
from infinity.errors import LimitExceededError, NotFoundError
from infinity.protocol import wire
from infinity.protocol.paths import RuntimeLayout
from test_daemon_optimizer import GROUP, item, read, reference_step, store_state


def anonymous_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon in /proc/<pid>/status")


def test_repeated_batch_gets_of_missing_names_leave_the_daemons_memory_flat(daemon: Any) -> None:
    """Each get of 4,095 missing names fails item by item. Before the fix each request left
    its failed items' errors in reference cycles that the daemon's rare full collections free:
    about 7 MiB more per request of 8,191 (228 MiB over 30). After a warm-up, 30 more requests
    may move the daemon's anonymous memory by at most 4 MiB (allocator noise)."""
    client = daemon.connect("missing-names")
    names = [f"missing-{i}" for i in range(4095)]

    def failing_get() -> None:
        with pytest.raises(NotFoundError):
            client.get_many(names, namespace="nothing-here")

    try:
        for _ in range(10):
            failing_get()
        warm = anonymous_mib(daemon.process.pid)
        for _ in range(30):
            failing_get()
        assert anonymous_mib(daemon.process.pid) - warm <= 4.0
    finally:
        client.close()


def test_repeated_refused_optimizer_steps_and_stream_opens_leave_the_daemons_memory_flat(
        daemon: Any) -> None:
    """A refused step and a read stream of a missing tensor fail in a handler that raised the
    error from its own results; each left a reference cycle (the error's traceback holds the
    frame that holds the error; a step and its parts refer to each other) that waited for the
    daemon's rare collections (the first after 50,000 objects): these grew it 4.8 MiB, where
    the fixed daemon grows by nothing (0.0 MiB in three runs). At most 2 MiB."""
    client = daemon.connect("refused")
    store_state(client, "p", 31)
    missing = item("missing")
    out = torch.zeros(3)

    def refused(count: int) -> None:
        for _ in range(count):
            with pytest.raises(NotFoundError):
                client.adam_step([GROUP], [missing])
            with pytest.raises(NotFoundError):
                client.read_into("missing", out, namespace="nothing-here")
        client.adam_step([GROUP], [item("p")])  # a step that works, too

    try:
        refused(300)
        warm = anonymous_mib(daemon.process.pid)
        refused(5000)
        assert anonymous_mib(daemon.process.pid) - warm <= 2.0
    finally:
        client.close()


def test_a_long_client_name_is_shortened_in_the_daemons_log(daemon: Any) -> None:
    name = "n" * 5000
    client = daemon.connect(name)
    client.close()
    log = daemon.log()
    assert "n" * 61 + "..." in log
    assert "n" * 65 not in log


def test_a_client_past_daemon_max_clients_is_refused_until_one_leaves(
        daemon_factory: Any) -> None:
    daemon = daemon_factory(**{"daemon.max_clients": 3})
    clients = [daemon.connect(f"c{i}") for i in range(3)]
    try:
        with pytest.raises(LimitExceededError, match="daemon.max_clients"):
            daemon.connect("one-too-many")
        clients.pop().close()
        wait_until(lambda: daemon.connect("after-one-left"), timeout_s=10,
                   what="a client to be let in once another closed").close()
    finally:
        for client in clients:
            client.close()


def test_a_stream_past_daemon_max_streams_per_client_is_refused_and_others_go_on(
        daemon_factory: Any) -> None:
    daemon = daemon_factory(**{"daemon.max_streams_per_client": 4})
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(RuntimeLayout(daemon.runtime_dir).control_endpoint)

    def call(request_id: int, message: wire.Request) -> Any:
        sock.send(wire.encode_request(request_id, message))
        return wire.decode_reply(sock.recv())

    try:
        secret = RuntimeLayout(daemon.runtime_dir).read_secret()
        welcome = call(1, wire.Hello(wire.PROTOCOL_VERSION, "streamer", os.getpid(),
                                     psutil.Process().create_time(), secret))
        assert welcome.failure is None
        for i in range(4):  # held open: never closed
            opened = call(10 + i, wire.StreamOpen("ns", f"w{i}", "write", "float32", (7,)))
            assert opened.failure is None and type(opened.results[0]) is not wire.ItemError
        refused = call(20, wire.StreamOpen("ns", "w5", "write", "float32", (7,))).failure
        assert refused is not None and refused.code == LimitExceededError.code
        assert "daemon.max_streams_per_client" in refused.message
        other = daemon.connect("other")  # the limit is per client
        other.write_from("streamed", torch.arange(11.0), namespace="ns")
        other.close()
    finally:
        sock.close()
        context.term()


def test_a_request_past_daemon_max_pending_requests_per_client_is_refused_at_once(
        daemon_factory: Any) -> None:
    # Each optimizer step's item waits 0.1 s in the daemon (a debug setting), so its reply
    # stays pending that long: three steps sent at once hold three pending replies.
    daemon = daemon_factory(**{"daemon.max_pending_requests_per_client": 3,
                               "daemon.debug_step_delay_s": 0.1})
    client = daemon.connect("pipelining")
    states = {f"p{i}": store_state(client, f"p{i}", 13 + 2 * i, seed=i) for i in range(5)}
    stepper = client.adam_stepper()
    pending = [stepper.send([GROUP], [item(f"p{i}")]) for i in range(4)]
    with pytest.raises(LimitExceededError, match="daemon.max_pending_requests_per_client"):
        pending[3].result()
    for step in pending[:3]:
        step.result()
    stepper.send([GROUP], [item("p4")]).result()  # answered replies no longer count
    for name in ("p0", "p1", "p2", "p4"):
        reference_step(states[name], 1)
    for name, state in states.items():  # p3's step was refused whole: p3 is as it was
        assert torch.equal(read(client, name), state["param"]), name
    client.close()


# --- what costs the daemon memory but no tier bytes -----------------------------------------

def test_a_new_tensor_past_daemon_max_tensors_is_refused_while_rewrites_go_on(
        daemon_factory: Any) -> None:
    """Tensors of no elements take no tier bytes, so no budget or quota bounded them: about
    1 KiB of catalog each, without end. Past the limit a new name is refused; the store can
    still rewrite what it holds, and a delete makes room."""
    daemon = daemon_factory(**{"daemon.max_tensors": 5})
    client = daemon.connect("many-empty-tensors")
    try:
        client.put_many({f"e{i}": torch.empty(0, 3) for i in range(4)}, namespace="ns")
        client.put("full", torch.arange(7.0), namespace="other")
        with pytest.raises(LimitExceededError, match="daemon.max_tensors"):
            client.put("one-too-many", torch.empty(0), namespace="ns")
        client.put("full", torch.arange(9.0), namespace="other")  # a rewrite
        with client.get("full", namespace="other") as view:
            assert torch.equal(view, torch.arange(9.0))
        client.delete("e0", namespace="ns")
        client.put("after-a-delete", torch.empty(0), namespace="ns")
        assert client.exists("after-a-delete", namespace="ns")
    finally:
        client.close()


def test_a_namespace_record_past_daemon_max_namespaces_is_refused(daemon_factory: Any) -> None:
    daemon = daemon_factory(**{"daemon.max_namespaces": 3})
    client = daemon.connect("namespace-maker")
    try:
        for i in range(3):
            client.create_namespace(f"job-{i}", quota_bytes=1 << 20)
        with pytest.raises(LimitExceededError, match="daemon.max_namespaces"):
            client.create_namespace("job-3")
        client.put("t", torch.arange(5.0), namespace="job-1")  # the records made still serve
        assert client.namespace_info("job-2").quota_bytes == 1 << 20
    finally:
        client.close()


def test_a_client_past_daemon_max_namespaces_per_client_is_refused_and_others_are_not(
        daemon_factory: Any) -> None:
    """Each namespace a session gets, puts or steps in is noted for the monitor and may give
    it a scheduler stream: a client cycling through namespaces grew both without end."""
    daemon = daemon_factory(**{"daemon.max_namespaces_per_client": 3})
    client = daemon.connect("wanderer")
    try:
        client.put("a", torch.arange(3.0), namespace="n0")
        client.put_many({"a": torch.arange(3.0)}, namespace="n1")
        with pytest.raises(NotFoundError):
            client.get("missing", namespace="n2")  # a failed get touches its namespace too
        client.put("b", torch.arange(5.0), namespace="n0")  # one it touched already
        with pytest.raises(LimitExceededError, match="daemon.max_namespaces_per_client"):
            client.put("a", torch.arange(3.0), namespace="n3")
        with pytest.raises(LimitExceededError, match="daemon.max_namespaces_per_client"):
            client.get("a", namespace="n3")
        other = daemon.connect("newcomer")  # per client: another one may use it
        other.put("a", torch.arange(3.0), namespace="n3")
        other.close()
        assert not client.exists("a", namespace="n4")  # exists is a lookup, not a touch
    finally:
        client.close()


def test_leases_past_daemon_max_leased_per_client_are_refused_until_released(
        daemon_factory: Any) -> None:
    """Every get holds its tensors until the client releases them: a client that never
    releases grew the catalog's leases without end."""
    daemon = daemon_factory(**{"daemon.max_leased_per_client": 5})
    client = daemon.connect("hoarder")
    try:
        client.put_many({f"t{i}": torch.full((3,), float(i)) for i in range(4)}, namespace="ns")
        first = client.get_many(["t0", "t1", "t2"], namespace="ns")
        second = client.get("t3", namespace="ns")
        with pytest.raises(LimitExceededError, match="daemon.max_leased_per_client"):
            client.get_many(["t0", "t1"], namespace="ns")
        other = daemon.connect("other")  # per client
        with other.get_many(["t0", "t1", "t2", "t3"], namespace="ns") as views:
            assert [float(v[0]) for v in views] == [0.0, 1.0, 2.0, 3.0]
        other.close()
        first.release()
        with client.get_many(["t0", "t1"], namespace="ns") as views:
            assert float(views[1][0]) == 1.0
        second.release()
    finally:
        client.close()


def test_a_space_shortage_leaves_no_reference_cycle_behind() -> None:
    """The CPU tier signals "wait for a segment" with SpaceShortage, often under pressure (a
    soak with a 32 MiB tier raised about ten a second). Kept in a local of the frame that
    raised it, each was a reference cycle (the frame holds it, its traceback holds the frame)
    that only the daemon's rare full collections free: the soak's anonymous memory grew
    between them. Collections are off here, so one left behind would be found below."""
    import gc

    from infinity.config import CpuTierConfig
    from infinity.daemon.arena import CpuArena, SpaceShortage

    arena = CpuArena(CpuTierConfig(budget_bytes=64 << 20, segment_bytes=8 << 20, prefault=False))
    gc.collect()
    gc.disable()
    try:
        for nbytes in (4097, 9 << 20, 1, 3 << 20):  # standard and dedicated segments
            for _ in range(25):
                try:
                    arena.allocate(nbytes, what="a test tensor")
                except SpaceShortage:
                    pass
        assert gc.collect() == 0
    finally:
        gc.enable()
