"""A character-level tokenizer that transformers and vLLM load from a local directory.

There is no model hub on the machines rlframe targets by default, so the project builds its own
tokenizer: one token per character of a fixed alphabet (printable ASCII), plus special tokens.

It is written in the byte-level form Qwen2 tokenizers use (a BPE model with no merges, ByteLevel
pre-tokenizer and decoder; space is stored as "\u0120", newline as "\u010a"). Why: in a directory
whose config.json says `model_type: qwen2`, `AutoTokenizer.from_pretrained` (transformers 5) builds a
`Qwen2Tokenizer`, which keeps the vocabulary but replaces the pre-tokenizer and decoder with the
byte-level ones. A plain character vocabulary then silently loses every space. In byte-level form
both loaders produce the same ids (tests/data/test_tokenizer.py checks this), and the ids of every
character are the same as in the earlier WordLevel version. Characters outside the alphabet map to
<unk> (one per UTF-8 byte) with this class and are dropped by Qwen2Tokenizer.
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


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map used by ByteLevel pre-tokenizers."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    mapping = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def build_char_tokenizer():
    """Return a `PreTrainedTokenizerFast` over `ALPHABET` with pad/bos/eos/unk specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    to_unicode = _byte_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in ALPHABET:
        vocab.setdefault(to_unicode[ord(ch)], len(vocab))
    # No merges: every byte is its own token, i.e. a character tokenizer over ASCII.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
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
