"""Importing a Hugging Face model folder into the store (`infinity.torch.model_store`): small
GPT-2 and Llama models saved with save_pretrained (sharded and not) into real folders on disk,
imported into a real infinityd with an NVMe tier, read back bit for bit; skips, read-only
namespaces, bad folders that leave nothing behind, the CLI, and the importer's memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny_models
from conftest import PREFETCH_SETTINGS, RunningDaemon
from infinity.errors import (AlreadyExistsError, ModelFormatError, ModelNotFoundError,
                             ReadOnlyNamespaceError, StoreFullError)
from infinity.io import crc32c
from infinity.torch.model_store import (FILES_PREFIX, MANIFEST_NAME, REGISTRY_NAMESPACE,
                                        import_model, list_models, model_files, require_model,
                                        write_model_files)

SAVE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def save_model(model: torch.nn.Module, folder: str, *, max_shard_size: str | None = None) -> str:
    """save_pretrained into `folder` (sharded where max_shard_size is given), with a tokenizer
    whose vocabulary is the model's."""
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)  # type: ignore[operator]
    vocab_size = model.config.vocab_size  # type: ignore[union-attr]
    tiny_models.word_tokenizer(vocab_size).save_pretrained(folder)  # type: ignore[attr-defined]
    return folder


def weights_in(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files, as the safetensors package reads them."""
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
    return tensors


def read_back(client: Any, namespace: str, name: str, like: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(like)
    client.read_into(name, out, namespace=namespace)
    return out


def held_names(client: Any, namespace: str) -> set[str]:
    return {t.name for t in client.list(namespace=namespace)}


@pytest.fixture
def model_dir(disk_tmp: str) -> Callable[[str], str]:
    """A fresh folder under the test's disk folder, by name."""
    def make(name: str) -> str:
        path = os.path.join(disk_tmp, name)
        os.makedirs(path)
        return path
    return make


@pytest.fixture
def store(nvme_daemon: RunningDaemon) -> Any:
    client = nvme_daemon.connect("importer")
    try:
        yield client
    finally:
        client.close()


# --- what an import stores ------------------------------------------------------------------


@pytest.mark.parametrize("build,shard,dtype", [
    (tiny_models.gpt2, None, torch.float32),
    (tiny_models.llama, "20KB", torch.float32),
    (tiny_models.llama, None, torch.bfloat16),
], ids=["gpt2", "llama-sharded", "llama-bf16"])
def test_every_tensor_reads_back_bit_exact_under_its_safetensors_name(
        store: Any, model_dir: Callable[[str], str], build: Callable[[], torch.nn.Module],
        shard: str | None, dtype: torch.dtype) -> None:
    folder = save_model(build().to(dtype), model_dir("model"), max_shard_size=shard)
    if shard:
        assert os.path.exists(os.path.join(folder, "model.safetensors.index.json"))
    expected = weights_in(folder)
    report = import_model(store, folder, namespace="m", progress=False)
    assert not report.skipped and report.durable and report.read_only
    assert report.tensors == len(expected)
    listed = {t.name: t for t in store.list(namespace="m")}
    for name, tensor in expected.items():
        assert listed[name].dtype == str(tensor.dtype).removeprefix("torch.")  # bf16 stays bf16
        assert listed[name].shape == tuple(tensor.shape)
        back = read_back(store, "m", name, tensor)
        assert torch.equal(back.view(torch.uint8), tensor.contiguous().view(torch.uint8)), name
    assert set(listed) == set(expected) | {MANIFEST_NAME} | {
        FILES_PREFIX + f for f in report.files}


def test_the_manifest_records_each_file_checksum_and_each_tensor(
        store: Any, model_dir: Callable[[str], str]) -> None:
    folder = save_model(tiny_models.llama(), model_dir("llama"), max_shard_size="20KB")
    import_model(store, folder, namespace="m", progress=False)
    manifest = require_model(store, "m")
    assert manifest["format_version"] == 1 and manifest["source"] == folder
    on_disk = sorted(os.listdir(folder))
    assert sorted(manifest["files"]) == on_disk
    for name, entry in manifest["files"].items():
        with open(os.path.join(folder, name), "rb") as f:
            data = f.read()
        assert entry["bytes"] == len(data) and entry["crc32c"] == f"{crc32c(data):08x}", name
    expected = weights_in(folder)
    assert {name: (e["dtype"], tuple(e["shape"])) for name, e in manifest["tensors"].items()} == {
        name: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in expected.items()}
    assert manifest["tensor_bytes"] == sum(t.numel() * t.element_size() for t in expected.values())


def test_config_and_tokenizer_files_come_back_and_build_the_config_and_tokenizer(
        store: Any, model_dir: Callable[[str], str]) -> None:
    from transformers import AutoConfig, AutoTokenizer

    folder = save_model(tiny_models.gpt2(), model_dir("gpt2"))
    import_model(store, folder, namespace="m", progress=False)
    files = model_files(store, "m")
    assert set(SAVE_FILES) <= set(files)
    for name, data in files.items():
        with open(os.path.join(folder, name), "rb") as f:
            assert f.read() == data, name
    rebuilt = write_model_files(store, "m", model_dir("rebuilt"))

    def config(path: str) -> dict[str, Any]:
        return {k: v for k, v in AutoConfig.from_pretrained(path).to_dict().items()
                if k != "_name_or_path"}

    assert config(rebuilt) == config(folder)
    text = "w3 w7 w99 unknown"
    assert (AutoTokenizer.from_pretrained(rebuilt)(text)["input_ids"]
            == AutoTokenizer.from_pretrained(folder)(text)["input_ids"] == [3, 7, 99, 100])


def test_weights_of_other_formats_hidden_files_and_folders_are_left_out(
        store: Any, model_dir: Callable[[str], str]) -> None:
    folder = save_model(tiny_models.gpt2(), model_dir("gpt2"))
    for name, data in (("pytorch_model.bin", b"old weights"), ("added_tokens.json", b""),
                       (".gitattributes", b"*.bin lfs")):
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    os.makedirs(os.path.join(folder, "checkpoint-10"))
    report = import_model(store, folder, namespace="m", progress=False)
    assert report.left_out == ("pytorch_model.bin (weights of another format)",)
    files = model_files(store, "m")
    assert files["added_tokens.json"] == b""  # an empty file is kept, as an empty tensor
    assert ".gitattributes" not in files and "pytorch_model.bin" not in files


def test_a_training_checkpoint_imports_its_model_weights_only(
        store: Any, model_dir: Callable[[str], str]) -> None:
    # save_checkpoint's folder: model.safetensors beside the optimizer's own safetensors file.
    folder = save_model(tiny_models.gpt2(), model_dir("checkpoint"))
    save_file({"transformer.wte.weight.exp_avg": torch.zeros(3, 5)},
              os.path.join(folder, "optimizer.safetensors"))
    model_weights = load_file(os.path.join(folder, "model.safetensors"))
    report = import_model(store, folder, namespace="m", progress=False)
    assert report.tensors == len(model_weights)
    assert {t.name for t in store.list(namespace="m")} >= set(model_weights)
    assert not store.exists("transformer.wte.weight.exp_avg", namespace="m")
    assert report.left_out == ("optimizer.safetensors (not the model's weights: "
                               "model.safetensors is)",)


def test_a_namespace_without_a_manifest_holds_no_model(store: Any) -> None:
    store.put("stray", torch.ones(3), namespace="half")
    for namespace in ("half", "never"):
        with pytest.raises(ModelNotFoundError, match="infinity import"):
            require_model(store, namespace)
        with pytest.raises(ModelNotFoundError):
            write_model_files(store, namespace, "/nonexistent/never/written")


def test_the_registry_lists_each_imported_model(store: Any,
                                                model_dir: Callable[[str], str]) -> None:
    gpt2 = save_model(tiny_models.gpt2(), model_dir("gpt2"))
    llama = save_model(tiny_models.llama(), model_dir("llama"))
    import_model(store, gpt2, namespace="a", progress=False)
    import_model(store, llama, namespace="b", read_only=False, progress=False)
    models = {m.namespace: m for m in list_models(store)}
    assert set(models) == {"a", "b"} == held_names(store, REGISTRY_NAMESPACE)
    assert models["a"].complete and models["a"].model_type == "gpt2" and models["a"].read_only
    assert models["b"].architectures == ("LlamaForCausalLM",) and not models["b"].read_only
    assert models["b"].tensors == len(weights_in(llama)) and models["b"].source == llama


# --- importing again --------------------------------------------------------------------------


def test_an_unchanged_folder_imported_again_is_skipped_and_nothing_is_written(
        store: Any, model_dir: Callable[[str], str]) -> None:
    folder = save_model(tiny_models.llama(), model_dir("llama"), max_shard_size="20KB")
    import_model(store, folder, namespace="m", progress=False)
    versions = {t.name: t.version for t in store.list(namespace="m")}
    again = import_model(store, folder, namespace="m", progress=False)
    assert again.skipped and again.reason == "unchanged since its import"
    assert {t.name: t.version for t in store.list(namespace="m")} == versions


def test_a_changed_folder_reimported_into_a_writable_namespace_replaces_the_model(
        store: Any, model_dir: Callable[[str], str]) -> None:
    folder = model_dir("gpt2")
    model = tiny_models.gpt2()
    save_model(model, folder)
    import_model(store, folder, namespace="m", read_only=False, progress=False)
    with torch.no_grad():
        model.transformer.h[0].ln_1.weight.add_(1.0)  # type: ignore[index,union-attr]
    save_model(model, folder)
    again = import_model(store, folder, namespace="m", read_only=False, progress=False)
    assert not again.skipped and "model.safetensors changed" in again.reason
    name = "transformer.h.0.ln_1.weight"
    expected = weights_in(folder)[name]
    assert torch.equal(read_back(store, "m", name, expected), expected)
    assert require_model(store, "m")["files"]["model.safetensors"]["crc32c"] == (
        f"{crc32c(open(os.path.join(folder, 'model.safetensors'), 'rb').read()):08x}")


def test_a_changed_folder_into_a_read_only_namespace_is_refused_and_the_model_kept(
        store: Any, model_dir: Callable[[str], str]) -> None:
    folder = model_dir("gpt2")
    model = tiny_models.gpt2()
    save_model(model, folder)
    import_model(store, folder, namespace="m", progress=False)
    versions = {t.name: t.version for t in store.list(namespace="m")}
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)  # type: ignore[union-attr,operator]
    save_model(model, folder)
    with pytest.raises(ReadOnlyNamespaceError, match="another namespace"):
        import_model(store, folder, namespace="m", progress=False)
    assert {t.name: t.version for t in store.list(namespace="m")} == versions
    require_model(store, "m")


def test_a_read_only_import_refuses_every_other_clients_write(
        nvme_daemon: RunningDaemon, store: Any, model_dir: Callable[[str], str]) -> None:
    folder = save_model(tiny_models.gpt2(), model_dir("gpt2"))
    import_model(store, folder, namespace="m", progress=False)
    assert store.namespace_info("m").sealed
    other = nvme_daemon.connect("other")
    try:
        with pytest.raises(ReadOnlyNamespaceError):
            other.put("transformer.wte.weight", torch.zeros(101, 32), namespace="m")
        with pytest.raises(ReadOnlyNamespaceError):
            other.delete(MANIFEST_NAME, namespace="m")
        expected = weights_in(folder)["transformer.wte.weight"]
        assert torch.equal(read_back(other, "m", "transformer.wte.weight", expected), expected)
    finally:
        other.close()
    with pytest.raises(ReadOnlyNamespaceError):  # sealed: the importer no more than others
        store.put("transformer.wte.weight", torch.zeros(101, 32), namespace="m")


def test_a_namespace_holding_other_tensors_is_not_imported_into(
        store: Any, model_dir: Callable[[str], str]) -> None:
    store.put("mine", torch.arange(5.0), namespace="m")
    folder = save_model(tiny_models.gpt2(), model_dir("gpt2"))
    with pytest.raises(AlreadyExistsError, match="not an imported model"):
        import_model(store, folder, namespace="m", progress=False)
    assert held_names(store, "m") == {"mine"}


# --- bad folders: a typed error naming the file, and nothing half-imported --------------------


def assert_nothing_imported(client: Any, namespace: str) -> None:
    assert held_names(client, namespace) == set()
    assert namespace not in held_names(client, REGISTRY_NAMESPACE)


@pytest.mark.parametrize("at,damage,says", [
    (8, b"\x00garbage{{{", "its header is not UTF-8 JSON; it is corrupted"),
    (0, (1 << 40).to_bytes(8, "little"), "its first 8 bytes give a header of 1099511627776 bytes"),
], ids=["header-garbage", "header-length-past-the-end"])
def test_a_corrupted_safetensors_header_is_refused_naming_the_file(
        store: Any, model_dir: Callable[[str], str], at: int, damage: bytes, says: str) -> None:
    folder = save_model(tiny_models.llama(), model_dir("llama"), max_shard_size="20KB")
    shards = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    damaged = os.path.join(folder, shards[-1])  # the last: the others are valid
    with open(damaged, "r+b") as f:
        f.seek(at)
        f.write(damage)
    with pytest.raises(ModelFormatError,
                       match=f"{damaged} is not a valid safetensors file: {says}.*save the model"):
        import_model(store, folder, namespace="m", progress=False)
    assert_nothing_imported(store, "m")


def test_a_truncated_safetensors_file_is_refused_naming_the_file(
        store: Any, model_dir: Callable[[str], str]) -> None:
    folder = save_model(tiny_models.gpt2(), model_dir("gpt2"))
    truncated = os.path.join(folder, "model.safetensors")
    os.truncate(truncated, os.path.getsize(truncated) - 999)
    with pytest.raises(ModelFormatError, match=f"{truncated} is truncated.*999 bytes short"):
        import_model(store, folder, namespace="m", progress=False)
    assert_nothing_imported(store, "m")


def test_a_missing_shard_is_refused_naming_it(store: Any,
                                              model_dir: Callable[[str], str]) -> None:
    folder = save_model(tiny_models.llama(), model_dir("llama"), max_shard_size="20KB")
    shard = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))[1]
    os.unlink(os.path.join(folder, shard))
    with pytest.raises(ModelFormatError, match=f"shard {shard} .* is missing"):
        import_model(store, folder, namespace="m", progress=False)
    assert_nothing_imported(store, "m")


def test_a_folder_without_config_json_is_refused(store: Any,
                                                 model_dir: Callable[[str], str]) -> None:
    folder = save_model(tiny_models.gpt2(), model_dir("gpt2"))
    os.unlink(os.path.join(folder, "config.json"))
    with pytest.raises(ModelFormatError, match=f"{folder} has no config.json.*save_pretrained"):
        import_model(store, folder, namespace="m", progress=False)
    assert_nothing_imported(store, "m")


def test_a_store_that_fills_up_mid_import_leaves_nothing_behind(
        daemon_factory: Callable[..., RunningDaemon], model_dir: Callable[[str], str]) -> None:
    """The failure comes after tensors were written (the model is 4 times the NVMe tier), so the
    import must take them back."""
    from transformers import GPT2Config, GPT2LMHeadModel

    daemon = daemon_factory(nvme_tier=True, **{
        **PREFETCH_SETTINGS, "nvme.capacity_bytes_per_dir": 1 << 20,
        "nvme.file_grow_bytes": 256 << 10})
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=5, n_embd=128, n_head=2, vocab_size=1003,
                                       n_positions=32, bos_token_id=1002, eos_token_id=1002))
    folder = save_model(model, model_dir("gpt2"))
    assert os.path.getsize(os.path.join(folder, "model.safetensors")) > 4 << 20
    client = daemon.connect("importer")
    try:
        with pytest.raises(StoreFullError):
            import_model(client, folder, namespace="m", progress=False)
        assert_nothing_imported(client, "m")
    finally:
        client.close()
    daemon.assert_serving()


# --- the command line ---------------------------------------------------------------------------


def run_cli(daemon: RunningDaemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "infinity.cli.main", *args, "--config",
         os.path.join(daemon.root, "settings.toml"), "--set",
         f"daemon.runtime_dir={daemon.runtime_dir}"],
        capture_output=True, text=True, timeout=120)


def test_infinity_import_and_infinity_models_on_the_command_line(
        nvme_daemon: RunningDaemon, model_dir: Callable[[str], str]) -> None:
    folder = save_model(tiny_models.llama(), model_dir("llama"))
    imported = run_cli(nvme_daemon, "import", folder, "--namespace", "llama-tiny")
    assert imported.returncode == 0, imported.stderr
    assert "llama-tiny" in imported.stdout and "read-only" in imported.stdout
    listed = run_cli(nvme_daemon, "models", "--json")
    assert listed.returncode == 0, listed.stderr
    (model,) = json.loads(listed.stdout)
    assert model["namespace"] == "llama-tiny" and model["state"] == "complete"
    assert model["model_type"] == "llama" and model["source"] == folder


def test_infinity_import_says_plainly_that_no_daemon_runs(disk_tmp: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "infinity.cli.main", "models", "--set",
         f"daemon.runtime_dir={os.path.join(disk_tmp, 'rt')}"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "INFINITY_CONFIG": ""})
    assert done.returncode == 2 and "no infinityd is running" in done.stderr


# --- memory -------------------------------------------------------------------------------------


def test_importing_a_model_and_its_int8_copy_keeps_the_importers_memory_bounded(
        daemon_factory: Callable[..., RunningDaemon], model_dir: Callable[[str], str]) -> None:
    """A GPT-2 of 115 MB in float32 imported, with its int8 copy (int4's takes the same path),
    by a fresh process into a daemon whose CPU tier is 8 MiB: the importer's resident peak grows
    by less than `bound`, under a third of the model. The bound: the CPU tier (the shared memory
    the importer fills, staging slices and small tensors' slices), a read buffer of at most 8
    MiB, the rows being quantized with their temporaries (4 x ROWS_BYTES: the source, padded,
    absolute values and quotients in float32) and 16 MiB for the interpreter's own allocations
    along the way (JSON, the lists of names, one tensor's scales). An importer that held the
    model, its codes, or mapped its file, would grow by their size."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from infinity.torch.model_quantized import ROWS_BYTES

    daemon = daemon_factory(nvme_tier=True, **PREFETCH_SETTINGS)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=8, n_embd=512, n_head=8, vocab_size=8192,
                                       n_positions=128, bos_token_id=8191, eos_token_id=8191))
    folder = save_model(model, model_dir("gpt2-large-ish"))
    del model
    model_bytes = sum(t.numel() * t.element_size() for t in weights_in(folder).values())
    bound = PREFETCH_SETTINGS["cpu.budget_bytes"] + (8 << 20) + 4 * ROWS_BYTES + (16 << 20)
    assert model_bytes > 3 * bound
    warm_up = save_model(tiny_models.gpt2(), model_dir("warm-up"))
    script = os.path.join(os.path.dirname(__file__), "model_import_rss.py")
    done = subprocess.run(
        [sys.executable, script, os.path.join(daemon.root, "settings.toml"), daemon.runtime_dir,
         warm_up, folder, "int8"],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 << 10)})
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.splitlines()[-1])
    assert measured["tensor_bytes"] == model_bytes
    assert measured["quantized"] == ["int8"]
    growth = measured["peak_rss_bytes"] - measured["rss_before_bytes"]
    assert growth < bound, measured


def test_an_imported_model_survives_a_killed_daemon(
        daemon_factory: Callable[..., RunningDaemon], model_dir: Callable[[str], str]) -> None:
    from conftest import start_daemon_process

    settings = {**PREFETCH_SETTINGS}
    daemon = daemon_factory(nvme_tier=True, **settings)
    folder = save_model(tiny_models.llama(), model_dir("llama"))
    client = daemon.connect("importer")
    try:
        import_model(client, folder, namespace="m", progress=False)
    finally:
        client.close()
    daemon.process.kill()  # no clean shutdown: only what was durable is there after it
    daemon.process.wait()
    restarted = start_daemon_process(
        daemon.root, **{"nvme.dirs": [os.path.join(daemon.root, "nvme")], **settings})
    client = restarted.connect("reader")
    try:
        require_model(client, "m")
        for name, tensor in weights_in(folder).items():
            assert torch.equal(read_back(client, "m", name, tensor), tensor), name
        (model,) = list_models(client)
        assert model.complete and model.durable
    finally:
        client.close()
        restarted.stop()
