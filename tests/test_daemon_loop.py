"""The daemon's event loop on its own: which callbacks a batch of events reaches."""

from __future__ import annotations

import os

from infinity.daemon.loop import EventLoop


def test_an_fd_closed_and_its_number_reused_within_one_batch_does_not_fire_the_new_callback() -> None:
    loop = EventLoop()
    first, second = os.pipe(), os.pipe()
    for _, write_end in (first, second):
        os.write(write_end, b"x")  # both readable: one epoll batch holds both events
    reused: list[int] = []
    stale_calls: list[int] = []

    def close_the_other_and_reuse_its_number(other: int) -> None:
        if reused:
            return
        loop.remove_reader(other)
        fresh_read, fresh_write = os.pipe()  # never readable: any call is for the old fd's event
        os.dup2(fresh_read, other)  # the kernel would hand out the lowest free number: this one
        os.close(fresh_read)
        reused.append(fresh_write)
        loop.add_reader(other, lambda: stale_calls.append(other))

    loop.add_reader(first[0], lambda: close_the_other_and_reuse_its_number(second[0]))
    loop.add_reader(second[0], lambda: close_the_other_and_reuse_its_number(first[0]))
    loop.call_later(0.05, loop.stop)
    loop.run()
    loop.close()
    # The event of the closed fd belonged to it, not to whatever took its number.
    assert reused and stale_calls == []
    for fd in (*first, *second, *reused):
        try:
            os.close(fd)
        except OSError:
            pass
