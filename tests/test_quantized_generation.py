"""Quantized copies of an imported model (`import_model(..., quantize=...)`) and streamed
generation from them (`load_causal_lm(..., quantization=...)`): the copies the namespace holds
and its manifest and listing show, re-imports that add a form, the error for a form not
imported, and what the streamed model computes, against the same seeded tiny Llama in memory.
A real infinityd; the model saved with save_pretrained into a real folder."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from infinity.client.device import CpuCopier
from infinity.client.launch import settings_as_flags
from infinity.errors import (InvalidRequestError, QuantizedFormNotFoundError,
                             ReadOnlyNamespaceError)
from infinity.torch.generation import load_causal_lm
from infinity.torch.model_store import import_model, list_models, require_model
from infinity.torch.offload import offload_state
from infinity.torch.quantize import BLOCK_SIZES, FUSED_MAX_ROWS, linear, quantize, round_trip
from tiny_models import llama, save_char_tokenizer

pytest.importorskip("transformers")

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture
def folder(disk_tmp: str) -> str:
    path = os.path.join(disk_tmp, "llama")
    llama().save_pretrained(path)
    save_char_tokenizer(path)
    return path


@pytest.fixture
def untied_folder(disk_tmp: str) -> str:
    """A Llama whose output projection is a weight of its own."""
    path = os.path.join(disk_tmp, "untied")
    llama(tied=False).save_pretrained(path)
    save_char_tokenizer(path)
    return path


def in_memory(folder: str, form: str | None = None, *, head: bool = False) -> Any:
    """The folder's model in memory; with `form`, each linear layer's weight (and with `head`
    the output projection's) replaced by what its quantized copy dequantizes to (what a
    streamed quantized model computes with)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    if form is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.split(".")[-2] in LINEAR or (head and name == "lm_head.weight"):
                    param.copy_(round_trip(param, form))
    return model


def computing_from_codes(model: Any, form: str, *, head: bool = False) -> Any:
    """`model` (in memory) with each linear layer (and with `head` the output projection)
    multiplying from its weight's `form` copy with the native kernel (what a streamed
    quantized model computes for a decode step)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and (head or
                                                    module is not model.get_output_embeddings()):
            codes, scales = quantize(module.weight.detach(), form, BLOCK_SIZES[form])
            module.forward = (lambda x, m=module, c=codes, s=scales:
                              linear(x, c, s, form, BLOCK_SIZES[form], m.bias))
    return model


def prompts(batch: int = 3, length: int = 11) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 98, (batch, length), generator=torch.Generator().manual_seed(7))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def logits(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def test_an_import_asked_for_both_forms_keeps_each_linear_weights_copies(
        client: Any, folder: str) -> None:
    report = import_model(client, folder, namespace="lm", progress=False,
                          quantize=("int4", "int8"))
    assert report.quantized == ("int8", "int4")
    manifest = require_model(client, "lm")
    held = {t.name: t for t in client.list(namespace="lm")}
    linear = sorted(n for n in manifest["tensors"] if n.split(".")[-2] in LINEAR)
    assert len(linear) == 2 * len(LINEAR)
    for form, block in (("int8", 128), ("int4", 64)):
        record = manifest["quantized"][form]
        assert record["block"] == block and sorted(record["tensors"]) == linear
        for name in linear:
            rows, n = manifest["tensors"][name]["shape"]
            codes, scales = held[f"__{form}__/{name}"], held[f"__{form}_scales__/{name}"]
            assert codes.shape == ((rows, n) if form == "int8" else (rows, (n + 1) // 2))
            assert codes.dtype == ("int8" if form == "int8" else "uint8")
            assert scales.shape == (rows, -(-n // block)) and scales.dtype == "float32"
    # The embeddings (tied to the output projection) and the norms have no copies.
    copied = {name.split("/", 1)[1] for name in held if name.startswith("__int8__/")}
    assert copied == set(linear)
    assert manifest["quantized"]["int8"]["output_projection"] is None
    (info,) = list_models(client)
    assert info.quantized == ("int8", "int4")


def test_a_streamed_int8_prompt_computes_as_the_model_with_its_copies_dequantized(
        client: Any, folder: str) -> None:
    """Bit for bit, for inputs of more rows than FUSED_MAX_ROWS (a prompt's prefill): the
    streamed model dequantizes each copy into a buffer and runs the same kernels on the same
    values as the in-memory model whose linear weights are replaced by their round trip (which
    test_torch_quantize checks against a plain reference)."""
    import_model(client, folder, namespace="lm", progress=False, quantize=("int8",))
    model = load_causal_lm(client, namespace="lm", quantization="int8")
    inputs = prompts()
    assert inputs["input_ids"].numel() > FUSED_MAX_ROWS["int8"]
    assert torch.equal(logits(model, inputs), logits(in_memory(folder, "int8"), inputs))
    assert offload_state(model).dequantized.idle_bytes() > 0  # the weights were dequantized
    assert client.stats()["clients"][0]["leases"] == 0


@pytest.mark.parametrize("form", ["int8", "int4"])
def test_a_streamed_decode_step_multiplies_from_the_codes_as_the_kernel_in_memory_does(
        client: Any, folder: str, form: str) -> None:
    """Bit for bit, for inputs of at most FUSED_MAX_ROWS rows (a decode step, 1 row a
    sequence): each linear layer multiplies from its leased codes with the native kernel
    (test_native_quant_linear checks it against a plain reference), as the in-memory model
    whose linear layers call that kernel on the same codes does, and no weight is dequantized
    into a buffer."""
    import_model(client, folder, namespace="lm", progress=False, quantize=(form,))
    model = load_causal_lm(client, namespace="lm", quantization=form)
    inputs = prompts(3, 1)
    got = logits(model, inputs)
    assert offload_state(model).dequantized.idle_bytes() == 0
    assert torch.equal(got, logits(computing_from_codes(in_memory(folder), form), inputs))
    assert client.stats()["clients"][0]["leases"] == 0


def test_streamed_int8_generation_keeps_the_greedy_tokens_of_its_copies_dequantized(
        client: Any, folder: str) -> None:
    """The decode steps multiply from the codes (float32 sums in the kernel's order, code *
    scale not rounded to the weight's type first), so their logits are not the dequantized
    model's bit for bit. Each linear output differs from the dequantized weight's product by
    at most about (2 gamma(n + 3) + u) sum |x| |w| (u = 2^-24 for this float32 model, n = 32
    or 48 features: under 1e-5 of sum |x| |w|); the test allows 1e-4 of the largest |logit|
    for the whole 2-layer model (measured: 1.5e-7), and asks for the same greedy tokens."""
    import_model(client, folder, namespace="lm", progress=False, quantize=("int8",))
    model = load_causal_lm(client, namespace="lm", quantization="int8")
    reference = in_memory(folder, "int8")
    step = prompts(3, 1)
    expected = logits(reference, step)
    assert (logits(model, step) - expected).abs().max().item() <= 1e-4 * expected.abs().max().item()
    inputs = prompts()
    options = dict(max_new_tokens=6, do_sample=False)
    assert torch.equal(model.generate(**inputs, **options),
                       reference.generate(**inputs, **options))
    assert client.stats()["clients"][0]["leases"] == 0


def test_streamed_int8_logits_are_within_the_derived_bound_of_full_precision(
        client: Any, folder: str) -> None:
    """The bound: an int8 code is within half a step, 1/254 of its block's largest weight, of
    the weight, so each linear layer's output moves by at most about 0.4% of what the block's
    largest weights contribute, with the rounding errors of a row's blocks independent and
    centred. Four quantized stages (attention and MLP of 2 layers) compounding in the worst
    case move the logits by about 4 x 0.4% = 1.6% of their scale; the test allows 2% of the
    largest |logit| for the largest difference and 0.5% for the mean (measured here: 0.27%
    and 0.044%; docs/BENCHMARKS.md has the table)."""
    import_model(client, folder, namespace="lm", progress=False, quantize=("int8",))
    inputs = prompts()
    exact = logits(in_memory(folder), inputs)
    streamed = logits(load_causal_lm(client, namespace="lm", quantization="int8"), inputs)
    scale = exact.abs().max().item()
    difference = (streamed - exact).abs()
    assert difference.max().item() <= 0.02 * scale
    assert difference.mean().item() <= 0.005 * scale
    assert (streamed.argmax(-1) == exact.argmax(-1)).float().mean().item() >= 0.9


def test_an_output_projection_of_its_own_gets_a_copy_its_record_names(
        client: Any, untied_folder: str) -> None:
    import_model(client, untied_folder, namespace="lm", progress=False, quantize=("int8",))
    record = require_model(client, "lm")["quantized"]["int8"]
    assert record["output_projection"] == "lm_head.weight"
    assert "lm_head.weight" in record["tensors"]
    held = {t.name for t in client.list(namespace="lm")}
    assert {"__int8__/lm_head.weight", "__int8_scales__/lm_head.weight"} <= held


def test_the_output_projection_streams_in_full_precision_unless_asked(
        client: Any, untied_folder: str) -> None:
    """Bit for bit, a decode step: by default every linear layer but the output projection
    multiplies from its codes; with quantized_lm_head the output projection does too."""
    import_model(client, untied_folder, namespace="lm", progress=False, quantize=("int8",))
    step = prompts(3, 1)
    for head in (False, True):
        model = load_causal_lm(client, namespace="lm", quantization="int8",
                               quantized_lm_head=head)
        expected = logits(computing_from_codes(in_memory(untied_folder), "int8", head=head), step)
        assert torch.equal(logits(model, step), expected)
        assert offload_state(model).dequantized.idle_bytes() == 0
    assert client.stats()["clients"][0]["leases"] == 0


def test_a_quantized_lm_head_prompt_computes_as_the_model_with_its_head_dequantized(
        client: Any, untied_folder: str) -> None:
    import_model(client, untied_folder, namespace="lm", progress=False, quantize=("int4",))
    model = load_causal_lm(client, namespace="lm", quantization="int4", quantized_lm_head=True)
    inputs = prompts()
    expected = logits(in_memory(untied_folder, "int4", head=True), inputs)
    assert torch.equal(logits(model, inputs), expected)
    assert not torch.equal(expected, logits(in_memory(untied_folder, "int4"), inputs))


def test_a_quantized_lm_head_of_a_model_whose_head_is_its_embeddings_is_refused(
        client: Any, folder: str) -> None:
    import_model(client, folder, namespace="lm", progress=False, quantize=("int8",))
    with pytest.raises(InvalidRequestError, match="full precision"):
        load_causal_lm(client, namespace="lm", quantization="int8", quantized_lm_head=True)


def test_a_quantized_lm_head_without_a_quantization_is_refused(client: Any, folder: str) -> None:
    import_model(client, folder, namespace="lm", progress=False, quantize=("int8",))
    with pytest.raises(InvalidRequestError, match="needs a quantization"):
        load_causal_lm(client, namespace="lm", quantized_lm_head=True)


def test_streamed_int4_through_a_copying_device_computes_as_its_copies_dequantized(
        client: Any, folder: str) -> None:
    # The CPU as a device that copies (the CUDA path's code, run here): the codes and scales
    # come into the device budget, and are dequantized there (inputs of more rows than
    # FUSED_MAX_ROWS: fewer would multiply from the copied codes, the CPU being the device).
    import_model(client, folder, namespace="lm", progress=False, quantize=("int4",))
    model = load_causal_lm(client, namespace="lm", quantization="int4", copier=CpuCopier(),
                           device_budget_bytes=64 << 10)
    inputs = prompts(2, FUSED_MAX_ROWS["int4"] // 2 + 1)
    assert torch.equal(logits(model, inputs), logits(in_memory(folder, "int4"), inputs))
    assert client.stats()["clients"][0]["leases"] == 0


def test_asking_for_a_form_not_imported_says_how_to_add_it(client: Any, folder: str) -> None:
    import_model(client, folder, namespace="lm", progress=False, quantize=("int8",))
    with pytest.raises(QuantizedFormNotFoundError, match="--quantize int4") as raised:
        load_causal_lm(client, namespace="lm", quantization="int4")
    assert "int8" in str(raised.value)  # what it does hold


def test_a_reimport_of_the_unchanged_model_adds_a_form_it_lacks(client: Any, folder: str) -> None:
    import_model(client, folder, namespace="lm", progress=False, read_only=False)
    before = {t.name: t.version for t in client.list(namespace="lm")
              if not t.name.startswith("__model__")}
    report = import_model(client, folder, namespace="lm", progress=False, read_only=False,
                          quantize=("int8",))
    assert not report.skipped and report.added == ("int8",) and report.quantized == ("int8",)
    after = {t.name: t.version for t in client.list(namespace="lm")}
    assert all(after[name] == version for name, version in before.items())  # not rewritten
    assert any(name.startswith("__int8__/") for name in after)
    assert list_models(client)[0].quantized == ("int8",)
    load_causal_lm(client, namespace="lm", quantization="int8")
    again = import_model(client, folder, namespace="lm", progress=False, read_only=False,
                         quantize=("int8",))
    assert again.skipped and again.quantized == ("int8",)


def test_a_form_cannot_be_added_to_a_sealed_namespace(client: Any, folder: str) -> None:
    import_model(client, folder, namespace="lm", progress=False)  # read-only, sealed
    with pytest.raises(ReadOnlyNamespaceError, match="into another namespace"):
        import_model(client, folder, namespace="lm", progress=False, quantize=("int4",))
    assert not any(t.name.startswith("__int4") for t in client.list(namespace="lm"))


def test_the_commands_import_a_form_and_generate_from_it(daemon: Any, folder: str,
                                                        capsys: Any) -> None:
    from infinity.cli.main import main

    flags = settings_as_flags(daemon.config)
    assert main(["import", folder, "--namespace", "lm", "--quantize", "int8,int4", *flags]) == 0
    assert "quantized copies: int8, int4" in capsys.readouterr().out
    assert main(["generate", "--namespace", "lm", "--quantization", "int4", "--max-new-tokens",
                 "5", "Odd prompt", *flags]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Odd prompt") and "5 tokens" in err


def test_the_generate_command_streams_the_lm_head_copy_when_asked(daemon: Any, untied_folder: str,
                                                                  capsys: Any) -> None:
    from infinity.cli.main import main

    flags = settings_as_flags(daemon.config)
    assert main(["import", untied_folder, "--namespace", "lm", "--quantize", "int8", *flags]) == 0
    capsys.readouterr()
    assert main(["generate", "--namespace", "lm", "--quantization", "int8", "--quantized-lm-head",
                 "--max-new-tokens", "4", "Odd prompt", *flags]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Odd prompt") and "4 tokens" in err


def test_the_generate_command_passes_quantized_lm_head_on(daemon: Any, folder: str,
                                                          capsys: Any) -> None:
    # Asked without a quantization, the flag reaches load_causal_lm, which refuses it.
    from infinity.cli.main import main

    flags = settings_as_flags(daemon.config)
    assert main(["import", folder, "--namespace", "lm", *flags]) == 0
    capsys.readouterr()
    assert main(["generate", "--namespace", "lm", "--quantized-lm-head", "Odd prompt",
                 *flags]) == 2
    assert "needs a quantization" in capsys.readouterr().err
