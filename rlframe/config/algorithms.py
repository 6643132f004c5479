"""What each `algorithm.name` is: its spec (dataflow, traits, and what it requires of the other keys).

The name picks a dataflow (online DPO's, SFT's) or is only a label on the PPO family's (ppo, grpo,
dapo, ...), so a name whose keys say another algorithm (`algorithm.name=grpo` with
`adv_estimator=gae`) would run something other than what it says. The config group
`configs/algorithm/<name>.yaml` (`algorithm=<name>`) sets all of them; `requires` makes a
contradiction a config error naming the keys. The rest of rlframe asks a spec's traits
(`algorithm_spec(cfg.algorithm)`), never the name. A custom algorithm (`algorithm.trainer` set, or a
name registered with `register_algorithm`) is the PPO family's unless its spec says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlframe.config.schema import AlgorithmConfig, RunConfig

PPO_TRAINER = "rlframe.controller.trainers.ppo:PPOTrainer"


@dataclass(frozen=True)
class AlgorithmSpec:
    """An algorithm's traits.

    requires: {key of the algorithm section: the values the name allows}.
    trainer: "package.module:Class" of its trainer (dataflow).
    dataflow: "" for the PPO family's dataflow (generate, score, advantages, PPO-style update), else a
        description of its own (`rlframe plan` and `trainer.auto_plan` model only the PPO family's).
    uses_estimator: its advantages come from `algorithm.adv_estimator` (whose traits may ask a critic).
    generates: it samples responses every step (everything but SFT).
    pairs: it trains on pairs of samples (online DPO): algorithm.n_samples is 2, a reference policy
        scores them, a step trains 2 rows per prompt, its loss has no PPO ratio (nothing for an
        off-policy correction to act on), and a pair's rows may repeat a sample.
    trains_on_ground_truth: it trains on each row's ground truth as the answer text (SFT).
    """

    name: str
    requires: dict[str, tuple] = field(default_factory=dict)
    trainer: str = PPO_TRAINER
    dataflow: str = ""
    uses_estimator: bool = True
    generates: bool = True
    pairs: bool = False
    trains_on_ground_truth: bool = False

    def __hash__(self):
        return hash(self.name)

    @property
    def ppo_ratio(self) -> bool:
        """Its loss is a ratio of the current policy to the old one (the PPO family's)."""
        return not self.pairs and self.generates


ALGORITHMS: dict[str, AlgorithmSpec] = {}


def register_algorithm(spec: AlgorithmSpec) -> AlgorithmSpec:
    """Register an algorithm's spec (`algorithm.name=<spec.name>` selects it)."""
    held = ALGORITHMS.get(spec.name)
    if held is not None and held != spec:
        raise ValueError(f"algorithm {spec.name!r} is already registered; pick another name")
    ALGORITHMS[spec.name] = spec
    return spec


for _spec in (
    AlgorithmSpec("ppo", {"adv_estimator": ("gae",)}),
    AlgorithmSpec("grpo", {"adv_estimator": ("grpo",)}),
    AlgorithmSpec("dr_grpo", {"adv_estimator": ("dr_grpo",), "loss_agg_mode": ("seq-mean-token-sum-norm",)}),
    AlgorithmSpec("rloo", {"adv_estimator": ("rloo",)}),
    AlgorithmSpec("reinforce_pp", {"adv_estimator": ("reinforce_plus_plus",)}),
    AlgorithmSpec("reinforce_pp_baseline", {"adv_estimator": ("reinforce_plus_plus_baseline",)}),
    AlgorithmSpec("remax", {"adv_estimator": ("remax",)}),
    AlgorithmSpec("lite_ppo", {"adv_estimator": ("lite_ppo", "group_mean_batch_std")}),
    AlgorithmSpec("dapo", {"adv_estimator": ("grpo",), "dynamic_sampling": (True,)}),
    AlgorithmSpec("gspo", {"adv_estimator": ("grpo",), "policy_loss": ("gspo",)}),
    # dynamic sampling would drop the groups whose responses are all right, which RAFT trains on
    AlgorithmSpec("raft", {"adv_estimator": ("raft",), "dynamic_sampling": (False,)}),
    AlgorithmSpec("online_dpo", trainer="rlframe.controller.trainers.dpo:OnlineDPOTrainer",
                  dataflow="pairs of samples, a reference pass and a DPO update", uses_estimator=False, pairs=True),
    AlgorithmSpec("sft", trainer="rlframe.controller.trainers.sft:SFTTrainer",
                  dataflow="supervised updates without generation", uses_estimator=False, generates=False,
                  trains_on_ground_truth=True),
):
    register_algorithm(_spec)


def algorithm_spec(alg: AlgorithmConfig) -> AlgorithmSpec:
    """The spec of the run's algorithm: the registered name's, with `algorithm.trainer` (a custom
    dataflow, which the planner does not model) when set; an unregistered name with a trainer is the
    PPO family's traits on that trainer."""
    spec = ALGORITHMS.get(alg.name)
    if alg.trainer is None:
        if spec is None:
            raise ValueError(f"algorithm.name={alg.name!r} is unknown")
        return spec
    base = spec or AlgorithmSpec(alg.name)
    return AlgorithmSpec(base.name, requires={}, trainer=alg.trainer, dataflow=base.dataflow or "its own trainer",
                         uses_estimator=base.uses_estimator, generates=base.generates, pairs=base.pairs,
                         trains_on_ground_truth=base.trains_on_ground_truth)


def known(alg: AlgorithmConfig) -> bool:
    """A registered name, or a custom trainer (anything else validation names as unknown)."""
    return alg.name in ALGORITHMS or alg.trainer is not None


def estimator_traits(alg: AlgorithmConfig):
    """The traits of the run's advantage estimator (rlframe.algos.registry.EstimatorTraits), or None when
    its algorithm uses none, or the algorithm or estimator is not registered (validation names them)."""
    from rlframe.algos.registry import ADVANTAGE_ESTIMATORS

    if not known(alg) or not algorithm_spec(alg).uses_estimator or alg.adv_estimator not in ADVANTAGE_ESTIMATORS:
        return None
    return ADVANTAGE_ESTIMATORS.traits(alg.adv_estimator)


def _text(value) -> str:
    return "true" if value is True else "false" if value is False else "null" if value is None else str(value)


def name_problems(cfg: RunConfig) -> list[str]:
    """One problem per key that contradicts `algorithm.name`, naming both and the fixes."""
    alg = cfg.algorithm
    if alg.trainer is not None or alg.name not in ALGORITHMS:
        return []
    out = []
    for key, allowed in ALGORITHMS[alg.name].requires.items():
        value = getattr(alg, key)
        if value not in allowed:
            want = " or ".join(f"algorithm.{key}={_text(v)}" for v in allowed)
            out.append(f"algorithm.name={alg.name} contradicts algorithm.{key}={_text(value)}: {alg.name} needs {want}; "
                       f"select the whole algorithm with algorithm={alg.name} (configs/algorithm/{alg.name}.yaml), "
                       f"set {want}, or name the algorithm these keys describe")
    return out
