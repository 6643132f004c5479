"""What each built-in `algorithm.name` requires of the other algorithm keys.

The name picks a dataflow (online_dpo, sft) or is only a label (the PPO-style ones), so a name whose
keys say another algorithm (`algorithm.name=grpo` with `adv_estimator=gae`) would run something
other than what it says. The config group `configs/algorithm/<name>.yaml` (`algorithm=<name>`) sets
all of them; these rules make a contradiction a config error naming the keys. Custom algorithms
(a name not in the table, or `algorithm.trainer` set) are not checked here.
"""

from __future__ import annotations

from rlframe.config.schema import RunConfig

# name -> {key of the algorithm section: the values the name allows}
REQUIRES: dict[str, dict[str, tuple]] = {
    "ppo": {"adv_estimator": ("gae",)},
    "grpo": {"adv_estimator": ("grpo",)},
    "dr_grpo": {"adv_estimator": ("dr_grpo",), "loss_agg_mode": ("seq-mean-token-sum-norm",)},
    "rloo": {"adv_estimator": ("rloo",)},
    "reinforce_pp": {"adv_estimator": ("reinforce_plus_plus",)},
    "reinforce_pp_baseline": {"adv_estimator": ("reinforce_plus_plus_baseline",)},
    "remax": {"adv_estimator": ("remax",)},
    "lite_ppo": {"adv_estimator": ("lite_ppo", "group_mean_batch_std")},
    "dapo": {"adv_estimator": ("grpo",), "dynamic_sampling": (True,)},
    "gspo": {"adv_estimator": ("grpo",), "policy_loss": ("gspo",)},
    # dynamic sampling would drop the groups whose responses are all right, which RAFT trains on
    "raft": {"adv_estimator": ("raft",), "dynamic_sampling": (False,)},
    "online_dpo": {},  # n_samples=2 is checked with the batch rules (validate._check_algorithm)
    "sft": {},
}


# names whose trainer runs another dataflow than the PPO family's (rlframe plan models that one)
OWN_DATAFLOW = {"online_dpo": "pairs of samples, a reference pass and a DPO update",
                "sft": "supervised updates without generation"}


def _text(value) -> str:
    return "true" if value is True else "false" if value is False else "null" if value is None else str(value)


def name_problems(cfg: RunConfig) -> list[str]:
    """One problem per key that contradicts `algorithm.name`, naming both and the fixes."""
    alg = cfg.algorithm
    if alg.trainer is not None or alg.name not in REQUIRES:
        return []
    out = []
    for key, allowed in REQUIRES[alg.name].items():
        value = getattr(alg, key)
        if value not in allowed:
            want = " or ".join(f"algorithm.{key}={_text(v)}" for v in allowed)
            out.append(f"algorithm.name={alg.name} contradicts algorithm.{key}={_text(value)}: {alg.name} needs {want}; "
                       f"select the whole algorithm with algorithm={alg.name} (configs/algorithm/{alg.name}.yaml), "
                       f"set {want}, or name the algorithm these keys describe")
    return out
