"""A tiny reward model for the arithmetic task: a stock HF sequence classifier with its own tokenizer.

`build_reward_model()` returns a local directory holding a `Qwen2ForSequenceClassification`
(num_labels=1, the score read at the last non-pad token) that scores "prompt, answer" high when the
answer is the right sum and low when it is wrong, loadable by `AutoModelForSequenceClassification`
with its tokenizer by `AutoTokenizer`. It is briefly trained here (binary cross-entropy on the
logit, half right and half wrong answers to the arithmetic task's train split; wrong answers are
near misses: one digit off, off by ten, swapped digits, a random number, an empty answer) for 200
steps from the pre-trained demo policy (its embeddings moved to the RM tokenizer's ids) and a fixed seed, and cached under `$RLFRAME_CACHE/models/` in a directory named by a hash of the recipe
(written to a temporary directory and renamed into place, as `pretrain.py` does).

Its tokenizer is deliberately not the policy's: the same characters in another order (every id
differs from the character tokenizer's), other special tokens and another chat template
("Q: ...\\nA: ...</s>"), so a run that uses it must re-tokenize the response from text
(docs/reward_models.md). `rm_accuracy` measures how often it ranks the right answer above a wrong one
and how often its sign is right on held-out problems.

`python -m rlframe.data.tiny_rm` builds (or finds) it and prints its path and accuracy.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

FORMAT_VERSION = 1
RM_PAD, RM_BOS, RM_EOS, RM_UNK = "<s_pad>", "<s>", "</s>", "<s_unk>"
RM_SPECIAL_TOKENS = (RM_UNK, RM_EOS, RM_BOS, RM_PAD)  # another order than the policy's (pad, bos, eos, unk)
RM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ 'A: ' + message['content'] + eos_token }}"
    "{% else %}{{ 'Q: ' + message['content'] + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'A: ' }}{% endif %}"
)


@dataclass(frozen=True)
class RMRecipe:
    """Shape and training of the tiny reward model (all of it goes into the cache key)."""

    hidden_size: int = 128  # the shape of a random init (init="random"); "policy" takes the demo's (the same)
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 384
    steps: int = 200
    batch_size: int = 64
    lr: float = 1e-3
    warmup: int = 20
    weight_decay: float = 0.01
    threads: int = 1
    # "policy": start from the pre-trained demo policy (rlframe/data/presets/demo), its embedding rows
    # moved to this tokenizer's ids, as InstructGPT's reward model starts from the SFT model;
    # "random": a seeded random init of the shape above.
    init: str = "policy"


def build_rm_tokenizer():
    """The reward model's character tokenizer: the policy's alphabet reversed, its own specials and
    chat template, in the byte-level form `rlframe.data.tokenizer` explains (so AutoTokenizer loads it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rlframe.data.tokenizer import ALPHABET, _byte_to_unicode

    to_unicode = _byte_to_unicode()
    vocab = {tok: i for i, tok in enumerate(RM_SPECIAL_TOKENS)}
    for ch in reversed(ALPHABET):
        vocab.setdefault(to_unicode[ord(ch)], len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=RM_UNK))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=RM_PAD, bos_token=RM_BOS, eos_token=RM_EOS,
                                  unk_token=RM_UNK, padding_side="left")
    tok.chat_template = RM_CHAT_TEMPLATE
    return tok


def wrong_answer(a_plus_b: str, rng: random.Random) -> str:
    """A plausible wrong answer to a sum whose right answer is `a_plus_b` (never equal to it)."""
    right = int(a_plus_b)
    for _ in range(20):
        kind = rng.randrange(6)
        if kind == 0:
            cand = str(right + rng.choice([-3, -2, -1, 1, 2, 3]))
        elif kind == 1:
            cand = str(right + rng.choice([-20, -10, 10, 20]))
        elif kind == 2 and len(a_plus_b) > 1:
            cand = a_plus_b[::-1].lstrip("0") or "0"
        elif kind == 3:
            cand = str(rng.randrange(0, 199))
        elif kind == 4:
            cand = a_plus_b + str(rng.randrange(10))  # one digit too many
        else:
            cand = "" if rng.random() < 0.5 else a_plus_b[:-1]  # nothing, or one digit short
        if cand != a_plus_b and not cand.startswith("-"):
            return cand
    return str(right + 1)


def labelled_examples(pairs: list[tuple[str, str]], *, seed: int) -> list[tuple[str, str, float]]:
    """(prompt, answer, label): every problem once with its right answer (1) and once with a wrong one (0)."""
    rng = random.Random(seed)
    out = []
    for prompt, answer in pairs:
        out += [(prompt, answer, 1.0), (prompt, wrong_answer(answer, rng), 0.0)]
    return out


def rm_texts(tokenizer, items) -> list[str]:
    """The chat-template text the reward model scores for (prompt, answer[, label]) items."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": it[0]}, {"role": "assistant", "content": it[1]}],
                                          tokenize=False) for it in items]


def encode_left(tokenizer, texts: list[str]):
    """Left-padded (B, T) input_ids and attention_mask of `texts` (no special tokens added)."""
    import torch

    seqs = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s)
        mask[i, width - len(s):] = 1
    return ids, mask


def score_texts(model, tokenizer, items, *, batch_size: int = 256):
    """(B,) scores of (prompt, answer) items."""
    import torch

    out = []
    with torch.no_grad():
        for s in range(0, len(items), batch_size):
            ids, mask = encode_left(tokenizer, rm_texts(tokenizer, items[s:s + batch_size]))
            out.append(model(input_ids=ids, attention_mask=mask).logits[:, 0].float())
    return torch.cat(out)


def rm_accuracy(model, tokenizer, pairs: list[tuple[str, str]], *, seed: int = 1) -> dict:
    """On (prompt, right answer) pairs: `pairwise` = share of problems whose right answer scores above a
    wrong one; `sign` = share of all 2N answers whose score has the right sign (>0 right, <0 wrong)."""
    items = labelled_examples(pairs, seed=seed)
    s = score_texts(model, tokenizer, items)
    right, wrong = s[0::2], s[1::2]
    return {"pairwise": float((right > wrong).float().mean()),
            "sign": float(((right > 0).float().sum() + (wrong < 0).float().sum()) / len(items)),
            "n": len(pairs), "mean_right": float(right.mean()), "mean_wrong": float(wrong.mean())}


def _train_into(tmp: Path, *, seed: int, recipe: RMRecipe) -> dict:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    from rlframe.data.pretrain import PRETRAIN_SEED, SFTConfig, sft_examples

    tok = build_rm_tokenizer()
    tok.save_pretrained(str(tmp))
    # The policy's train/test split (pretrain.py), so the held-out problems stay held out here too.
    train_pairs, test_pairs = sft_examples("arithmetic", seed=PRETRAIN_SEED, cfg=SFTConfig())
    config = Qwen2Config(vocab_size=len(tok), hidden_size=recipe.hidden_size, intermediate_size=recipe.intermediate_size,
                         num_hidden_layers=recipe.num_layers, num_attention_heads=recipe.num_heads,
                         num_key_value_heads=recipe.num_heads, max_position_embeddings=256, tie_word_embeddings=False,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         num_labels=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        torch.manual_seed(seed)
        model = (_from_policy(tok) if recipe.init == "policy"
                 else Qwen2ForSequenceClassification(config).to(torch.float32))
        train = labelled_examples(train_pairs, seed=seed)
        gen = torch.Generator().manual_seed(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay, betas=(0.9, 0.98))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / recipe.warmup))
        model.train()
        start, losses = time.perf_counter(), []
        for _ in range(recipe.steps):
            batch = [train[i] for i in torch.randint(len(train), (recipe.batch_size,), generator=gen).tolist()]
            ids, mask = encode_left(tok, rm_texts(tok, batch))
            logits = model(input_ids=ids, attention_mask=mask).logits[:, 0]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.tensor([b[2] for b in batch]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
        wall = time.perf_counter() - start
        model.eval()
        model.save_pretrained(str(tmp))
        # what a user gets: the saved files through the Auto classes
        loaded = AutoModelForSequenceClassification.from_pretrained(str(tmp), dtype=torch.float32).eval()
        acc = rm_accuracy(loaded, AutoTokenizer.from_pretrained(str(tmp)), test_pairs)
    finally:
        torch.set_num_threads(threads)
    info = {"seed": seed, "recipe": asdict(recipe), "format_version": FORMAT_VERSION, "train_wall_s": round(wall, 2),
            "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4), "heldout": acc,
            "weights_sha256": hashlib.sha256((tmp / "model.safetensors").read_bytes()).hexdigest()}
    (tmp / "rlframe_rm.json").write_text(json.dumps(info, indent=2))
    return info


def _from_policy(rm_tok):
    """The demo policy as a sequence classifier over `rm_tok`: its transformer, its input embedding of
    each character (and of pad/bos/eos/unk) at that token's id in `rm_tok`, a new score head (seeded)."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForSequenceClassification

    from rlframe.data.pretrain import build_pretrained_model

    src = build_pretrained_model(preset="demo")
    pol_tok = AutoTokenizer.from_pretrained(str(src))
    model = Qwen2ForSequenceClassification.from_pretrained(str(src), num_labels=1, dtype=torch.float32)
    old = model.get_input_embeddings().weight.detach().clone()
    pol_vocab = pol_tok.get_vocab()
    roles = {rm_tok.pad_token: pol_tok.pad_token, rm_tok.bos_token: pol_tok.bos_token,
             rm_tok.eos_token: pol_tok.eos_token, rm_tok.unk_token: pol_tok.unk_token}
    new = torch.nn.Embedding(len(rm_tok), old.shape[1])
    with torch.no_grad():
        for token, rm_id in rm_tok.get_vocab().items():
            new.weight[rm_id] = old[pol_vocab[roles.get(token, token)]]
    model.set_input_embeddings(new)
    for key, tid in (("pad_token_id", rm_tok.pad_token_id), ("bos_token_id", rm_tok.bos_token_id),
                     ("eos_token_id", rm_tok.eos_token_id)):
        setattr(model.config, key, tid)
    model.config.vocab_size = len(rm_tok)
    model.config.num_labels = 1
    return model


def cache_key(*, seed: int, recipe: RMRecipe) -> str:
    blob = json.dumps({"v": FORMAT_VERSION, "seed": seed, **asdict(recipe)}, sort_keys=True).encode()
    return f"rm-arithmetic-s{seed}-n{recipe.steps}-{hashlib.sha256(blob).hexdigest()[:12]}"


def build_reward_model(*, seed: int = 0, recipe: RMRecipe | None = None, cache_dir: str | Path | None = None) -> Path:
    """Directory of the tiny arithmetic reward model: cached, or trained now (seconds) and cached."""
    from rlframe.data.pretrain import default_cache_dir

    recipe = recipe or RMRecipe()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / "models" / cache_key(seed=seed, recipe=recipe)
    if (final / "rlframe_rm.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        _train_into(tmp, seed=seed, recipe=recipe)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished the same model first
            if not (final / "rlframe_rm.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def main() -> int:
    path = build_reward_model()
    info = json.loads((path / "rlframe_rm.json").read_text())
    print(f"{path}\nheld-out: {json.dumps(info['heldout'])}; trained in {info['train_wall_s']} s")
    print(f"use it with: reward.model_paths=[{path}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
