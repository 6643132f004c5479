"""Validation on the held-out split: greedy accuracy, mean reward, and pass@k with k samples."""

from __future__ import annotations


from rlframe.controller.trainers import phases
from rlframe.data.dataloader import collate, to_dataproto


def validation_prompts(trainer, dataset):
    rows = [dataset[i] for i in range(len(dataset))]
    prompts = to_dataproto(collate(rows, list(range(len(rows))), pad_token_id=trainer.tokenizer.pad_token_id,
                                   pad_to=trainer.cfg.data.prompt_length))
    prompts.non_tensor_batch["uid"] = phases.uids("val", len(prompts))
    return prompts


def validate(trainer, dataset) -> dict[str, float]:
    """`val/accuracy` (greedy), `val/mean_reward`, and `val/pass@k` when rollout.val_n = k > 1."""
    cfg = trainer.cfg
    prompts = validation_prompts(trainer, dataset)
    greedy = phases.sampling_for(cfg, n=1, temperature=cfg.rollout.val_temperature, seed=cfg.trainer.seed)
    batch, gen_m = trainer.generate(prompts, greedy)
    batch, reward_m = trainer.score(batch)
    trainer.generations.val(trainer.step, batch)  # generations/val.jsonl while dumps are on
    scores = batch.batch["token_level_scores"].sum(-1)
    # accuracy is the verifier's verdict, never the shaped training reward (an overlong penalty or a
    # reward model's score would count right answers as wrong)
    out = {"val/accuracy": float(batch.batch["acc"].mean()), "val/mean_reward": float(scores.mean()),
           "val/response_length": float(batch.batch["response_mask"].sum(-1).float().mean())}
    out.update({f"val/{k}": v for k, v in reward_m.items() if k.startswith("reward/")})
    out.update({f"val/{k}": v for k, v in gen_m.items() if k.startswith("agent/")})  # tool use, greedy
    k = cfg.rollout.val_n
    if k > 1:
        sampled = phases.sampling_for(cfg, n=k, temperature=max(cfg.rollout.temperature, 1e-3), seed=cfg.trainer.seed + 1)
        batch, _ = trainer.generate(prompts, sampled)
        batch, _ = trainer.score(batch)
        solved = batch.batch["acc"].bool().view(len(prompts), k)
        out[f"val/pass@{k}"] = float(solved.any(dim=1).float().mean())
        out[f"val/mean@{k}"] = float(solved.float().mean())
    return out
