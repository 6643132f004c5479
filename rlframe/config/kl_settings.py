"""Which KL settings act in the mode a config chooses, and the settings that would do nothing.

rlframe has two KL terms to the reference policy, each with its own keys:

- in the reward (`algorithm.kl_in_reward=true`; PPO, REINFORCE++): `kl_coef`, `kl_estimator`, and the
  adaptive controller's `kl_target` / `kl_horizon`;
- in the loss (`algorithm.use_kl_loss=true`; GRPO, REINFORCE++-baseline): `kl_loss_coef`, `kl_loss_estimator`.

A key of a term that is off has no effect. Validation refuses one that is set (`kl_setting_problems`:
its value differs from the schema's default; a coefficient of 0 says "no KL" and agrees with the term
being off, as verl's recipes write it), naming the key that does act; a resume names only keys that
act (`kl_key_acts`).
"""

from __future__ import annotations

import dataclasses

from rlframe.config.schema import AlgorithmConfig

_REWARD = "algorithm.kl_in_reward"
_LOSS = "algorithm.use_kl_loss"
# key -> (the switch it needs, what it is, its counterpart in the other term or None)
_KEYS = {
    "kl_coef": (_REWARD, "weights the KL penalty in the reward", "kl_loss_coef"),
    "kl_estimator": (_REWARD, "estimates the KL penalty in the reward", "kl_loss_estimator"),
    "kl_horizon": (_REWARD, "is the adaptive KL controller's horizon (with algorithm.kl_target)", None),
    "kl_loss_coef": (_LOSS, "weights the KL term in the loss", "kl_coef"),
    "kl_loss_estimator": (_LOSS, "estimates the KL term in the loss", "kl_estimator"),
}
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(AlgorithmConfig) if f.name in _KEYS}


def _on(alg, switch: str) -> bool:
    return bool(_get(alg, switch.rpartition(".")[2]))


def _get(alg, name: str):
    return alg.get(name) if isinstance(alg, dict) else getattr(alg, name)


def kl_key_acts(key: str, alg) -> bool:
    """Whether `key` ("algorithm.kl_coef", ...) acts in the mode of `alg` (an AlgorithmConfig or its
    dict); keys other than the KL terms' are taken to act."""
    section, _, name = key.partition(".")
    if section != "algorithm" or name not in _KEYS:
        return True
    if name == "kl_horizon":
        return _on(alg, _REWARD) and _get(alg, "kl_target") is not None
    return _on(alg, _KEYS[name][0])


def _is_set(name: str, value) -> bool:
    if value == _DEFAULTS[name]:
        return False
    return not (name.endswith("coef") and value == 0)


def kl_setting_problems(alg) -> list[str]:
    """One problem per KL key set to a value that has no effect in the configured mode."""
    out = []
    for name, (switch, what, other) in _KEYS.items():
        value = _get(alg, name)
        if kl_key_acts(f"algorithm.{name}", alg) or not _is_set(name, value):
            continue
        head = f"algorithm.{name}={value} has no effect: it {what}, and "
        if name == "kl_horizon":
            if not _on(alg, _REWARD):
                head += f"{_REWARD}=false"
            else:
                head += "algorithm.kl_target=null (a fixed coefficient)"
            out.append(head + "; set algorithm.kl_target (and algorithm.kl_in_reward=true) to adapt the coefficient, "
                       f"or remove the algorithm.{name} override")
            continue
        head += f"{switch}=false"
        other_switch = _LOSS if switch == _REWARD else _REWARD
        term = "reward" if switch == _REWARD else "loss"
        if _on(alg, other_switch):
            other_term = "loss" if term == "reward" else "reward"
            out.append(head + f". This run's KL is in the {other_term} ({other_switch}=true), set by "
                       f"algorithm.{other}: set algorithm.{other}={value} instead and remove algorithm.{name} "
                       f"(or set {switch}=true to add a KL term in the {term} too)")
        else:
            out.append(head + f" (this run has no KL term); set {switch}=true to add one in the {term}, "
                       f"or remove the algorithm.{name} override")
    return out
