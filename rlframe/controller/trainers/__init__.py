"""Trainers: the algorithms as dataflows over worker groups (driver side).

`trainer_class(cfg)` is the trainer `algorithm.name` (or `algorithm.trainer`) selects;
rlframe/controller/run.py runs it.
"""

from __future__ import annotations

from rlframe.config.schema import RunConfig


def trainer_class(cfg: RunConfig):
    if cfg.algorithm.trainer is not None:
        from rlframe.config.validate import load_class

        return load_class(cfg.algorithm.trainer)
    if cfg.algorithm.name == "sft":
        from rlframe.controller.trainers.sft import SFTTrainer

        return SFTTrainer
    if cfg.algorithm.name == "online_dpo":
        from rlframe.controller.trainers.dpo import OnlineDPOTrainer

        return OnlineDPOTrainer
    from rlframe.controller.trainers.ppo import PPOTrainer

    return PPOTrainer
