"""A character-level tokenizer that transformers and vLLM load from a local directory.

There is no model hub on the machines rlframe targets by default, so the project builds its own
tokenizer: one token per character of a fixed alphabet, plus special tokens. It is a
`PreTrainedTokenizerFast` (WordLevel model, split into single characters, decoded by fusing), so
`save_pretrained` / `AutoTokenizer.from_pretrained` and vLLM's tokenizer loading all work.
"""

from __future__ import annotations

import string
from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# Printable ASCII without the form-feed/vertical-tab oddities, plus newline.
ALPHABET = "".join(ch for ch in string.printable if ch not in "\x0b\x0c\r\t")

# The chat template joins user turns and ends the prompt with "=" as the answer cue; assistant
# turns (for SFT data) follow with their content and EOS. Kept tiny because sequences are chars.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{% endif %}"
)


def build_char_tokenizer():
    """Return a `PreTrainedTokenizerFast` over `ALPHABET` with pad/bos/eos/unk specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in ALPHABET:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_char_tokenizer(out_dir: str | Path):
    """Build the tokenizer and `save_pretrained` it into `out_dir`; returns the tokenizer."""
    tok = build_char_tokenizer()
    tok.save_pretrained(str(out_dir))
    return tok
