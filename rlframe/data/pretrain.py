"""Brief supervised pre-training of the tiny model on a synthetic task, cached on disk.

RL needs a policy that already gets some answers right: a random model never samples a correct
sum, so every reward is 0 and there is nothing to reinforce. `build_pretrained_model` trains the
preset's random init (seeded) with a plain single-process torch loop on the task's train split
for a small step budget (cross-entropy on the answer and EOS only, prompt tokens masked), so the
model learns the format "answer then EOS" and part of the arithmetic. The budget is chosen so the
result is partially competent (see docs/tiny_model.md for the measured accuracies). The agent preset
trains the same way on multi-turn transcripts of the tool task in its chat format (`encode_chat_batch`:
loss on the assistant turns only), with its own default recipe (`DEFAULT_SFT`).

The training runs in a child process (`python -m rlframe.data.pretrain`) started with the
environment of `REPRODUCIBLE_ENV` and a fixed thread count, so that neither the machine nor the
caller's torch settings change the result: on x86-64 CPUs with AVX2 (Intel or AMD, with or without
AVX512, any core count) and the same torch and transformers, the weights are bitwise identical
(docs/tiny_model.md says what is pinned, what it costs and what still varies).

The result is cached under `cache_dir` (default `$RLFRAME_CACHE` or `~/.cache/rlframe`) in a
directory named by a hash of everything that determines the weights (preset, task, seed, steps,
optimiser settings, thread count, format version). It is written to a temporary directory and renamed into place,
so a crash or a concurrent builder never leaves a half-written model behind.

Even pinned, AMD and Intel machines built different demo models, so the default recipe's result ships
in the repository (`rlframe/data/shipped.py`, `rlframe/data/presets/demo/`): `build_pretrained_model`
copies it, sha256-verified, into the cache instead of training (`use_shipped=False` builds anyway;
`python -m rlframe.data.rebuild demo` rebuilds the shipped files).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rlframe.data.synthetic import (GROUND_TRUTH_NOT_ANSWER, ArithmeticSpec, CountdownSpec, SeriesSpec,
                                    arithmetic_rows, countdown_rows, series_rows)
from rlframe.utils.machine import cpu_model
from rlframe.data.tool_task import ToolArithmeticSpec

# Bump when the training recipe changes in a way the key below does not capture.
# 3: trained in a child process with REPRODUCIBLE_ENV (AVX2 ATen kernels, MKL CNR COMPATIBLE).
FORMAT_VERSION = 3

# Environment of the pre-training child, in place before torch is loaded there. fp32 results on CPU
# depend on which kernels run (chosen from the CPU's instruction sets and vendor) and on how sums are
# split between threads; 350 steps of AdamW turn last-bit differences into different models (held-out
# accuracy 25.8% on one machine, 44.5% on another). Each setting below removes one such dependence.
REPRODUCIBLE_ENV: dict[str, str] = {
    # ATen's vectorised kernels (softmax, RMSNorm, SiLU, reductions, AdamW's element-wise math, the
    # attention kernel's exp): torch picks the AVX512 build where the CPU has it and the AVX2 build
    # otherwise, and the two round differently. Pin the AVX2 build; only set where the CPU has AVX2
    # and FMA (`_cpu_has_avx2`), since torch does not check and the AVX2 build would stop with an
    # illegal instruction elsewhere.
    "ATEN_CPU_CAPABILITY": "avx2",
    # MKL runs every fp32 matmul (torch's CPU linear/mm/addmm and the attention kernel's blocks call
    # MKL's sgemm; oneDNN is not used for fp32, and the child disables it besides). Its kernels differ
    # by ISA (AVX512 / AVX2) and by vendor: on AMD CPUs MKL uses its own code path and ignores both
    # MKL_ENABLE_INSTRUCTIONS and the ISA branches of MKL_CBWR (MKL_CBWR=AVX2 silently becomes AUTO
    # there), so AVX2 on Intel and on AMD still disagree. COMPATIBLE is the one conditional-numerical-
    # reproducibility branch MKL honours on every x86-64 CPU: SSE2 code without the approximate
    # rcpps/rsqrtps, fixed cache sizes, static scheduling. It makes matmuls about 2x slower.
    "MKL_CBWR": "COMPATIBLE",
    # MKL and OpenMP use exactly the thread count they are given (the count itself is pinned by
    # `reproducible_env`, from SFTConfig.threads), never fewer at run time.
    "MKL_DYNAMIC": "FALSE",
    "OMP_DYNAMIC": "FALSE",
    # Cost only, no effect on the numbers: with more than one thread, idle OpenMP threads sleep instead
    # of spinning, which on a busy machine made a 2-thread build 3 to 5 times slower.
    "OMP_WAIT_POLICY": "PASSIVE",
}

# The seed of the tiny model a run starts from (its init and the pre-training's order) and of the
# synthetic tasks' train/test split (rlframe/controller/trainers/prepare.py): fixed, so that a run's
# `data.seed` changes only the order of its prompts, never which problems are held out.
PRETRAIN_SEED = 0

# Named task settings for pre-training; the RL demo must generate its data with the same spec
# and seed so that its test split is held out from what the model saw here.
TASKS: dict[str, ArithmeticSpec | CountdownSpec | SeriesSpec | ToolArithmeticSpec] = {
    "arithmetic": ArithmeticSpec(digits=2, min_digits=1, ops="+"),
    # Three numbers 1..9 -> an expression of them equal to the target ("6,4,9->90:" -> "(6+4)*9"),
    # trained on one solution per problem; the reward accepts any (the harder task of docs/claims.md).
    "countdown": CountdownSpec(count=3, max_number=9),
    # Arithmetic series of 1-40 terms written out ("94+9x3=" -> "2:103,1:112,0:121"), responses of ~5 to
    # ~270 characters with a long tail (the generation-bound workload, configs/grpo_series.yaml).
    "series": SeriesSpec(),
    # Multi-turn transcripts with calculator calls, in the BPE tokenizer's chat format (agent preset).
    "tool_arithmetic": ToolArithmeticSpec(),
}


@dataclass(frozen=True)
class SFTConfig:
    """Optimiser settings of the brief pre-training (AdamW, linear warmup then a constant rate).

    The rate stays constant after warmup so that a budget of N steps is a prefix of any longer
    run: the accuracy-vs-steps table in docs/tiny_model.md comes from one run. `threads` is the
    child's thread count whatever the machine has, and part of the recipe (and of the cache key):
    how sums are split between threads changes the last bits (for the default run 1, 2 and 4
    threads gave the same weights, 3 did not). One thread is the default: it splits nothing and,
    on a shared 2-core machine, was as fast as two.
    """

    steps: int = 350
    batch_size: int = 64
    lr: float = 1e-3
    warmup: int = 30
    weight_decay: float = 0.01
    num_train: int = 5000
    num_test: int = 500
    threads: int = 1


# Per-task recipe when the caller gives none (the agent's sequences are ~15x longer than the demo's).
DEFAULT_SFT: dict[str, SFTConfig] = {
    # Copying the operands into the call and the result into the answer emerges between steps 200 and
    # 400 at lr 3e-3 (not within 800 steps at 5e-3).
    "tool_arithmetic": SFTConfig(steps=400, batch_size=16, lr=3e-3, warmup=20, num_train=5000, num_test=500),
    # The series is learnt in a jump: 7% of held-out series right at step 800, 33% at 1200, 62% at 1500
    # (docs/tiny_model.md, "The shipped model").
    "series": SFTConfig(steps=1500, batch_size=32, lr=2e-3, warmup=30, num_train=5000, num_test=500),
}


def default_sft(task: str) -> SFTConfig:
    """The task's pre-training recipe when the caller gives none; its num_train / num_test are also the
    task's fixed train/test split (rlframe/controller/trainers/prepare.py)."""
    return DEFAULT_SFT.get(task, SFTConfig())


def _cpu_has_avx2() -> bool:
    """True on x86-64 Linux CPUs with AVX2 and FMA (the test torch applies to pick its AVX2 build)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return {"avx2", "fma"} <= flags
    return False


def reproducible_env(threads: int) -> dict[str, str]:
    """The variables the pre-training child is started with: REPRODUCIBLE_ENV and the thread count."""
    env = {k: v for k, v in REPRODUCIBLE_ENV.items() if k != "ATEN_CPU_CAPABILITY" or _cpu_has_avx2()}
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def default_cache_dir() -> Path:
    return Path(os.environ.get("RLFRAME_CACHE", Path.home() / ".cache" / "rlframe"))


def cache_key(*, preset: str, task: str, seed: int, cfg: SFTConfig) -> str:
    """Hash of everything that determines the pre-trained weights (thread count included)."""
    spec = asdict(TASKS[task]) if task in TASKS else task
    payload = {"v": FORMAT_VERSION, "preset": preset, "task": spec, "seed": seed, **asdict(cfg)}
    blob = json.dumps(payload, sort_keys=True).encode()
    return f"{preset}-{task}-s{seed}-n{cfg.steps}-{hashlib.sha256(blob).hexdigest()[:12]}"


def sft_examples(task: str, *, seed: int, cfg: SFTConfig) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(prompt, answer) pairs of the train and test splits the pre-training uses."""
    if task not in TASKS:
        raise ValueError(f"unknown pre-training task {task!r}; choose one of {sorted(TASKS)}")
    if isinstance(TASKS[task], ToolArithmeticSpec):
        raise ValueError(f"task {task!r} trains on conversations; use chat_sft_examples")
    rows = task_rows(task, num_train=cfg.num_train, num_test=cfg.num_test, seed=seed)

    def answer(row: dict) -> str:  # the stored solution where the ground truth is not the answer text
        if row["data_source"] in GROUND_TRUTH_NOT_ANSWER:
            return row["extra_info"]["solution"]
        return row["reward_model"]["ground_truth"]

    def pairs(split: str) -> list[tuple[str, str]]:
        return [(r["prompt"][0]["content"], answer(r)) for r in rows[split]]

    return pairs("train"), pairs("test")


def task_rows(task: str, *, num_train: int, num_test: int, seed: int) -> dict[str, list[dict]]:
    """The train/test rows of a named single-turn task (arithmetic, countdown), as its spec says."""
    spec = TASKS[task]
    if isinstance(spec, CountdownSpec):
        return countdown_rows(num_train=num_train, num_test=num_test, seed=seed, count=spec.count,
                              max_number=spec.max_number)
    if isinstance(spec, SeriesSpec):
        return series_rows(num_train=num_train, num_test=num_test, seed=seed, spec=spec)
    return arithmetic_rows(num_train=num_train, num_test=num_test, spec=spec, seed=seed)


def chat_sft_examples(task: str, *, seed: int, cfg: SFTConfig) -> tuple[list[list[dict]], list[dict]]:
    """Train transcripts (message lists, some with tool calls) and the held-out test rows of a chat task."""
    from rlframe.data.tool_task import sft_conversations, tool_rows

    spec = TASKS[task]
    rows = tool_rows(num_train=cfg.num_train, num_test=cfg.num_test, spec=spec, seed=seed)
    return sft_conversations(rows["train"], spec=spec, seed=seed), rows["test"]


def chat_segments(tokenizer, messages: list[dict]) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, trained) pieces: each assistant turn's content and its
    end-of-turn token are trained, everything before it (system, user and tool turns, the template's
    role headers) is context. The pieces join to the chat template's text without its last newline."""
    eos = tokenizer.eos_token
    segs: list[tuple[str, bool]] = []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=False)
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        assert before.startswith(done) and through.startswith(before), "the chat template must only append"
        turn = through[len(before):]
        turn = turn[: turn.rindex(eos) + len(eos)]
        segs += [(before[len(done):], False), (turn, True)]
        done = before + turn
    return segs


def encode_chat_batch(tokenizer, conversations: list[list[dict]]):
    """Right-padded (B, T) input_ids, attention_mask and labels (-100 outside the assistant turns)."""
    seqs, labels = [], []
    for messages in conversations:
        ids, lab = [], []
        for text, trained in chat_segments(tokenizer, messages):
            piece = tokenizer.encode(text, add_special_tokens=False)
            ids += piece
            lab += piece if trained else [-100] * len(piece)
        seqs.append(ids)
        labels.append(lab)
    return _pad_batch(tokenizer, seqs, labels)


def encode_sft_batch(tokenizer, pairs: list[tuple[str, str]]):
    """Right-padded (B, T) input_ids, attention_mask and labels (-100 on prompt and padding)."""
    seqs, labels = [], []
    for prompt, answer in pairs:
        p = tokenizer.encode(prompt, add_special_tokens=False)
        a = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        seqs.append(p + a)
        labels.append([-100] * len(p) + a)
    return _pad_batch(tokenizer, seqs, labels)


def _pad_batch(tokenizer, seqs: list[list[int]], labels: list[list[int]]):
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    lab = torch.full_like(ids, -100)
    for i, (s, l) in enumerate(zip(seqs, labels)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
        lab[i, : len(l)] = torch.tensor(l)
    return ids, mask, lab


class BatchDraw:
    """The indices of a training batch: `batch_size` uniform draws with replacement; with
    `bucket_of`, one uniform draw of an item picks its length class and the batch is drawn within it."""

    def __init__(self, train: list, batch_size: int, *, bucket_of=None):
        self.n, self.batch_size = len(train), batch_size
        classes: dict = {}
        for i, item in enumerate(train if bucket_of is not None else ()):
            classes.setdefault(bucket_of(item), []).append(i)
        self.members_of = {i: members for members in classes.values() for i in members}

    def __call__(self, gen) -> list[int]:
        import torch

        if not self.members_of:
            return torch.randint(self.n, (self.batch_size,), generator=gen).tolist()
        members = self.members_of[int(torch.randint(self.n, (1,), generator=gen))]
        return [members[j] for j in torch.randint(len(members), (self.batch_size,), generator=gen).tolist()]


def sft_train(
    model, tokenizer, train: list, *, cfg: SFTConfig, seed: int, callback=None, encode=encode_sft_batch,
    bucket_of=None,
) -> list[float]:
    """Train `model` in place for `cfg.steps` steps; returns the loss of every step.

    `train` holds what `encode(tokenizer, items)` turns into a batch: (prompt, answer) pairs for
    `encode_sft_batch`, message lists for `encode_chat_batch`. `callback(step, model)` (optional)
    runs after every step, e.g. to evaluate along the way. With `bucket_of(item)` (a length class),
    each batch is drawn from one class, that of an item drawn uniformly: every item is still drawn
    with the same probability, and a batch is padded to its own class's length instead of the
    longest of the task (series: about 3 times less compute).
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    draw = BatchDraw(train, cfg.batch_size, bucket_of=bucket_of)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / cfg.warmup))
    model.train()
    losses = []
    for step in range(cfg.steps):
        idx = draw(gen)
        ids, mask, labels = encode(tokenizer, [train[i] for i in idx])
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
    import numpy as np
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlframe.data.tiny_model import build_random_model

    build_random_model(tmp, preset=preset, seed=seed)
    tok = AutoTokenizer.from_pretrained(str(tmp))
    model = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32)
    bucket_of = None
    if isinstance(TASKS[task], ToolArithmeticSpec):
        train, encode = chat_sft_examples(task, seed=seed, cfg=cfg)[0], encode_chat_batch
    else:
        train, encode = sft_examples(task, seed=seed, cfg=cfg)[0], encode_sft_batch
        if isinstance(TASKS[task], SeriesSpec):  # batches of series of 4 lengths (1-4 terms, 5-8, ...)
            bucket_of = lambda pair: pair[1].count(",") // 4  # noqa: E731
    start, cpu = time.perf_counter(), time.process_time()
    losses = sft_train(model, tok, train, cfg=cfg, seed=seed, encode=encode, bucket_of=bucket_of)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    model.save_pretrained(str(tmp))
    info = {
        "preset": preset, "task": task, "seed": seed, "sft": asdict(cfg), "format_version": FORMAT_VERSION,
        "sft_wall_s": round(wall, 2), "sft_cpu_s": round(cpu, 2),
        "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4) if losses else None,  # 0 steps: none
        "weights_sha256": hashlib.sha256((tmp / "model.safetensors").read_bytes()).hexdigest(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "env": {k: os.environ.get(k) for k in reproducible_env(cfg.threads)},
        "torch": torch.__version__, "transformers": transformers.__version__,
        # What else the bits may depend on, to compare two machines that disagree (docs/tiny_model.md).
        "python": platform.python_version(), "numpy": np.__version__, "libc": " ".join(platform.libc_ver()),
        "cpu": cpu_model(), "mkl": _torch_blas(),
    }
    (tmp / "rlframe_pretrain.json").write_text(json.dumps(info, indent=2))
    return info




def _torch_blas() -> str:
    """The MKL build torch carries (the library behind every fp32 matmul of the pre-training)."""
    import torch

    return next((ln.strip(" -") for ln in torch.__config__.show().splitlines() if "Math Kernel Library" in ln), "")


def _child_main(argv: list[str]) -> None:
    """Entry point of the pre-training child: `python -m rlframe.data.pretrain '<json>'`."""
    args = json.loads(argv[0])
    cfg = SFTConfig(**args["cfg"])
    import torch

    torch.set_num_threads(cfg.threads)
    # Keep fp32 matmuls on MKL (pinned by MKL_CBWR) even in a torch that would route them to oneDNN,
    # whose kernels are chosen per CPU.
    torch.backends.mkldnn.enabled = False
    _train_into(Path(args["out"]), preset=args["preset"], task=args["task"], seed=args["seed"], cfg=cfg)


def _train_in_child(tmp: Path, *, preset: str, task: str, seed: int, cfg: SFTConfig) -> None:
    """Run `_train_into` in a fresh interpreter started with `reproducible_env(cfg.threads)`."""
    env = dict(os.environ)
    env.update(reproducible_env(cfg.threads))
    root = str(Path(__file__).resolve().parents[2])  # the directory holding the rlframe package
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    args = {"out": str(tmp), "preset": preset, "task": task, "seed": seed, "cfg": asdict(cfg)}
    proc = subprocess.run([sys.executable, "-m", "rlframe.data.pretrain", json.dumps(args)], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pre-training child failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


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
    use_shipped: bool = True,
) -> Path:
    """Return the directory of the pre-trained model: the shipped one, the cached one, or a new build.

    The directory holds an HF Qwen2 model, the preset's tokenizer and `rlframe_pretrain.json`
    (settings, SFT wall time, final loss, sha256 of the weights, the pinned environment, the machine).
    When the recipe is one shipped in the repository (rlframe/data/shipped.py: the demo model of the
    default configs) and `use_shipped`, its verified files are copied into the cache and nothing is
    trained, so every machine starts from the same bits. Otherwise the training runs in a child process
    with REPRODUCIBLE_ENV, so the weights depend only on the arguments and the installed
    torch/transformers (and, as measured, on whether the CPU is AMD or Intel: docs/tiny_model.md).
    """
    source, shipped, final, cfg = _source(preset=preset, task=task, seed=seed, steps=steps, cache_dir=cache_dir,
                                          cfg=cfg, use_shipped=use_shipped)
    if source == "shipped":
        from rlframe.data.shipped import install_shipped

        return install_shipped(shipped, final)
    if source == "build":
        _build_into(final, preset=preset, task=task, seed=seed, cfg=cfg)
    return final


def pretrained_source(*, preset: str = "demo", task: str = "arithmetic", seed: int = 0, steps: int | None = None,
                      cache_dir: str | Path | None = None, use_shipped: bool = True) -> str:
    """Where `build_pretrained_model` with these arguments takes the model from, without doing it:
    "shipped" (the repository's pre-trained copy), "cached" (built earlier on this machine) or "build"
    (trained now, in a child process)."""
    return _source(preset=preset, task=task, seed=seed, steps=steps, cache_dir=cache_dir, cfg=None,
                   use_shipped=use_shipped)[0]


def _source(*, preset: str, task: str, seed: int, steps: int | None, cache_dir, cfg: SFTConfig | None,
            use_shipped: bool):
    """(source, the shipped entry or None, the model's directory in the cache, the recipe): the one
    decision of `build_pretrained_model` and `pretrained_source`."""
    cfg = _recipe(preset, task, steps, cfg)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = cache_key(preset=preset, task=task, seed=seed, cfg=cfg)
    if use_shipped:
        from rlframe.data.shipped import find_shipped

        if (shipped := find_shipped(key)) is not None:
            return "shipped", shipped, root / "models" / f"{key}-shipped", cfg
    final = root / "models" / key
    return ("cached" if (final / "rlframe_pretrain.json").exists() else "build"), None, final, cfg


def _recipe(preset: str, task: str, steps: int | None, cfg: SFTConfig | None) -> SFTConfig:
    """The SFT settings of a build (the task's default unless given), after checking preset and task."""
    from rlframe.data.tiny_model import PRESETS

    cfg = cfg or default_sft(task)
    if steps is not None:
        cfg = SFTConfig(**{**asdict(cfg), "steps": steps})
    if task not in TASKS:
        raise ValueError(f"unknown pre-training task {task!r}; choose one of {sorted(TASKS)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    chat_task = isinstance(TASKS[task], ToolArithmeticSpec)
    if chat_task != (PRESETS[preset].tokenizer == "bpe"):
        raise ValueError(f"task {task!r} and preset {preset!r} do not fit: the tool task needs the chat template of "
                         "the BPE tokenizer (preset 'agent'), the other tasks the character tokenizer of the other presets")
    return cfg


def _build_into(final: Path, *, preset: str, task: str, seed: int, cfg: SFTConfig) -> None:
    """Train in a temporary directory next to `final`, then rename it into place."""
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        _train_in_child(tmp, preset=preset, task=task, seed=seed, cfg=cfg)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished the same model first; its copy is identical in content.
            if not (final / "rlframe_pretrain.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    _child_main(sys.argv[1:])
