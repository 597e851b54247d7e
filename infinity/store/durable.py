"""The durable index: which flushed tensor lives in which NVMe extents, kept in SQLite.

A flush is out of place: the bytes already went to fresh extents; this module
makes them durable (`fdatasync` of the extent files) and then points the names at
them in one SQLite transaction (WAL, synchronous=FULL). Only after that commit may
the caller free the extents of the versions replaced. A kill at any moment
therefore leaves each name at its old or its new version, never a mix, and the
space of half-done writes is simply not in the index at restart.

SQLite and fdatasync block, so they run on one writer thread, in the order the
jobs were submitted. Completions are signalled on an eventfd (`completion_fd`)
and delivered by `poll()` on the caller's thread, the same pattern as the I/O
engine, so the daemon's loop can wait on both without ever blocking on disk.

The index holds an exclusive lock (`infinity-store.lock`, flock) in every store
directory for its whole life: two daemons, or a daemon and `infinity verify`,
never use one directory at once, whichever directories each names. And each
directory carries a marker (`infinity-store.id`: the store's id and the
directory's position in nvme.dirs), so that a directory of one store is never
taken as a fresh directory of another, nor in another position.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import queue
import secrets
import sqlite3
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from infinity.errors import DiskFullError, IOEngineError, StoreDirectoryError
from infinity.store.nvme import DIRECTORY_FAULTS, NvmeTier, TensorLayout

INDEX_FILE_NAME = "infinity-index.sqlite"
LOCK_FILE_NAME = "infinity-store.lock"
MARKER_FILE_NAME = "infinity-store.id"
_Job = tuple[Callable[[], Any], "Future[Any]", "Callable[[Future[Any]], None] | None"]
SCHEMA_VERSION = 1
_SQLITE_FULL = 13  # sqlite3's result code for "database or disk is full"
# The WAL is truncated back to this after a checkpoint, so a small store directory is not
# eaten by a log that only ever grows.
_JOURNAL_SIZE_LIMIT_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class DurableRecord:
    """A flushed tensor: its name, what it is, and where its bytes are."""

    namespace: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    layout: TensorLayout
    # The tier's `sync_failures` when these bytes began to be written: publishing refuses
    # the record if an fdatasync failed since (see `NvmeTier.sync_failures`).
    sync_failures_before: int = 0


def store_files_in(directory: str, extent_file_bytes: int) -> str | None:
    """What in `directory` shows a store's data, in words: its marker, or an extent file that
    held `extent_file_bytes` (as the caller found it, before any writes of its own); None when
    there is none."""
    if os.path.exists(os.path.join(directory, MARKER_FILE_NAME)):
        return f"a store ({MARKER_FILE_NAME})"
    return "an extent file" if extent_file_bytes else None


def index_path(first_directory: str) -> str:
    """Where the index of a store whose first directory is `first_directory` lives."""
    return os.path.join(first_directory, INDEX_FILE_NAME)


def _disk_error(exc: OSError, what: str) -> IOEngineError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return DiskFullError(f"{what} failed: {exc.strerror}; free space on the store's file "
                             f"system or lower nvme.capacity_bytes_per_dir")
    return IOEngineError(f"{what} failed: {exc.strerror}; check the device and the kernel log "
                         f"(dmesg), then run `infinity verify`")


def _sqlite_error(exc: sqlite3.Error, path: str) -> IOEngineError:
    if getattr(exc, "sqlite_errorcode", None) == _SQLITE_FULL:
        return DiskFullError(f"the store index {path} cannot grow: the file system is full; free "
                             f"space there or lower nvme.capacity_bytes_per_dir")
    return StoreDirectoryError(f"the store index {path} failed ({exc}); check that the directory "
                               f"is writable, then run `infinity verify`")


class DurableIndex:
    """SQLite index of flushed tensors with one writer thread."""

    def __init__(self, tier: NvmeTier) -> None:
        self.tier = tier
        self.path = index_path(tier.directories[0].path)
        self._closed = False
        self._unmarked_id: str | None = None  # the store id its directories still await
        self._lock_fds: list[int] = []
        try:
            for directory in tier.directories:
                self._lock_fds.append(self._lock_store(directory.path))
            if not os.path.exists(self.path):  # refused before a file is left behind
                for directory in tier.directories:
                    self._refuse_foreign(directory.path, directory.opened_bytes)
            self._db = self._open(self.path)
            self._index_inode = os.stat(self.path).st_ino  # a removed index is found by it
            self._check_meta()
            self._sync_directories()
        except BaseException:
            for fd in self._lock_fds:
                os.close(fd)
            raise
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._done: queue.SimpleQueue[tuple[Future[Any], Callable[[Future[Any]], None] | None]] = \
            queue.SimpleQueue()
        self.completion_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._thread = threading.Thread(target=self._serve, name="infinity-durable", daemon=True)
        self._thread.start()

    @staticmethod
    def _lock_store(directory: str) -> int:
        path = os.path.join(directory, LOCK_FILE_NAME)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise StoreDirectoryError(f"cannot create the store lock {path}: {exc.strerror}; check "
                                      f"the directory's permissions") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StoreDirectoryError(
                    f"the store in {directory} is in use by another process (an infinityd, or "
                    f"`infinity verify`); stop it first, or give this one other nvme.dirs") from None
            raise StoreDirectoryError(f"cannot lock {path}: {exc.strerror}") from None
        return fd

    @staticmethod
    def _open(path: str) -> sqlite3.Connection:
        try:
            # Used by the opening thread for load(), then only by the writer thread.
            db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.execute(f"PRAGMA journal_size_limit={_JOURNAL_SIZE_LIMIT_BYTES}")
            db.execute("""CREATE TABLE IF NOT EXISTS tensors (
                namespace TEXT NOT NULL, name TEXT NOT NULL, dtype TEXT NOT NULL, shape TEXT NOT NULL,
                layout TEXT NOT NULL, PRIMARY KEY (namespace, name))""")
            db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            # The scheduler's step traces (JSON), so a restarted client prefetches from its first
            # step. Added without a schema change: older indexes gain the table on open.
            db.execute("""CREATE TABLE IF NOT EXISTS traces (
                namespace TEXT NOT NULL, client TEXT NOT NULL, trace TEXT NOT NULL,
                PRIMARY KEY (namespace, client))""")
        except sqlite3.Error as exc:
            raise StoreDirectoryError(f"cannot open the store index {path}: {exc}; check that the "
                                      f"directory is writable and the file is not corrupted") from None
        return db

    def _check_meta(self) -> None:
        """Refuse an index of another schema, or one written for other directories, or a
        directory that is not this store's.

        The directories are marked with the index's `store_id` under a 'marking' row, removed
        once every marker is durable: an open that finds the row (start-up killed, a store from
        before markers) marks them again, and refuses only other stores' markers meanwhile.
        With tensors indexed, that waits for `load` to have found every extent file in place:
        a directory not mounted yet must not get the marker its real contents lack."""
        dirs = json.dumps([d.path for d in self.tier.directories])
        meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        if not meta:
            for directory in self.tier.directories:
                self._refuse_foreign(directory.path, directory.opened_bytes)
            with _Transaction(self._db) as db:
                db.execute("INSERT INTO meta VALUES ('dirs', ?), ('schema', ?), ('store_id', ?), "
                           "('marking', '1')", (dirs, str(SCHEMA_VERSION), secrets.token_hex(16)))
            meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        if meta.get("schema") != str(SCHEMA_VERSION):
            raise StoreDirectoryError(
                f"the store index {self.path} has schema {meta.get('schema')!r}, but this Infinity "
                f"reads schema {SCHEMA_VERSION}; use the Infinity version that wrote it")
        if meta.get("dirs") != dirs:
            raise StoreDirectoryError(
                f"the store index {self.path} was written for nvme.dirs = {meta.get('dirs')}, but "
                f"the settings name {dirs}; restore the original nvme.dirs (same order) to keep "
                f"the stored tensors")
        store_id = meta.get("store_id")
        if store_id is None:  # written before directories were marked
            beside = self._read_marker(self.tier.directories[0].path)
            # A marker at position 0 beside this index can only be this store's (an earlier
            # marking stopped before it noted the id); otherwise a new id.
            store_id = beside[0] if beside is not None and beside[1] == 0 else secrets.token_hex(16)
            with _Transaction(self._db) as db:
                db.execute("INSERT INTO meta VALUES ('store_id', ?), ('marking', '1')", (store_id,))
            meta["marking"] = "1"
        if "marking" in meta:
            for position, directory in enumerate(self.tier.directories):
                found = self._read_marker(directory.path)
                if found is not None and found[0] != store_id:
                    self._refuse_foreign(directory.path, 0)  # its marker names another store
                if found is not None and found[1] != position:
                    raise StoreDirectoryError(
                        f"store directory {directory.path} is position {found[1]} of this store, "
                        f"not {position}: restore the original nvme.dirs order (or put each "
                        f"drive back at its own path)")
            self._unmarked_id = store_id
            if self._db.execute("SELECT 1 FROM tensors LIMIT 1").fetchone() is None:
                self._finish_marking()
            return
        for position, directory in enumerate(self.tier.directories):
            found = self._read_marker(directory.path)
            if found != (store_id, position):
                raise StoreDirectoryError(
                    f"store directory {directory.path} is not position {position} of the store "
                    f"indexed in {self.path} (its marker {MARKER_FILE_NAME} says "
                    f"{'nothing' if found is None else found}): another store's directory, or "
                    f"one emptied or replaced since; restore it, or give this store other "
                    f"nvme.dirs")

    @staticmethod
    def _read_marker(directory: str) -> tuple[str, int] | None:
        """(store id, position) from a directory's marker, or None if it has none."""
        try:
            with open(os.path.join(directory, MARKER_FILE_NAME), encoding="ascii") as f:
                store_id, position = f.read().split()
            return store_id, int(position)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise StoreDirectoryError(
                f"cannot read {os.path.join(directory, MARKER_FILE_NAME)} ({exc}); restore it "
                f"from the store's other directories or a backup") from None

    def _refuse_foreign(self, directory: str, extent_file_bytes: int) -> None:
        """For a fresh store: refuse a directory that holds another store's data."""
        found = store_files_in(directory, extent_file_bytes)
        if found is not None:
            raise StoreDirectoryError(
                f"store directory {directory} already holds {found} that the new store index "
                f"{self.path} knows nothing of: it belongs to another store, perhaps with other "
                f"nvme.dirs or another order; use those settings, or give this store empty "
                f"directories")

    def _finish_marking(self) -> None:
        """Write every directory's marker, make them durable, then drop the 'marking' row."""
        store_id, self._unmarked_id = self._unmarked_id, None
        if store_id is None:
            return
        self._mark_directories(store_id)
        self._sync_directories()
        with _Transaction(self._db) as db:
            db.execute("DELETE FROM meta WHERE key = 'marking'")

    def _mark_directories(self, store_id: str) -> None:
        for position, directory in enumerate(self.tier.directories):
            path = os.path.join(directory.path, MARKER_FILE_NAME)
            try:
                with open(path + ".tmp", "w", encoding="ascii") as f:
                    f.write(f"{store_id} {position}\n")
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(path + ".tmp", path)
            except OSError as exc:
                raise StoreDirectoryError(f"cannot write {path}: {exc.strerror}; check the "
                                          f"directory's permissions") from None

    def _sync_directories(self) -> None:
        """Make the extent files' and the index's directory entries durable (once, at open)."""
        for directory in self.tier.directories:
            fd = os.open(directory.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    # --- reading (start-up, verify) ----------------------------------------

    def load(self) -> list[DurableRecord]:
        """Every flushed tensor, and mark its extents as used in the tier."""
        records = []
        rows = self._db.execute(
            "SELECT namespace, name, dtype, shape, layout FROM tensors ORDER BY namespace, name")
        for namespace, name, dtype, shape, layout in rows:
            try:
                record = DurableRecord(namespace, name, dtype, tuple(json.loads(shape)),
                                       TensorLayout.from_wire(json.loads(layout)))
                self.tier.adopt(record.layout)
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                raise StoreDirectoryError(
                    f"the store index {self.path} is damaged at tensor {name!r} in namespace "
                    f"{namespace!r} ({exc}); run `infinity verify` and restore the store from a "
                    f"backup") from None
            records.append(record)
        self._finish_marking()  # every extent file found where the index says
        return records

    def load_traces(self) -> list[tuple[str, str, Any]]:
        """Every stored step trace as (namespace, client name, plain data); unreadable ones are
        skipped (a trace is a prediction: losing one costs a recorded step, nothing else)."""
        traces = []
        for namespace, client, text in self._db.execute(
                "SELECT namespace, client, trace FROM traces ORDER BY namespace, client"):
            try:
                traces.append((namespace, client, json.loads(text)))
            except ValueError:
                continue
        return traces

    # --- writing (the writer thread) ------------------------------------------

    def publish(self, records: Iterable[DurableRecord], *,
                on_done: Callable[[Future[None]], None] | None = None) -> Future[None]:
        """Make the records' extents durable, then point their names at them in one transaction.

        The future completes (and `on_done` runs on the thread that calls `poll`) only after the
        transaction committed; that is when replaced extents may be freed. Its exception is
        DiskFullError, IOEngineError or StoreDirectoryError when the disk or SQLite refused.
        """
        batch = list(records)
        directories = sorted({d for r in batch for d, _ in r.layout.extents})
        fds = [self.tier.directories[d].fd for d in directories]
        rows = [(r.namespace, r.name, r.dtype, json.dumps(list(r.shape)),
                 json.dumps(r.layout.to_wire())) for r in batch]

        def job() -> None:
            for d in directories:
                directory = self.tier.directories[d]
                try:
                    os.fdatasync(directory.fd)
                except OSError as exc:
                    self.tier.sync_failures += 1
                    what = f"fdatasync of {directory.file_path}"
                    # EIO from fdatasync is a write-back that failed, and reported once: the
                    # copies written before it are written anew (see `sync_failures`), and
                    # the directory stays in use. A read-only file system is for good.
                    if exc.errno == errno.EROFS:
                        raise directory.fail(exc.errno, what) from None
                    raise _disk_error(exc, what) from None
            self._require_files_in_place(fds)
            failed_since = [r.name for r in batch
                            if r.layout.extents and r.sync_failures_before != self.tier.sync_failures]
            if failed_since:
                raise IOEngineError(
                    f"an fdatasync of the store failed after the bytes of {failed_since[0]!r} were "
                    f"written, so they may not be on the disk; flush again (the tensors still in "
                    f"memory are written anew), and check the device and the kernel log (dmesg)")
            with _Transaction(self._db, path=self.path) as db:
                db.executemany("INSERT OR REPLACE INTO tensors VALUES (?, ?, ?, ?, ?)", rows)

        return self._submit(job, on_done)

    def _require_files_in_place(self, fds: Iterable[int]) -> None:
        """StoreDirectoryError if an extent file or the index was removed (its directory
        deleted, a file unlinked) while the daemon runs: the writes still succeed, into files
        no name reaches, so nothing written there would be found after a restart. Checked
        before each publication, so no such write is acknowledged as durable."""
        for directory in self.tier.directories:
            if directory.fd in fds and os.fstat(directory.fd).st_nlink == 0:
                raise StoreDirectoryError(
                    f"the store's extent file in {directory.path} was removed while infinityd "
                    f"ran, so nothing written to it is durable; restore the directory or stop "
                    f"the daemon, and do not delete a store directory in use")
        try:
            in_place = os.stat(self.path).st_ino == self._index_inode
        except OSError:
            in_place = False
        if not in_place:
            raise StoreDirectoryError(
                f"the store index {self.path} was removed or replaced while infinityd ran, so "
                f"no flush can be made durable; restore the directory or stop the daemon, and "
                f"do not delete a store directory in use")

    def remove(self, keys: Iterable[tuple[str, str]], *,
               on_done: Callable[[Future[None]], None] | None = None) -> Future[None]:
        """Forget names; their extents may be freed once the future completes."""
        batch = list(keys)

        def job() -> None:
            with _Transaction(self._db, path=self.path) as db:
                db.executemany("DELETE FROM tensors WHERE namespace = ? AND name = ?", batch)

        return self._submit(job, on_done)

    def save_trace(self, namespace: str, client: str, trace: Callable[[], Any] | None, *,
                   on_done: Callable[[Future[None]], None] | None = None) -> Future[None]:
        """Store (or, for None, forget) the step trace of a (namespace, client name). `trace`
        makes its plain data; it is called on the writer thread, as a long trace takes a while
        to turn into JSON."""

        def job() -> None:
            text = None if trace is None else json.dumps(trace(), separators=(",", ":"))
            with _Transaction(self._db, path=self.path) as db:
                if text is None:
                    db.execute("DELETE FROM traces WHERE namespace = ? AND client = ?",
                               (namespace, client))
                else:
                    db.execute("INSERT OR REPLACE INTO traces VALUES (?, ?, ?)",
                               (namespace, client, text))

        return self._submit(job, on_done)

    def _index_directory_failure(self) -> StoreDirectoryError | None:
        """After SQLite failed: whether that is the index's directory turning read-only or its
        device failing (SQLite says only "disk I/O error"). An fsync of its lock file asks the
        file system; a failure fails the directory, and that error is the one to report."""
        directory = self.tier.directories[0]
        if directory.failure is not None:
            return directory.failure
        try:
            os.fsync(self._lock_fds[0])
        except OSError as exc:
            if exc.errno in DIRECTORY_FAULTS:
                return directory.fail(exc.errno, f"a write of the store index {self.path}")
        return None

    def _submit(self, job: Callable[[], Any], on_done: Callable[[Future[Any]], None] | None) -> Future[Any]:
        if self._closed:
            raise StoreDirectoryError("the store index is closed (the daemon is stopping)")
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
            except StoreDirectoryError as exc:  # SQLite's, or a directory failed
                future.set_exception(self._index_directory_failure() or exc)
            except BaseException as exc:  # handed to the caller through the future
                future.set_exception(exc)
            # on_done runs later in poll(), on the owner's thread, never on this one.
            self._done.put((future, on_done))
            os.eventfd_write(self.completion_fd, 1)

    def poll(self) -> int:
        """Run the callbacks of finished jobs on this thread; never blocks. Returns how many.
        A callback that raises does not hold back the others: the first error is raised after."""
        try:
            os.eventfd_read(self.completion_fd)
        except BlockingIOError:
            pass
        count = 0
        failure: Exception | None = None
        while True:
            try:
                future, callback = self._done.get_nowait()
            except queue.Empty:
                break
            count += 1
            if callback is not None:
                try:
                    callback(future)
                except Exception as exc:  # the rest still run: their signal was read above
                    failure = failure or exc
        if failure is not None:
            raise failure
        return count

    def close(self) -> None:
        """Finish the jobs already submitted (their callbacks run here), then close. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._thread.join()
        self.poll()
        self._db.close()
        os.close(self.completion_fd)
        for fd in self._lock_fds:
            os.close(fd)  # drops the store's locks


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, rolled back on error (a COMMIT that fails, too)."""

    def __init__(self, db: sqlite3.Connection, *, path: str = "") -> None:
        self.db = db
        self.path = path

    def __enter__(self) -> sqlite3.Connection:
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise _sqlite_error(exc, self.path) from None
        return self.db

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        if kind is None:
            try:
                self.db.execute("COMMIT")
                return
            except sqlite3.Error as commit_error:
                # A failed COMMIT (disk full, I/O error) leaves the transaction open: end it.
                self._rollback()
                raise _sqlite_error(commit_error, self.path) from None
        self._rollback()
        if isinstance(exc, sqlite3.Error):
            raise _sqlite_error(exc, self.path) from None

    def _rollback(self) -> None:
        try:
            self.db.execute("ROLLBACK")
        except sqlite3.Error:
            pass  # SQLite already rolled back on its own
