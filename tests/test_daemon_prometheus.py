"""Prometheus metrics of a real daemon, over HTTP and in a textfile: they parse with
prometheus_client's own parser, and their values are the daemon's `stats`."""

from __future__ import annotations

import os
import socket
import urllib.request
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from conftest import wait_until


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_textfile_and_endpoint_agree_with_stats(daemon_factory: Any) -> None:
    port = free_port()
    daemon = daemon_factory(nvme_tier=True, **{"telemetry.interval_s": 0.1,
                                               "telemetry.prometheus_port": port})
    client = daemon.connect("exported")
    try:
        client.put("w", torch.ones(4096), namespace="ns")
        with client.get("w", namespace="ns"):
            pass
        client.flush()
        stats = client.stats()
        url = f"http://127.0.0.1:{port}/metrics"

        def scraped() -> dict[Any, float] | None:
            got = samples(urllib.request.urlopen(url, timeout=10).read().decode())
            # A snapshot taken after the stats request above (nothing moved since).
            requests = got.get(("infinity_requests_total", ()), 0)
            return got if requests >= stats["counters"]["requests"] else None

        got = wait_until(scraped, timeout_s=10, what="a snapshot after the stats request")
        cpu = stats["tiers"]["cpu"]
        assert got[("infinity_cpu_tier_capacity_bytes", ())] == cpu["budget_bytes"]
        assert got[("infinity_cpu_tier_used_bytes", ())] == cpu["used_bytes"]
        assert got[("infinity_cpu_tier_dirty_bytes", ())] == cpu["dirty_bytes"] == 16384
        assert got[("infinity_cpu_tier_read_bytes_total", ())] == cpu["read_bytes"]
        assert got[("infinity_cpu_tier_written_bytes_total", ())] == cpu["written_bytes"]
        assert got[("infinity_tensors", ())] == stats["catalog"]["num_tensors"] == 1
        (directory,) = stats["tiers"]["nvme"]["dirs"]
        label = (("dir", directory["path"]),)
        assert got[("infinity_nvme_capacity_bytes", label)] == directory["capacity_bytes"]
        assert got[("infinity_nvme_written_bytes_total", label)] == directory["bytes_written"]
        me = next(c for c in stats["clients"] if c["name"] == "exported")
        who = (("client", "exported"), ("id", str(me["id"])))
        assert got[("infinity_client_get_bytes_total", who)] == me["get_bytes"] == 16384
        assert got[("infinity_client_commit_bytes_total", who)] == me["commit_bytes"]
        assert got[("infinity_client_leases", who)] == 0
        assert got[("infinity_daemon_info", (("protocol", str(stats["daemon"]["protocol"])),
                                             ("version", stats["daemon"]["version"])))] == 1
        assert ("infinity_client_stall_seconds_total", who) in got
    finally:
        client.close()


def test_textfile_for_node_exporter(daemon_factory: Any, tmp_path: Any) -> None:
    path = str(tmp_path / "infinity.prom")
    daemon = daemon_factory(**{"telemetry.interval_s": 0.1,
                               "telemetry.prometheus_textfile": path})
    client = daemon.connect("node")
    try:
        client.put("w", torch.ones(1024))
        stats = client.stats()

        def written() -> dict[Any, float] | None:
            if not os.path.exists(path):
                return None
            with open(path) as f:
                got = samples(f.read())
            return got if got.get(("infinity_tensors", ())) == 1 else None

        got = wait_until(written, timeout_s=10, what="the textfile")
        assert got[("infinity_cpu_tier_written_bytes_total", ())] == \
            stats["tiers"]["cpu"]["written_bytes"] == 4096
        assert got[("infinity_clients", ())] >= 1
    finally:
        client.close()


def test_a_port_in_use_stops_the_start_with_words(daemon_factory: Any) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(AssertionError, match="choose a free port"):
            daemon_factory(**{"telemetry.prometheus_port": port})
