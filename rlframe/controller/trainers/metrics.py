"""Per-step metrics of a batch, with verl's names (critic/score/mean, response_length/mean, ...)."""

from __future__ import annotations

import torch

from rlframe.controller.dispatch import METRICS_KEY


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    x = x.float()
    if x.numel() == 0:
        return {}
    return {f"{prefix}/mean": x.mean().item(), f"{prefix}/max": x.max().item(), f"{prefix}/min": x.min().item()}


def batch_metrics(batch, *, response_length: int) -> dict[str, float]:
    b = batch.batch
    mask = b["response_mask"].bool()
    resp_len = mask.sum(-1).float()
    prompt_len = b["attention_mask"][:, : b["prompts"].shape[1]].sum(-1).float()
    valid = mask.any(-1)
    out = {
        **_stats("critic/score", b["token_level_scores"].sum(-1)),
        **_stats("critic/rewards", b["token_level_rewards"].sum(-1)),
        **_stats("critic/advantages", b["advantages"][mask]),
        **_stats("critic/returns", b["returns"][mask]),
        **_stats("response_length", resp_len),
        **_stats("prompt_length", prompt_len),
        "response_length/clip_ratio": (resp_len >= response_length).float().mean().item(),
        "response_length/empty_ratio": (~valid).float().mean().item(),
    }
    if "values" in b.keys():
        out.update(_stats("critic/values", b["values"][mask]))
    return out


def gathered(result, *, reduce: str = "mean") -> dict[str, float]:
    """Reduce the per-dp-rank metric dicts a DP_COMPUTE call gathered in meta_info."""
    rows = [r for r in (result.meta_info.get(METRICS_KEY) or []) if r]
    keys = sorted({k for r in rows for k in r})
    fn = max if reduce == "max" else (lambda v: sum(v) / len(v))
    return {k: fn([r[k] for r in rows if k in r]) for k in keys}


def throughput(batch, *, step_time: float, world_size: int) -> dict[str, float]:
    tokens = int(batch.batch["attention_mask"].sum())
    return {"perf/total_num_tokens": tokens, "perf/time_per_step": step_time,
            "perf/throughput": tokens / step_time / world_size}
