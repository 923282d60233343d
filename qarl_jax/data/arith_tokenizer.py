"""A 128-token character-level tokenizer for the synthetic task and tiny policies.

One token per printable ASCII character (digits, operators, letters for the templates, ``\\boxed{}``),
newline and tab, plus Qwen3's special tokens, so the same templates and stop tokens work with the tiny
models as with real Qwen3 checkpoints. Padded with reserved tokens to a power-of-two vocabulary.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

EOS = "<|endoftext|>"
SPECIAL_TOKENS = (EOS, "<|im_start|>", "<|im_end|>")
UNK = "<|unk|>"
VOCAB_SIZE = 128


def build_arithmetic_tokenizer() -> Tokenizer:
    """The tokenizer; ``<|endoftext|>`` (id 0) is both padding and end of sequence."""
    chars = sorted(set(string.printable) - set("\r\x0b\x0c"))
    tokens = [*SPECIAL_TOKENS, UNK, *chars]
    tokens += [f"<|reserved_{i}|>" for i in range(VOCAB_SIZE - len(tokens))]
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer
