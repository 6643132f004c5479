"""Off-policy corrections of asynchronous training, on a hand-made batch: which old log-probs the
PPO ratio uses, and truncated importance weights on the advantages."""

import math

import pytest
import torch

from rlframe.config import load_config
from rlframe.controller.trainers import phases
from rlframe.protocol import DataProto
from rlframe.protocol.step import StepSettings, step_settings, with_step

ASYNC = ["resources.placement=split", "trainer.max_staleness=1"]


def _cfg(correction, **extra):
    return load_config("grpo_tiny", ASYNC + [f"algorithm.off_policy_correction={correction}",
                                             *(f"{k}={v}" for k, v in extra.items())])


def _batch():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.2], [0.1, 0.9, 0.3]]))
    behaviour = torch.log(torch.tensor([[0.5, 0.1, 0.4], [0.4, 0.3, 0.3]]))  # the weights that sampled
    return DataProto.from_dict(tensors={
        "old_log_probs": old, "rollout_log_probs": behaviour, "advantages": torch.ones(2, 3),
        "response_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])})


def test_tis_weights_advantages_by_the_truncated_ratio():
    batch, m = phases.off_policy_correction(_batch(), cfg=_cfg("tis", **{"algorithm.tis_cap": 2.0}))
    # pi_old / pi_behaviour per token: [1, 5, 0.5], [0.25, 3, (masked)] -> capped at 2
    expected = torch.tensor([[1.0, 2.0, 0.5], [0.25, 2.0, 0.0]])
    assert torch.allclose(batch.batch["advantages"], expected)
    assert m["async/is_weight_max"] == pytest.approx(5.0)
    assert m["async/is_weight_mean"] == pytest.approx((1 + 5 + 0.5 + 0.25 + 3) / 5)
    assert m["async/is_clipped_frac"] == pytest.approx(2 / 5)


def test_none_reports_the_weights_without_changing_the_advantages():
    batch, m = phases.off_policy_correction(_batch(), cfg=_cfg("none"))
    assert torch.equal(batch.batch["advantages"], torch.ones(2, 3))
    assert m["async/is_weight_max"] == pytest.approx(5.0) and "async/is_clipped_frac" not in m


def test_which_old_log_probs_the_update_needs():
    sync = load_config("grpo_tiny", [])
    assert phases.update_is_on_policy(sync, rows=256) and not phases.needs_old_log_probs(sync, rows=256)
    for correction, needs in (("none", True), ("tis", True), ("behaviour", False)):
        cfg = _cfg(correction)
        assert not phases.update_is_on_policy(cfg, rows=256)  # a stale batch is never on-policy
        assert phases.needs_old_log_probs(cfg, rows=256) is needs
    assert math.isclose(_cfg("tis").algorithm.tis_cap, 2.0)


def test_the_actor_alone_gets_the_kept_mask():
    cfg = _cfg("icepop", **{"algorithm.mask_low": 0.4, "algorithm.mask_high": 4.0})
    batch, m = phases.off_policy_correction(_batch(), cfg=cfg)
    with_step(batch, StepSettings(global_step=3, temperature=0.7))
    full = batch.batch["response_mask"].clone()
    actor = phases.for_actor(batch)
    # ratios [1, 5, 0.5] and [0.25, 3]: 5 and 0.25 are outside [0.4, 4]
    assert actor.batch["response_mask"].tolist() == [[1, 0, 1], [0, 1, 0]]
    assert step_settings(actor) == StepSettings(global_step=3, temperature=0.7, allow_empty_minibatches=True)
    assert torch.equal(batch.batch["response_mask"], full)  # the critic, metrics and dumps keep every token
    assert not step_settings(batch).allow_empty_minibatches
    assert torch.equal(actor.batch["advantages"], batch.batch["advantages"])
    assert m["async/masked_token_frac"] == pytest.approx(2 / 5)
    tis, _ = phases.off_policy_correction(_batch(), cfg=_cfg("tis"))
    assert phases.for_actor(tis) is tis  # nothing masked: the same batch
