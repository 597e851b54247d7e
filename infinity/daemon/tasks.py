"""The daemon's task pool on its event loop: compute beside the data, completed on the loop thread.

`infinity.io.TaskPool` runs copies, checksums, fills and Adam steps on native
threads. Here its completion eventfd is watched by the daemon's `EventLoop`, which polls the
pool when the fd fires, so every task future's callbacks (and the jobs of
`infinity.daemon.jobs` waiting on them) run on the loop thread, just as the I/O engine's
batches complete there (see `watch_completions`, which serves both).
"""

from __future__ import annotations

from infinity.daemon.loop import EventLoop
from infinity.io.completions import CompletionSource
from infinity.io.tasks import TaskPool, default_task_threads


def watch_completions(loop: EventLoop, source: CompletionSource) -> None:
    """Resolve `source`'s futures on the loop thread whenever its eventfd fires (call on the
    loop thread, or before the loop runs)."""
    loop.add_reader(source.completion_fd, lambda: void(source.poll()))


def unwatch_completions(loop: EventLoop, source: CompletionSource) -> None:
    """Stop watching `source`; call before closing it (its fd number may be reused)."""
    loop.remove_reader(source.completion_fd)


def void(_: object) -> None:
    """Drops a value (a loop callback returns nothing)."""


class LoopTaskPool:
    """A `TaskPool` whose futures complete on `loop`'s thread. Submit through `.pool`."""

    def __init__(self, loop: EventLoop, *, num_threads: int | None = None) -> None:
        self._loop = loop
        self.pool = TaskPool(num_threads=default_task_threads() if num_threads is None else num_threads)
        try:
            watch_completions(loop, self.pool)
        except BaseException:
            self.pool.close()
            raise

    def close(self) -> None:
        """Stop watching the pool, then close it: chunks not started are cancelled, and every
        future left resolves (with its callbacks) on the calling thread."""
        if self.pool.closed:
            return
        unwatch_completions(self._loop, self.pool)
        self.pool.close()
