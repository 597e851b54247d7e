"""The Client API's own behaviour: leases as context managers, batches, specs, closing."""

from __future__ import annotations

import signal
import threading
from typing import Any, Callable

import pytest
import torch
import zmq

from conftest import RunningDaemon, outcome_in_forked_child, run_in_threads, wait_until
from infinity.errors import (DaemonUnavailableError, InvalidRequestError,
                             LeaseError, NotFoundError)
from infinity.protocol import wire


def test_get_context_releases_the_lease_at_the_end_of_the_block(client: Any) -> None:
    client.put("g", torch.arange(4.0))
    with client.get("g") as view:
        assert client.stats()["catalog"]["num_leases"] == 1
        assert torch.equal(view, torch.arange(4.0))
    assert client.stats()["catalog"]["num_leases"] == 0


def test_lease_release_is_idempotent_and_reports_the_version(client: Any) -> None:
    version = client.put("v", torch.ones(1))
    lease = client.get("v")
    assert lease.version == version
    lease.release()
    lease.release()
    assert client.stats()["catalog"]["num_leases"] == 0


def test_get_many_yields_views_in_request_order(client: Any) -> None:
    client.put_many({f"m{i}": torch.full((i + 1,), float(i)) for i in range(32)})
    names = [f"m{i}" for i in reversed(range(32))]
    with client.get_many(names) as views:
        assert [int(v[0]) for v in views] == list(reversed(range(32)))
        catalog = client.stats()["catalog"]
        assert catalog["num_leases"] == 1 and catalog["num_leased_tensors"] == 32
    assert client.stats()["catalog"]["num_leases"] == 0


def test_a_repeated_get_many_gives_fresh_tensor_objects_over_the_same_memory(client: Any) -> None:
    client.put_many({f"r{i}": torch.full((7 + i,), float(i)) for i in range(5)})
    names = [f"r{i}" for i in range(5)]
    with client.get_many(names) as first:
        first[0].requires_grad_(True)  # a caller marking its tensor must not mark the next one's
    with client.get_many(names) as second:
        assert all(a is not b and a.data_ptr() == b.data_ptr() for a, b in zip(first, second))
        assert not second[0].requires_grad
        assert [float(t[0]) for t in second] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_a_repeated_get_many_sees_a_version_committed_in_between(client: Any) -> None:
    names = ["s0", "s1", "s2"]
    client.put_many({name: torch.zeros(9) for name in names})
    for _ in range(2):  # the second reply is byte for byte the first
        with client.get_many(names) as views:
            assert all(float(v.sum()) == 0.0 for v in views)
    old = client.get_many(names)
    client.put("s1", torch.ones(9))
    with client.get_many(names) as views:
        assert [float(v.sum()) for v in views] == [0.0, 9.0, 0.0]
        assert views[1].data_ptr() != old.tensors[1].data_ptr()
    assert float(old.tensors[1].sum()) == 0.0  # the reader of the old version keeps it
    old.release()


def test_get_many_with_a_missing_name_raises_and_keeps_no_lease(client: Any) -> None:
    client.put("here", torch.ones(1))
    with pytest.raises(NotFoundError, match="missing"):
        client.get_many(["here", "missing", "here"])
    assert client.stats()["catalog"]["num_leases"] == 0


def test_reserve_accepts_a_template_tensor_or_a_dtype_and_shape(client: Any) -> None:
    template = torch.zeros(3, 5, dtype=torch.float16)
    views = client.reserve({"from_tensor": template, "from_spec": (torch.int32, [2, 2])})
    assert views["from_tensor"].dtype == torch.float16 and views["from_tensor"].shape == (3, 5)
    assert views["from_spec"].dtype == torch.int32 and views["from_spec"].shape == (2, 2)
    views["from_spec"].copy_(torch.tensor([[1, 2], [3, 4]], dtype=torch.int32))
    versions = client.commit(["from_tensor", "from_spec"])
    assert set(versions) == {"from_tensor", "from_spec"}
    with client.get("from_spec") as view:
        assert view.tolist() == [[1, 2], [3, 4]]


def test_reserved_view_is_invisible_until_commit(client: Any) -> None:
    views = client.reserve({"later": (torch.float32, (3,))})
    assert not client.exists("later")
    views["later"].fill_(9)
    client.commit("later")
    with client.get("later") as view:
        assert torch.all(view == 9)


def test_put_of_a_non_contiguous_tensor_stores_its_values(client: Any) -> None:
    source = torch.arange(24.0).reshape(4, 6).t()
    client.put("t", source)
    with client.get("t") as view:
        assert view.is_contiguous() and torch.equal(view, source)


def test_put_many_is_one_reserve_and_one_commit(client: Any) -> None:
    before = client.stats()["counters"]["ops"]
    client.put_many({"a": torch.ones(2), "b": torch.zeros(3)})
    after = client.stats()["counters"]["ops"]
    assert after.get("reserve", 0) - before.get("reserve", 0) == 1
    assert after.get("commit_renew", 0) - before.get("commit_renew", 0) == 1
    assert after.get("commit", 0) == before.get("commit", 0)


def test_delete_of_several_names_in_one_call(client: Any) -> None:
    client.put_many({"d1": torch.ones(1), "d2": torch.ones(1)})
    client.delete(["d1", "d2"])
    assert client.exists_many(["d1", "d2"]) == [False, False]


def test_delete_of_an_unknown_name_is_not_found(client: Any) -> None:
    with pytest.raises(NotFoundError):
        client.delete("never")


def test_unsupported_dtype_is_refused_before_it_is_sent(client: Any) -> None:
    with pytest.raises(InvalidRequestError, match="cannot be stored"):
        client.put("q", torch.zeros(2, dtype=torch.complex32))


def test_prefetch_needs_no_reply_and_is_counted(client: Any) -> None:
    client.put("p", torch.ones(1))
    client.prefetch(["p", "p"])
    assert client.stats()["clients"][0]["prefetches"] == 2


def test_closed_client_refuses_calls_and_its_session_ends(daemon: Any) -> None:
    first = daemon.connect("first")
    first.put("c", torch.ones(1))
    lease = first.get("c")
    first.close()
    with pytest.raises(DaemonUnavailableError, match="closed"):
        first.get("c")
    lease.release()  # harmless after close
    with daemon.connect("second") as second:
        # The bye travels on another socket than second's requests, so it may land just after.
        wait_until(lambda: [c["name"] for c in second.stats()["clients"]] == ["second"],
                   timeout_s=5, what="the first session to end")
        assert second.stats()["catalog"]["num_leases"] == 0


def test_client_works_as_a_context_manager(daemon: Any) -> None:
    with daemon.connect("ctx") as client:
        client.put("x", torch.ones(1))
    assert client._closed


def test_client_and_protocol_never_import_the_daemon() -> None:
    import subprocess
    import sys

    from conftest import clean_environment

    code = ("import sys, infinity.client.client, infinity.client.admin, infinity.protocol.wire; "
            "bad = [m for m in sys.modules if m.startswith('infinity.daemon')]; "
            "assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=clean_environment(), timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_default_client_name_carries_the_rank_of_a_distributed_launch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from infinity.client.client import _default_name

    monkeypatch.setattr("sys.argv", ["/opt/jobs/train.py"])
    monkeypatch.delenv("RANK", raising=False)
    assert _default_name() == "train.py"
    monkeypatch.setenv("RANK", "3")  # torchrun: each rank keeps its own step trace
    assert _default_name() == "train.py-rank3"


def test_a_get_whose_views_cannot_be_made_gives_its_lease_back(
        client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from infinity.errors import ProtocolError

    client.put("x", torch.arange(10.0))

    def fail(results: Any) -> Any:
        # Injected: a daemon that names a segment it never handed over cannot be made here.
        raise ProtocolError("infinityd did not hand over segment 7")

    monkeypatch.setattr(client._segments, "_views_of", fail)
    with pytest.raises(ProtocolError):
        client.get("x")
    monkeypatch.undo()
    client.flush()
    assert client.stats()["catalog"]["num_leases"] == 0


def test_a_write_from_refused_for_a_name_the_client_reserved_leaves_that_reservation_alone(
        daemon: RunningDaemon, client: Any) -> None:
    views = client.reserve({"w": (torch.float32, (1021,))})
    with pytest.raises(LeaseError, match="already holds a reservation"):
        client.write_from("w", torch.ones(1021))
    other = daemon.connect("other")
    try:
        other.put("victim", torch.full((1021,), 7.0))  # would take the slice, had it been freed
        views["w"].fill_(3.0)
        client.commit("w")
        with other.get("victim") as victim, other.get("w") as w:
            assert torch.equal(victim, torch.full((1021,), 7.0))
            assert torch.equal(w, torch.full((1021,), 3.0))
    finally:
        other.close()


def test_a_write_stream_whose_reservation_the_client_aborted_does_not_commit_a_new_one(
        client: Any) -> None:
    info = client._open_stream(wire.StreamOpen("default", "s", "write", "float32", (1021,)))
    client.abort("s")  # the stream's own reservation, by name
    views = client.reserve({"s": (torch.float32, (1021,))})
    views["s"].fill_(5.0)
    with pytest.raises(LeaseError, match="is gone"):
        client._close_stream(info, commit=True, durable=False)
    client.commit("s")  # the client's reservation is still its own to publish
    with client.get("s") as s:
        assert torch.equal(s, torch.full((1021,), 5.0))


def test_closing_a_client_while_another_thread_waits_for_a_reply_fails_that_request_cleanly(
        daemon: RunningDaemon) -> None:
    client = daemon.connect("two-threads")
    client.put("w", torch.ones(3))
    outcome: list[BaseException] = []
    attached, go = threading.Event(), threading.Event()

    def wait_for_a_get() -> None:
        client.get("w").release()  # the thread's socket exists and is attached
        attached.set()
        go.wait()
        try:
            client.get("w")
        except BaseException as exc:  # noqa: BLE001 - the test looks at what it was
            outcome.append(exc)

    worker = threading.Thread(target=wait_for_a_get)
    worker.start()
    attached.wait(timeout=10)
    daemon.process.send_signal(signal.SIGSTOP)  # so the get waits for its reply
    try:
        go.set()
        wait_until(lambda: any(channel._in_use for channel in list(client._channels)),
                   timeout_s=10, what="the worker's get to wait for its reply")
        client.close()  # closed the worker's socket under it: a libzmq assertion, or a hang
        worker.join(timeout=10)
    finally:
        daemon.process.send_signal(signal.SIGCONT)
    assert not worker.is_alive()
    assert len(outcome) == 1 and type(outcome[0]) is DaemonUnavailableError
    assert "closed (by another thread) while get waited" in str(outcome[0])
    other = daemon.connect("after")  # the daemon serves on
    with other.get("w") as w:
        assert torch.equal(w, torch.ones(3))
    other.close()


@pytest.fixture
def impatient_daemon(daemon_factory: Any) -> RunningDaemon:
    """A daemon whose clients give up on a reply after half a second."""
    return daemon_factory(**{"daemon.request_timeout_s": 0.5})


def stopped_for(daemon: RunningDaemon, request: Callable[[], Any]) -> BaseException:
    """What `request` raised while the daemon was stopped (it answers once it goes on)."""
    daemon.process.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(DaemonUnavailableError, match="did not answer") as raised:
            request()
    finally:
        daemon.process.send_signal(signal.SIGCONT)
    return raised.value


def test_the_lease_of_a_get_answered_after_the_client_gave_up_goes_back(
        impatient_daemon: RunningDaemon) -> None:
    client = impatient_daemon.connect("impatient")
    client.put("w", torch.ones(5))
    raised = stopped_for(impatient_daemon, lambda: client.get("w"))
    assert "did not answer get" in str(raised)
    client.flush()  # the late answer comes first on this thread's socket
    assert client.stats()["catalog"]["num_leases"] == 0
    client.close()


def test_the_lease_of_a_get_resident_answered_after_the_client_gave_up_goes_back(
        impatient_daemon: RunningDaemon) -> None:
    client = impatient_daemon.connect("impatient")
    client.put("w", torch.ones(5))
    requester = client.resident_requester()
    requester.send(["w"]).result()[0].release()  # its socket is attached
    raised = stopped_for(impatient_daemon, lambda: requester.send(["w"]).result())
    assert "did not answer get_ahead" in str(raised)
    lease, names = requester.send(["w"]).result()  # the late answer comes first on its socket
    assert lease is not None and names == ["w"]
    lease.release()
    client.flush()
    assert client.stats()["catalog"]["num_leases"] == 0
    client.close()


def test_what_a_reserve_answered_after_the_client_gave_up_reserved_is_aborted(
        impatient_daemon: RunningDaemon) -> None:
    client = impatient_daemon.connect("impatient")
    client.put("first", torch.ones(5))  # the tier's first segment: the reserve below waits for none
    raised = stopped_for(impatient_daemon,
                         lambda: client.reserve({"r": (torch.float32, (1021,))}))
    assert "did not answer reserve" in str(raised)
    client.flush()  # takes the late answer; its abort follows
    assert client.stats()["catalog"]["num_reservations"] == 0
    client.put("r", torch.ones(1021))  # the name is free to reserve again
    client.close()


@pytest.mark.parametrize("direction", ["write_from", "read_into"])
def test_a_stream_opened_after_the_client_gave_up_is_closed(
        daemon_factory: Any, direction: str) -> None:
    daemon = daemon_factory(nvme_tier=True, **{"daemon.request_timeout_s": 0.5,
                                               "nvme.stream_chunk_bytes": 1 << 20})
    client = daemon.connect("impatient")
    big = torch.arange(3 * (1 << 18) + 5, dtype=torch.float32)  # over three 1 MiB chunks: staged
    client.write_from("big", big)
    if direction == "write_from":
        raised = stopped_for(daemon, lambda: client.write_from("other", big))
    else:
        raised = stopped_for(daemon, lambda: client.read_into("big", torch.empty_like(big)))
    assert "did not answer stream_open" in str(raised)
    client.flush()  # takes the late answer; the stream's close follows
    counters = client.stats()
    assert counters["counters"]["open_streams"] == 0
    assert counters["catalog"]["num_leases"] == 0 and counters["catalog"]["num_reservations"] == 0
    with client.get("big", exclusive=True) as view:  # no read lease left behind
        assert torch.equal(view, big)
    client.close()


def test_an_exclusive_get_retried_after_one_given_up_on_gets_the_lease(
        impatient_daemon: RunningDaemon) -> None:
    client = impatient_daemon.connect("impatient")
    client.put("w", torch.ones(5))
    raised = stopped_for(impatient_daemon, lambda: client.get("w", exclusive=True))
    assert "did not answer get" in str(raised)
    # The late answer (the first try's exclusive lease) is here before the retry goes out.
    assert client._channel().sock.poll(10_000, zmq.POLLIN)
    with client.get("w", exclusive=True) as view:
        view.fill_(2.0)
    with client.get("w") as view:
        assert torch.equal(view, torch.full((5,), 2.0))
    client.close()


# --- what a PyTorch user may hand to put, get and read_into ----------------------------------

def raw_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
                 .view(torch.uint8).tolist())


def test_a_conjugate_or_negative_view_is_stored_as_the_values_it_reads(client: Any) -> None:
    x = torch.complex(torch.randn(1021), torch.randn(1021))
    client.put("conj", x.conj())
    client.put("neg", x.conj().imag)  # a negative view of the imaginary part
    with client.get("conj") as conj, client.get("neg") as neg:
        assert raw_bytes(conj) == raw_bytes(x.conj()) and raw_bytes(neg) == raw_bytes(-x.imag)


def test_a_put_of_a_tensor_that_requires_grad_leaves_autograd_out_of_the_store(
        client: Any) -> None:
    w = torch.randn(31, 33, requires_grad=True)
    client.put("w", w.t())
    views = client.reserve({"g": (torch.float32, (33, 31))})
    assert not views["g"].requires_grad and views["g"].grad_fn is None
    torch.add(w.detach().t(), 1.0, out=views["g"])  # refused when the base carried a graph
    client.commit("g")
    with client.get("w") as stored:
        assert not stored.requires_grad and torch.equal(stored, w.detach().t())


def test_a_released_lease_used_again_is_a_lease_error(client: Any) -> None:
    client.put("once", torch.ones(3))
    lease = client.get("once")
    lease.release()
    with pytest.raises(LeaseError, match="was released"):
        lease.tensor
    with pytest.raises(LeaseError, match="call get\\(\\) again"):
        with lease:
            pass


def test_puts_of_one_name_from_several_threads_all_succeed(client: Any) -> None:
    def put_often(me: int) -> None:
        for _ in range(25):
            client.put("shared", torch.full((1021,), float(me)))

    run_in_threads(put_often, 4)
    with client.get("shared") as shared:
        assert float(shared[0]) in {0.0, 1.0, 2.0, 3.0} and bool((shared == shared[0]).all())


def _fake_tensor(device: str = "cpu") -> torch.Tensor:
    """A tensor with a shape and no memory, as torch.compile traces with (a GPU not needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        return torch.empty(5, device=device)


@pytest.mark.parametrize("make, advice", [
    (lambda: torch.empty(5, device="meta"), "meta device"),
    (lambda: torch.ones(4, 4).to_sparse(), "to_dense"),
    (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "unbind"),
    (lambda: torch.quantize_per_tensor(torch.ones(7), 0.1, 0, torch.quint8), "int_repr"),
    (lambda: [1.0, 2.0], "torch tensor"),
    (lambda: _fake_tensor(), "no memory of its own"),
    (lambda: _fake_tensor("cuda"), "no memory of its own"),
], ids=["meta", "sparse", "nested", "quantized", "list", "fake", "fake-cuda"])
@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's, on prototype and fake tensors
def test_a_tensor_without_dense_bytes_is_refused_with_advice(client: Any, make: Any,
                                                             advice: str) -> None:
    with pytest.raises(InvalidRequestError, match=advice):
        client.put("none", make())
    with pytest.raises(InvalidRequestError, match=advice):
        client.write_from("none", make())
    assert not client.exists("none")


def test_a_zero_tensor_is_stored_as_zeros(client: Any) -> None:
    zeros = torch._efficientzerotensor(5, 3)  # what autograd passes for a gradient known zero
    client.put("z", zeros)
    client.write_from("zw", zeros)
    for name in ("z", "zw"):
        with client.get(name) as view:
            assert torch.equal(view, torch.zeros(5, 3))
    with pytest.raises(InvalidRequestError, match="no memory to write into"):
        client.read_into("z", zeros)


@pytest.mark.parametrize("spec, fault", [
    ((torch.float32, (2.5, 3)), "not an integer"),
    ((torch.float32, (True, 3)), "not an integer"),
    ((torch.float32, 5), "sequence of sizes"),
    ((torch.float32, (2**64,)), "2\\*\\*50"),
    ((torch.uint8, (0, 2**40, 2**40)), "strides"),
    (("float32", (3,)), "torch.dtype"),
    ((torch.float32, (3,), 0), "pair"),
], ids=["float", "bool", "int", "huge", "strides", "dtype-name", "triple"])
def test_a_reserve_item_that_is_no_tensor_spec_is_refused_before_it_is_sent(
        client: Any, spec: Any, fault: str) -> None:
    with pytest.raises(InvalidRequestError, match=f"'r': .*{fault}"):
        client.reserve({"r": spec})
    assert client.stats()["catalog"]["num_reservations"] == 0


def test_reserve_mimics_a_tensor_without_memory_by_its_dtype_and_shape(client: Any) -> None:
    template = torch.empty(3, 1021, dtype=torch.bfloat16, device="meta")
    view = client.reserve({"m": template})["m"]
    assert (view.dtype, view.shape, view.device.type) == (torch.bfloat16, (3, 1021), "cpu")
    client.abort("m")


def test_a_zero_element_shape_torch_can_represent_is_reserved(client: Any) -> None:
    view = client.reserve({"z": (torch.float32, (0, 2**40, 2048))})["z"]
    assert view.shape == (0, 2**40, 2048) and view.numel() == 0
    client.commit("z")
    with client.get("z") as stored:
        assert stored.shape == (0, 2**40, 2048)


def test_a_string_of_names_is_one_name(client: Any) -> None:
    client.put("ab", torch.ones(3))
    with client.get_many("ab") as (view,):
        assert torch.equal(view, torch.ones(3))
    assert client.exists_many("ab") == [True]


def test_read_into_an_output_without_bytes_is_refused(client: Any) -> None:
    client.put("r", torch.ones(8))
    with pytest.raises(InvalidRequestError, match="meta device"):
        client.read_into("r", torch.empty(8, device="meta"))


def test_a_name_that_is_not_valid_text_is_refused_before_it_is_sent(client: Any) -> None:
    with pytest.raises(InvalidRequestError, match="not valid text"):
        client.put("bad\ud800", torch.ones(2))
    client.put("good", torch.ones(2))  # the connection serves on


def test_a_batch_beyond_what_one_request_may_carry_is_refused_at_once(client: Any) -> None:
    with pytest.raises(InvalidRequestError, match="more than the 65536 one request may"):
        client.get_many(["a"] * 65537)
    with pytest.raises(InvalidRequestError, match="larger than the 16777216 one message may be"):
        client.exists_many(["n" * 1000 + str(i) for i in range(20000)])
    client.put("after", torch.ones(2))  # this thread's connection still has its session
    assert client.exists("after")


def test_a_segment_handover_that_times_out_ends_the_session_instead_of_skewing_the_channel(
        impatient_daemon: RunningDaemon, monkeypatch: pytest.MonkeyPatch) -> None:
    from infinity.client.segments import SegmentMap

    reader, writer = impatient_daemon.connect("reader"), impatient_daemon.connect("writer")
    writer.put("big", torch.ones(3 * 1024 * 1024))  # 12 MiB: a segment the reader has not mapped
    fetch = SegmentMap._fetch
    resume = threading.Timer(1.0, impatient_daemon.process.send_signal, (signal.SIGCONT,))

    def fetch_while_the_daemon_stalls(self: SegmentMap, want: Any) -> None:
        if want is not None:  # the daemon stops just as the reader asks for the new segment
            impatient_daemon.process.send_signal(signal.SIGSTOP)
            resume.start()
        fetch(self, want)

    monkeypatch.setattr(SegmentMap, "_fetch", fetch_while_the_daemon_stalls)
    with pytest.raises(DaemonUnavailableError, match="did not hand over shared-memory segments"):
        reader.get("big")
    monkeypatch.setattr(SegmentMap, "_fetch", fetch)
    # Its late answer would have been read as the next request's: the session is over instead.
    with pytest.raises(DaemonUnavailableError, match="session ended"):
        reader.get("big")
    resume.join()  # the daemon goes on
    again = impatient_daemon.connect("reader")
    with again.get("big") as big:
        assert bool((big == 1).all())
    for client in (reader, writer, again):
        client.close()


def test_a_request_refused_before_sending_keeps_the_releases_it_would_have_carried(
        client: Any) -> None:
    client.put("kept", torch.ones(3))
    with client.get("kept"):
        pass  # a shared release: it rides with the next message
    with pytest.raises(InvalidRequestError, match="split the batch"):
        client.exists_many(["n"] * 65537)  # refused: its releases must ride with the next one
    client.flush()
    assert client.stats()["catalog"]["num_leases"] == 0


def test_a_forked_child_putting_is_told_to_connect_again_even_while_a_parent_thread_puts(
        client: Any) -> None:
    # A parent thread holds the put lock of "x" at fork (its fill is slow): the child must not
    # wait on that lock, which no thread of its own will ever release.
    started, finish = threading.Event(), threading.Event()
    slow = torch.ones(1021)
    import infinity.client.writes as client_module  # where put fills its slices
    copy_into = client_module.copy_into

    def slow_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        started.set()
        finish.wait(10)
        copy_into(dst, src)

    client_module.copy_into = slow_copy  # a stand-in for a long fill: the lock is held meanwhile
    try:
        putter = threading.Thread(target=client.put, args=("x", slow))
        putter.start()
        started.wait(10)
        outcome = outcome_in_forked_child(lambda: client.put("x", slow))
    finally:
        finish.set()
        putter.join(10)
        client_module.copy_into = copy_into
    assert outcome == b"forked"
