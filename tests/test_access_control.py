"""Access control, tried against real daemons: private files and sockets, the daemon's secret,
private namespaces and their grants, read-only shares, quotas, and a second Unix user created
for the test who can neither connect nor map a segment."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import subprocess
from typing import Any, Iterator

import psutil
import pytest
import torch
import zmq

import infinity
from conftest import short_tmp_root, start_daemon_process
from infinity.client.channel import Channel
from infinity.errors import (AuthenticationError, NamespaceAccessError, NotFoundError,
                             QuotaExceededError, ReadOnlyNamespaceError)
from infinity.protocol import wire
from infinity.protocol.paths import RuntimeLayout

TOKEN = "job-a-" + "7" * 26


def _mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _segment_paths(pid: int) -> list[str]:
    """/proc paths of the memfd segments process `pid` holds open."""
    fd_dir = f"/proc/{pid}/fd"
    found = []
    for fd in os.listdir(fd_dir):
        try:
            if os.readlink(f"{fd_dir}/{fd}").startswith("/memfd:"):
                found.append(f"{fd_dir}/{fd}")
        except OSError:
            continue  # closed meanwhile
    return found


class Raw:
    """One channel that says hello by hand, with whatever secret the test gives."""

    def __init__(self, daemon: Any) -> None:
        self.context = zmq.Context()
        self.channel = Channel(self.context, RuntimeLayout(daemon.runtime_dir).control_endpoint,
                               timeout_s=10.0, daemon_gone=lambda: None)

    def hello(self, secret: bytes, name: str = "raw") -> wire.Reply:
        return self.channel.call(1, wire.Hello(wire.PROTOCOL_VERSION, name, os.getpid(),
                                               psutil.Process().create_time(), secret))

    def close(self) -> None:
        self.channel.close()
        self.context.term()


@pytest.fixture
def raw(daemon: Any) -> Iterator[Raw]:
    session = Raw(daemon)
    try:
        yield session
    finally:
        session.close()


# --- files and sockets ------------------------------------------------------------------

def test_every_file_and_socket_the_daemon_makes_is_its_users_alone(
        daemon_factory: Any) -> None:
    daemon = daemon_factory(nvme_tier=True)
    with daemon.connect() as client:
        client.create_namespace("weights", mode="read-only")
        client.put("w", torch.ones(1024), namespace="weights", durable=True)
        client.put("x", torch.ones(1024), durable=True)
        layout = RuntimeLayout(daemon.runtime_dir)
        assert _mode(layout.root) == 0o700
        for path in (layout.control_path, layout.fds_path, layout.secret_path,
                     layout.lock_path, layout.pid_path):
            assert _mode(path) == 0o600, path
        nvme_dir = daemon.config.nvme.dirs[0]
        made = os.listdir(nvme_dir)
        assert any(name.endswith(".sqlite") for name in made) and len(made) >= 3
        for name in made:  # extents, index (and its WAL), markers, lock
            assert _mode(os.path.join(nvme_dir, name)) & 0o077 == 0, name
        segments = _segment_paths(daemon.process.pid)
        assert len(segments) >= 2  # a read-only namespace's segment and a standard one
        for path in segments:  # memfds are born 0777; a read-only one drops to 0400
            assert _mode(path) in (0o600, 0o400), path


# --- the daemon's secret -----------------------------------------------------------------

def test_a_hello_without_the_secret_is_refused_and_logged_short_and_the_daemon_serves_on(
        daemon: Any, raw: Raw) -> None:
    secret = RuntimeLayout(daemon.runtime_dir).read_secret()
    assert len(secret) == 32
    wrong = bytes(b ^ 1 for b in secret)
    for presented, said in ((wrong, "a wrong one"), (b"", "none presented")):
        reply = raw.hello(presented, name="intruder" * 8000)
        assert reply.failure is not None and reply.failure.code == AuthenticationError.code
        assert said in reply.failure.message and "infinityd.secret" in reply.failure.message
        # No session was opened: the socket still has to say hello.
        assert raw.channel.call(2, wire.Stats()).failure is not None
    lines = [line for line in daemon.log().splitlines() if "refused a hello" in line]
    assert len(lines) == 2 and all(len(line) < 400 for line in lines)
    daemon.assert_serving()
    with daemon.connect() as client:  # the secret from the file opens a session
        client.put("t", torch.ones(4))
        assert client.stats()["counters"]["errors"]["authentication"] == 2


def test_the_secret_is_kept_across_restarts_and_replaced_when_others_could_read_it() -> None:
    root = short_tmp_root()
    try:
        layout = RuntimeLayout(os.path.join(root, "rt"))
        first = start_daemon_process(root)
        secret = layout.read_secret()
        first.stop()
        second = start_daemon_process(root)
        assert layout.read_secret() == secret  # a client may hold it already
        second.stop()
        os.chmod(layout.secret_path, 0o644)
        third = start_daemon_process(root)
        try:
            assert layout.read_secret() != secret and _mode(layout.secret_path) == 0o600
            assert "was not a private secret" in third.log()
            with third.connect() as client:
                client.put("t", torch.ones(4))
        finally:
            third.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


# --- private namespaces ------------------------------------------------------------------

@pytest.fixture
def job_a(daemon: Any) -> Iterator[Any]:
    """A client that created the private namespace "job-a" (token TOKEN) and put "w" in it."""
    client = daemon.connect("job-a")
    info = client.create_namespace("job-a", token=TOKEN)
    assert info.private and info.owner_uid == os.geteuid()
    client.put("w", torch.arange(8.0), namespace="job-a")
    try:
        yield client
    finally:
        client.close()


def test_another_namespace_without_its_grant_is_neither_seen_nor_touched(
        daemon: Any, job_a: Any) -> None:
    with daemon.connect("job-b") as other:
        other.put("w", torch.ones(2), namespace="job-b")
        refused = [
            lambda: other.get("w", namespace="job-a"),
            lambda: other.get_many(["w"], namespace="job-a"),
            lambda: other.put("w", torch.zeros(8), namespace="job-a"),
            lambda: other.put("new", torch.zeros(8), namespace="job-a"),
            lambda: other.exists("w", namespace="job-a"),
            lambda: other.list(namespace="job-a"),
            lambda: other.delete("w", namespace="job-a"),
            lambda: other.namespace_info("job-a"),
            lambda: other.step_begin(namespace="job-a"),
        ]
        for call in refused:
            with pytest.raises(NamespaceAccessError, match="grant_namespace"):
                call()
        # Its own namespace works, and nothing it sees names the private one.
        with other.get("w", namespace="job-b") as view:
            assert view.tolist() == [1.0, 1.0]
        with pytest.raises(NotFoundError) as missing:
            other.get("w", namespace="elsewhere")
        assert "job-a" not in str(missing.value)
        assert "job-a" not in other.stats()["catalog"]["namespaces"]
        assert "job-a" in job_a.stats()["catalog"]["namespaces"]
        # A wrong token is refused, and logged; the right one grants.
        with pytest.raises(NamespaceAccessError, match="not its grant token"):
            other.grant_namespace("job-a", "x" * 32)
        assert "presented a wrong token" in daemon.log()
        assert other.grant_namespace("job-a", TOKEN).private
        with other.get("w", namespace="job-a") as view:
            assert view.tolist() == list(range(8))
    # A job's next client presents the token as it connects.
    with infinity.connect(config=daemon.config, namespace_tokens={"job-a": TOKEN}) as again:
        assert again.exists("w", namespace="job-a")
    with job_a.get("w", namespace="job-a") as view:  # the owner was never in the way
        assert view.tolist() == list(range(8))


def test_a_private_namespace_stays_private_across_a_restart_of_the_daemon() -> None:
    root = short_tmp_root()
    nvme = os.path.join(root, "nvme")
    os.mkdir(nvme)
    try:
        first = start_daemon_process(root, **{"nvme.dirs": [nvme]})
        try:
            with first.connect("job-a") as client:
                client.create_namespace("job-a", token=TOKEN)
                client.put("w", torch.arange(8.0), namespace="job-a", durable=True)
        finally:
            first.stop()
        assert _mode(os.path.join(nvme, "infinity-namespaces.json")) == 0o600
        assert TOKEN not in open(os.path.join(nvme, "infinity-namespaces.json")).read()
        second = start_daemon_process(root, **{"nvme.dirs": [nvme]})
        try:
            with second.connect("job-b") as other:
                with pytest.raises(NamespaceAccessError):
                    other.get("w", namespace="job-a")
                info = other.grant_namespace("job-a", TOKEN)
                assert info.private and info.owner_client == 0 and info.created
                with other.get("w", namespace="job-a") as view:
                    assert view.tolist() == list(range(8))
        finally:
            second.stop()
        # A damaged file would open those namespaces to everyone: the daemon refuses to start.
        with open(os.path.join(nvme, "infinity-namespaces.json"), "w") as f:
            f.write("{not json")
        with pytest.raises(AssertionError, match="infinity-namespaces.json cannot be read"):
            start_daemon_process(root, **{"nvme.dirs": [nvme]})
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_multi_request_naming_an_ungranted_namespace_is_refused_part_by_part(
        daemon: Any, job_a: Any, raw: Raw) -> None:
    assert raw.hello(RuntimeLayout(daemon.runtime_dir).read_secret()).failure is None
    mine, theirs = raw.channel.call_multi(4, [
        (2, wire.Exists((wire.TensorRef("mine", "w"),))),
        (3, wire.Exists((wire.TensorRef("job-a", "w"),)))])
    assert mine.failure is None and list(mine.results) == [False]
    assert theirs.failure is not None and theirs.failure.code == NamespaceAccessError.code


def test_a_write_to_a_read_only_share_is_refused(daemon: Any) -> None:
    with daemon.connect("importer") as owner, daemon.connect("reader") as reader:
        owner.create_namespace("weights", mode="read-only", token=TOKEN)
        owner.put("w", torch.ones(16), namespace="weights")
        reader.grant_namespace("weights", TOKEN)
        with reader.get("w", namespace="weights") as view:
            assert view.sum().item() == 16
        with pytest.raises(ReadOnlyNamespaceError):
            reader.put("w", torch.zeros(16), namespace="weights")
        with pytest.raises(ReadOnlyNamespaceError):
            reader.delete("w", namespace="weights")


def test_a_write_past_a_namespaces_quota_is_refused(daemon: Any) -> None:
    with daemon.connect() as client:
        client.create_namespace("small", quota_bytes=4096)
        client.put("a", torch.ones(512), namespace="small")  # 2 KiB of 4
        with pytest.raises(QuotaExceededError, match="quota of 4096"):
            client.put("b", torch.ones(1024), namespace="small")  # 4 KiB more
        client.put("a", torch.ones(1024), namespace="small")  # a replacement within it
        assert client.namespace_info("small").used_bytes == 4096


# --- a second Unix user ------------------------------------------------------------------

# Run as the second user, with the system Python (no package of ours): each attempt and what
# happened, as JSON.
_INTRUDER = r"""
import json, mmap, os, socket, sys
targets = json.loads(sys.argv[1])
outcomes = {}

def attempt(what, action):
    try:
        action()
        outcomes[what] = "succeeded"
    except OSError as exc:
        outcomes[what] = type(exc).__name__

def connect(path, kind):
    with socket.socket(socket.AF_UNIX, kind) as s:
        s.connect(path)

def open_and_map(path, flags, prot):
    fd = os.open(path, flags)
    try:
        mmap.mmap(fd, 4096, mmap.MAP_SHARED, prot).close()
    finally:
        os.close(fd)

attempt("open file", lambda: open(targets["open file"], "rb").read())
attempt("control socket", lambda: connect(targets["control"], socket.SOCK_STREAM))
attempt("fd channel", lambda: connect(targets["fds"], socket.SOCK_SEQPACKET))
attempt("secret", lambda: open(targets["secret"], "rb").read())
for i, path in enumerate(targets["segments"]):
    attempt(f"segment {i} rw", lambda: open_and_map(path, os.O_RDWR,
                                                    mmap.PROT_READ | mmap.PROT_WRITE))
    attempt(f"segment {i} ro", lambda: open_and_map(path, os.O_RDONLY, mmap.PROT_READ))
print(json.dumps(outcomes))
"""


@pytest.fixture
def second_user() -> Iterator[str]:
    """A throwaway Unix account, removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("creating a second Unix user needs root")
    if shutil.which("useradd") is None or shutil.which("userdel") is None:
        pytest.skip("useradd / userdel are not installed")
    if not os.path.exists("/usr/bin/python3"):
        pytest.skip("no system /usr/bin/python3 for the second user to run")
    name = "inftest" + secrets.token_hex(3)
    subprocess.run(["useradd", "--create-home", "--user-group", "--shell", "/bin/sh", name],
                   check=True, capture_output=True)
    try:
        yield name
    finally:
        subprocess.run(["userdel", "-r", name], capture_output=True)


def _as_user(user: str, targets: dict[str, Any]) -> dict[str, str]:
    done = subprocess.run(["/usr/bin/python3", "-c", _INTRUDER, json.dumps(targets)],
                          user=user, group=user, extra_groups=[], capture_output=True,
                          text=True, timeout=30, cwd="/", env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    outcomes: dict[str, str] = json.loads(done.stdout)
    return outcomes


def test_a_second_unix_user_can_neither_connect_nor_map_a_segment(
        daemon: Any, second_user: str) -> None:
    with daemon.connect() as client:
        client.put("t", torch.ones(1024))
        layout = RuntimeLayout(daemon.runtime_dir)
        # Segments as the daemon holds them, and as this client (mapping them) does.
        segments = _segment_paths(daemon.process.pid) + _segment_paths(os.getpid())
        assert segments
        # A file the second user may read, beside the runtime folder: the attempts can succeed,
        # so a refusal below is the permissions' doing.
        open_file = os.path.join(os.path.dirname(layout.root), "readable")
        with open(open_file, "w") as f:
            f.write("anyone")
        os.chmod(open_file, 0o644)
        targets = {"control": layout.control_path, "fds": layout.fds_path,
                   "secret": layout.secret_path, "segments": segments, "open file": open_file}
        # The folder above the runtime folder is opened to the second user, so that the runtime
        # folder's own mode (0700) is what refuses; then that is loosened too (a mistake an
        # administrator could make), and the sockets' and the secret's 0600 still refuse.
        os.chmod(os.path.dirname(layout.root), 0o711)
        try:
            for folder_mode in (0o700, 0o711):
                os.chmod(layout.root, folder_mode)
                outcomes = _as_user(second_user, targets)
                assert outcomes.pop("open file") == "succeeded"
                assert len(outcomes) == 3 + 2 * len(segments)
                assert set(outcomes.values()) == {"PermissionError"}, (folder_mode, outcomes)
        finally:
            os.chmod(layout.root, 0o700)
            os.chmod(os.path.dirname(layout.root), 0o700)
        client.put("u", torch.ones(4))  # nothing changed for the daemon's own user
        daemon.assert_serving()
