"""The durable index: which flushed tensor lives in which NVMe extents, kept in SQLite.

A flush is out of place: the bytes already went to fresh extents; this module
makes them durable (`fdatasync` of the extent files) and then points the names at
them in one SQLite transaction (WAL, synchronous=FULL). Only after that commit may
the caller free the extents of the versions replaced. A kill at any moment
therefore leaves each name at its old or its new version, never a mix, and the
space of half-done writes is simply not in the index at restart.

SQLite and fdatasync block, so they run on one writer thread. Completions are
signalled on an eventfd (`completion_fd`) and delivered by `poll()` on the
caller's thread, the same pattern as the I/O engine, so the daemon's loop can
wait on both without ever blocking on disk.
"""

from __future__ import annotations

import json
import os
import queue
import sqlite3
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from infinity.errors import StoreDirectoryError
from infinity.store.nvme import NvmeTier, TensorLayout

INDEX_FILE_NAME = "infinity-index.sqlite"
_Job = tuple[Callable[[], Any], "Future[Any]", "Callable[[Future[Any]], None] | None"]
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class DurableRecord:
    """A flushed tensor: its name, what it is, and where its bytes are."""

    namespace: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    layout: TensorLayout


class DurableIndex:
    """SQLite index of flushed tensors with one writer thread."""

    def __init__(self, tier: NvmeTier) -> None:
        self.tier = tier
        self.path = os.path.join(tier.directories[0].path, INDEX_FILE_NAME)
        self._db = self._open(self.path)
        self._check_directories()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._done: queue.SimpleQueue[tuple[Future[Any], Callable[[Future[Any]], None] | None]] = \
            queue.SimpleQueue()
        self.completion_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._thread = threading.Thread(target=self._serve, name="infinity-durable", daemon=True)
        self._thread.start()

    @staticmethod
    def _open(path: str) -> sqlite3.Connection:
        try:
            db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.execute("""CREATE TABLE IF NOT EXISTS tensors (
                namespace TEXT NOT NULL, name TEXT NOT NULL, dtype TEXT NOT NULL, shape TEXT NOT NULL,
                layout TEXT NOT NULL, PRIMARY KEY (namespace, name))""")
            db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        except sqlite3.Error as exc:
            raise StoreDirectoryError(f"cannot open the store index {path}: {exc}; check that the "
                                      f"directory is writable and the file is not corrupted") from None
        return db

    def _check_directories(self) -> None:
        """Refuse a configuration whose directories differ from the ones the index was written with."""
        dirs = json.dumps([d.path for d in self.tier.directories])
        row = self._db.execute("SELECT value FROM meta WHERE key = 'dirs'").fetchone()
        if row is None:
            self._db.execute("INSERT INTO meta VALUES ('dirs', ?), ('schema', ?)", (dirs, str(SCHEMA_VERSION)))
        elif row[0] != dirs:
            raise StoreDirectoryError(
                f"the store index {self.path} was written for nvme.dirs = {row[0]}, but the settings "
                f"name {dirs}; restore the original nvme.dirs (same order) to keep the stored tensors")

    # --- reading (start-up, verify) ----------------------------------------

    def load(self) -> list[DurableRecord]:
        """Every flushed tensor, and mark its extents as used in the tier."""
        records = []
        for namespace, name, dtype, shape, layout in self._db.execute(
                "SELECT namespace, name, dtype, shape, layout FROM tensors ORDER BY namespace, name"):
            record = DurableRecord(namespace, name, dtype, tuple(json.loads(shape)),
                                   TensorLayout.from_wire(json.loads(layout)))
            self.tier.adopt(record.layout)
            records.append(record)
        return records

    # --- writing (the writer thread) ------------------------------------------

    def publish(self, records: Iterable[DurableRecord], *,
                on_done: Callable[[Future[None]], None] | None = None) -> Future[None]:
        """Make the records' extents durable, then point their names at them in one transaction.

        The future completes (and `on_done` runs on the thread that calls `poll`) only after the
        transaction committed; that is when replaced extents may be freed.
        """
        batch = list(records)

        def job() -> None:
            for fd in {self.tier.directories[d].fd for r in batch for d, _ in r.layout.extents}:
                os.fdatasync(fd)
            with self._transaction() as db:
                db.executemany(
                    "INSERT OR REPLACE INTO tensors VALUES (?, ?, ?, ?, ?)",
                    [(r.namespace, r.name, r.dtype, json.dumps(list(r.shape)),
                      json.dumps(r.layout.to_wire())) for r in batch])

        return self._submit(job, on_done)

    def remove(self, keys: Iterable[tuple[str, str]], *,
               on_done: Callable[[Future[None]], None] | None = None) -> Future[None]:
        """Forget names; their extents may be freed once the future completes."""
        batch = list(keys)

        def job() -> None:
            with self._transaction() as db:
                db.executemany("DELETE FROM tensors WHERE namespace = ? AND name = ?", batch)

        return self._submit(job, on_done)

    def _transaction(self) -> "_Transaction":
        return _Transaction(self._db)

    def _submit(self, job: Callable[[], Any], on_done: Callable[[Future[Any]], None] | None) -> Future[Any]:
        future: Future[Any] = Future()
        future.set_running_or_notify_cancel()
        self._jobs.put((job, future, on_done))
        return future

    def _serve(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, future, on_done = item
            try:
                future.set_result(job())
            except BaseException as exc:  # handed to the caller through the future
                future.set_exception(exc)
            # on_done runs later in poll(), on the owner's thread, never on this one.
            self._done.put((future, on_done))
            os.eventfd_write(self.completion_fd, 1)

    def poll(self) -> int:
        """Run the callbacks of finished jobs on this thread; never blocks. Returns how many."""
        try:
            os.eventfd_read(self.completion_fd)
        except BlockingIOError:
            pass
        count = 0
        while True:
            try:
                future, callback = self._done.get_nowait()
            except queue.Empty:
                return count
            count += 1
            if callback is not None:
                callback(future)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()
        self.poll()
        self._db.close()
        os.close(self.completion_fd)


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, rolled back on error."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        self.db.execute("COMMIT" if kind is None else "ROLLBACK")
