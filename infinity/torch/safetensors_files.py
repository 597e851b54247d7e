"""safetensors files written tensor by tensor, for checkpoints of state that is not in this process.

`safetensors.torch.save_file` wants every tensor in memory at once; a checkpoint's tensors are in
the store, possibly far more of them than RAM. The format is simple enough to write in a stream:
an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and byte
range, then the bytes. The header is known before any byte is read (the store lists dtypes and
shapes), so `write_file` writes it, sizes the file, and fills each tensor's range through a
memory map of just that range: the tensor's source (the store's `read_into`) writes straight into
the file's pages, which go to disk with `msync` and leave the process's memory with the map. The
process holds at most one tensor's mapped pages at a time, and no copy of them.

`plan_shards` cuts a list of tensors into files of at most `max_shard_bytes` (Hugging Face's
names: `model.safetensors`, or `model-00001-of-00003.safetensors` and an index
`model.safetensors.index.json` mapping each tensor to its file), so `transformers`
`from_pretrained` reads them as its own. `TensorFile` reads one back a tensor at a time with
plain reads into a tensor of its own (not a map of the file, whose pages would stay resident
while it is open, the whole file in the end).
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from infinity.errors import CheckpointError

__all__ = ["FileTensor", "TensorFile", "fsync_path", "plan_shards", "write_file", "write_index"]

MAX_HEADER_BYTES = 100 << 20  # what the safetensors library accepts too

# The store's dtype names (infinity.protocol.dtypes) as safetensors names them.
SAFETENSORS_DTYPES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16",
    "int32": "I32", "uint32": "U32", "int64": "I64", "uint64": "U64", "float16": "F16",
    "bfloat16": "BF16", "float32": "F32", "float64": "F64", "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


@dataclass(frozen=True)
class FileTensor:
    """One tensor to write: its key in the file, dtype (a store dtype name), shape, byte size,
    and what fills it (given a uint8 tensor of exactly `nbytes` over the file's bytes)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    fill: Callable[[torch.Tensor], None]


def plan_shards(stem: str, tensors: Sequence[FileTensor], max_shard_bytes: int
                ) -> list[tuple[str, list[FileTensor]]]:
    """(file name, tensors) per file: `<stem>.safetensors` when all fit in one, else
    `<stem>-00001-of-0000N.safetensors`, each at most max_shard_bytes (or one tensor larger)."""
    shards: list[list[FileTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    if len(shards) == 1:
        return [(f"{stem}.safetensors", shards[0])]
    count = len(shards)
    return [(f"{stem}-{i:05d}-of-{count:05d}.safetensors", shard)
            for i, shard in enumerate(shards, 1)]


def write_index(path: str, files: Sequence[tuple[str, Sequence[FileTensor]]]) -> None:
    """The index of a sharded set of files (`<stem>.safetensors.index.json`), fsynced."""
    weight_map = {tensor.key: name for name, shard in files for tensor in shard}
    total = sum(tensor.nbytes for _, shard in files for tensor in shard)
    with open(path, "w") as index:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, index, indent=2)
        index.flush()
        os.fsync(index.fileno())


def write_file(path: str, tensors: Sequence[FileTensor], *,
               advance: Callable[[int], None] = lambda nbytes: None) -> None:
    """Write one safetensors file, filling each tensor in place through a map of its bytes;
    fsynced. `advance(nbytes)` is called after each tensor (for a progress bar)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor in tensors:
        header[tensor.key] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype],
                              "shape": list(tensor.shape),
                              "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-aligned, as the library writes it
    start = 8 + len(text)
    with open(path, "w+b") as file:
        file.write(len(text).to_bytes(8, "little") + text)
        file.truncate(start + offset)
        position = start
        for tensor in tensors:
            if tensor.nbytes:
                _fill_range(file.fileno(), position, tensor)
            position += tensor.nbytes
            advance(tensor.nbytes)
        os.fsync(file.fileno())


def _fill_range(fd: int, position: int, tensor: FileTensor) -> None:
    """Map the file's bytes [position, position + nbytes), let the tensor's source fill them,
    and write them back before the map goes."""
    aligned = position - position % mmap.ALLOCATIONGRANULARITY
    with mmap.mmap(fd, position - aligned + tensor.nbytes, offset=aligned) as mapped:
        view = torch.frombuffer(mapped, dtype=torch.uint8, count=tensor.nbytes,
                                offset=position - aligned)
        try:
            tensor.fill(view)
        finally:
            del view  # the map cannot close while a tensor still exports its memory
        mapped.flush()


class TensorFile:
    """A safetensors file read one tensor at a time; a file that is not one is a
    CheckpointError."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            with open(path, "rb") as file:
                length = int.from_bytes(file.read(8), "little")
                if not 0 < length <= MAX_HEADER_BYTES:
                    raise ValueError(f"a header of {length} bytes")
                header = json.loads(file.read(length))
                size = os.fstat(file.fileno()).st_size
            header.pop("__metadata__", None)
            names = {code: name for name, code in SAFETENSORS_DTYPES.items()}
            self._entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
            for key, entry in header.items():
                begin, end = (int(x) for x in entry["data_offsets"])
                dtype = getattr(torch, names[entry["dtype"]])
                shape = tuple(int(dim) for dim in entry["shape"])
                count = 1
                for dim in shape:
                    count *= dim
                if end - begin != count * dtype.itemsize or 8 + length + end > size:
                    raise ValueError(f"tensor {key!r} does not fit its bytes")
                self._entries[key] = (dtype, shape, 8 + length + begin, end - begin)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{path} cannot be read as safetensors ({exc}); the "
                                  f"checkpoint is damaged or incomplete") from None

    def keys(self) -> set[str]:
        return set(self._entries)

    def get(self, key: str) -> torch.Tensor:
        """The tensor, read into memory of its own."""
        dtype, shape, offset, nbytes = self._entries[key]
        raw = torch.empty(nbytes, dtype=torch.uint8)
        with open(self.path, "rb") as file:
            file.seek(offset)
            if file.readinto(raw.numpy().data) != nbytes:
                raise CheckpointError(f"{self.path} ends inside tensor {key!r}; the checkpoint "
                                      f"is damaged")
        return raw.view(dtype).reshape(shape)


def fsync_path(path: str) -> None:
    """fsync a file or a folder by name (a folder's entries: files created, renamed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
