"""`IOOp`: one read or write of a raw buffer at a file offset, as the engine takes it."""

from __future__ import annotations

from dataclasses import dataclass

from infinity.io.native import OpTuple

CRC_BLOCK_BYTES = 1 << 20  # the store keeps one CRC32C per MiB


@dataclass(frozen=True, kw_only=True)
class IOOp:
    """A transfer between `nbytes` at `address` and the file `fd` at `offset`.

    direct: the fd was opened with O_DIRECT, so address, nbytes and offset
    must be 4096-aligned (checked at submit); False sends the op to the
    pread/pwrite pool. crc_address: 0, or the address of
    uint32[crc_count(nbytes)] that a write fills with the CRC32C of each
    `crc_block_bytes` block and a read verifies against. staged (direct
    ops only): each block moves through the engine's huge-page staging memory
    (a read lands there and is copied to `address`, a write is copied there
    first), which is faster on disks that slow down for scattered 4 KiB pages
    (see `NvmeConfig.staged_reads`, `staged_writes`).
    """

    is_write: bool
    fd: int
    address: int
    nbytes: int
    offset: int
    direct: bool = True
    crc_address: int = 0
    crc_block_bytes: int = CRC_BLOCK_BYTES
    staged: bool = False

    @classmethod
    def read(cls, *, fd: int, address: int, nbytes: int, offset: int, direct: bool = True,
             crc_address: int = 0, crc_block_bytes: int = CRC_BLOCK_BYTES,
             staged: bool = False) -> IOOp:
        return cls(is_write=False, fd=fd, address=address, nbytes=nbytes, offset=offset, direct=direct,
                   crc_address=crc_address, crc_block_bytes=crc_block_bytes, staged=staged)

    @classmethod
    def write(cls, *, fd: int, address: int, nbytes: int, offset: int, direct: bool = True,
              crc_address: int = 0, crc_block_bytes: int = CRC_BLOCK_BYTES,
              staged: bool = False) -> IOOp:
        return cls(is_write=True, fd=fd, address=address, nbytes=nbytes, offset=offset, direct=direct,
                   crc_address=crc_address, crc_block_bytes=crc_block_bytes, staged=staged)

    def crc_count(self) -> int:
        """How many uint32 checksums this op reads or writes at crc_address."""
        return crc_count(self.nbytes, self.crc_block_bytes)

    def as_tuple(self) -> OpTuple:
        return (
            self.is_write,
            self.fd,
            self.address,
            self.nbytes,
            self.offset,
            self.direct,
            self.crc_address,
            self.crc_block_bytes,
            self.staged,
        )


def crc_count(nbytes: int, crc_block_bytes: int = CRC_BLOCK_BYTES) -> int:
    """Number of CRC32C values for `nbytes` in blocks of `crc_block_bytes` (the last may be short)."""
    return -(-nbytes // crc_block_bytes)
