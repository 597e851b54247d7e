"""A Hugging Face model folder on disk, as an import reads it: which files it has, every tensor of
its safetensors files (checked against the file before a byte is stored), and the files read
front to back with their CRC32C.

`scan_model_folder(path)` finds config.json, the safetensors weights (the shards an index
`model.safetensors.index.json` names, or every `*.safetensors` file where there is no index),
and the folder's small files (config, generation config, tokenizer files: every other file of
the folder up to `MAX_SMALL_FILE_BYTES`, weights in other formats left out). It parses each
safetensors header itself (8 bytes of little-endian header length, a JSON header, the data),
so it needs neither the safetensors package nor a memory mapping of the file, and refuses
with `ModelFormatError`, naming the file, a header that is not valid, a file shorter than its
header says, a shard the index names that is missing, a tensor the index places in a shard
that does not hold it. So every refusal of bad input comes before anything is stored.

`SourceReader` then reads one weights file front to back into the pieces the store hands out
(`Client.write_pieces`), accumulating the CRC32C of every byte of the file on the way, so an
import reads each file once and holds no more of it than the piece being filled. CRC32C is the
store's own checksum (the native, SSE4.2 one of `infinity.io`): several GB/s on one core, a
few times zlib's CRC32 and far faster than a cryptographic hash, and an import only needs to
notice a changed file, not resist a forged one.

Pure file work: no client, no daemon.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from typing import Any, Callable, NoReturn

import torch

from infinity.errors import InfinityError, ModelFormatError
from infinity.io import crc32c
from infinity.protocol import dtypes
from infinity.torch.quantize import RESERVED_PREFIXES as QUANTIZED_PREFIXES

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_SUFFIX = ".safetensors"
MODEL_WEIGHTS_FILE = "model.safetensors"
# Weights in other formats: never stored as small files (an import takes safetensors only).
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf",
                         ".pkl", ".npz", ".npy", ".ot", ".tflite", ".index.json")
# A small file larger than this is left out (and named in the import's report): tokenizer.json
# of the largest vocabularies is some tens of MB.
MAX_SMALL_FILE_BYTES = 64 << 20
# The safetensors format refuses headers past 100 MB; so does this reader, before allocating.
MAX_HEADER_BYTES = 100_000_000
READ_BYTES = 8 << 20  # one read(2) at most: a piece's progress shows while a large one fills
# The names an import keeps for itself in a model's namespace (see `model_store`; the quantized
# copies' prefixes are `quantize`'s).
RESERVED_NAME = "__model__"
RESERVED_PREFIX = "__files__/"

# safetensors dtype -> the store's dtype name
SAFETENSORS_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
    "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16",
    "BF16": "bfloat16", "F32": "float32", "F64": "float64", "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}

RESAVE = "save the model again (model.save_pretrained(folder)) or copy the file anew"


@dataclass(frozen=True)
class SourceFile:
    """One file of the folder that an import reads."""

    name: str  # its name in the folder
    path: str
    size: int
    mtime_ns: int
    kind: str  # "weights" | "index" | "small"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes are and what they are."""

    name: str
    dtype: str  # the store's name for it (`SAFETENSORS_DTYPES`)
    shape: tuple[int, ...]
    file: str  # the weights file's name in the folder
    offset: int  # of its first byte in the file
    nbytes: int


@dataclass(frozen=True)
class ModelFolder:
    """What `scan_model_folder` found: the files to read and every tensor, checked."""

    path: str  # absolute
    weights: tuple[SourceFile, ...]
    index: SourceFile | None
    small_files: tuple[SourceFile, ...]  # config.json, tokenizer files, ...
    tensors: tuple[TensorEntry, ...]  # file by file, each file's in the order of their bytes
    left_out: tuple[str, ...]  # files of the folder not imported, each with why
    config: dict[str, Any]  # config.json

    @property
    def files(self) -> tuple[SourceFile, ...]:
        """Every file whose checksum the import records."""
        return self.weights + ((self.index,) if self.index else ()) + self.small_files

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _source_file(folder: str, name: str, kind: str) -> SourceFile:
    path = os.path.join(folder, name)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ModelFormatError(f"{path} is missing; {RESAVE}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ModelFormatError(f"{path} is not a regular file; {RESAVE}")
    return SourceFile(name, path, info.st_size, info.st_mtime_ns, kind)


def _plain_file_name(name: Any, where: str) -> str:
    """A file name an index may give: a name in the same folder, nothing else."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name
            or "\x00" in name):
        raise ModelFormatError(f"{where} names {str(name)[:80]!r} as a shard, which is not a "
                               f"file name in the same folder; {RESAVE}")
    return name


def scan_model_folder(path: str | os.PathLike[str]) -> ModelFolder:
    """Every file and tensor an import of the folder `path` reads, all checked (see the module
    docstring); ModelFormatError, naming the file, for anything that cannot be imported."""
    folder = os.path.abspath(os.fspath(path))
    if not os.path.isdir(folder):
        raise ModelFormatError(f"{folder} is not a folder; pass the folder a model was saved into "
                               f"with save_pretrained (config.json and *.safetensors)")
    if not os.path.isfile(os.path.join(folder, CONFIG_FILE)):
        raise ModelFormatError(
            f"{folder} has no {CONFIG_FILE}, so the model could not be built from the store; "
            f"save it with model.save_pretrained({folder!r}), which writes one")
    config = _read_config(os.path.join(folder, CONFIG_FILE))
    names = sorted(os.listdir(folder))
    index: SourceFile | None = None
    weight_map: dict[str, str] | None = None
    if INDEX_FILE in names:
        index = _source_file(folder, INDEX_FILE, "index")
        weight_map = _read_weight_map(index)
        weight_names = sorted(set(weight_map.values()))
    elif MODEL_WEIGHTS_FILE in names:
        # transformers' own name: other safetensors beside it are not the model's weights (a
        # training checkpoint's optimizer.safetensors, an adapter's).
        weight_names = [MODEL_WEIGHTS_FILE]
    else:
        weight_names = [n for n in names if n.endswith(WEIGHTS_SUFFIX)]
    if not weight_names:
        others = [n for n in names if n.endswith(OTHER_WEIGHT_SUFFIXES)]
        hint = (f" (it has {', '.join(others[:3])}: load the model and save it again with "
                f"save_pretrained(folder, safe_serialization=True))" if others else "")
        raise ModelFormatError(f"{folder} holds no *.safetensors weights{hint}; an import reads "
                               f"safetensors only")
    weights = tuple(_source_file(folder, name, "weights") for name in weight_names)
    tensors: list[TensorEntry] = []
    found: dict[str, str] = {}  # tensor name -> file
    for source in weights:
        for entry in read_safetensors_header(source):
            if entry.name in found:
                raise ModelFormatError(f"tensor {entry.name!r} is in both {found[entry.name]} and "
                                       f"{source.name} of {folder}; {RESAVE}")
            found[entry.name] = source.name
            tensors.append(entry)
    if weight_map is not None:
        for name, shard in weight_map.items():
            if found.get(name) != shard:
                raise ModelFormatError(
                    f"{index.path if index else INDEX_FILE} places tensor {name[:200]!r} in "
                    f"{shard}, which does not hold it; {RESAVE}")
    small: list[SourceFile] = []
    left_out: list[str] = []
    chosen = set(weight_names) | {INDEX_FILE}
    for name in names:
        if name in chosen or name.startswith("."):
            continue
        full = os.path.join(folder, name)
        if not os.path.isfile(full):
            continue  # sub-folders (checkpoints, caches) are not part of the model
        if name.endswith(WEIGHTS_SUFFIX):  # only where an index or model.safetensors is
            named_by = INDEX_FILE if index is not None else MODEL_WEIGHTS_FILE
            left_out.append(f"{name} (not the model's weights: {named_by} is)")
            continue
        if name.endswith(OTHER_WEIGHT_SUFFIXES):
            left_out.append(f"{name} (weights of another format)")
            continue
        source = _source_file(folder, name, "small")
        if source.size > MAX_SMALL_FILE_BYTES:
            left_out.append(f"{name} ({source.size} bytes, over {MAX_SMALL_FILE_BYTES})")
            continue
        small.append(source)
    return ModelFolder(folder, weights, index, tuple(small), tuple(tensors), tuple(left_out),
                       config)


def _read_json(path: str) -> Any:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"{path} is not a readable JSON file ({exc}); {RESAVE}") from None


def _read_config(path: str) -> dict[str, Any]:
    config = _read_json(path)
    if not isinstance(config, dict):
        raise ModelFormatError(f"{path} is not a JSON object, so it is no model config; {RESAVE}")
    return config


def _read_weight_map(index: SourceFile) -> dict[str, str]:
    document = _read_json(index.path)
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelFormatError(f"{index.path} has no \"weight_map\" of tensor names to shard "
                               f"files; {RESAVE}")
    shards = {}
    for name, shard in weight_map.items():
        shards[name] = _plain_file_name(shard, index.path)
    for shard in set(shards.values()):
        if not os.path.isfile(os.path.join(os.path.dirname(index.path), shard)):
            raise ModelFormatError(
                f"shard {shard} that {index.path} names is missing from "
                f"{os.path.dirname(index.path)}; copy the missing shard there, or {RESAVE}")
    return shards


def read_safetensors_header(source: SourceFile) -> list[TensorEntry]:
    """The tensors of one safetensors file, in the order of their bytes, each checked against
    the file: ModelFormatError, naming the file, for a header that is not valid or data that
    is shorter than the header says."""
    path = source.path
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelFormatError(
                f"{path} is {source.size} bytes, too short to be a safetensors file (8 bytes of "
                f"header length, then the header); it is truncated: {RESAVE}")
        header_bytes = int.from_bytes(head, "little")
        if header_bytes > min(MAX_HEADER_BYTES, source.size - 8):
            raise ModelFormatError(
                f"{path} is not a valid safetensors file: its first 8 bytes give a header of "
                f"{header_bytes} bytes, but the file holds {source.size - 8} after them (at most "
                f"{MAX_HEADER_BYTES} allowed); it is corrupted or truncated: {RESAVE}")
        raw = f.read(header_bytes)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ModelFormatError(f"{path} is not a valid safetensors file: its header is not UTF-8 "
                               f"JSON; it is corrupted: {RESAVE}") from None
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path} is not a valid safetensors file: its header is not a JSON "
                               f"object; it is corrupted: {RESAVE}")
    data_start = 8 + header_bytes
    data_bytes = source.size - data_start
    entries: list[tuple[int, TensorEntry]] = []
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        begin, entry = _entry(source, name, spec, data_start)
        entries.append((begin, entry))
    entries.sort(key=lambda pair: pair[0])
    end = 0
    for begin, entry in entries:
        if begin < end:
            raise ModelFormatError(f"{path} is not a valid safetensors file: the bytes of tensor "
                                   f"{entry.name[:200]!r} overlap another's; {RESAVE}")
        end = begin + entry.nbytes
    if end > data_bytes:
        raise ModelFormatError(
            f"{path} is truncated: its header says it holds {end} bytes of tensor data, but "
            f"only {max(data_bytes, 0)} follow the header ({end - max(data_bytes, 0)} bytes "
            f"short); {RESAVE}")
    return [entry for _, entry in entries]


def _entry(source: SourceFile, name: str, spec: Any, data_start: int) -> tuple[int, TensorEntry]:
    """One header entry, checked: (its first byte relative to the data, the entry)."""
    bad = f"{source.path} is not a valid safetensors file: tensor {name[:200]!r}"
    if not name or len(name) > 1024 or "\x00" in name:
        raise ModelFormatError(f"{bad} has a name the store cannot hold (1 to 1024 characters, "
                               f"no NUL); rename it and save the model again")
    if name == RESERVED_NAME or name.startswith((RESERVED_PREFIX, *QUANTIZED_PREFIXES)):
        kept = ", ".join(f"{prefix}*" for prefix in (RESERVED_PREFIX, *QUANTIZED_PREFIXES))
        raise ModelFormatError(f"{bad} has a name an import keeps for itself ({RESERVED_NAME}, "
                               f"{kept}); rename it and save the model again")
    if not isinstance(spec, dict):
        raise ModelFormatError(f"{bad} is described by {type(spec).__name__}, not an object; "
                               f"{RESAVE}")
    dtype = SAFETENSORS_DTYPES.get(spec.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise ModelFormatError(f"{bad} has dtype {str(spec.get('dtype'))[:40]!r}, which the store "
                               f"does not hold (it holds {', '.join(SAFETENSORS_DTYPES)}); convert "
                               f"the model to one of those and save it again")
    shape, offsets = spec.get("shape"), spec.get("data_offsets")
    if (not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape)
            or not isinstance(offsets, list) or len(offsets) != 2
            or not all(type(o) is int and o >= 0 for o in offsets) or offsets[0] > offsets[1]):
        raise ModelFormatError(f"{bad} has a shape or data_offsets that are not valid; {RESAVE}")
    try:
        nbytes = dtypes.tensor_nbytes(dtype, tuple(shape))
    except InfinityError as exc:
        raise ModelFormatError(f"{bad}: {exc}") from None
    if offsets[1] - offsets[0] != nbytes:
        raise ModelFormatError(f"{bad} of {dtype}{shape} needs {nbytes} bytes, but its "
                               f"data_offsets span {offsets[1] - offsets[0]}; {RESAVE}")
    return offsets[0], TensorEntry(name, dtype, tuple(shape), source.name,
                                   data_start + offsets[0], nbytes)


class SourceReader:
    """One file read front to back into pieces the caller hands in, in order of their offsets;
    the bytes before, between and after them are read too, so `finish` returns the CRC32C of
    the whole file having read each byte once. Refuses (ModelFormatError) a file that ends
    early or changed since it was scanned. `progress(n)`, if given, hears of every n bytes
    read."""

    def __init__(self, source: SourceFile, *,
                 progress: Callable[[int], None] | None = None) -> None:
        self.source = source
        self._progress = progress
        self._fd = os.open(source.path, os.O_RDONLY | os.O_CLOEXEC)
        self._position = 0
        self._crc = 0
        self._scratch: bytearray | None = None

    def __enter__(self) -> SourceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def read_into(self, piece: torch.Tensor, offset: int) -> None:
        """Fill `piece` (flat uint8, contiguous, CPU) with the file's bytes from `offset` on."""
        self._skip_to(offset)
        view = piece.numpy().data.cast("B")  # the piece itself: preadv fills it in place
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:done + READ_BYTES]], offset + done)
            if n <= 0:
                self._ended_early(offset + done)
            done += n
            if self._progress is not None:
                self._progress(n)
        self._crc = crc32c(piece, self._crc)
        self._position = offset + done

    def _skip_to(self, offset: int) -> None:
        """Read the bytes up to `offset` for the checksum alone (headers and any gaps)."""
        if offset < self._position:
            raise ValueError(f"pieces of {self.source.path} must come in order of their offsets")
        if self._scratch is None and offset > self._position:
            self._scratch = bytearray(min(READ_BYTES, max(offset - self._position, 64 << 10)))
        while self._position < offset:
            assert self._scratch is not None
            view = memoryview(self._scratch)[:min(len(self._scratch), offset - self._position)]
            n = os.preadv(self._fd, [view], self._position)
            if n <= 0:
                self._ended_early(self._position)
            self._crc = crc32c(view[:n], self._crc)
            self._position += n
            if self._progress is not None:
                self._progress(n)

    def _ended_early(self, at: int) -> NoReturn:
        raise ModelFormatError(
            f"{self.source.path} ended at byte {at}, before the {self.source.size} bytes it had "
            f"when the import began: it changed while being imported; import it again once it "
            f"is complete")

    def finish(self) -> int:
        """Read what is left, check the file did not change, and return its CRC32C."""
        self._skip_to(self.source.size)
        info = os.fstat(self._fd)
        if info.st_size != self.source.size or info.st_mtime_ns != self.source.mtime_ns:
            raise ModelFormatError(
                f"{self.source.path} changed while being imported (size or modification time); "
                f"import it again once nothing writes it")
        return self._crc


def file_checksum(source: SourceFile, *, progress: Callable[[int], None] | None = None) -> int:
    """The CRC32C of a whole file, as `SourceReader.finish` gives it."""
    with SourceReader(source, progress=progress) as reader:
        return reader.finish()
