"""Turns a native (errno, message) pair into the project's typed exception.

The engine reports a failed batch as a positive errno and a message naming
the call, fd and offset, after "op N: ", N the index in the batch of the
first op that failed (`failed_op` reads it back); this module picks the
`infinity.errors` class and appends a sentence saying what to do about it.
"""

from __future__ import annotations

import errno
import re

from infinity.errors import ChecksumError, DiskFullError, IOEngineError

_DISK_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}

_ADVICE: dict[int, str] = {
    errno.EBADMSG: (
        "The stored copy is corrupted: rewrite the tensor from a good copy (or delete it), "
        "and run `infinity verify` to look for other damage."
    ),
    errno.ENOSPC: (
        "The file system is full: free space on it, move the store to another directory "
        "(nvme.dirs), or keep nvme.capacity_bytes_per_dir below the space the file system really has."
    ),
    errno.EDQUOT: (
        "The disk quota is used up: free space, raise the quota, or move the store to another "
        "directory (nvme.dirs)."
    ),
    errno.EFBIG: (
        "The file would exceed the process's file-size limit (`ulimit -f`) or the file system's "
        "maximum file size: raise the limit, free space, or use another directory (nvme.dirs); "
        "nvme.capacity_bytes_per_dir caps the store file's size."
    ),
    errno.EBADF: "The file descriptor is not open (closed before the I/O ran?): keep it open until the future completes.",
    errno.EINVAL: (
        "The kernel refused the request; if the file system does not support O_DIRECT "
        "(tmpfs, ramfs, some network file systems), set nvme.direct=off or pass direct=False."
    ),
    errno.EIO: "Check that the file is as large as the read expects, and the device's health (dmesg).",
    errno.EROFS: (
        "The file system is read-only (remounted so after errors? see dmesg): repair it and "
        "mount it read-write."
    ),
    errno.ECANCELED: "The engine was closed while the request was queued: submit it again on an open engine.",
    errno.EAGAIN: "The kernel ran short of resources: retry later, or lower io.queue_depth.",
}


def error_from_errno(err: int, message: str) -> IOEngineError:
    """The exception for a failed batch (errno > 0)."""
    advice = _ADVICE.get(err, "Check the file, the device and the kernel log (dmesg).")
    text = f"{message}. {advice}" if message else f"I/O failed: {errno.errorcode.get(err, err)}. {advice}"
    if err == errno.EBADMSG:
        return ChecksumError(text)
    if err in _DISK_FULL:
        return DiskFullError(text)
    return IOEngineError(text)


_FAILED_OP = re.compile(r"op (\d+): ")


def failed_op(message: str) -> int | None:
    """The index in its batch of the op a failed batch's message is about; None if the
    message names none (a failure of the batch as a whole)."""
    found = _FAILED_OP.match(message)
    return int(found.group(1)) if found else None
