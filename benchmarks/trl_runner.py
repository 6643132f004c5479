"""TRL's GRPOTrainer on a local model directory: the peer side of `benchmarks/vs_trl.py`.

Runs inside TRL's own virtual environment (vs_trl.py creates it; TRL is no dependency of rlframe),
so it imports nothing from rlframe. Input: a model directory and JSONL prompt files written by
vs_trl.py ({"prompt": [chat messages], "answer": "146"}). Output: one JSON object (per-step wall
times, generation times, token counts, start-up time, held-out greedy accuracy) written to --out.

    TRL_VENV/bin/python benchmarks/trl_runner.py --model DIR --train train.jsonl --out out.json \
        [--test test.jsonl] [--steps 8] [--prompts 64] [--n 4] [--new-tokens 16] [--lr 1e-5]

The settings mirror rlframe's GRPO: one optimizer step per generated batch (num_iterations=1, so
TRL uses the current log-probs as old ones), token-mean loss over the batch ("dapo"), group-scaled
advantages, no KL (beta=0, no reference model), fp32 on CPU, micro-batches of 32 completions.
"""

from __future__ import annotations

import argparse
import json
import time

T_LAUNCH = time.time()


def exact_match_reward(completions, answer, **_):
    """1.0 where the stripped completion is exactly the answer (rlframe's `arithmetic_score`)."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(t.strip() == str(a).strip()) for t, a in zip(texts, answer)]


def greedy_accuracy(model, tok, rows, *, new_tokens: int, batch: int = 256) -> float:
    import torch

    model.eval()
    correct = 0
    tok.padding_side = "left"
    with torch.no_grad():
        for i in range(0, len(rows), batch):
            chunk = rows[i:i + batch]
            texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in chunk]
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
            for r, ids in zip(chunk, out[:, enc["input_ids"].shape[1]:]):
                correct += tok.decode(ids, skip_special_tokens=True).strip() == str(r["answer"]).strip()
    model.train()
    return correct / max(1, len(rows))


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--test", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--micro-batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bf16", action="store_true", help="TRL's bf16 mode (the Trainer's CPU autocast)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    completions = args.prompts * args.n
    accum = completions // args.micro_batch
    config = GRPOConfig(
        output_dir=args.out + ".trainer", per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=accum, num_generations=args.n, max_completion_length=args.new_tokens,
        temperature=1.0, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, beta=0.0,
        num_iterations=1, loss_type="dapo", max_steps=args.steps, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, bf16=args.bf16, fp16=False, seed=args.seed, max_grad_norm=1.0,
        adam_beta2=0.999, weight_decay=0.0, dataloader_num_workers=0, disable_tqdm=True,
        gradient_checkpointing=False,
    )
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    test = read_jsonl(args.test) if args.test else None
    acc_before = greedy_accuracy(model, tok, test, new_tokens=args.new_tokens) if test else None
    times: dict[str, list] = {"step": [], "gen": [], "generate": [], "tokens": [], "reward": []}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()
            times.setdefault("first_step_at", time.time() - T_LAUNCH)

        def on_step_end(self, *_, **__):
            times["step"].append(time.perf_counter() - self.t0)

    trainer = GRPOTrainer(model=model, reward_funcs=exact_match_reward, args=config, processing_class=tok,
                          train_dataset=Dataset.from_list(read_jsonl(args.train)), callbacks=[StepTimer()])
    _time(trainer, "_generate", times["generate"])
    inner = _time(trainer, "_generate_and_score_completions", times["gen"])

    def counted(batch):  # valid prompt + completion tokens of the batch, as rlframe counts them
        out = inner(batch)
        times["tokens"].append(int(out["prompt_mask"].sum() + out["completion_mask"].sum()))
        times["reward"].append(float(trainer._metrics["train"]["reward"][-1]))
        return out

    trainer._generate_and_score_completions = counted
    t0 = time.time()
    trainer.train()
    train_s = time.time() - t0
    acc_after = greedy_accuracy(trainer.model, tok, test, new_tokens=args.new_tokens) if test else None
    result = {**times, "train_wall_s": train_s, "accuracy_before": acc_before, "accuracy_after": acc_after,
              "threads": torch.get_num_threads()}
    with open(args.out, "w") as f:
        json.dump(result, f)


def _time(obj, name, sink):
    """Wrap obj.name so every call's wall time is appended to `sink`; returns the wrapper."""
    fn = getattr(obj, name)

    def timed(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            sink.append(time.perf_counter() - t0)

    setattr(obj, name, timed)
    return timed


if __name__ == "__main__":
    main()
