"""The private namespaces' records on disk, so that a restart does not open them to everyone.

One JSON file beside the store's index (`infinity-namespaces.json` in the first
NVMe directory): a restored tensor's namespace is private again at start, with
its mode, quota, seal, owner's uid and token digest (never the token). Only
private records are kept: the others were never promised to outlive the daemon.
Written whole on a worker thread (temporary file, fsync, rename, fsync of the
folder), read once at start. Without an NVMe tier nothing outlives the daemon,
so there is no file.
"""

from __future__ import annotations

import json
import os
from typing import Any

from infinity.errors import StoreDirectoryError

FILE_NAME = "infinity-namespaces.json"
FORMAT = 1


def records_path(nvme_dirs: list[str] | tuple[str, ...]) -> str | None:
    """Where the records live for these `nvme.dirs`; None without an NVMe tier."""
    return os.path.join(nvme_dirs[0], FILE_NAME) if nvme_dirs else None


def load(path: str) -> list[dict[str, Any]]:
    """The saved records; none when there is no file yet. A damaged file is an error, not an
    empty list: the namespaces it names would otherwise be open to every client."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
        records = data["private"]
        for record in records:
            if not (isinstance(record["name"], str) and record["mode"] in ("read-write",
                                                                           "read-only")
                    and isinstance(record["quota_bytes"], int)
                    and isinstance(record["sealed"], bool)
                    and isinstance(record["owner_uid"], int)
                    and len(bytes.fromhex(record["token_sha256"])) == 32):
                raise ValueError(f"a damaged record: {str(record)[:200]}")
        return list(records)
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StoreDirectoryError(
            f"the private namespaces' records {path} cannot be read ({exc}); restore the file "
            f"from a backup, or remove it to open those namespaces to every client") from None


def save(path: str, records: list[dict[str, Any]]) -> None:
    """Replace the file with `records` (any thread; one writer at a time)."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        data = memoryview(json.dumps({"format": FORMAT, "private": records}, indent=1).encode())
        while data:
            data = data[os.write(fd, data):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    folder = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(folder)  # the rename itself is durable
    finally:
        os.close(folder)
