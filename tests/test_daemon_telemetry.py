"""Telemetry through real daemons: the counters `stats` adds (pinned and dirty bytes, per-client
bytes, rates, namespaces, recent errors), and the snapshot stream on the runtime folder's
telemetry socket, which carries the same figures."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import zmq

from infinity.errors import NotFoundError, ProtocolError
from infinity.protocol import wire
from infinity.protocol.paths import RuntimeLayout

from conftest import wait_until

FAST = {"telemetry.interval_s": 0.1}


class Subscriber:
    """A SUB socket on a daemon's telemetry stream."""

    def __init__(self, config: Any) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(RuntimeLayout(config.daemon.runtime_dir).telemetry_endpoint)

    def next(self, timeout_s: float = 10.0) -> wire.TelemetrySnapshot:
        if not self.socket.poll(int(timeout_s * 1000)):
            raise AssertionError(f"no telemetry snapshot within {timeout_s}s")
        return wire.TelemetrySnapshot.decode(self.socket.recv())

    def until(self, predicate: Any, *, what: str,
              timeout_s: float = 10.0) -> wire.TelemetrySnapshot:
        def matching() -> wire.TelemetrySnapshot | None:
            snapshot = self.next()
            return snapshot if predicate(snapshot.stats) else None
        return wait_until(matching, timeout_s=timeout_s, what=what)

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


def client_named(stats: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in stats["clients"] if c["name"] == name)


def test_the_stream_carries_both_clients_their_rates_and_the_tiers(daemon_factory: Any) -> None:
    daemon = daemon_factory(nvme_tier=True, **FAST)
    subscriber = Subscriber(daemon.config)
    first, second = daemon.connect("first"), daemon.connect("second")
    try:
        first.put("a", torch.ones(1024), namespace="ns-a")
        second.put("b", torch.ones(2048), namespace="ns-b")

        def busy(stats: dict[str, Any]) -> bool:
            with first.step(namespace="ns-a"):  # a step (a token, for a generating client)
                first.put("a", torch.ones(1024), namespace="ns-a")  # traffic in every interval
            with second.get("b", namespace="ns-b"):
                pass
            names = {c["name"]: c for c in stats["clients"]}
            return ("first" in names and "second" in names
                    and names["first"]["requests_per_s"] > 0
                    and names["first"]["steps_per_s"] > 0
                    and names["second"]["get_bytes_per_s"] > 0
                    and stats["tiers"]["cpu"]["written_bytes_per_s"] > 0
                    and stats["tiers"]["cpu"]["read_bytes_per_s"] > 0)

        snapshot = subscriber.until(busy, what="both clients busy in a snapshot")
        stats = snapshot.stats
        assert snapshot.seq >= 1 and snapshot.interval_s == pytest.approx(0.1)
        assert list(client_named(stats, "first")["namespaces"]) == ["ns-a"]
        assert list(client_named(stats, "second")["namespaces"]) == ["ns-b"]
        nvme = stats["tiers"]["nvme"]
        assert len(nvme["dirs"]) == 1 and "read_bytes_per_s" in nvme["dirs"][0]
        assert nvme["queue_depth"] >= 0
        assert stats["telemetry"]["endpoint"].endswith("telemetry.sock")
        # The request's own figures agree with the stream's on what did not move since.
        later = first.stats()
        assert later["catalog"]["num_tensors"] == stats["catalog"]["num_tensors"] == 2
        assert later["daemon"]["settings"] == stats["daemon"]["settings"]
        assert list(later["daemon"]["settings"]["nvme_dirs"]) == list(daemon.config.nvme.dirs)
    finally:
        first.close()
        second.close()
        subscriber.close()


def test_pinned_and_dirty_bytes_are_kept_as_leases_and_flushes_happen(daemon_factory: Any) -> None:
    daemon = daemon_factory(nvme_tier=True, **FAST)
    client = daemon.connect("pinned")
    try:
        client.put("x", torch.ones(4096))       # 16 KiB
        client.put("y", torch.ones(1024 * 3))   # 12 KiB
        stats = client.stats()
        assert stats["tiers"]["cpu"]["dirty_bytes"] == 16384 + 12288
        with client.get("x"):
            stats = client.stats()
            assert stats["tiers"]["cpu"]["leased_bytes"] == 16384
            me = client_named(stats, "pinned")
            assert me["leased_bytes"] == 16384 and me["leases"] == 1
            assert me["resident_bytes"] >= 16384  # spares of the puts count too
        client.flush()  # the release is served
        stats = client.stats()
        assert stats["tiers"]["cpu"]["leased_bytes"] == 0
        assert client_named(stats, "pinned")["leased_bytes"] == 0
        client.flush_store()
        assert client.stats()["tiers"]["cpu"]["dirty_bytes"] == 0
        client.put("x", torch.zeros(4096))  # a new version: dirty again, the old one went
        assert client.stats()["tiers"]["cpu"]["dirty_bytes"] == 16384
    finally:
        client.close()


def test_recent_errors_name_the_client_and_the_error(daemon: Any) -> None:
    client = daemon.connect("clumsy")
    try:
        with pytest.raises(NotFoundError):
            client.get("missing")
        errors = client.stats()["recent_errors"]
        assert errors[-1]["code"] == NotFoundError.code
        assert "missing" in errors[-1]["message"] and "clumsy" in errors[-1]["client"]
    finally:
        client.close()


def test_without_a_stream_there_is_no_socket_and_rates_span_the_requests(
        daemon_factory: Any) -> None:
    daemon = daemon_factory(**{"telemetry.interval_s": 0})
    client = daemon.connect("quiet")
    try:
        assert not os.path.exists(RuntimeLayout(daemon.runtime_dir).telemetry_path)
        client.stats()
        client.put("w", torch.ones(256))
        stats = client.stats()
        assert stats["telemetry"]["endpoint"] is None
        assert client_named(stats, "quiet")["requests_per_s"] > 0
    finally:
        client.close()


def test_a_snapshot_round_trips_and_refuses_another_version() -> None:
    stats = {section: {} for section in wire.TELEMETRY_SECTIONS}
    snapshot = wire.TelemetrySnapshot(3, 12.5, 1.0, {**stats, "clients": []})
    again = wire.TelemetrySnapshot.decode(snapshot.encode())
    assert (again.seq, again.time_s, again.interval_s) == (3, 12.5, 1.0)
    assert again.stats["clients"] == ()
    import msgpack
    other = msgpack.packb(["telemetry", wire.TELEMETRY_VERSION + 1, 1, 0.0, 1.0, stats])
    with pytest.raises(ProtocolError, match="same release"):
        wire.TelemetrySnapshot.decode(other)
    with pytest.raises(ProtocolError):
        wire.TelemetrySnapshot.decode(msgpack.packb(["telemetry", 1, 1, 0.0, 1.0, {}]))


def test_dirty_bytes_follow_evictions_loads_and_writes_in_place(nvme_daemon: Any) -> None:
    """The kept figure equals what `list` says, tensor by tensor, whatever the tier did: a tensor
    listed "cpu" with an NVMe tier is resident with no clean copy."""
    client = nvme_daemon.connect("churn")

    def agree() -> bool:
        listed = sum(info.nbytes for info in client.list() if info.tier == "cpu")
        return client.stats()["tiers"]["cpu"]["dirty_bytes"] == listed

    try:
        for i in range(16):  # 16 MiB through an 8 MiB tier: write-backs and evictions
            client.put(f"t{i}", torch.full((256 * 1024,), float(i)))
        wait_until(agree, timeout_s=20, what="dirty bytes to agree after evictions")
        assert client.stats()["tiers"]["cpu"]["dirty_bytes"] > 0  # the last puts' at least
        for i in range(4):  # loads back from NVMe (clean), one written in place (dirty)
            with client.get(f"t{i}", exclusive=(i == 0)) as view:
                if i == 0:
                    view += 1
        client.flush()
        wait_until(agree, timeout_s=20, what="dirty bytes to agree after loads and a write")
        client.flush_store()
        stats = client.stats()
        assert stats["tiers"]["cpu"]["dirty_bytes"] == 0
        assert agree()
        # Every op counted in a directory's queue left it when its batch completed.
        nvme = stats["tiers"]["nvme"]
        assert nvme["dirs"][0]["bytes_written"] > 0 and nvme["dirs"][0]["bytes_read"] > 0
        assert nvme["queue_depth"] == nvme["dirs"][0]["queue_depth"] == 0
    finally:
        client.close()


def test_a_clients_device_cache_is_reported_as_its_gpu_tier(daemon: Any) -> None:
    from infinity.client.device import CpuCopier, DeviceCache
    from infinity.daemon.prometheus import metric_families

    client = daemon.connect("gpu-user")
    try:
        client.put("w", torch.ones(1024))
        cache = DeviceCache(client, budget_bytes=1 << 20, copier=CpuCopier(), prefetch=False)
        with cache.get("w"):
            pass

        def reported() -> dict[str, Any] | None:
            stats = client.stats()
            tier = stats["tiers"]["gpu"]
            return stats if tier and tier[0]["used_bytes"] == 4096 else None

        stats = wait_until(reported, timeout_s=10, what="the cache's figures in stats")
        (gpu,) = stats["tiers"]["gpu"]
        assert (gpu["client"], gpu["device"], gpu["budget_bytes"]) == ("gpu-user", "cpu", 1 << 20)
        assert gpu["misses"] == 1 and gpu["copied_bytes"] == 4096
        assert client_named(stats, "gpu-user")["gpu_used_bytes"] == 4096
        metrics = {s.name: s for family in metric_families(stats) for s in family.samples}
        assert metrics["infinity_gpu_tier_used_bytes"].value == 4096
        cache.close()  # the report goes: an empty one follows
        wait_until(lambda: client.stats()["tiers"]["gpu"] == (), timeout_s=10,
                   what="the closed cache to leave the report")
    finally:
        client.close()


@pytest.mark.parametrize("overrides,words", [
    (["telemetry.interval_s=0.001"], "at least 0.01"),
    (["telemetry.interval_s=0", "telemetry.prometheus_port=9464"], "telemetry.interval_s above 0"),
    (["telemetry.prometheus_port=70000"], "TCP port"),
])
def test_telemetry_settings_are_checked(overrides: list[str], words: str) -> None:
    from infinity.config import load_config
    from infinity.errors import ConfigError

    with pytest.raises(ConfigError, match=words):
        load_config(env={}, overrides=overrides)
