"""rlframe.algos: the algorithms as pure tensor functions, registered by name.

Token-level tensors are (B, R) with a `response_mask` (B, R); groups are given by `index` (B,),
the batch's `uid`. The trainer looks pieces up by the names in its config:

| kind | registry lookup | built-in names | module |
|---|---|---|---|
| advantage estimator | get_advantage_estimator | gae, grpo, dr_grpo, rloo, remax, reinforce_plus_plus, reinforce_plus_plus_baseline, lite_ppo (= group_mean_batch_std), raft | advantages.py, group_advantages.py |
| policy loss | get_policy_loss | ppo (= vanilla; clip-higher via clip_ratio_high), dual_clip, gspo | policy_loss.py |
| KL estimator | get_kl_estimator | k1 (= kl), k2 (= mse), k3 (= low_var_kl), abs | kl.py |
| loss aggregation | get_loss_agg_mode | token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm | aggregation.py |

Not registered (one implementation each): `compute_value_loss`, `online_dpo_loss` and
`make_preference_pairs`, `apply_kl_penalty` and the KL controllers, `compute_kl_loss`,
`entropy_from_logits`, DAPO's `filter_groups_by_reward_variance` / `DynamicSamplingProgress` /
`overlong_reward_penalty`. `dataproto_glue` applies them to a DataProto.
"""

from rlframe.algos.registry import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    Registry,
    get_advantage_estimator,
    get_kl_estimator,
    get_loss_agg_mode,
    get_policy_loss,
    register_advantage_estimator,
    register_kl_estimator,
    register_loss_agg_mode,
    register_policy_loss,
    resolve_loss_agg_mode,
)
from rlframe.algos.aggregation import agg_loss
from rlframe.algos.advantages import gae, reinforce_plus_plus, remax
from rlframe.algos.group_advantages import dr_grpo, grpo, lite_ppo, raft, reinforce_plus_plus_baseline, rloo
from rlframe.algos.policy_loss import dual_clip_loss, gspo_loss, ppo_loss
from rlframe.algos.value_loss import compute_value_loss
from rlframe.algos.entropy import entropy_from_logits
from rlframe.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_kl_loss,
    kl_penalty,
    make_kl_controller,
)
from rlframe.algos.preference import make_preference_pairs, online_dpo_loss
from rlframe.algos.dapo import (
    DynamicSamplingProgress,
    GroupFilterResult,
    filter_groups_by_reward_variance,
    first_groups,
    overlong_reward_penalty,
)
from rlframe.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten
from rlframe.algos.dataproto_glue import apply_kl_penalty_to_batch, compute_advantage

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdaptiveKLController",
    "DynamicSamplingProgress",
    "FixedKLController",
    "GroupFilterResult",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "Registry",
    "agg_loss",
    "apply_kl_penalty",
    "apply_kl_penalty_to_batch",
    "compute_advantage",
    "compute_kl_loss",
    "compute_value_loss",
    "dr_grpo",
    "dual_clip_loss",
    "entropy_from_logits",
    "filter_groups_by_reward_variance",
    "first_groups",
    "gae",
    "get_advantage_estimator",
    "get_kl_estimator",
    "get_loss_agg_mode",
    "get_policy_loss",
    "grpo",
    "gspo_loss",
    "kl_penalty",
    "lite_ppo",
    "make_kl_controller",
    "make_preference_pairs",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "raft",
    "online_dpo_loss",
    "overlong_reward_penalty",
    "ppo_loss",
    "register_advantage_estimator",
    "register_kl_estimator",
    "register_loss_agg_mode",
    "resolve_loss_agg_mode",
    "register_policy_loss",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
]
