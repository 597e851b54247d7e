"""kill -9 of infinityd at random points of a stream of durable rewrites, 50 times over: after
each restart every tensor reads back as the value last acknowledged or the one whose commit was
under way, whole (never a mix of two versions), and none acknowledged is missing."""

from __future__ import annotations

import multiprocessing
import random
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

import infinity
from infinity.errors import InfinityError, NotFoundError
from test_daemon_nvme import Store, store  # noqa: F401  (store: the fixture, one per test)

SPAWN = multiprocessing.get_context("spawn")
CYCLES = 50
# int32 elements: odd sizes, from under a page to over a MiB (more than one CRC block).
SIZES = {"small": 1_031, "middle": 70_001, "large": 300_007}


def _rewrite(config: Any, conn: Connection) -> None:
    """From each k the parent sends, rewrite every name durably with k, then k + 1, and so on;
    report each commit before it is sent and each acknowledgement. When the daemon dies, say so
    and wait for the next k."""
    while True:
        k = conn.recv()
        try:
            with infinity.connect(config=config, name="rewriter") as client:
                while True:
                    for name, elements in SIZES.items():
                        views = client.reserve({name: (torch.int32, (elements,))})
                        views[name].fill_(k)
                        conn.send(("committing", name, k))
                        client.commit(name, durable=True)
                        conn.send(("acked", name, k))
                    k += 1
        except InfinityError:
            conn.send(("gone", "", k))


def test_kill_9_at_random_points_over_50_cycles_loses_and_tears_nothing(
        store: Store) -> None:  # noqa: F811
    rng = random.Random(50)
    daemon = store.start()
    parent, child = SPAWN.Pipe()
    writer = SPAWN.Process(target=_rewrite, args=(daemon.config, child), daemon=True)
    writer.start()
    child.close()  # so that recv() fails rather than hangs if the writer dies
    acked: dict[str, int] = {}  # each name's last acknowledged value
    under_way: dict[str, int] = {}  # a commit sent and not (yet) acknowledged
    kill_points = {"before any ack of the cycle": 0, "after one": 0}
    try:
        for cycle in range(CYCLES):
            parent.send(1000 * (cycle + 1))
            event, name, k = parent.recv()
            assert event == "committing", (event, name, k)
            under_way[name] = k
            # No event marks a random point of write, fdatasync and index commit: a random
            # delay from the cycle's first commit places the kill among its first few.
            time.sleep(rng.uniform(0.0, 0.03))
            daemon.process.kill()
            daemon.process.wait()
            acks_this_cycle = 0
            while True:  # an acknowledgement that raced the kill counts as one
                event, name, k = parent.recv()
                if event == "gone":
                    break
                if event == "committing":
                    under_way[name] = k
                else:
                    acked[name] = k
                    under_way.pop(name, None)
                    acks_this_cycle += 1
            kill_points["after one" if acks_this_cycle else "before any ack of the cycle"] += 1
            daemon = store.start()
            with daemon.connect("checker") as client:
                for name, elements in SIZES.items():
                    allowed = {acked.get(name), under_way.get(name)} - {None}
                    try:
                        view_context = client.get(name)
                    except NotFoundError:
                        assert name not in acked, f"cycle {cycle}: acknowledged {name} is gone"
                        continue
                    with view_context as view:
                        value = int(view[0])
                        assert view.numel() == elements
                        assert value in allowed, (cycle, name, value, allowed)
                        assert bool((view == value).all()), f"cycle {cycle}: {name} torn"
                    # What reads back is what the next cycle's kill may fall back to.
                    acked[name] = value
                    under_way.pop(name, None)
    finally:
        writer.kill()
        writer.join()
    # The kills fell both before and after acknowledgements within their cycles.
    assert all(count > 0 for count in kill_points.values()), kill_points
