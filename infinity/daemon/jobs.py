"""Multi-stage jobs (read, compute, write) written as one generator, run on the loop thread.

A job is a generator that yields what it waits for, an `IOFuture` of the I/O engine or of
the task pool, or a `concurrent.futures.Future` that another part of the daemon completes (a
load from NVMe, say), or a list of them, waited for together; it is resumed on the daemon's loop
thread when that has completed; so its stages read top to bottom in one place, instead of
as a chain of callbacks:

    def copy_checked(...) -> Generator[Stage, None, int]:
        yield engine.submit(IOOp.read(fd=src_fd, address=buf.address, nbytes=n, offset=0))
        yield pool.submit_crc32c(address=buf.address, nbytes=n, crc_address=crcs)
        yield engine.submit(IOOp.write(fd=dst_fd, address=buf.address, nbytes=n, offset=0))
        return n

    start_job(loop, copy_checked(...), name="copy").add_done_callback(...)

A stage that fails raises its error at the `yield` (for a list: the first failure, once
all of the list has completed, so no buffer of the stage is still in use), where the job may
catch it. What the job returns, or the error that escapes it, completes the
`concurrent.futures.Future` that `start_job` returns. The futures must complete on their own:
their sources' eventfds must be watched by the loop (`infinity.daemon.tasks.watch_completions`).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any, Generator, Generic, Sequence, TypeVar, Union

from infinity.daemon.loop import EventLoop
from infinity.io.future import IOFuture

log = logging.getLogger("infinityd.jobs")

T = TypeVar("T")
Waitable = Union[IOFuture, "Future[Any]"]
Stage = Union[Waitable, Sequence[Waitable]]
Job = Generator[Stage, None, T]


def start_job(loop: EventLoop, job: Job[T], *, name: str) -> Future[T]:
    """Run `job` on `loop`'s thread from its first stage to its end; callable from any thread.
    The returned future completes (on the loop thread) with the job's return value or error."""
    runner = _JobRunner(loop, job, name)
    loop.call_soon_threadsafe(lambda: runner.advance(None))
    return runner.outcome


class _JobRunner(Generic[T]):
    """Resumes one job each time the stage it yielded has completed."""

    def __init__(self, loop: EventLoop, job: Job[T], name: str) -> None:
        self._loop = loop
        self._job = job
        self.name = name
        self.outcome: Future[T] = Future()
        self._stage: list[Waitable] = []
        self._waiting = 0

    def advance(self, error: BaseException | None) -> None:
        """Resume the job with the stage's error (or none); on the loop thread only."""
        try:
            stage = self._job.send(None) if error is None else self._job.throw(error)
        except StopIteration as stop:
            self.outcome.set_result(stop.value)
            return
        except Exception as exc:  # the job's own failure: its future carries it
            self.outcome.set_exception(exc)
            return
        futures = self._futures_of(stage)
        if futures is None:
            self.advance(TypeError(
                f"job {self.name!r} yielded {stage!r}; a job stage must be an IOFuture (of the I/O "
                "engine or the task pool), a concurrent.futures.Future, or a list of them"))
            return
        self._stage, self._waiting = futures, len(futures)
        if not futures:
            self._loop.call_soon_threadsafe(lambda: self.advance(None))
            return
        for future in futures:
            # Resolved on whatever thread polled or waited: the job resumes on the loop's.
            future.add_done_callback(lambda _f: self._loop.call_soon_threadsafe(self._part_done))

    @staticmethod
    def _futures_of(stage: object) -> list[Waitable] | None:
        if isinstance(stage, (IOFuture, Future)):
            return [stage]
        if isinstance(stage, (list, tuple)) and all(isinstance(f, (IOFuture, Future))
                                                    for f in stage):
            return list(stage)
        return None

    def _part_done(self) -> None:
        self._waiting -= 1
        if self._waiting > 0:
            return
        stage, self._stage = self._stage, []
        error = next((e for e in (f.exception(0) for f in stage) if e is not None), None)
        self.advance(error)
