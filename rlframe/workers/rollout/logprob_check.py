"""Log-prob consistency between the rollout engine and the training forward pass.

The rollout engine reports, per response token, the log-prob of the distribution it sampled from
(`rollout_log_probs`); the actor recomputes them in training (`old_log_probs`). They should agree up
to numerics (fp32 on CPU: ~1e-5; bf16: ~5e-3 mean on the demo model); a large gap means stale
weights after a sync, a different temperature convention, or a kernel bug, and it biases
off-policy corrections (e.g. truncated importance sampling). `logprob_diff_metrics` reduces the
gap to two scalars for the step metrics.
"""

from __future__ import annotations

import torch


def logprob_diff_metrics(rollout_log_probs: torch.Tensor, log_probs: torch.Tensor,
                         response_mask: torch.Tensor) -> dict[str, float]:
    """Mean and max |rollout - training| log-prob over response tokens.

    rollout_log_probs, log_probs, response_mask: (B, R). Returns
    {"rollout/logprob_diff_mean": ..., "rollout/logprob_diff_max": ...} (0.0 when no token counts).
    """
    if rollout_log_probs.shape != log_probs.shape or log_probs.shape != response_mask.shape:
        raise ValueError(
            f"rollout_log_probs {tuple(rollout_log_probs.shape)}, log_probs {tuple(log_probs.shape)} and "
            f"response_mask {tuple(response_mask.shape)} must all be (B, R)"
        )
    m = response_mask.bool()
    diff = (rollout_log_probs.float() - log_probs.float()).abs()[m]
    if diff.numel() == 0:
        return {"rollout/logprob_diff_mean": 0.0, "rollout/logprob_diff_max": 0.0}
    return {"rollout/logprob_diff_mean": float(diff.mean()), "rollout/logprob_diff_max": float(diff.max())}


@torch.no_grad()
def response_log_probs(model: torch.nn.Module, batch, *, temperature: float = 1.0,
                       micro_batch_size: int = 64) -> torch.Tensor:
    """Log-probs of `responses` under an HF causal LM, the way the actor computes them.

    batch: mapping/DataProto with input_ids, attention_mask, position_ids (B, P+R) and responses (B, R).
    Logits are divided by `temperature` (use 1.0 for greedy rollouts). Returns (B, R) float32.
    """
    b = batch.batch if hasattr(batch, "batch") else batch
    resp_len = b["responses"].shape[1]
    outs = []
    for s in range(0, b["input_ids"].shape[0], micro_batch_size):
        sl = slice(s, s + micro_batch_size)
        logits = model(input_ids=b["input_ids"][sl], attention_mask=b["attention_mask"][sl],
                       position_ids=b["position_ids"][sl]).logits
        # position t predicts token t+1: the R response tokens are predicted by positions P-1 .. P+R-2.
        logits = logits[:, -resp_len - 1:-1].float() / temperature
        lp = torch.log_softmax(logits, dim=-1).gather(-1, b["responses"][sl].unsqueeze(-1)).squeeze(-1)
        outs.append(lp)
    return torch.cat(outs, dim=0)
