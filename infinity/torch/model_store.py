"""Models imported into the store: `import_model` loads a Hugging Face model folder into a
namespace, tensor by tensor; `list_models`, `require_model`, `model_files` and
`write_model_files` read what was imported, for whoever builds the model from the store alone.

An imported model in namespace NAME is laid out so (a contract: streamed generation reads it):

- every tensor of the folder's safetensors files under its safetensors name, dtype and shape
  as in the file (bf16 stays bf16);
- every small file of the folder (config.json, generation_config.json, the tokenizer's files:
  see `model_folder`) as a 1-D uint8 tensor `__files__/<file name>`;
- with `quantize=("int8",)` (or "int4", or both), for each weight of the model's linear layers
  (`infinity.torch.quantize` says which, and why not the embeddings, a tied output projection
  or the norms) a block-wise quantized copy beside it: its codes `__int8__/<name>` (int8, the
  weight's shape) or `__int4__/<name>` (uint8, two codes a byte: the last dimension halved,
  rounded up), and its scales `__int8_scales__/<name>` or `__int4_scales__/<name>` (the
  weight's dtype, one per block of the last dimension: shape (rows, ceil(n / block)));
- `__model__`, a 1-D uint8 tensor of UTF-8 JSON, the manifest, written last, once everything
  else is durable: format version, source folder, per source file its size and CRC32C, per
  tensor its dtype, shape and file, the sum of tensor bytes, when and how long, and under
  "quantized" per form made its block size, the names of the tensors it has copies of, their
  bytes and which of them is the output projection's weight ("output_projection", null where
  none is: generation streams that one in full precision unless asked; `quantized_forms`,
  `require_quantized`). A namespace without it holds no
  complete imported model (`require_model` raises ModelNotFoundError).

The registry namespace `infinity.models` holds one small uint8 JSON tensor per model, named by
the model's namespace, so that listing models reads one namespace. It is written "importing"
before the first tensor (so a later import knows the leftovers of one that was killed are an
import's to clear) and "complete" after the manifest; it lists the quantized forms held, so that
`list_models` (and `infinity models`) shows them.

Memory: each tensor goes through `Client.write_pieces`, read from the file (pread, no memory
mapping) straight into the store's slices: with an NVMe tier, a tensor larger than a stream
chunk passes through the stream's few staging slices to NVMe, chunk by chunk; a smaller one,
or any without an NVMe tier, is read into its own slice of the CPU tier. The importer holds no
copy of a tensor: besides the interpreter, only the daemon's shared memory it fills and a
small read buffer. Small files (at most `MAX_SMALL_FILE_BYTES` each) are read whole. Quantized
copies are made from the file a chunk of rows at a time (`model_quantized`): the importer holds
that chunk, its temporaries and one tensor's scales.

Durability: with an NVMe tier, `flush_store` makes every tensor durable before the manifest is
put durable; so a kill at any moment leaves either no manifest or a complete model. (It
flushes the whole store, other clients' dirty tensors too: imports are rare, and one index
transaction is cheaper than one per tensor. A tensor under another client's exclusive lease
makes it report LeaseError; the import then checks its own tensors reached NVMe.) Without an
NVMe tier the model lives in the CPU tier only and the report says durable=False.

Skip: where the namespace's manifest lists the same files with the same sizes and CRC32C as
the folder, and the namespace still holds every tensor it lists (quantized copies included),
nothing is written, unless the import asks for a quantized form the namespace lacks: then only
that form's copies are written, after them a new manifest that lists them (replacing the old one
in one write: a kill leaves the old manifest, and copies it does not list), then the registry
entry. Forms are added, never taken away by a skip; a changed model is imported anew with the
forms asked for now. Adding needs a namespace the importer may write: not one sealed read-only
(the default) while the daemon that sealed it runs (ReadOnlyNamespaceError says what to do).

Read-only (the default): the namespace is created read-only before the first tensor and
sealed after the manifest, so no client writes it again, the importer included, while the
daemon runs (namespace records do not survive a restart of infinityd). A re-import of a
changed folder into a read-only namespace is refused with ReadOnlyNamespaceError saying to
import into another namespace (an unchanged one is skipped as always); so is an import into a
read-only namespace an earlier import left unfinished. With read_only=False (`--writable`), a
re-import of a changed folder replaces the model: its old manifest goes first, then its
tensors, then the new ones are written.

Failures: bad input is refused (ModelFormatError, naming the file) by `scan_model_folder`
before anything is written. A failure once writing began (a file changed meanwhile, a full
store, an interrupt) deletes what the import wrote and its registry entry, then re-raises; a
killed importer leaves tensors without a manifest and its registry entry "importing".
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from infinity.client.client import Client
from infinity.errors import (AlreadyExistsError, InfinityError, InvalidRequestError, LeaseError,
                             ModelFormatError, ModelNotFoundError, QuantizedFormNotFoundError,
                             ReadOnlyNamespaceError)
from infinity.io import crc32c
from infinity.torch.model_folder import (RESERVED_NAME, RESERVED_PREFIX, ModelFolder, SourceFile,
                                         SourceReader, TensorEntry, file_checksum,
                                         scan_model_folder)
from infinity.torch.model_quantized import quantizable, quantized_weights, write_form
from infinity.torch.quantize import FORMS, QuantizedWeight, check_form

MANIFEST_NAME = RESERVED_NAME  # "__model__"
FILES_PREFIX = RESERVED_PREFIX  # "__files__/"
REGISTRY_NAMESPACE = "infinity.models"
FORMAT_VERSION = 1
CHECKSUM = "crc32c"
DELETE_BATCH = 4096  # names per delete request
IMPORTING, COMPLETE = "importing", "complete"


@dataclass(frozen=True)
class ImportReport:
    """What `import_model` did."""

    namespace: str
    source: str  # the folder, absolute
    skipped: bool  # the folder was imported already, unchanged: nothing was written
    reason: str  # why it was skipped, or why (re)imported
    tensors: int
    tensor_bytes: int
    files: tuple[str, ...]  # the small files kept under __files__/
    left_out: tuple[str, ...]  # files of the folder not imported, each with why
    read_only: bool
    durable: bool  # on NVMe and in the store's index (False: the daemon has no NVMe tier)
    seconds: float
    quantized: tuple[str, ...] = ()  # the quantized forms the namespace holds now
    added: tuple[str, ...] = ()  # those of them this import wrote to an unchanged model


@dataclass(frozen=True)
class ModelInfo:
    """One model of the registry (`list_models`)."""

    namespace: str
    state: str  # "complete", "importing" (unfinished or under way) or "unreadable"
    source: str
    model_type: str
    architectures: tuple[str, ...]
    tensors: int
    tensor_bytes: int
    imported_at: float  # Unix time; 0 for one not complete
    read_only: bool
    durable: bool
    quantized: tuple[str, ...] = ()  # its quantized forms ("int8", "int4")

    @property
    def complete(self) -> bool:
        return self.state == COMPLETE


# --- reading what was imported -------------------------------------------------------------


def _read_bytes(client: Client, namespace: str, name: str, nbytes: int) -> bytes:
    out = torch.empty(nbytes, dtype=torch.uint8)
    client.read_into(name, out, namespace=namespace)
    return out.numpy().tobytes()


def _write_bytes(client: Client, namespace: str, name: str, data: bytes, *,
                 durable: bool = False) -> None:
    tensor = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
              else torch.empty(0, dtype=torch.uint8))
    client.write_from(name, tensor, namespace=namespace, durable=durable)


def _manifest_or_none(client: Client, namespace: str) -> dict[str, Any] | None:
    found = [t for t in client.list(namespace=namespace, prefix=MANIFEST_NAME)
             if t.name == MANIFEST_NAME]
    if not found:
        return None
    raw = _read_bytes(client, namespace, MANIFEST_NAME, found[0].nbytes)
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        manifest = None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("format_version"), int):
        raise ModelFormatError(
            f"the manifest {MANIFEST_NAME} of namespace {namespace!r} is not an import's JSON; "
            f"import the model again into a fresh namespace")
    if manifest["format_version"] > FORMAT_VERSION:
        raise ModelFormatError(
            f"namespace {namespace!r} was imported by a newer Infinity (manifest format "
            f"{manifest['format_version']}, this one reads up to {FORMAT_VERSION}); upgrade "
            f"infinity, or import the model again into another namespace")
    return manifest


def require_model(client: Client, namespace: str) -> dict[str, Any]:
    """The manifest of the model imported into `namespace` (see the module docstring);
    ModelNotFoundError, saying how to import one, where it holds no complete imported model."""
    manifest = _manifest_or_none(client, namespace)
    if manifest is None:
        unfinished = bool(client.list(namespace=namespace))
        why = ("holds tensors but no manifest: an import into it did not finish"
               if unfinished else "holds nothing")
        raise ModelNotFoundError(
            f"namespace {namespace!r} holds no complete imported model ({why}); import one with "
            f"`infinity import MODEL_FOLDER --namespace {namespace}`")
    return manifest


def quantized_forms(manifest: dict[str, Any]) -> tuple[str, ...]:
    """The quantized forms a model's manifest lists, in the order of `FORMS`."""
    held = manifest.get("quantized") or {}
    return tuple(form for form in FORMS if form in held)


def require_quantized(client: Client, namespace: str, form: str, *,
                      output_projection: bool = False) -> dict[str, QuantizedWeight]:
    """The `form` copies of the model imported into `namespace`, by the name of the tensor
    each copies, the output projection's left out unless `output_projection`;
    QuantizedFormNotFoundError, saying how to add them, where it has none (ModelNotFoundError
    where the namespace holds no complete model). With `output_projection`, an error where the
    form has no copy of it: InvalidRequestError where the model's is tied to its input
    embeddings (or is no linear layer), QuantizedFormNotFoundError where the copies were made
    before imports made one."""
    check_form(form)
    manifest = require_model(client, namespace)
    source = manifest.get("source") or "MODEL_FOLDER"
    if form not in quantized_forms(manifest):
        held = ", ".join(quantized_forms(manifest)) or "none"
        raise QuantizedFormNotFoundError(
            f"namespace {namespace!r} holds no {form} copy of its model (quantized forms held: "
            f"{held}); add one with `infinity import {source} --namespace {namespace} "
            f"--quantize {form}` (an unchanged model gets only the copy added), or generate "
            f"without quantization")
    copies = quantized_weights(manifest, form)
    record = manifest["quantized"][form]
    head = record.get("output_projection")
    if output_projection and head is None:
        if "output_projection" not in record:
            raise QuantizedFormNotFoundError(
                f"the {form} copies of namespace {namespace!r} were made by an import that gave "
                f"the output projection none; import the model into a new namespace (`infinity "
                f"import {source} --namespace NEW_NAME --quantize {form}`), or generate with "
                f"the output projection in full precision")
        raise InvalidRequestError(
            f"the model of namespace {namespace!r} has no output projection of its own (its "
            f"weight is the input embeddings', or it is no linear layer), so it has no {form} "
            f"copy; generate with the output projection in full precision")
    if not output_projection and head is not None:
        copies.pop(head, None)
    return copies


def model_files(client: Client, namespace: str) -> dict[str, bytes]:
    """The small files (config.json, tokenizer files, ...) of the model imported into
    `namespace`, by file name; ModelNotFoundError where it holds no complete model."""
    require_model(client, namespace)
    return {info.name[len(FILES_PREFIX):]: _read_bytes(client, namespace, info.name, info.nbytes)
            for info in client.list(namespace=namespace, prefix=FILES_PREFIX)}


def write_model_files(client: Client, namespace: str, folder: str | os.PathLike[str]) -> str:
    """Write the small files of the model imported into `namespace` into `folder` (made if
    need be), so that `AutoConfig.from_pretrained(folder)` and `AutoTokenizer.from_pretrained(
    folder)` work without the original folder; returns the folder's absolute path."""
    target = os.path.abspath(os.fspath(folder))
    files = model_files(client, namespace)
    os.makedirs(target, exist_ok=True)
    for name, data in files.items():
        if os.path.basename(name) != name or name in ("", ".", ".."):
            raise ModelFormatError(f"namespace {namespace!r} holds a file named {name[:80]!r}, "
                                   f"which is not a plain file name; import the model again")
        with open(os.path.join(target, name), "wb") as f:
            f.write(data)
    return target


def _model_info(namespace: str, raw: bytes) -> ModelInfo:
    try:
        entry = json.loads(raw.decode("utf-8"))
        if not isinstance(entry, dict):
            raise ValueError("not an object")
        return ModelInfo(namespace, str(entry.get("state", IMPORTING)),
                         str(entry.get("source", "")), str(entry.get("model_type") or ""),
                         tuple(str(a) for a in entry.get("architectures") or ()),
                         int(entry.get("tensors", 0)), int(entry.get("tensor_bytes", 0)),
                         float(entry.get("imported_at", 0.0)), bool(entry.get("read_only")),
                         bool(entry.get("durable")),
                         tuple(str(f) for f in entry.get("quantized") or ()))
    except (UnicodeDecodeError, ValueError, TypeError):
        return ModelInfo(namespace, "unreadable", "", "", (), 0, 0, 0.0, False, False)


def list_models(client: Client) -> list[ModelInfo]:
    """Every model of the registry, by namespace: complete ones and imports not finished."""
    return [_model_info(info.name, _read_bytes(client, REGISTRY_NAMESPACE, info.name, info.nbytes))
            for info in client.list(namespace=REGISTRY_NAMESPACE)]


# --- importing -----------------------------------------------------------------------------


class _Progress:
    """A rich progress bar of bytes on the terminal (stderr), or nothing where there is none."""

    def __init__(self, enabled: bool) -> None:
        self._bar: Any = None
        if enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                                       TimeRemainingColumn, TransferSpeedColumn)

            console = Console(stderr=True)
            if console.is_terminal:
                self._bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                     DownloadColumn(binary_units=True), TransferSpeedColumn(),
                                     TimeRemainingColumn(), console=console, transient=True)

    def __enter__(self) -> _Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def task(self, description: str, total: int) -> Callable[[int], None] | None:
        """A function to call with each number of bytes done, or None without a bar."""
        if self._bar is None:
            return None
        bar, task = self._bar, self._bar.add_task(description, total=total)
        return lambda n: bar.advance(task, n)


def _checksum_text(crc: int) -> str:
    return f"{crc:08x}"


def _first_change(client: Client, namespace: str, folder: ModelFolder, manifest: dict[str, Any],
                  progress: _Progress) -> str | None:
    """How the folder differs from what `manifest` recorded of it, or None where it does not
    (and the namespace still holds every tensor and file of it)."""
    recorded = manifest.get("files")
    if not isinstance(recorded, dict):
        return "the manifest lists no files"
    current = {source.name: source for source in folder.files}
    if set(recorded) != set(current):
        gone, new = sorted(set(recorded) - set(current)), sorted(set(current) - set(recorded))
        return f"the folder's files changed (new: {new or 'none'}, gone: {gone or 'none'})"
    for name, source in current.items():
        if not isinstance(recorded[name], dict) or recorded[name].get("bytes") != source.size:
            return f"{name} changed size"
    advance = progress.task("checking", sum(source.size for source in current.values()))
    for name, source in current.items():
        if recorded[name].get(CHECKSUM) != _checksum_text(file_checksum(source, progress=advance)):
            return f"{name} changed (its CRC32C differs)"
    held = {t.name for t in client.list(namespace=namespace)}
    wanted = set(manifest.get("tensors") or ()) | {
        FILES_PREFIX + source.name for source in folder.small_files}
    for form in quantized_forms(manifest):
        for weight in quantized_weights(manifest, form).values():
            wanted.update(weight.names)
    missing = sorted(wanted - held)
    if missing:
        return f"the namespace lost {len(missing)} of its tensors (e.g. {missing[0]!r})"
    return None


def _delete_all(client: Client, namespace: str, names: Sequence[str]) -> None:
    for start in range(0, len(names), DELETE_BATCH):
        client.delete(list(names[start:start + DELETE_BATCH]), namespace=namespace)


def _clear_namespace(client: Client, namespace: str, *, path: str, read_only: bool,
                     previous: dict[str, Any] | None, change: str) -> None:
    """Make `namespace` ready for a fresh import: refuse one that is not ours to change, delete
    what an earlier import left (its manifest first), and create it read-only if asked."""
    info = client.namespace_info(namespace)
    if info.mode == "read-only" and (info.sealed or info.owner_client != client.client_id):
        held = (f"the model imported from {previous.get('source')}" if previous is not None
                else "no complete model")
        why = "sealed" if info.sealed else "another client owns it"
        raise ReadOnlyNamespaceError(
            f"namespace {namespace!r} is read-only ({why}) and holds {held}, so nothing can be "
            f"imported into it while this infinityd runs ({change}); import {path} into another "
            f"namespace (infinity import {path} --namespace NEW_NAME)")
    if read_only and info.created and info.mode != "read-only":
        raise InvalidRequestError(
            f"namespace {namespace!r} was created read-write (by {info.owner_name!r}), so an "
            f"import cannot make it read-only; import with --writable (read_only=False), or "
            f"into another namespace")
    existing = [t.name for t in client.list(namespace=namespace)]
    if existing:
        if previous is None and not client.exists(namespace, namespace=REGISTRY_NAMESPACE):
            raise AlreadyExistsError(
                f"namespace {namespace!r} holds {len(existing)} tensors that are not an imported "
                f"model (e.g. {existing[0]!r}); import into another namespace, or delete them "
                f"first")
        if MANIFEST_NAME in existing:  # first: from here on it holds no complete model
            client.delete(MANIFEST_NAME, namespace=namespace)
        _delete_all(client, namespace, [n for n in existing if n != MANIFEST_NAME])
    if read_only and info.mode != "read-only":
        client.create_namespace(namespace, mode="read-only")


def _has_nvme_tier(client: Client) -> bool:
    return "nvme" in (client.stats().get("tiers") or {})


class _Import:
    """One import's writes, remembered so that a failure can take them back."""

    def __init__(self, client: Client, namespace: str, folder: ModelFolder, *, read_only: bool,
                 durable: bool, progress: _Progress, forms: tuple[str, ...] = ()) -> None:
        self.client = client
        self.namespace = namespace
        self.folder = folder
        self.read_only = read_only
        self.durable = durable
        self.progress = progress
        self.forms = forms
        self.written: list[str] = []
        self.registered = False
        self.checksums: dict[str, int] = {}
        self.quantized: dict[str, Any] = {}  # the manifest's record of each form written

    def _register(self, entry: dict[str, Any], *, durable: bool) -> None:
        self.registered = True
        _write_bytes(self.client, REGISTRY_NAMESPACE, self.namespace,
                     json.dumps(entry).encode(), durable=durable)

    def run(self, started: float) -> dict[str, Any]:
        """Write everything (see the module docstring for the order); returns the manifest."""
        folder = self.folder
        # Durable too: after a kill, the leftovers of this import must still read as an
        # import's (see `_clear_namespace`), not as someone's tensors to keep.
        self._register({"format_version": FORMAT_VERSION, "namespace": self.namespace,
                        "state": IMPORTING, "source": folder.path}, durable=self.durable)
        advance = self.progress.task(f"importing {os.path.basename(folder.path)}",
                                     sum(source.size for source in folder.files))
        by_file: dict[str, list[TensorEntry]] = {}
        for entry in folder.tensors:
            by_file.setdefault(entry.file, []).append(entry)
        for source in folder.weights:
            self._import_weights(source, by_file.get(source.name, []), advance)
        self._write_forms(self.forms)
        if folder.index is not None:
            self.checksums[folder.index.name] = file_checksum(folder.index, progress=advance)
        for source in folder.small_files:
            self._import_small_file(source, advance)
        if self.durable:
            self._flush()
        manifest = self._manifest(started)
        self.written.append(MANIFEST_NAME)
        _write_bytes(self.client, self.namespace, MANIFEST_NAME,
                     json.dumps(manifest, indent=1).encode(), durable=self.durable)
        self._register({**self._registry_entry(manifest), "state": COMPLETE},
                       durable=self.durable)
        if self.read_only:
            self.client.seal_namespace(self.namespace)
        return manifest

    def _import_weights(self, source: SourceFile, tensors: list[TensorEntry],
                        advance: Callable[[int], None] | None) -> None:
        with SourceReader(source, progress=advance) as reader:
            for entry in tensors:
                def fill(piece: torch.Tensor, offset: int, start: int = entry.offset) -> None:
                    reader.read_into(piece, start + offset)

                self.written.append(entry.name)  # before: a failure may leave it half-written
                self.client.write_pieces(entry.name, getattr(torch, entry.dtype), entry.shape,
                                         fill, namespace=self.namespace)
            self.checksums[source.name] = reader.finish()

    def _write_forms(self, forms: tuple[str, ...]) -> None:
        """The quantized copies of each form in `forms` (see `model_quantized`)."""
        if not forms:
            return
        entries, head = quantizable(self.folder)
        for form in forms:
            advance = self.progress.task(f"quantizing to {form}",
                                         sum(entry.nbytes for entry in entries))
            self.quantized[form] = write_form(self.client, self.namespace, self.folder, entries,
                                              form, written=self.written,
                                              output_projection=head, progress=advance)

    def add_forms(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Add the copies of `self.forms` to the unchanged model whose manifest is `manifest`
        (see the module docstring's skip); returns the new manifest."""
        self._write_forms(self.forms)
        if self.durable:
            self._flush()
        manifest = {**manifest, "quantized": {**(manifest.get("quantized") or {}),
                                              **self.quantized}}
        # One write replaces the old manifest: a kill before it leaves the old one, whose
        # model is complete without these copies.
        _write_bytes(self.client, self.namespace, MANIFEST_NAME,
                     json.dumps(manifest, indent=1).encode(), durable=self.durable)
        self.written.clear()  # the copies are the model's now: a failure from here keeps them
        _write_bytes(self.client, REGISTRY_NAMESPACE, self.namespace,
                     json.dumps({**self._registry_entry(manifest), "state": COMPLETE}).encode(),
                     durable=self.durable)
        return manifest

    def _import_small_file(self, source: SourceFile, advance: Callable[[int], None] | None) -> None:
        with open(source.path, "rb") as f:
            data = f.read(source.size + 1)
        if len(data) != source.size:
            raise ModelFormatError(f"{source.path} changed while being imported (it was "
                                   f"{source.size} bytes, now {len(data)}); import it again")
        self.checksums[source.name] = crc32c(data)
        name = FILES_PREFIX + source.name
        self.written.append(name)
        _write_bytes(self.client, self.namespace, name, data)
        if advance is not None:
            advance(len(data))

    def _flush(self) -> None:
        """Every tensor written durable (see the module docstring on LeaseError)."""
        try:
            self.client.flush_store()
        except LeaseError:
            # Another client's exclusive lease somewhere in the store; the rest was flushed.
            on_nvme = {t.name for t in self.client.list(namespace=self.namespace)
                       if t.tier != "cpu"}
            if not set(self.written) <= on_nvme:
                raise

    def _manifest(self, started: float) -> dict[str, Any]:
        folder = self.folder
        return {
            "format": "infinity-model", "format_version": FORMAT_VERSION,
            "namespace": self.namespace, "source": folder.path, "checksum": CHECKSUM,
            "files": {source.name: {"kind": source.kind, "bytes": source.size,
                                    CHECKSUM: _checksum_text(self.checksums[source.name])}
                      for source in folder.files},
            "tensors": {t.name: {"dtype": t.dtype, "shape": list(t.shape), "file": t.file}
                        for t in folder.tensors},
            "tensor_count": len(folder.tensors), "tensor_bytes": folder.tensor_bytes,
            "model_type": folder.config.get("model_type"),
            "architectures": folder.config.get("architectures"),
            "left_out": list(folder.left_out), "read_only": self.read_only,
            "durable": self.durable, "imported_at": time.time(),
            "import_seconds": round(time.monotonic() - started, 3),
            "quantized": self.quantized,
        }

    def _registry_entry(self, manifest: dict[str, Any]) -> dict[str, Any]:
        keys = ("format_version", "namespace", "source", "model_type", "architectures",
                "tensor_bytes", "read_only", "durable", "imported_at")
        return {**{key: manifest[key] for key in keys}, "tensors": manifest["tensor_count"],
                "quantized": list(quantized_forms(manifest))}

    def undo(self) -> None:
        """Take back what was written (best effort: the daemon may be what failed)."""
        written = set(self.written)
        try:
            _delete_all(self.client, self.namespace,
                        [t.name for t in self.client.list(namespace=self.namespace)
                         if t.name in written])
        except InfinityError:
            pass
        if self.registered:
            try:
                self.client.delete(self.namespace, namespace=REGISTRY_NAMESPACE)
            except InfinityError:
                pass


def import_model(client: Client, path: str | os.PathLike[str], *, namespace: str,
                 read_only: bool = True, progress: bool = True,
                 quantize: Sequence[str] = ()) -> ImportReport:
    """Import the Hugging Face model folder `path` (config.json and safetensors weights,
    sharded or not) into `namespace`, tensor by tensor, with bounded memory; see the module
    docstring for the layout, the skip, read-only and what a failure leaves. progress: a bar
    on the terminal. quantize: the quantized forms to keep beside the weights ("int8", "int4";
    none by default); an unchanged model imported before gets those it lacks added. Raises
    ModelFormatError for a folder that cannot be imported (nothing is written then),
    ReadOnlyNamespaceError for a changed model, or a form to add, into a read-only namespace."""
    started = time.monotonic()
    if namespace == REGISTRY_NAMESPACE:
        raise InvalidRequestError(f"namespace {REGISTRY_NAMESPACE!r} is the registry of imported "
                                  f"models; import into a namespace of the model's own")
    if isinstance(quantize, str):
        quantize = (quantize,)
    forms = tuple(form for form in FORMS if form in {check_form(f) for f in quantize})
    folder = scan_model_folder(path)
    durable = _has_nvme_tier(client)
    with _Progress(progress) as bar:
        previous = _manifest_or_none(client, namespace)
        change = "never imported here"
        if previous is not None:
            found = _first_change(client, namespace, folder, previous, bar)
            if found is None:
                held = quantized_forms(previous)
                missing = tuple(form for form in forms if form not in held)
                if missing:
                    return _add_forms(client, namespace, folder, previous, missing,
                                      progress=bar, started=started)
                info = client.namespace_info(namespace)
                return ImportReport(
                    namespace, folder.path, True, "unchanged since its import",
                    len(folder.tensors), folder.tensor_bytes,
                    tuple(s.name for s in folder.small_files), folder.left_out,
                    info.mode == "read-only", bool(previous.get("durable")),
                    time.monotonic() - started, held)
            change = found
        _clear_namespace(client, namespace, path=folder.path, read_only=read_only,
                         previous=previous, change=change)
        work = _Import(client, namespace, folder, read_only=read_only, durable=durable,
                       progress=bar, forms=forms)
        try:
            work.run(started)
        except BaseException:
            work.undo()
            raise
    return ImportReport(namespace, folder.path, False, change, len(folder.tensors),
                        folder.tensor_bytes, tuple(s.name for s in folder.small_files),
                        folder.left_out, read_only, durable, time.monotonic() - started, forms)


def _add_forms(client: Client, namespace: str, folder: ModelFolder, manifest: dict[str, Any],
               forms: tuple[str, ...], *, progress: _Progress, started: float) -> ImportReport:
    """Write the quantized `forms` of the unchanged model of `namespace` that it lacks."""
    info = client.namespace_info(namespace)
    if info.mode == "read-only" and (info.sealed or info.owner_client != client.client_id):
        why = "sealed" if info.sealed else "another client owns it"
        raise ReadOnlyNamespaceError(
            f"namespace {namespace!r} is read-only ({why}): it holds the model imported from "
            f"{folder.path} without its {' and '.join(forms)} copies, and nothing can be added "
            f"to it while this infinityd runs; import the model with --quantize "
            f"{','.join(forms)} into another namespace (infinity import {folder.path} "
            f"--namespace NEW_NAME --quantize {','.join(forms)}), or into a --writable one")
    durable = bool(manifest.get("durable")) and _has_nvme_tier(client)
    work = _Import(client, namespace, folder, read_only=info.mode == "read-only",
                   durable=durable, progress=progress, forms=forms)
    try:
        manifest = work.add_forms(manifest)
    except BaseException:
        work.undo()
        raise
    return ImportReport(namespace, folder.path, False,
                        f"unchanged since its import; added its {' and '.join(forms)} copies",
                        len(folder.tensors), folder.tensor_bytes,
                        tuple(s.name for s in folder.small_files), folder.left_out,
                        info.mode == "read-only", durable, time.monotonic() - started,
                        quantized_forms(manifest), forms)
