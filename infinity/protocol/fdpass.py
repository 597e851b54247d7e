"""Moving file descriptors between processes: one message plus its fds on a SOCK_SEQPACKET socket.

ZeroMQ cannot carry file descriptors, so the CPU tier's memfds travel over a
separate Unix socket as SCM_RIGHTS ancillary data. SEQPACKET keeps message
boundaries, so a message and the fds attached to it always arrive together.
The bytes of each message are `wire.FdRequest` / `wire.FdReply`.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Sequence

from infinity.errors import ProtocolError

MAX_FD_MESSAGE_BYTES = 256 * 1024


def seqpacket_socket() -> socket.socket:
    return socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)


def send_message(sock: socket.socket, data: bytes, fds: Sequence[int] = ()) -> None:
    """One message with its fds (the kernel duplicates them into the receiver)."""
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def recv_message(sock: socket.socket, *, max_fds: int) -> tuple[bytes, list[int]]:
    """The next message and the fds that came with it; b"" means the peer closed the socket."""
    data, fds, flags, _ = socket.recv_fds(sock, MAX_FD_MESSAGE_BYTES, max_fds)
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            os.close(fd)
        raise ProtocolError("an fd-channel message was truncated (too long or too many fds)")
    return data, list(fds)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer as the kernel saw it at connect, in this process's pid namespace."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid
