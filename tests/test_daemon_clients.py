"""Several client processes on one real infinityd: shared memory, versions, dead clients, fork."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

import msgpack
import psutil
import pytest
import torch
import zmq

import infinity
from conftest import run_in_threads, wait_until
from infinity.errors import DaemonUnavailableError, ForkedClientError
from infinity.protocol import wire
from infinity.protocol.paths import RuntimeLayout

SPAWN = multiprocessing.get_context("spawn")
CASES = [(torch.float32, (3, 1001)), (torch.bfloat16, (4097,)), (torch.uint8, (1,)),
         (torch.int64, (17, 3, 5)), (torch.float16, ()), (torch.complex128, (9,))]


def _seeded(i: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    count = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 256, (count,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(1000 + i))
    return raw.view(dtype).reshape(shape)


def _run_child(target: Callable[..., None], *args: Any, timeout_s: float = 60) -> None:
    process = SPAWN.Process(target=target, args=args)
    process.start()
    process.join(timeout_s)
    if process.is_alive():
        process.kill()
        raise AssertionError(f"{target.__name__} did not finish in {timeout_s}s")
    assert process.exitcode == 0, f"{target.__name__} failed with exit code {process.exitcode}"


# --- children (spawned: they import this module) -------------------------------------------

def _write_cases(config: Any) -> None:
    with infinity.connect(config=config, name="writer") as client:
        client.put_many({f"case{i}": _seeded(i, dtype, shape)
                         for i, (dtype, shape) in enumerate(CASES)}, namespace="x")


def _write_in_place(config: Any, value: float) -> None:
    with infinity.connect(config=config, name="in-place") as client:
        with client.get("shared", exclusive=True) as view:
            view.fill_(value)


def _commit_new_version(config: Any, value: float) -> None:
    with infinity.connect(config=config, name="committer") as client:
        client.put("versioned", torch.full((4096,), value))


def _hold_and_wait(config: Any, conn: Connection) -> None:
    client = infinity.connect(config=config, name="doomed")
    client.put("kept", torch.ones(1000))
    lease = client.get("kept")
    client.reserve({"pending": (torch.float32, (1000,))})
    conn.send((client.client_id, lease.version))
    conn.recv()  # blocks until killed


def _read_and_write_concurrently(config: Any, me: int, peers: int, rounds: int,
                                 barrier: Any) -> None:
    with infinity.connect(config=config, name=f"peer{me}") as client:
        client.put(f"t{me}", torch.full((65536,), float(me * 1000)))
        barrier.wait()
        for round_ in range(1, rounds + 1):
            client.put(f"t{me}", torch.full((65536,), float(me * 1000 + round_)))
            names = [f"t{p}" for p in range(peers)]
            with client.get_many(names) as views:
                for peer, view in enumerate(views):
                    first = float(view[0])
                    # Whatever version is seen, it is whole: never a mix of two writes.
                    assert torch.all(view == first), "torn read"
                    assert peer * 1000 <= first <= peer * 1000 + rounds
        barrier.wait()


# --- tests ----------------------------------------------------------------------------------

def test_data_written_by_one_process_is_read_bit_exactly_by_another(
        daemon: Any, client: Any) -> None:
    _run_child(_write_cases, daemon.config)
    for i, (dtype, shape) in enumerate(CASES):
        with client.get(f"case{i}", namespace="x") as view:
            expected = _seeded(i, dtype, shape)
            assert view.dtype == dtype and tuple(view.shape) == shape
            assert torch.equal(view.reshape(-1).view(torch.uint8),
                               expected.reshape(-1).view(torch.uint8))


def test_view_data_ptr_lies_inside_a_shared_memfd_segment(client: Any) -> None:
    client.put("where", torch.zeros(3000))
    with client.get("where") as view:
        address = view.data_ptr()
        assert any(start <= address and address + view.nbytes <= end
                   for _, start, end in client.segment_ranges())
        with open("/proc/self/maps") as maps:
            for line in maps:
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                if start <= address < end:
                    assert "memfd:infinity-seg" in line, line
                    break
            else:
                raise AssertionError("the view's address is not mapped")


def test_in_place_write_by_another_process_shows_through_an_existing_view(
        daemon: Any, client: Any) -> None:
    client.put("shared", torch.zeros(5000))
    lease = client.get("shared")
    view = lease.tensor
    # The version stays current and unfreed after release, so this view still shows its memory.
    lease.release()
    client.flush()  # the child's exclusive lease needs our release served first
    _run_child(_write_in_place, daemon.config, 7.5)
    assert torch.all(view == 7.5)
    with client.get("shared") as again:
        assert again.data_ptr() == view.data_ptr()


def test_reader_keeps_the_old_version_across_a_commit_by_another_process(
        daemon: Any, client: Any) -> None:
    client.put("versioned", torch.full((4096,), 1.0))
    with client.get("versioned") as held:
        _run_child(_commit_new_version, daemon.config, 2.0)
        with client.get("versioned") as fresh:
            assert torch.all(fresh == 2.0)
            assert fresh.data_ptr() != held.data_ptr()
        assert torch.all(held == 1.0)
    assert client.stats()["catalog"]["num_versions"] == 1


def test_kill_9_of_a_client_frees_its_leases_and_reservations_at_once(
        daemon_factory: Callable[..., Any]) -> None:
    # A long timeout: only the process-exit detection (pidfd, fd channel) can be this quick.
    daemon = daemon_factory(**{"daemon.client_timeout_s": 60.0})
    client = daemon.connect()
    parent_end, child_end = SPAWN.Pipe()
    child = SPAWN.Process(target=_hold_and_wait, args=(daemon.config, child_end))
    child.start()
    try:
        doomed_id, _ = parent_end.recv()
        catalog = client.stats()["catalog"]
        assert catalog["num_leases"] == 1 and catalog["num_reservations"] == 1
        killed_at = time.monotonic()
        assert child.pid is not None
        os.kill(child.pid, signal.SIGKILL)

        def freed() -> bool:
            stats = client.stats()
            return (stats["catalog"]["num_leases"] == 0
                    and stats["catalog"]["num_reservations"] == 0
                    and all(c["id"] != doomed_id for c in stats["clients"]))

        wait_until(freed, timeout_s=5, what="the killed client's leases to be freed")
        assert time.monotonic() - killed_at < 5
        assert "process exited" in daemon.log()
        assert client.stats()["tiers"]["cpu"]["used_bytes"] == 4096  # only "kept" remains
    finally:
        child.join(10)
        client.close()


def test_silent_client_is_dropped_after_client_timeout(
        daemon_factory: Callable[..., Any]) -> None:
    daemon = daemon_factory(**{"daemon.client_timeout_s": 1.0})
    client = daemon.connect()
    client.put("s", torch.ones(10))
    context = zmq.Context()
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(RuntimeLayout(daemon.runtime_dir).control_endpoint)
    try:
        # A start time that matches no process: the daemon cannot watch it and must rely on silence.
        raw.send(wire.encode_request(1, wire.Hello(
            wire.PROTOCOL_VERSION, "silent", os.getpid(), 1.0,
            RuntimeLayout(daemon.runtime_dir).read_secret())))
        wire.decode_reply(raw.recv())
        raw.send(wire.encode_request(2, wire.Get((wire.GetItem("default", "s"),))))
        wire.decode_reply(raw.recv())
        went_silent = time.monotonic()
        assert client.stats()["catalog"]["num_leases"] == 1
        wait_until(lambda: client.stats()["catalog"]["num_leases"] == 0, timeout_s=5,
                   what="the silent client's lease to be freed")
        assert time.monotonic() - went_silent >= 0.9
        assert "silent for 1s" in daemon.log()
    finally:
        raw.close()
        context.term()
        client.close()


def test_idle_client_keeps_its_leases_through_heartbeats(
        daemon_factory: Callable[..., Any]) -> None:
    daemon = daemon_factory(**{"daemon.client_timeout_s": 1.0, "daemon.heartbeat_interval_s": 0.1})
    client = daemon.connect()
    try:
        client.put("idle", torch.ones(3))
        with client.get("idle") as view:
            time.sleep(2.5)  # 2.5 timeouts of doing nothing: the passage of time is the point
            assert client.stats()["catalog"]["num_leases"] == 1
            assert torch.all(view == 1)
    finally:
        client.close()


def test_client_used_in_a_forked_child_raises_and_the_child_can_connect_again(
        daemon: Any, client: Any) -> None:
    client.put("f", torch.arange(6))
    pid = os.fork()
    if pid == 0:  # the child: exit codes tell the parent what happened
        code = 1
        try:
            try:
                client.get("f")
            except ForkedClientError as exc:
                code = 2 if "connect() again" not in str(exc) else 3
            if code == 3:
                with infinity.connect(config=daemon.config, name="child") as fresh:
                    with fresh.get("f") as view:
                        code = 0 if torch.equal(view, torch.arange(6)) else 4
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    with client.get("f") as view:  # the parent's client and the daemon are unaffected
        assert torch.equal(view, torch.arange(6))


def test_four_processes_read_and_write_at_once_without_torn_reads(
        daemon: Any, client: Any) -> None:
    peers, rounds = 4, 20
    barrier = SPAWN.Barrier(peers)
    processes = [SPAWN.Process(target=_read_and_write_concurrently,
                               args=(daemon.config, me, peers, rounds, barrier))
                 for me in range(peers)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(120)
    assert [p.exitcode for p in processes] == [0] * peers
    for me in range(peers):
        with client.get(f"t{me}") as view:
            assert torch.all(view == me * 1000 + rounds)


def test_threads_share_one_client(client: Any) -> None:
    def work(me: int) -> None:
        for i in range(50):
            client.put(f"th{me}", torch.full((100,), float(i)))
            with client.get(f"th{me}") as view:
                assert torch.all(view == i)

    run_in_threads(work, 8)
    assert client.stats()["catalog"]["num_leases"] == 0


def test_the_sockets_of_client_threads_that_ended_leave_the_session(client: Any) -> None:
    def sockets() -> int:
        (mine,) = [c for c in client.stats()["clients"] if c["id"] == client.client_id]
        return int(mine["sockets"])

    client.put("w", torch.ones(7))
    before = sockets()  # this thread's and the heartbeat thread's
    for _ in range(3):  # one after another: each thread's socket goes when the thread ends
        run_in_threads(lambda me: client.get("w").release(), 17)
    wait_until(lambda: sockets() == before, timeout_s=10,
               what="the ended threads' sockets to leave the session")
    run_in_threads(lambda me: client.get("w").release(), 3)  # the session still serves threads


def test_daemon_killed_mid_session_gives_daemon_unavailable_promptly(
        daemon: Any, client: Any) -> None:
    client.put("k", torch.ones(1))
    daemon.process.kill()
    daemon.process.wait()
    started = time.monotonic()
    with pytest.raises(DaemonUnavailableError, match="went away|closed"):
        client.get("k")
    assert time.monotonic() - started < 3


def test_raw_hello_reports_the_daemon_liveness_settings(daemon: Any) -> None:
    context = zmq.Context()
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(RuntimeLayout(daemon.runtime_dir).control_endpoint)
    try:
        raw.send(msgpack.packb(["hello", 1, [wire.PROTOCOL_VERSION, "r", os.getpid(),
                                             psutil.Process().create_time(),
                                             RuntimeLayout(daemon.runtime_dir).read_secret()]]))
        welcome = wire.Welcome.from_wire(wire.decode_reply(raw.recv()).results[0])
        assert welcome.client_timeout_s == daemon.config.daemon.client_timeout_s
        assert welcome.daemon_pid == daemon.process.pid
    finally:
        raw.close()
        context.term()


def test_a_stall_of_the_daemon_itself_longer_than_the_timeout_ends_no_live_session(
        daemon_factory: Callable[..., Any]) -> None:
    daemon = daemon_factory(**{"daemon.client_timeout_s": 1.0,
                               "daemon.heartbeat_interval_s": 0.2})
    client = daemon.connect("healthy")
    client.put("w", torch.ones(4))
    lease = client.get("w")
    daemon.process.send_signal(signal.SIGSTOP)
    time.sleep(2.0)  # the stall itself is what is tested: twice the client timeout
    daemon.process.send_signal(signal.SIGCONT)
    # Its heartbeats sat in the socket: the first sweep after the stall must not take the
    # silence for the client's. Three sweeps later, it would have been ended by now.
    time.sleep(1.0)
    assert [c["name"] for c in client.stats()["clients"]] == ["healthy"]
    assert client.stats()["catalog"]["num_leases"] == 1
    lease.release()
    client.close()


def test_a_daemon_out_of_file_descriptors_waits_instead_of_spinning_and_serves_on(
        daemon: Any) -> None:
    import resource

    from infinity.protocol import fdpass

    pid = daemon.process.pid
    limits = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (len(os.listdir(f"/proc/{pid}/fd")) + 3,
                                                   limits[1]))
    held = []
    try:
        for _ in range(6):  # the last ones meet EMFILE in the daemon's accept()
            sock = fdpass.seqpacket_socket()
            sock.connect(RuntimeLayout(daemon.runtime_dir).fds_path)
            held.append(sock)
        time.sleep(1.0)  # a while out of fds: one complaint per pause, not one per turn
        complaints = daemon.log().count("cannot accept connections")
        assert 1 <= complaints <= 4, complaints
    finally:
        for sock in held:
            sock.close()
        resource.prlimit(pid, resource.RLIMIT_NOFILE, limits)
    after = daemon.connect("after")  # accepted again once fds are free
    assert "after" in {c["name"] for c in after.stats()["clients"]}
    after.close()


def test_a_second_fd_channel_for_a_session_is_refused_and_closed(daemon: Any) -> None:
    # Only the session's first fd channel is closed when it ends: a second one bound too
    # outlived it, handing out segments to a session long gone.
    from infinity.protocol import fdpass

    client = daemon.connect("owner")
    try:
        second = fdpass.seqpacket_socket()
        second.settimeout(10)
        second.connect(RuntimeLayout(daemon.runtime_dir).fds_path)
        fdpass.send_message(second, wire.FdRequest(client._token, None).encode())
        data, fds, _, _ = socket.recv_fds(second, 1 << 16, 8)
        for fd in fds:
            os.close(fd)
        reply = wire.FdReply.decode(data)
        assert reply.error is not None and "already has an fd channel" in reply.error.message
        assert not fds and second.recv(16) == b""  # closed by the daemon
        second.close()
        client.put("still", torch.ones(3))  # the session and its own channel carry on
        with client.get("still") as view:
            assert torch.equal(view, torch.ones(3))
    finally:
        client.close()
