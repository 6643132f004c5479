"""Trainers: the algorithms as dataflows over worker groups (driver side).

`trainer_class(cfg)` is the trainer `algorithm.name` (or `algorithm.trainer`) selects;
rlframe/controller/run.py runs it.
"""

from __future__ import annotations

from rlframe.config.schema import RunConfig


def trainer_class(cfg: RunConfig):
    """The trainer class of the run's algorithm: its spec's (rlframe/config/algorithms.py), or
    `algorithm.trainer`."""
    from rlframe.config.algorithms import algorithm_spec
    from rlframe.config.validate import load_class

    return load_class(algorithm_spec(cfg.algorithm).trainer)
