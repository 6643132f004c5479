"""Brief supervised pre-training of the tiny model on a synthetic task, cached on disk.

RL needs a policy that already gets some answers right: a random model never samples a correct
sum, so every reward is 0 and there is nothing to reinforce. `build_pretrained_model` trains the
preset's random init (seeded) with a plain single-process torch loop on the task's train split
for a small step budget (cross-entropy on the answer and EOS only, prompt tokens masked), so the
model learns the format "answer then EOS" and part of the arithmetic. The budget is chosen so the
result is partially competent (see docs/tiny_model.md for the measured accuracies).

The result is cached under `cache_dir` (default `$RLFRAME_CACHE` or `~/.cache/rlframe`) in a
directory named by a hash of everything that determines the weights (preset, task, seed, steps,
optimiser settings, format version). It is written to a temporary directory and renamed into place,
so a crash or a concurrent builder never leaves a half-written model behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rlframe.data.synthetic import ArithmeticSpec, arithmetic_rows

# Bump when the training recipe changes in a way the key below does not capture.
FORMAT_VERSION = 2

# Named task settings for pre-training; the RL demo must generate its data with the same spec
# and seed so that its test split is held out from what the model saw here.
TASKS: dict[str, ArithmeticSpec] = {
    "arithmetic": ArithmeticSpec(digits=2, min_digits=1, ops="+"),
}


@dataclass(frozen=True)
class SFTConfig:
    """Optimiser settings of the brief pre-training (AdamW, linear warmup then a constant rate).

    The rate stays constant after warmup so that a budget of N steps is a prefix of any longer
    run: the accuracy-vs-steps table in docs/tiny_model.md comes from one run.
    """

    steps: int = 350
    batch_size: int = 64
    lr: float = 1e-3
    warmup: int = 30
    weight_decay: float = 0.01
    num_train: int = 5000
    num_test: int = 500
    threads: int = 2


def default_cache_dir() -> Path:
    return Path(os.environ.get("RLFRAME_CACHE", Path.home() / ".cache" / "rlframe"))


def cache_key(*, preset: str, task: str, seed: int, cfg: SFTConfig) -> str:
    """Hash of everything that determines the pre-trained weights (threads excluded on purpose)."""
    spec = asdict(TASKS[task]) if task in TASKS else task
    payload = {"v": FORMAT_VERSION, "preset": preset, "task": spec, "seed": seed, **asdict(cfg)}
    payload.pop("threads")
    blob = json.dumps(payload, sort_keys=True).encode()
    return f"{preset}-{task}-s{seed}-n{cfg.steps}-{hashlib.sha256(blob).hexdigest()[:12]}"


def sft_examples(task: str, *, seed: int, cfg: SFTConfig) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(prompt, answer) pairs of the train and test splits the pre-training uses."""
    if task not in TASKS:
        raise ValueError(f"unknown pre-training task {task!r}; choose one of {sorted(TASKS)}")
    rows = arithmetic_rows(num_train=cfg.num_train, num_test=cfg.num_test, spec=TASKS[task], seed=seed)

    def pairs(split: str) -> list[tuple[str, str]]:
        return [(r["prompt"][0]["content"], r["reward_model"]["ground_truth"]) for r in rows[split]]

    return pairs("train"), pairs("test")


def encode_sft_batch(tokenizer, pairs: list[tuple[str, str]]):
    """Right-padded (B, T) input_ids, attention_mask and labels (-100 on prompt and padding)."""
    import torch

    seqs, labels = [], []
    for prompt, answer in pairs:
        p = tokenizer.encode(prompt, add_special_tokens=False)
        a = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        seqs.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    lab = torch.full_like(ids, -100)
    for i, (s, l) in enumerate(zip(seqs, labels)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
        lab[i, : len(l)] = torch.tensor(l)
    return ids, mask, lab


def sft_train(
    model, tokenizer, train: list[tuple[str, str]], *, cfg: SFTConfig, seed: int, callback=None
) -> list[float]:
    """Train `model` in place for `cfg.steps` steps; returns the loss of every step.

    `callback(step, model)` (optional) runs after every step, e.g. to evaluate along the way.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / cfg.warmup))
    model.train()
    losses = []
    for step in range(cfg.steps):
        idx = torch.randint(len(train), (cfg.batch_size,), generator=gen).tolist()
        ids, mask, labels = encode_sft_batch(tokenizer, [train[i] for i in idx])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if callback is not None:
            callback(step + 1, model)
    model.eval()
    return losses


def _train_into(tmp: Path, *, preset: str, task: str, seed: int, cfg: SFTConfig) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlframe.data.tiny_model import build_random_model

    build_random_model(tmp, preset=preset, seed=seed)
    tok = AutoTokenizer.from_pretrained(str(tmp))
    model = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32)
    train, _ = sft_examples(task, seed=seed, cfg=cfg)
    start, cpu = time.perf_counter(), time.process_time()
    losses = sft_train(model, tok, train, cfg=cfg, seed=seed)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    model.save_pretrained(str(tmp))
    info = {
        "preset": preset, "task": task, "seed": seed, "sft": asdict(cfg), "format_version": FORMAT_VERSION,
        "sft_wall_s": round(wall, 2), "sft_cpu_s": round(cpu, 2),
        "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
    }
    (tmp / "rlframe_pretrain.json").write_text(json.dumps(info, indent=2))
    return info


STALE_TEMP_S = 2 * 3600


def _remove_stale_temp_dirs(final: Path) -> None:
    """Delete temp dirs of this model left by killed builders (a live build is far younger)."""
    for stale in final.parent.glob(f".{final.name}.*"):
        try:
            if time.time() - stale.stat().st_mtime > STALE_TEMP_S:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass  # removed concurrently


def build_pretrained_model(
    *,
    preset: str = "demo",
    task: str = "arithmetic",
    seed: int = 0,
    steps: int | None = None,
    cache_dir: str | Path | None = None,
    cfg: SFTConfig | None = None,
) -> Path:
    """Return the directory of the pre-trained model, training it first if it is not cached.

    The directory holds an HF Qwen2 model, the char tokenizer and `rlframe_pretrain.json`
    (settings, SFT wall time, final loss). Deterministic from `seed` on a given machine and
    thread count.
    """
    import torch

    cfg = cfg or SFTConfig()
    if steps is not None:
        cfg = SFTConfig(**{**asdict(cfg), "steps": steps})
    if task not in TASKS:
        raise ValueError(f"unknown pre-training task {task!r}; choose one of {sorted(TASKS)}")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / "models" / cache_key(preset=preset, task=task, seed=seed, cfg=cfg)
    if (final / "rlframe_pretrain.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        _train_into(tmp, preset=preset, task=task, seed=seed, cfg=cfg)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished the same model first; its copy is identical in content.
            if not (final / "rlframe_pretrain.json").exists():
                raise
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(tmp, ignore_errors=True)
    return final
