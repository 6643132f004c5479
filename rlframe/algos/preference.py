"""Online DPO: preference pairs from the policy's own samples, scored by a reward, and the DPO loss.

Dataflow (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback",
arXiv:2402.04792): sample n >= 2 responses per prompt from the current policy, score them, take the
best and the worst of each group as (chosen, rejected), and minimize the DPO loss on those pairs
(Rafailov et al. 2023, arXiv:2305.18290). Not a registered policy loss: it consumes pairs of
responses, not per-token advantages.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rlframe.algos.grouping import group_rows
from rlframe.algos.masked import check_token_tensors, masked_sum


@torch.no_grad()
def make_preference_pairs(*, scores: torch.Tensor, index: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the best (chosen) and worst (rejected) response of each group.

    Args:
        scores (B,): one reward per response. index (B,): group id per response (`uid`).
    Returns:
        chosen_rows, rejected_rows: (P,) int64, one pair per group whose scores are not all equal
        (a tie carries no preference), in order of the groups' first appearance. Among equal best
        (or worst) scores the first row wins.
    Raises ValueError for a group of one response (a pair needs two).
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be (B,), got shape {tuple(scores.shape)}")
    groups = group_rows(index, batch_size=scores.shape[0], device=scores.device)
    groups.require_min_size(2, algorithm="online DPO pairs", why="a preference pair needs two responses")
    chosen, rejected = [], []
    for g in range(groups.num_groups):
        rows = torch.nonzero(groups.inverse == g).flatten()
        s = scores[rows]
        best, worst = int(torch.argmax(s)), int(torch.argmin(s))
        if s[best] > s[worst]:
            chosen.append(rows[best])
            rejected.append(rows[worst])
    as_tensor = lambda xs: torch.stack(xs) if xs else torch.zeros(0, dtype=torch.long, device=scores.device)
    return as_tensor(chosen), as_tensor(rejected)


def online_dpo_loss(
    *,
    chosen_log_prob: torch.Tensor,
    rejected_log_prob: torch.Tensor,
    ref_chosen_log_prob: torch.Tensor,
    ref_rejected_log_prob: torch.Tensor,
    chosen_mask: torch.Tensor,
    rejected_mask: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO loss (Rafailov et al. 2023, eq. 7) on P (chosen, rejected) pairs.

    h = beta * [(log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))] with sequence
    log-probs summed over each response's mask; loss = mean over pairs of
    -(1 - ls) log sigmoid(h) - ls log sigmoid(-h) (ls = label_smoothing, the conservative DPO of
    Mitchell 2023; 0 is plain DPO).

    Args:
        chosen_log_prob, ref_chosen_log_prob, chosen_mask: (P, R) token log-probs / mask of the
            chosen responses; likewise for rejected (their R may differ from the chosen R).
    Returns:
        (loss scalar, metrics of detached scalars: rewards_chosen, rewards_rejected (mean implicit
        rewards beta * log-ratio), reward_accuracy (fraction of pairs with h > 0), reward_margin).
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0 (the strength of the KL constraint), got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    check_token_tensors(response_mask=chosen_mask, chosen_log_prob=chosen_log_prob, ref_chosen_log_prob=ref_chosen_log_prob)
    check_token_tensors(response_mask=rejected_mask, rejected_log_prob=rejected_log_prob,
                        ref_rejected_log_prob=ref_rejected_log_prob)
    if chosen_mask.shape[0] != rejected_mask.shape[0]:
        raise ValueError(f"{chosen_mask.shape[0]} chosen but {rejected_mask.shape[0]} rejected responses; pairs must align")
    chosen_reward = beta * (masked_sum(chosen_log_prob, chosen_mask, dim=-1)
                            - masked_sum(ref_chosen_log_prob.detach(), chosen_mask, dim=-1))
    rejected_reward = beta * (masked_sum(rejected_log_prob, rejected_mask, dim=-1)
                              - masked_sum(ref_rejected_log_prob.detach(), rejected_mask, dim=-1))
    h = chosen_reward - rejected_reward
    losses = -(1.0 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)
    loss = losses.mean() if losses.numel() else (chosen_log_prob.sum() * 0.0)
    with torch.no_grad():
        metrics = {
            "rewards_chosen": chosen_reward.mean() if h.numel() else h.new_zeros(()),
            "rewards_rejected": rejected_reward.mean() if h.numel() else h.new_zeros(()),
            "reward_accuracy": (h > 0).to(h.dtype).mean() if h.numel() else h.new_zeros(()),
            "reward_margin": h.mean() if h.numel() else h.new_zeros(()),
        }
    return loss, metrics
