"""A byte-level BPE tokenizer trained here, in the form of Qwen2's, with the tool-calling chat template.

The agent preset (`rlframe/data/tiny_model.py`) needs what real chat models have and the character
tokenizer lacks: multi-character tokens, single-token turn markers and tool tags, and a chat template
with system/user/assistant/tool roles (`rlframe/data/chat_format.py`). The tokenizer is trained with
the `tokenizers` library on the texts of the tool task (`rlframe.data.tool_task.tokenizer_corpus`):

    normalizer     NFC
    pre-tokenizer  Qwen2's split regex (words, single digits, punctuation runs, whitespace), then
                   ByteLevel: every byte has a token, so any text encodes and decodes exactly
    model          BPE up to VOCAB_SIZE tokens (fewer when the corpus runs out of pairs to merge)
    added tokens   ids 0..6, in `chat_format.ADDED_TOKENS` order: <|endoftext|> (pad),
                   <|im_start|>, <|im_end|> (eos) are special; the four tool tags are not
                   (never split, kept by decode(skip_special_tokens=True)), as in Qwen2.5

These are the settings `Qwen2Tokenizer` rebuilds around the vocabulary when `AutoTokenizer` loads a
model directory whose config says `qwen2`, so both loaders give the same ids. Digits stay single
tokens (the regex splits them), as in Qwen2: a number is copied digit by digit.

`save_bpe_tokenizer(out_dir)` writes tokenizer.json and tokenizer_config.json (the chat template is
in its `chat_template` field); building twice gives byte-identical files.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlframe.data.chat_format import ADDED_TOKENS, CHAT_TEMPLATE, IM_END, PAD, SPECIAL_TOKENS

VOCAB_SIZE = 512
# Qwen2's pre-tokenization regex (the one `Qwen2Tokenizer` installs).
SPLIT_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
MAX_LENGTH = 512


def train_core(corpus: list[str], *, vocab_size: int = VOCAB_SIZE):
    """A `tokenizers.Tokenizer` trained on `corpus` (BPE merges, byte alphabet, added tokens first)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    core = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    core.decoder = decoders.ByteLevel()
    added = [AddedToken(t, special=t in SPECIAL_TOKENS, normalized=False) for t in ADDED_TOKENS]
    core.add_tokens(added)  # so that training cuts them out of the corpus texts
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False, special_tokens=added,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(corpus, trainer=trainer)
    # The trainer registers all its tokens as special (and add_tokens cannot undo that): clear the
    # flag of the tool tags in the serialized form.
    data = json.loads(core.to_str())
    for entry in data["added_tokens"]:
        entry["special"] = entry["content"] in SPECIAL_TOKENS
    return Tokenizer.from_str(json.dumps(data))


def build_bpe_tokenizer(*, vocab_size: int = VOCAB_SIZE, corpus: list[str] | None = None):
    """The transformers tokenizer: the trained core, pad/eos set, the chat template attached."""
    from transformers import PreTrainedTokenizerFast

    from rlframe.data.tool_task import tokenizer_corpus

    core = train_core(tokenizer_corpus() if corpus is None else corpus, vocab_size=vocab_size)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=IM_END, pad_token=PAD,
                                  padding_side="left", model_max_length=MAX_LENGTH, clean_up_tokenization_spaces=False)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_bpe_tokenizer(out_dir: str | Path, **kwargs):
    """Build the tokenizer and save it into `out_dir` (template inside tokenizer_config.json)."""
    tok = build_bpe_tokenizer(**kwargs)
    tok.save_pretrained(str(out_dir), save_jinja_files=False)
    return tok
