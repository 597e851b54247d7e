"""Small transformers causal LMs built from a config with seeded weights (no model hub here), for
the torch-layer tests: the same model every time it is built, so two copies compare step by step."""

from __future__ import annotations

import torch
from torch import nn


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(11)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=101,
                                      n_positions=64, eos_token_id=100, bos_token_id=100))


def llama(*, tied: bool = True) -> nn.Module:
    """Llama with its embedding tied to its output projection (`tied=False`: its own)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(13)
    return LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=103, max_position_embeddings=64,
        tie_word_embeddings=tied, eos_token_id=102, bos_token_id=101, pad_token_id=0))


def word_tokenizer(vocab_size: int) -> object:
    """A word-level fast tokenizer over words w0 .. w{vocab_size - 2} and [UNK] (the last id),
    built without the hub; `save_pretrained(folder)` writes its tokenizer files."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size - 1)} | {"[UNK]": vocab_size - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")


def save_char_tokenizer(folder: str) -> None:
    """A character-level tokenizer (98 ids: three specials and printable ASCII, so it fits both
    models' vocabularies) saved as transformers saves one, for tests that need text."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for code in range(32, 127):
        vocab[chr(code)] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)
