"""Checkpoints: the whole training state of an offloaded model in a folder, streamed tensor by tensor.

`save_checkpoint(path, model, optimizer, scheduler)` writes

    config.json, generation_config.json   (a transformers model: its config, as save_pretrained)
    model.safetensors                      (the parameters by the model's names, tied ones once,
                                            and the persistent buffers; or model-0000i-of-0000n
                                            shards and model.safetensors.index.json)
    optimizer.safetensors                  (per parameter `<name>.exp_avg`, `.exp_avg_sq`,
                                            `.master` where kept, `.previous` with the delayed
                                            update; sharded the same way)
    infinity_checkpoint.json               (the parameters' names, dtypes and shapes, the
                                            optimizer's step counts, groups and step() calls,
                                            the scheduler's state_dict)

so `transformers` `from_pretrained(path)` loads the weights as it loads its own, and
`load_checkpoint(path, model, optimizer, scheduler)` puts the whole state back into the model's
namespace (a fresh one, or the same) and returns the number of steps taken: training goes on with
exactly the losses of a run that did not stop.

Every tensor goes between the store and its file on its own (`read_into` into a map of its bytes
in the file, `write_from` from one tensor read back with plain reads), so the process never holds
more than one tensor, whatever the model's size; a state over a GiB shows a rich progress bar. The optimizer's
steps still running in the daemon are waited for first, and nothing else changes: the run goes on
as if it had not been saved.

A save is crash-safe: it writes a new sibling folder `.<name>.partial-<pid>`, fsyncs each file and
the folder, and then swaps it with the previous checkpoint in one `renameat2(RENAME_EXCHANGE)`
(a plain rename when there is none) before deleting the old one. A kill at any point leaves the
previous checkpoint whole under its name (leftover partial folders are removed by the next save).
A folder that is not a checkpoint is never replaced. Loading checks what the folder holds against
the model and the optimizer first and raises `CheckpointError` saying what differs, before it
writes anything.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import errno
import json
import os
import shutil
from typing import Any, Callable, Iterator

import torch
from torch import nn

from infinity.errors import CheckpointError
from infinity.torch.offload import OffloadState, offload_state
from infinity.torch.optim import StoredParameter, _StoreAdam
from infinity.torch.restart import plain_groups
from infinity.torch.safetensors_files import (FileTensor, TensorFile, fsync_path, plan_shards,
                                              write_file, write_index)

__all__ = ["load_checkpoint", "save_checkpoint"]

STATE_FILE = "infinity_checkpoint.json"
FORMAT = 1
MAX_SHARD_BYTES = 5 * 10**9  # transformers' default shard size
PROGRESS_BYTES = 1 << 30     # a save or load of more shows a progress bar (progress=None)
_OPTIMIZER_TENSORS = ("exp_avg", "exp_avg_sq", "master")


# --- saving --------------------------------------------------------------------------------


def save_checkpoint(path: str | os.PathLike[str], model: nn.Module, optimizer: Any,
                    scheduler: Any = None, *, max_shard_bytes: int = MAX_SHARD_BYTES,
                    progress: bool | None = None) -> None:
    """Write the training state of `model` (given to `infinity.torch.offload`), `optimizer`
    (an `infinity.torch.Adam` / `AdamW` over its parameters) and `scheduler` (any object with
    `state_dict()` of plain values, or None) into the folder `path`, replacing the checkpoint
    there, crash-safe (see the module's docstring). `progress`: a progress bar (None: when the
    state is over a GiB)."""
    state, stored = _check_pair(model, optimizer)
    optimizer.wait_for_daemon()  # what the steps sent write, without changing what comes next
    target = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(target)
    if os.path.exists(target) and not _is_checkpoint(target) and os.listdir(target):
        raise CheckpointError(
            f"{target} exists and is not a checkpoint (it has no {STATE_FILE}); save_checkpoint "
            f"replaces only a checkpoint: choose another path or empty that folder")
    _remove_leftovers(parent, name)
    partial = os.path.join(parent, f".{name}.partial-{os.getpid()}")
    os.makedirs(partial)
    current = {parameter.name: parameter.current for parameter in stored}
    model_tensors, described = _model_tensors(model, state, current)
    optimizer_tensors = _optimizer_tensors(state, stored)
    document = {
        "format": FORMAT,
        "model": {"class": type(model).__name__, "prefix": state.config.prefix,
                  "parameters": described},
        "optimizer": _optimizer_document(optimizer, state, stored),
        "scheduler": _scheduler_state(scheduler),
    }
    files = {"model": plan_shards("model", model_tensors, max_shard_bytes),
             "optimizer": plan_shards("optimizer", optimizer_tensors, max_shard_bytes)}
    total = sum(t.nbytes for t in model_tensors + optimizer_tensors)
    _save_config(model, partial, state)
    with _progress_bar(f"saving {name}", total, progress) as advance:
        for stem, planned in files.items():
            for file_name, tensors in planned:
                write_file(os.path.join(partial, file_name), tensors, advance=advance)
            if len(planned) > 1:
                write_index(os.path.join(partial, f"{stem}.safetensors.index.json"), planned)
    with open(os.path.join(partial, STATE_FILE), "w") as out:  # last: it marks a checkpoint
        json.dump(document, out, indent=1)
        out.flush()
        os.fsync(out.fileno())
    fsync_path(partial)
    _put_in_place(partial, target)
    fsync_path(parent)


def _check_pair(model: nn.Module, optimizer: Any) -> tuple[OffloadState, list[StoredParameter]]:
    """The model's offload state and the optimizer's parameters, all of them the model's."""
    state = offload_state(model)
    if not isinstance(optimizer, _StoreAdam):
        raise CheckpointError(
            f"the optimizer is {type(optimizer).__name__}; checkpoints hold the state of "
            f"infinity.torch.Adam / AdamW, whose state is in the store")
    stored = optimizer.stored_parameters()
    if any(parameter.state is not state for parameter in stored):
        raise CheckpointError(
            "the optimizer holds parameters of another offloaded module than this model's; a "
            "checkpoint holds one model and its optimizer: save each model with its own")
    return state, stored


def _model_name(state: OffloadState, stored_name: str) -> str:
    return stored_name[len(state.config.prefix):]


def _stored_tensor(state: OffloadState, key: str, stored_name: str,
                   listing: dict[str, Any]) -> FileTensor:
    """A tensor of the file filled from the store's `stored_name`."""
    info = listing.get(stored_name)
    if info is None:
        raise CheckpointError(f"the store holds no {stored_name!r} in namespace "
                              f"{state.config.namespace!r}; it is part of the training state")
    client, namespace = state.client, state.config.namespace

    def fill(out: torch.Tensor) -> None:
        client.read_into(stored_name, out, namespace=namespace)

    return FileTensor(key, info.dtype, tuple(info.shape), int(info.nbytes), fill)


def _model_tensors(model: nn.Module, state: OffloadState, current: dict[str, str]
                   ) -> tuple[list[FileTensor], dict[str, dict[str, Any]]]:
    """The model file's tensors (each parameter's newest values from the store, `current`
    naming the copy that holds them where the optimizer keeps two; the persistent buffers from
    the module) and the parameters' description for the state file."""
    listing = _listing(state)
    tensors: list[FileTensor] = []
    described: dict[str, dict[str, Any]] = {}
    for entry in state.params:
        key = _model_name(state, entry.name)
        tensor = _stored_tensor(state, key, current.get(entry.name, entry.read_name), listing)
        tensors.append(tensor)
        described[key] = {"dtype": tensor.dtype, "shape": list(tensor.shape)}
    for key, buffer in _persistent_buffers(model):
        value = buffer.detach().to("cpu").contiguous()

        def fill(out: torch.Tensor, value: torch.Tensor = value) -> None:
            out.copy_(value.reshape(-1).view(torch.uint8))

        dtype = str(value.dtype).removeprefix("torch.")
        tensors.append(FileTensor(key, dtype, tuple(value.shape),
                                  value.numel() * value.element_size(), fill))
    return tensors, described


def _optimizer_tensors(state: OffloadState, stored: list[StoredParameter]) -> list[FileTensor]:
    listing = _listing(state)
    tensors = []
    for parameter in stored:
        key = _model_name(state, parameter.name)
        for role in _OPTIMIZER_TENSORS:
            if parameter.names[role]:
                tensors.append(_stored_tensor(state, f"{key}.{role}", parameter.names[role],
                                              listing))
        if parameter.previous:
            tensors.append(_stored_tensor(state, f"{key}.previous", parameter.previous, listing))
    return tensors


def _optimizer_document(optimizer: Any, state: OffloadState,
                        stored: list[StoredParameter]) -> dict[str, Any]:
    names = {id(p.param): _model_name(state, p.name) for p in stored}
    groups = plain_groups(optimizer.param_groups)
    for group, values in zip(optimizer.param_groups, groups):
        values["params"] = [names[id(param)] for param in group["params"]]
    return {"class": type(optimizer).__name__, "calls": optimizer.steps_taken, "groups": groups,
            "steps": {names[id(p.param)]: p.step for p in stored},
            "previous": [names[id(p.param)] for p in stored if p.previous]}


def _scheduler_state(scheduler: Any) -> Any:
    if scheduler is None:
        return None
    state = scheduler.state_dict()
    try:
        json.dumps(state, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"the scheduler's state_dict is not plain numbers, strings and lists ({exc}); a "
            f"checkpoint keeps it as JSON: save it yourself, and pass scheduler=None") from None
    return state


def _save_config(model: nn.Module, folder: str, state: OffloadState) -> None:
    """A transformers model's config.json (and generation_config.json), as save_pretrained
    writes them, so from_pretrained(folder) builds the same model."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    config = copy.deepcopy(config)
    config.architectures = [type(model).__name__]
    if state.params:
        config.dtype = str(state.params[0].placeholder.dtype).removeprefix("torch.")
    config.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", lambda: False)
    if generation is not None and can_generate():
        generation.save_pretrained(folder)
    for file_name in os.listdir(folder):
        fsync_path(os.path.join(folder, file_name))


def _persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers `state_dict()` holds (not those registered persistent=False)."""
    for name, buffer in model.named_buffers():
        owner, _, attribute = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        if attribute not in module._non_persistent_buffers_set:
            yield name, buffer


def _listing(state: OffloadState) -> dict[str, Any]:
    return {info.name: info for info in state.client.list(namespace=state.config.namespace,
                                                          prefix=state.config.prefix)}


def _is_checkpoint(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, STATE_FILE))


def _remove_leftovers(parent: str, name: str) -> None:
    """Partial folders of saves that were killed, and old checkpoints not deleted yet."""
    for entry in os.listdir(parent):
        if entry.startswith((f".{name}.partial-", f".{name}.old-")):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _put_in_place(partial: str, target: str) -> None:
    """Make `partial` the checkpoint at `target` in one step, then delete the one it replaced."""
    if not os.path.exists(target):
        os.rename(partial, target)
        return
    if _exchange(partial, target):
        shutil.rmtree(partial)  # the previous checkpoint, now under the partial name
        return
    # No RENAME_EXCHANGE (old kernel, or a file system without it): two renames; a kill
    # between them leaves the previous checkpoint whole as .<name>.old-<pid>.
    parent, name = os.path.split(target)
    old = os.path.join(parent, f".{name}.old-{os.getpid()}")
    os.rename(target, old)
    os.rename(partial, target)
    shutil.rmtree(old)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(first: str, second: str) -> bool:
    """Swap two paths atomically (renameat2 RENAME_EXCHANGE); False where unsupported."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second),
                 _RENAME_EXCHANGE) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(error, f"renameat2({first!r}, {second!r}, RENAME_EXCHANGE): "
                         f"{os.strerror(error)}")


@contextlib.contextmanager
def _progress_bar(title: str, total: int, wanted: bool | None) -> Iterator[Callable[[int], None]]:
    """`advance(nbytes)` for a rich progress bar of bytes, or for nothing."""
    if not (wanted if wanted is not None else total >= PROGRESS_BYTES):
        yield lambda nbytes: None
        return
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                               TimeRemainingColumn, TransferSpeedColumn)

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), transient=True) as bar:
        task = bar.add_task(title, total=total)
        yield lambda nbytes: bar.advance(task, nbytes)


# --- loading -------------------------------------------------------------------------------


def load_checkpoint(path: str | os.PathLike[str], model: nn.Module, optimizer: Any,
                    scheduler: Any = None, *, progress: bool | None = None) -> int:
    """Put the training state saved in `path` into the store of `model` (given to
    `infinity.torch.offload`, in any namespace), into `optimizer` (built over its parameters
    as the saved one was) and `scheduler` (None: its state is not loaded); returns the number
    of steps the saved run had taken, the number of the loop's next step. Raises
    CheckpointError, before writing anything, where the folder is not a checkpoint or holds
    another model's or optimizer's state."""
    folder = os.fspath(path)
    document = _read_document(folder)
    state, stored = _check_pair(model, optimizer)
    names = [_model_name(state, p.name) for p in stored]
    _check_model(document["model"], state, type(model).__name__)
    saved = document["optimizer"]
    _check_optimizer(saved, optimizer, names)
    if scheduler is not None and document.get("scheduler") is None:
        raise CheckpointError(f"{folder} holds no scheduler state (it was saved without one); "
                              f"pass scheduler=None, or save with the scheduler")
    model_files = _files(folder, "model")
    optimizer_files = _files(folder, "optimizer")
    optimizer.synchronize()
    if state.device_params is not None:
        state.device_params.settle()
    # Delayed update saved and loaded: the module computes with the saved `.previous` copy
    # until the next step, then with the newest values (a load without it takes the newest).
    previous = {p.name for p in stored if p.names["copy"]} & {
        state.config.prefix + name for name in saved.get("previous", [])}
    by_name = {p.name: p for p in stored}
    total = sum(_tensor_bytes(entry) for entry in document["model"]["parameters"].values())
    with _progress_bar(f"loading {os.path.basename(folder)}", total, progress) as advance, \
            _Reader(model_files) as weights, _Reader(optimizer_files) as moments:
        for entry in state.params:
            key = _model_name(state, entry.name)
            parameter = by_name.get(entry.name)
            value = weights.get(key)
            if entry.placeholder.dtype == torch.float32 and moments.has(f"{key}.master"):
                value = moments.get(f"{key}.master")  # saved in a lower precision, loaded in fp32
            value = value.to(entry.placeholder.dtype)
            if parameter is not None and entry.name in previous:
                _write(state, parameter.names["copy"], value)
                _write(state, entry.name, moments.get(f"{key}.previous"))
            else:
                _write(state, entry.name, value)
            if parameter is not None:
                for role in _OPTIMIZER_TENSORS:
                    if not parameter.names[role]:
                        continue
                    saved_value = (moments.get(f"{key}.{role}") if moments.has(f"{key}.{role}")
                                   else value.float())  # a master the saved run did not keep
                    _write(state, parameter.names[role], saved_value.float())
            advance(value.numel() * value.element_size())
        for key, buffer in _persistent_buffers(model):
            if weights.has(key):
                with torch.no_grad():
                    buffer.copy_(weights.get(key))
    if state.device_params is not None:
        state.device_params.stepped([entry.name for entry in state.params])
    state.zero_grad()
    if scheduler is not None:
        scheduler.load_state_dict(document["scheduler"])
    optimizer.restore_loop([int(saved["steps"][name]) for name in names],
                           [{k: v for k, v in group.items() if k != "params"}
                            for group in saved["groups"]],
                           int(saved["calls"]), [p.name in previous for p in stored], scheduler)
    return int(saved["calls"])


def _read_document(folder: str) -> dict[str, Any]:
    state_path = os.path.join(folder, STATE_FILE)
    if not os.path.isfile(state_path):
        raise CheckpointError(
            f"{folder} is not a checkpoint: it has no {STATE_FILE} (a save killed before its "
            f"end leaves none); pass the folder save_checkpoint wrote")
    try:
        with open(state_path) as file:
            document = json.load(file)
        if document.get("format") != FORMAT:
            raise ValueError(f"format {document.get('format')!r}, not {FORMAT}")
        for key in ("model", "optimizer"):
            if not isinstance(document.get(key), dict):
                raise ValueError(f"no {key!r} section")
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{state_path} cannot be read as a checkpoint's state ({exc}); "
                              f"it was not written by this version of save_checkpoint") from None
    return document


def _check_model(saved: dict[str, Any], state: OffloadState, model_class: str) -> None:
    """The same parameters, by name and shape, as the saved model's."""
    parameters = saved.get("parameters", {})
    ours = {_model_name(state, e.name): list(e.placeholder.shape) for e in state.params}
    missing = sorted(set(ours) - set(parameters))
    extra = sorted(set(parameters) - set(ours))
    shapes = [f"{name} (saved {parameters[name]['shape']}, the model's {shape})"
              for name, shape in ours.items()
              if name in parameters and list(parameters[name]["shape"]) != shape]
    if missing or extra or shapes:
        problems = ([f"it lacks {', '.join(missing[:5])}"] if missing else []) + \
                   ([f"the model lacks {', '.join(extra[:5])}"] if extra else []) + \
                   ([f"other shapes: {'; '.join(shapes[:5])}"] if shapes else [])
        raise CheckpointError(
            f"the checkpoint holds a {saved.get('class', 'model')} that does not fit this "
            f"{model_class} ({'; '.join(problems)}); build the model from the config it was "
            f"saved with")


def _check_optimizer(saved: dict[str, Any], optimizer: Any, names: list[str]) -> None:
    if saved.get("class") != type(optimizer).__name__:
        raise CheckpointError(f"the checkpoint holds the state of {saved.get('class')}, not "
                              f"{type(optimizer).__name__}; build the optimizer the saved run had")
    ours, position = [], 0
    for group in optimizer.param_groups:  # the names, group by group
        ours.append(names[position:position + len(group["params"])])
        position += len(group["params"])
    if [list(group.get("params", [])) for group in saved.get("groups", [])] != ours:
        raise CheckpointError(
            "the checkpoint's optimizer has other parameter groups (or parameters in another "
            "order) than this one; build the optimizer over the same groups as the saved run")


def _files(folder: str, stem: str) -> dict[str, str]:
    """Tensor key -> the file holding it, for `<stem>.safetensors` or its shards."""
    single = os.path.join(folder, f"{stem}.safetensors")
    index_path = single + ".index.json"
    if os.path.isfile(single):
        return {"*": single}
    try:
        with open(index_path) as file:
            weight_map = json.load(file)["weight_map"]
        return {key: os.path.join(folder, name) for key, name in weight_map.items()}
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{folder} has neither {stem}.safetensors nor a readable "
                              f"{stem}.safetensors.index.json ({exc}); the checkpoint is "
                              f"incomplete") from None


class _Reader:
    """Tensors by key from a checkpoint's files, one at a time (files opened as needed)."""

    def __init__(self, files: dict[str, str]) -> None:
        self._files = files
        self._open: dict[str, TensorFile] = {}

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._open.clear()

    def _file_of(self, key: str) -> TensorFile | None:
        path = self._files.get(key, self._files.get("*"))
        if path is None:
            return None
        if path not in self._open:
            self._open[path] = TensorFile(path)
        return self._open[path]

    def has(self, key: str) -> bool:
        file = self._file_of(key)
        return file is not None and key in file.keys()

    def get(self, key: str) -> torch.Tensor:
        if not self.has(key):
            raise CheckpointError(f"the checkpoint's files hold no tensor {key!r}; it is "
                                  f"incomplete or of another model")
        file = self._file_of(key)
        assert file is not None
        return file.get(key)


def _write(state: OffloadState, name: str, value: torch.Tensor) -> None:
    state.client.write_from(name, value.contiguous(), namespace=state.config.namespace)


def _tensor_bytes(entry: dict[str, Any]) -> int:
    count = 1
    for dim in entry["shape"]:
        count *= int(dim)
    return count * torch.empty((), dtype=getattr(torch, entry["dtype"])).element_size()
