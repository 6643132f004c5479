"""Does RL have room to work on the pre-trained tiny model? A plain on-policy GRPO loop says.

Not the framework's trainer: a single-process reference loop (GRPO advantages, Shao et al. 2024,
"DeepSeekMath", section 4.1: per-prompt group z-scores of a 0/1 reward; one on-policy policy-gradient
step per batch, so the PPO ratio is 1 and clipping is inactive; no KL term). It checks that the
pre-trained model (docs/tiny_model.md) improves on held-out prompts with a budget like the demo's.
Reproduce: `python benchmarks/tiny_model_grpo_check.py --lr 1e-4 --steps 30 --batch 64 --n 4`
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from report import markdown_row, markdown_table

from rlframe.data.pretrain import SFTConfig, build_pretrained_model, sft_examples
from rlframe.data.tiny_eval import evaluate_pairs, generate_grouped, is_correct


def rollout(model, tok, batch, n):
    """(prompt ids, response ids incl. EOS, advantage) for every sample of groups with mixed rewards."""
    out = []
    with torch.no_grad():
        for i, resps in generate_grouped(model, tok, [p for p, _ in batch], num=n, sample=True, max_new_tokens=6):
            rewards = torch.tensor([float(is_correct(tok, r, batch[i][1])[0]) for r in resps])
            if rewards.std() == 0:
                continue  # no signal in this group
            adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
            prompt = tok.encode(batch[i][0], add_special_tokens=False)
            for r, a in zip(resps, adv.tolist()):
                out.append((prompt, r[: r.index(tok.eos_token_id) + 1] if tok.eos_token_id in r else r, a))
    return out


def pg_loss(model, tok, samples):
    """-mean over response tokens of advantage * log-prob; right-padded (B, T) batch."""
    width = max(len(p) + len(r) for p, r, _ in samples)
    ids = torch.full((len(samples), width), tok.pad_token_id)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    resp = torch.zeros(len(samples), width)
    for j, (p, r, _) in enumerate(samples):
        ids[j, : len(p) + len(r)] = torch.tensor(p + r)
        mask[j, : len(p) + len(r)] = 1
        resp[j, len(p) : len(p) + len(r)] = 1
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1], -1)
    logp = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # (B, T-1): log p(token t+1)
    adv = torch.tensor([a for _, _, a in samples]).unsqueeze(1)
    m = resp[:, 1:]
    return -(logp * m * adv).sum() / m.sum()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--eval-prompts", type=int, default=200)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    path = build_pretrained_model(cfg=SFTConfig(threads=1))
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    train, test = sft_examples("arithmetic", seed=0, cfg=SFTConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rng = random.Random(0)
    torch.manual_seed(0)
    t0 = time.time()
    print(markdown_table(["step", "greedy acc %", "pass@4 %", "sample acc %", "wall s"], []))
    for step in range(args.steps + 1):
        if step % 10 == 0:
            model.eval()
            r = evaluate_pairs(model, tok, test[: args.eval_prompts], k=4, max_new_tokens=6)
            print(markdown_row([step, f"{100 * r.greedy_acc:.1f}", f"{100 * r.pass_at_k:.1f}",
                                f"{100 * r.sample_acc:.1f}", f"{time.time() - t0:.0f}"]), flush=True)
        if step == args.steps:
            break
        model.eval()
        samples = rollout(model, tok, rng.sample(train, args.batch), args.n)
        if samples:
            model.train()
            loss = pg_loss(model, tok, samples)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()


if __name__ == "__main__":
    main()
