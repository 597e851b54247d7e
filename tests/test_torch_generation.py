"""Streamed generation: an imported model generates with its weights in the store.

Each test saves a small model built from a config with seeded weights (`save_pretrained`, with a
character-level tokenizer), imports the folder into a real infinityd, and compares what
`load_causal_lm` generates with what the same folder loaded fully into memory generates: token
for token (the same kernels on the same values on the CPU).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, Callable

import pytest
import torch
from torch import nn

from infinity.client.device import CpuCopier
from infinity.client.launch import settings_as_flags
from infinity.errors import InfinityError, ReadOnlyNamespaceError
from infinity.torch.generation import load_causal_lm, load_tokenizer
from infinity.torch.model_store import import_model
from tiny_models import gpt2, llama, save_char_tokenizer

pytest.importorskip("transformers")


@pytest.fixture(params=[gpt2, llama], ids=["gpt2", "llama"])
def model_folder(request: Any, disk_tmp: str) -> str:
    build: Callable[[], nn.Module] = request.param
    folder = os.path.join(disk_tmp, "model")
    build().save_pretrained(folder)
    save_char_tokenizer(folder)
    return folder


def in_memory(folder: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).eval()


def prompts(batch: int, length: int, seed: int = 5) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 98, (batch, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_streamed_greedy_generation_equals_the_model_in_memory(client: Any,
                                                               model_folder: str) -> None:
    import_model(client, model_folder, namespace="lm", progress=False)
    model = load_causal_lm(client, namespace="lm")
    inputs = prompts(1, 9)
    expected = in_memory(model_folder).generate(**inputs, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(**inputs, max_new_tokens=12, do_sample=False), expected)


def test_a_batch_of_prompts_with_padding_generates_as_in_memory(client: Any,
                                                                model_folder: str) -> None:
    import_model(client, model_folder, namespace="lm", progress=False)
    model = load_causal_lm(client, namespace="lm")
    inputs = prompts(3, 8)
    inputs["attention_mask"][1, :3] = 0  # left padding, as a batch of unequal prompts has
    options = dict(max_new_tokens=7, do_sample=False, pad_token_id=0)
    expected = in_memory(model_folder).generate(**inputs, **options)
    assert torch.equal(model.generate(**inputs, **options), expected)


def test_sampling_with_a_seed_draws_the_tokens_the_model_in_memory_draws(
        client: Any, model_folder: str) -> None:
    import_model(client, model_folder, namespace="lm", progress=False)
    model = load_causal_lm(client, namespace="lm")
    inputs = prompts(2, 6)
    options = dict(max_new_tokens=10, do_sample=True, temperature=0.9, top_k=20)
    torch.manual_seed(17)
    expected = in_memory(model_folder).generate(**inputs, **options)
    torch.manual_seed(17)
    assert torch.equal(model.generate(**inputs, **options), expected)


def test_generation_through_a_copying_device_within_a_budget_equals_in_memory(
        client: Any, model_folder: str) -> None:
    # The CPU as a device that copies (the CUDA path's code, run here): the weights come into a
    # budget of a third of them, one unit's worth at a time and ahead by the trace.
    import_model(client, model_folder, namespace="lm", progress=False)
    weight_bytes = sum(info.nbytes for info in client.list(namespace="lm")
                       if not info.name.startswith("__"))
    model = load_causal_lm(client, namespace="lm", copier=CpuCopier(),
                           device_budget_bytes=weight_bytes // 3)
    inputs = prompts(2, 5)
    expected = in_memory(model_folder).generate(**inputs, max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(**inputs, max_new_tokens=8, do_sample=False), expected)
    assert client.stats()["clients"][0]["leases"] == 0


def saved(model: nn.Module, disk_tmp: str, name: str) -> str:
    folder = os.path.join(disk_tmp, name)
    model.save_pretrained(folder)
    save_char_tokenizer(folder)
    return folder


def embedding_unit(model: nn.Module) -> Any:
    from infinity.torch import offload_state

    (unit,) = [u for u in offload_state(model).units
               if u.module is model.get_input_embeddings()]
    return unit


def test_an_untied_embedding_reads_only_the_rows_it_looks_up_and_generates_as_in_memory(
        client: Any, disk_tmp: str) -> None:
    folder = saved(llama(tied=False), disk_tmp, "untied")
    import_model(client, folder, namespace="untied", progress=False)
    model = load_causal_lm(client, namespace="untied")
    assert embedding_unit(model).by_rows is not None  # it leases no table: it reads rows
    reference = in_memory(folder)
    for inputs in (prompts(1, 9), prompts(3, 7, seed=8)):
        expected = reference.generate(**inputs, max_new_tokens=10, do_sample=False)
        assert torch.equal(model.generate(**inputs, max_new_tokens=10, do_sample=False),
                           expected)


def test_a_tied_embedding_is_leased_whole_as_its_output_projection_needs(
        client: Any, disk_tmp: str) -> None:
    folder = saved(gpt2(), disk_tmp, "tied")
    import_model(client, folder, namespace="tied", progress=False)
    assert embedding_unit(load_causal_lm(client, namespace="tied")).by_rows is None


def test_generation_leaves_no_lease_behind(client: Any, model_folder: str) -> None:
    import_model(client, model_folder, namespace="lm", progress=False)
    model = load_causal_lm(client, namespace="lm")
    model.generate(**prompts(1, 4), max_new_tokens=3, do_sample=False)
    assert client.stats()["clients"][0]["leases"] == 0


def test_the_stored_tokenizer_is_the_folders(client: Any, model_folder: str) -> None:
    import_model(client, model_folder, namespace="lm", progress=False)
    tokenizer = load_tokenizer(client, namespace="lm")
    assert tokenizer.decode(tokenizer("Odd sizes: 37!")["input_ids"]) == "Odd sizes: 37!"


def test_the_generate_command_streams_the_greedy_completion(daemon: Any, client: Any,
                                                           model_folder: str) -> None:
    from transformers import AutoTokenizer

    import_model(client, model_folder, namespace="lm", progress=False)
    result = subprocess.run(
        [sys.executable, "-m", "infinity.cli.main", "generate", "--namespace", "lm",
         "--max-new-tokens", "9", "Odd prompt", *settings_as_flags(daemon.config)],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    inputs = tokenizer("Odd prompt", return_tensors="pt")
    expected = in_memory(model_folder).generate(**inputs, max_new_tokens=9, do_sample=False)
    assert result.stdout == tokenizer.decode(expected[0]) + "\n"  # the streamer ends the line
    assert "9 tokens; first after" in result.stderr


def test_the_generate_command_names_a_namespace_without_a_model(daemon: Any) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "infinity.cli.main", "generate", "--namespace", "nothing",
         "hello", *settings_as_flags(daemon.config)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "nothing" in result.stderr and "infinity import" in result.stderr


def test_a_namespace_without_an_imported_model_is_a_typed_error(client: Any) -> None:
    client.put("w", torch.ones(3))
    with pytest.raises(InfinityError, match="import"):
        load_causal_lm(client, namespace="default")


def test_processes_generating_from_one_import_share_one_copy(daemon: Any, client: Any,
                                                              disk_tmp: str) -> None:
    folder = os.path.join(disk_tmp, "model")
    llama().save_pretrained(folder)
    import_model(client, folder, namespace="shared", progress=False)
    script = os.path.join(disk_tmp, "generate_one.py")
    with open(script, "w") as f:
        f.write(SHARED_READER)
    used_before = client.stats()["tiers"]["cpu"]["used_bytes"]
    readers = [subprocess.Popen([sys.executable, script, daemon.runtime_dir],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for _ in range(3)]
    try:
        answers = [reader.stdout.readline().split() for reader in readers]  # type: ignore[union-attr]
        # All three hold their leases now: the tier holds each weight once, whoever reads it.
        used_during = client.stats()["tiers"]["cpu"]["used_bytes"]
        leases = [c["leases"] for c in client.stats()["clients"] if c["name"].startswith("reader")]
    finally:
        for reader in readers:
            reader.communicate("done\n", timeout=60)
    assert all(answer == answers[0] for answer in answers)
    assert len(leases) == 3 and all(count > 0 for count in leases)
    assert used_during == used_before


def test_a_second_client_generating_from_the_model_replays_the_firsts_trace_from_its_first_step(
        nvme_daemon: Any, disk_tmp: str) -> None:
    folder = os.path.join(disk_tmp, "model")
    llama().save_pretrained(folder)
    client = nvme_daemon.connect("first")
    other = nvme_daemon.connect("second")
    try:
        import_model(client, folder, namespace="lm", progress=False)
        load_causal_lm(client, namespace="lm").generate(**prompts(1, 7), max_new_tokens=3,
                                                        do_sample=False)
        inputs = prompts(1, 5, seed=6)
        tokens = load_causal_lm(other, namespace="lm").generate(**inputs, max_new_tokens=3,
                                                                do_sample=False)
        second = next(c for c in client.stats()["scheduler"]["clients"]
                      if (c["namespace"], c["client"]) == ("lm", "second"))
    finally:
        other.close()
        client.close()
    assert second["totals"]["traces_borrowed"] == 1  # its first step, then its own trace
    assert second["totals"]["traces_recorded"] == 0 and second["totals"]["divergences"] == 0
    expected = in_memory(folder).generate(**inputs, max_new_tokens=3, do_sample=False)
    assert torch.equal(tokens, expected)


def test_a_write_to_a_shared_model_is_refused(daemon: Any, client: Any, disk_tmp: str) -> None:
    folder = os.path.join(disk_tmp, "model")
    gpt2().save_pretrained(folder)
    import_model(client, folder, namespace="shared", progress=False)
    other = daemon.connect("writer")
    try:
        with pytest.raises(ReadOnlyNamespaceError):
            other.put("transformer.wte.weight", torch.zeros(101, 32), namespace="shared")
        with pytest.raises(ReadOnlyNamespaceError):
            other.get("transformer.wte.weight", namespace="shared", exclusive=True)
    finally:
        other.close()


# A process that generates from the shared import, then holds a lease of every weight until told
# to finish.
SHARED_READER = r'''
import sys
import infinity
import torch
from infinity.config import load_config
from infinity.torch.generation import load_causal_lm

client = infinity.connect(config=load_config(env={}, overrides=[f"daemon.runtime_dir={sys.argv[1]}"]),
                          name="reader")
model = load_causal_lm(client, namespace="shared")
ids = torch.tensor([[5, 9, 14, 3]])
tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                        do_sample=False)[0].tolist()
leases = [client.get_many([n for n, _ in model.named_parameters()], namespace="shared")]
print(" ".join(map(str, tokens)), flush=True)
sys.stdin.readline()
leases[0].release()
client.close()
'''
