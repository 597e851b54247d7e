"""What clients send cannot make the daemon's memory grow without bound: failed items leave
nothing behind, and client-chosen strings are shortened in its log."""

from __future__ import annotations

from typing import Any

import pytest

from infinity.errors import NotFoundError


def anonymous_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon in /proc/<pid>/status")


def test_repeated_batch_gets_of_missing_names_leave_the_daemons_memory_flat(daemon: Any) -> None:
    """Each get of 8,191 missing names fails item by item. Before the fix each request left
    its failed items' errors in reference cycles that the daemon's rare full collections free:
    about 7 MiB more per request (300 MiB after 40). After a warm-up, 30 more requests may move
    the daemon's anonymous memory by at most 4 MiB (allocator noise)."""
    client = daemon.connect("missing-names")
    names = [f"missing-{i}" for i in range(8191)]

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


def test_a_long_client_name_is_shortened_in_the_daemons_log(daemon: Any) -> None:
    name = "n" * 5000
    client = daemon.connect(name)
    client.close()
    log = daemon.log()
    assert "n" * 61 + "..." in log
    assert "n" * 65 not in log
