"""Per-step metrics of a batch, with verl's names (critic/score/mean, response_length/mean, ...)."""

from __future__ import annotations

import torch

from rlframe.single_controller.dispatch import METRICS_KEY


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    x = x.float()
    if x.numel() == 0:
        return {}
    return {f"{prefix}/mean": x.mean().item(), f"{prefix}/max": x.max().item(), f"{prefix}/min": x.min().item()}


def ended_and_cut(batch, *, response_length: int, end_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) bools: the response ended (its last token is an end id: `end_ids`, every id the engine
    stops at), and it was cut off (it fills the length limit without ending)."""
    resp = batch.batch["responses"]
    occupied = batch.batch["attention_mask"][:, -resp.shape[1]:].sum(-1)
    last = resp.gather(1, (occupied - 1).clamp(min=0).long().unsqueeze(1)).squeeze(1)
    ended = torch.isin(last, torch.tensor(sorted(end_ids), dtype=resp.dtype)) & (occupied > 0)
    return ended, (occupied >= response_length) & ~ended


def batch_metrics(batch, *, response_length: int, end_ids) -> dict[str, float]:
    """The batch's scores, lengths and (where it has them) rewards, advantages, returns and values
    (docs/metrics.md). `response_length/clip_ratio` is the fraction of rows cut off: at the length
    limit without an end id as their last token (ended_and_cut)."""
    b = batch.batch
    mask = b["response_mask"].bool()
    resp_len = mask.sum(-1).float()
    _, cut = ended_and_cut(batch, response_length=response_length, end_ids=end_ids)
    prompt_len = b["attention_mask"][:, : b["prompts"].shape[1]].sum(-1).float()
    valid = mask.any(-1)
    out = {
        **_stats("critic/score", b["token_level_scores"].sum(-1)),
        **_stats("response_length", resp_len),
        **_stats("prompt_length", prompt_len),
        "response_length/clip_ratio": cut.float().mean().item(),
        "response_length/empty_ratio": (~valid).float().mean().item(),
    }
    if "token_level_rewards" in b.keys():  # the PPO family's advantages phase made them (not online DPO)
        out.update({**_stats("critic/rewards", b["token_level_rewards"].sum(-1)),
                    **_stats("critic/advantages", b["advantages"][mask]), **_stats("critic/returns", b["returns"][mask])})
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
    out = {"perf/total_num_tokens": tokens, "perf/time_per_step": step_time,
           "perf/throughput": tokens / step_time / world_size}
    if "response_mask" in batch.batch.keys():  # the generated tokens the step trained on
        out["perf/response_tokens"] = int(batch.batch["response_mask"].sum())
    return out


def overhead(calls, *, step_time: float) -> dict[str, float]:
    """A step's time outside the workers' compute, by cause (issue: the control plane's cost).

    `calls` are the step's CallRecords (rlframe.single_controller.worker_group.record_calls):
    - timing_s/workers_compute: sum over calls of the slowest rank's time inside the method;
    - timing_s/overhead/submit: splitting, serializing and submitting the calls on the driver;
    - timing_s/overhead/rpc: waiting beyond the slowest rank's compute (Ray scheduling, transfer
      of arguments and results, deserialization in the workers, ranks waiting for each other);
    - timing_s/overhead/collect: deserializing and gathering outputs on the driver;
    - timing_s/overhead/driver: the driver's own work between calls (reward scoring, advantages,
      batch operations, metrics);
    - timing_s/overhead/total: the step minus the workers' compute (the sum of the four).
    With groups in their own processes computing at once (split placement), the compute of calls
    that overlapped is counted for each, so it can exceed the step; the total is then 0.
    """
    compute = sum(c.compute_s for c in calls)
    submit = sum(c.submit_s for c in calls)
    rpc = sum(max(0.0, c.answer_s - c.compute_s) for c in calls)
    collect = sum(c.collect_s for c in calls)
    driver = max(0.0, step_time - sum(c.wall_s for c in calls))
    return {"timing_s/workers_compute": compute, "timing_s/overhead/submit": submit, "timing_s/overhead/rpc": rpc,
            "timing_s/overhead/collect": collect, "timing_s/overhead/driver": driver,
            "timing_s/overhead/total": max(0.0, step_time - compute)}
