"""Quantized copies of an imported model's weights (`infinity import PATH --quantize int8`): which
tensors of the folder get one, and writing a form's copies into the model's namespace.

The format and the choice of tensors are `infinity.torch.quantize`'s (block-wise, symmetric,
scales in the weight's dtype; the linear layers' weights, the output projection's where it is
not tied to the input embeddings, not the embeddings or anything 1-D); the names in the
namespace and the manifest's record of each form are `model_store`'s contract. A form's record
names the output projection among its tensors ("output_projection"), so that generation can
leave it in full precision, as it does unless asked.

Memory: a tensor's codes go into the store through `Client.write_pieces`, as the import's
full-precision tensors do: each piece the store hands out (a stream chunk, or the tensor's own
slice) is filled with the codes of the rows it covers, quantized from those rows read from the
safetensors file with pread, `ROWS_BYTES` of source values at a time (in float32 while being
quantized, with a few temporaries of that size); the tensor's scales (1/64 of its codes' bytes
for int8 in bf16, 1/16 for int4) are gathered on the way and written after its codes. So the
importer holds a chunk of rows and one tensor's scales, never a tensor's codes or values. Each
chosen tensor's bytes are read from the file once more per form (the page cache usually still
has them); a file whose size or modification time changed since it was scanned is refused
(ModelFormatError), as the full-precision import refuses it.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

import torch

from infinity.client.client import Client
from infinity.errors import ModelFormatError
from infinity.torch.model_folder import ModelFolder, SourceFile, TensorEntry
from infinity.torch.quantize import BLOCK_SIZES, DTYPES, QuantizedWeight, codes_shape, quantize

ROWS_BYTES = 1 << 20  # source bytes quantized at once (at least one row)


def quantizable(folder: ModelFolder) -> tuple[list[TensorEntry], str | None]:
    """The tensors of `folder` that get quantized copies (see `infinity.torch.quantize`), in
    the order of their bytes, and the name of the output projection's weight among them (None
    where it has no copy: tied to the input embeddings, say)."""
    from infinity.torch.quantize import copied_weight_names

    chosen, head = copied_weight_names(folder.path, (t.name for t in folder.tensors))
    entries = [t for t in folder.tensors if t.name in chosen and len(t.shape) == 2
               and getattr(torch, t.dtype) in DTYPES and math.prod(t.shape) > 0]
    return entries, head if head in {e.name for e in entries} else None


class _RowCodes:
    """One tensor's codes, made row chunk by row chunk from its file as the store asks for
    consecutive pieces of them; its scales gathered meanwhile."""

    def __init__(self, fd: int, source: SourceFile, entry: TensorEntry, weight: QuantizedWeight,
                 progress: Callable[[int], None] | None) -> None:
        self.fd, self.source, self.entry, self.weight = fd, source, entry, weight
        self.progress = progress
        self.rows, self.n = entry.shape
        self.dtype = weight.dtype
        self.row_source_bytes = self.n * self.dtype.itemsize
        self.row_code_bytes = weight.codes_shape[-1]
        self.chunk_rows = max(1, ROWS_BYTES // self.row_source_bytes)
        self.scales = torch.empty(weight.scales_shape, dtype=self.dtype)
        self._first = 0
        self._codes = torch.empty(0, dtype=torch.uint8)  # of rows [_first, _first + count)

    def fill(self, piece: torch.Tensor, offset: int) -> None:
        done = 0
        while done < piece.numel():
            at = offset + done
            start = at - self._first * self.row_code_bytes
            if not 0 <= start < self._codes.numel():
                self._quantize_rows(at // self.row_code_bytes)
                start = at - self._first * self.row_code_bytes
            count = min(piece.numel() - done, self._codes.numel() - start)
            piece[done:done + count].copy_(self._codes[start:start + count])
            done += count

    def _quantize_rows(self, first: int) -> None:
        count = min(self.chunk_rows, self.rows - first)
        raw = torch.empty(count * self.row_source_bytes, dtype=torch.uint8)
        self._read(raw, self.entry.offset + first * self.row_source_bytes)
        codes, scales = quantize(raw.view(self.dtype).view(count, self.n), self.weight.form,
                                 self.weight.block)
        self.scales[first:first + count] = scales
        self._codes = codes.view(torch.uint8).reshape(-1)
        self._first = first

    def _read(self, out: torch.Tensor, offset: int) -> None:
        view = out.numpy().data.cast("B")
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise ModelFormatError(
                    f"{self.source.path} ended at byte {offset + done}, before the "
                    f"{self.source.size} bytes it had when the import began: it changed while "
                    f"being imported; import it again once it is complete")
            done += n
        if self.progress is not None:
            self.progress(done)


def write_form(client: Client, namespace: str, folder: ModelFolder, entries: list[TensorEntry],
               form: str, *, written: list[str], output_projection: str | None = None,
               progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Write the `form` copies of `entries` (from `quantizable`, with the `output_projection`
    it names) into `namespace`, appending each name to `written` before writing it (so a
    failure can take it back); returns the form's record for the manifest."""
    block = BLOCK_SIZES[form]
    sources = {source.name: source for source in folder.weights}
    stored_bytes = 0
    for entry in entries:
        source = sources[entry.file]
        weight = QuantizedWeight(entry.name, form, block, tuple(entry.shape),
                                 getattr(torch, entry.dtype))
        fd = os.open(source.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            rows = _RowCodes(fd, source, entry, weight, progress)
            written.append(weight.codes_name)
            client.write_pieces(weight.codes_name, torch.int8 if form == "int8" else torch.uint8,
                                codes_shape(form, weight.shape), rows.fill, namespace=namespace)
            info = os.fstat(fd)
        finally:
            os.close(fd)
        if info.st_size != source.size or info.st_mtime_ns != source.mtime_ns:
            raise ModelFormatError(
                f"{source.path} changed while being imported (size or modification time); "
                f"import it again once nothing writes it")
        written.append(weight.scales_name)
        client.write_from(weight.scales_name, rows.scales, namespace=namespace)
        stored_bytes += weight.nbytes
    return {"block": block, "scales_dtype": "the weight's", "tensors": [e.name for e in entries],
            "bytes": stored_bytes, "output_projection": output_projection}


def quantized_weights(manifest: dict[str, Any], form: str) -> dict[str, QuantizedWeight]:
    """The `form` copies a model's manifest lists, by the full-precision tensor's name (empty
    where it has none)."""
    record = (manifest.get("quantized") or {}).get(form)
    if not isinstance(record, dict):
        return {}
    tensors = manifest.get("tensors") or {}
    block = int(record["block"])
    found: dict[str, QuantizedWeight] = {}
    for name in record.get("tensors") or ():
        spec = tensors[name]
        found[name] = QuantizedWeight(name, form, block, tuple(spec["shape"]),
                                      getattr(torch, spec["dtype"]))
    return found
