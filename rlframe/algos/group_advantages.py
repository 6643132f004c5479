"""Critic-free advantage estimators that compare the n responses sampled for one prompt.

All share the signature documented in `advantages.py` and need `index` (B,): the group id of each
sample (the batch's `uid`; strings, ints, numpy object arrays and tensors all work). Each response
is scored by its outcome reward s_i = sum of its token-level rewards over the mask; the
sequence-level advantage is then broadcast to every valid token (zero off the mask), and
returns = advantages (there is no critic to regress).

| name | advantage of response i in group g | group of 1 sample |
|---|---|---|
| grpo | (s_i - mean_g) / (std_g + eps) | error (std undefined) |
| dr_grpo | s_i - mean_g | advantage 0 |
| rloo | s_i - mean_{j != i} s_j | error (no other sample) |
| reinforce_plus_plus_baseline | whiten_batch(s_i - mean_g) | 0 before whitening |
| lite_ppo | (s_i - mean_g) / (std_batch + eps) | 0 |
| raft | 1 if s_i = max_g > 0 else 0 (the group's best responses, kept by rejection sampling) | 1 if s_i > 0 |

std is the unbiased (Bessel-corrected) standard deviation, as torch.std; `epsilon` guards it.
A row with no valid token still counts as a member of its group (score 0) and gets advantage 0.
A group whose rewards are all equal gets advantage exactly 0 in every estimator but raft (which
keeps a group whose responses are all equally good and positive: supervised learning needs no
contrast): it carries no signal, and its floating-point mean is off by rounding (see `grouping.group_is_constant`). For
reinforce_plus_plus_baseline this holds after the batch whitening too (docs/algorithms.md lists
this and the other departures from verl).
"""

from __future__ import annotations

import torch

from rlframe.algos.grouping import Groups, group_is_constant, group_max, group_mean, group_rows, group_std
from rlframe.algos.masked import as_float_mask, check_token_tensors, masked_whiten, sequence_scores
from rlframe.algos.registry import register_advantage_estimator


def _scores_and_groups(name: str, token_level_rewards, response_mask, index) -> tuple[torch.Tensor, Groups]:
    if index is None:
        raise ValueError(
            f"advantage estimator {name!r} needs index (B,), the group id of each sample (the batch's "
            f"'uid' field, shared by the n responses of one prompt); it is missing"
        )
    check_token_tensors(response_mask=response_mask, token_level_rewards=token_level_rewards)
    groups = group_rows(index, batch_size=token_level_rewards.shape[0], device=token_level_rewards.device)
    return sequence_scores(token_level_rewards, response_mask), groups


def _centered(scores: torch.Tensor, groups: Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """(s_i - mean_g, constant) both (B,): exactly 0 where the row's group has equal rewards."""
    constant = group_is_constant(scores, groups)[groups.inverse]
    centered = scores - group_mean(scores, groups)[groups.inverse]
    return torch.where(constant, torch.zeros_like(centered), centered), constant


def _broadcast(seq_adv: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) sequence advantages -> (advantages, returns), both (B, R) and zero off the mask."""
    adv = seq_adv.unsqueeze(-1) * as_float_mask(response_mask, seq_adv)
    return adv, adv.clone()


@register_advantage_estimator("grpo", needs_groups=True, zero_mean_groups=True)
@torch.no_grad()
def grpo(*, token_level_rewards, response_mask, index=None, values=None, baseline_rewards=None,
         gamma=1.0, lam=1.0, epsilon=1e-6):
    """GRPO outcome supervision (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300, Sec. 4.1.2).

    A_i = (s_i - mean(s_group)) / (std(s_group) + epsilon). Needs index. Shapes (B, R) -> (B, R).
    """
    scores, groups = _scores_and_groups("grpo", token_level_rewards, response_mask, index)
    groups.require_min_size(2, algorithm="grpo", why="the standard deviation of one sample is undefined")
    centered, _ = _centered(scores, groups)
    seq_adv = centered / (group_std(scores, groups)[groups.inverse] + epsilon)
    return _broadcast(seq_adv, response_mask)


@register_advantage_estimator("dr_grpo", needs_groups=True, zero_mean_groups=True)
@torch.no_grad()
def dr_grpo(*, token_level_rewards, response_mask, index=None, values=None, baseline_rewards=None,
            gamma=1.0, lam=1.0, epsilon=1e-6):
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783).

    A_i = s_i - mean(s_group): GRPO without the std division. The paper's other change, no
    per-response length normalization, is the loss side: use loss_agg_mode
    "seq-mean-token-sum-norm" with it. Needs index. Shapes (B, R) -> (B, R).
    """
    scores, groups = _scores_and_groups("dr_grpo", token_level_rewards, response_mask, index)
    return _broadcast(_centered(scores, groups)[0], response_mask)


@register_advantage_estimator("rloo", needs_groups=True, zero_mean_groups=True)
@torch.no_grad()
def rloo(*, token_level_rewards, response_mask, index=None, values=None, baseline_rewards=None,
         gamma=1.0, lam=1.0, epsilon=1e-6):
    """RLOO, REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740).

    A_i = s_i - (1 / (n - 1)) * sum_{j != i} s_j = n / (n - 1) * (s_i - mean). Needs index.
    Shapes (B, R) -> (B, R).
    """
    scores, groups = _scores_and_groups("rloo", token_level_rewards, response_mask, index)
    groups.require_min_size(2, algorithm="rloo", why="the leave-one-out baseline of one sample has no other sample")
    n = groups.counts.to(scores)[groups.inverse]
    sums = torch.zeros(groups.num_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, groups.inverse, scores
    )
    baseline = (sums[groups.inverse] - scores) / (n - 1)
    constant = group_is_constant(scores, groups)[groups.inverse]
    seq_adv = torch.where(constant, torch.zeros_like(scores), scores - baseline)
    return _broadcast(seq_adv, response_mask)


@register_advantage_estimator("reinforce_plus_plus_baseline", needs_groups=True)
@torch.no_grad()
def reinforce_plus_plus_baseline(*, token_level_rewards, response_mask, index=None, values=None,
                                 baseline_rewards=None, gamma=1.0, lam=1.0, epsilon=1e-6):
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262, v3+): group-mean baseline, then batch whitening.

    A_i = s_i - mean(s_group) on every valid token, then whitened over all valid tokens of the batch
    (variance guarded by epsilon). The paper puts the KL in the loss (k2/k3) for this variant.
    Needs index. Shapes (B, R) -> (B, R).
    """
    scores, groups = _scores_and_groups("reinforce_plus_plus_baseline", token_level_rewards, response_mask, index)
    centered, constant = _centered(scores, groups)
    token_adv = centered.unsqueeze(-1).expand_as(token_level_rewards)
    adv = masked_whiten(token_adv, response_mask, epsilon=epsilon)
    adv = torch.where(constant.unsqueeze(-1), torch.zeros_like(adv), adv)  # whitening shifts by the batch mean
    return adv, adv.clone()


@register_advantage_estimator("lite_ppo", needs_groups=True, zero_mean_groups=True)
@register_advantage_estimator("group_mean_batch_std", needs_groups=True, zero_mean_groups=True)
@torch.no_grad()
def lite_ppo(*, token_level_rewards, response_mask, index=None, values=None, baseline_rewards=None,
             gamma=1.0, lam=1.0, epsilon=1e-6):
    """Lite PPO's normalization (Liu et al. 2025, "Tricks or Traps? A Deep Dive into RL for LLM
    Reasoning", arXiv:2508.08221): group-level mean, batch-level standard deviation.

    A_i = (s_i - mean(s_group)) / (std(s_batch) + epsilon), std over the B sequence scores. The
    recipe pairs it with token-level loss aggregation (loss_agg_mode "token-mean").
    Needs index. Shapes (B, R) -> (B, R).
    """
    scores, groups = _scores_and_groups("lite_ppo", token_level_rewards, response_mask, index)
    centered, _ = _centered(scores, groups)
    batch_std = scores.std() if scores.numel() > 1 else scores.new_zeros(())
    return _broadcast(centered / (batch_std + epsilon), response_mask)


@register_advantage_estimator("raft", needs_groups=True)
@torch.no_grad()
def raft(*, token_level_rewards, response_mask, index=None, values=None, baseline_rewards=None,
         gamma=1.0, lam=1.0, epsilon=1e-6):
    """RAFT, reward-ranked fine-tuning (Dong et al. 2023, arXiv:2304.06767), as rejection sampling:
    each group keeps its best-scored responses (ties included) when that score is positive, and the
    update is supervised learning on them.

    A_i = 1 if s_i == max(s_group) > 0, else 0. With the PPO loss and one on-policy optimizer step per
    batch (ratio 1) the gradient is the kept responses' log-likelihood gradient, weighted by the loss
    aggregation (token-mean: per kept token over every token of the mini-batch, so the step scales
    with the kept share). With binary rewards the kept responses are the correct ones (RAFT++ of
    Xiong et al. 2025). s is the reward the estimator gets: shaped (KL in the reward, DAPO's overlong
    penalty) it breaks ties between correct responses, and a reward model's scores must be positive
    for the best to be kept (the original RAFT ranks whatever the sign). Needs index.
    Shapes (B, R) -> (B, R).
    """
    scores, groups = _scores_and_groups("raft", token_level_rewards, response_mask, index)
    best = group_max(scores, groups)[groups.inverse]
    keep = (scores == best) & (best > 0)
    return _broadcast(keep.to(scores.dtype), response_mask)
