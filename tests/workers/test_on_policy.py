"""The on-policy actor update (old log-probs = the update's own, detached) trains exactly like the
update with old log-probs from a separate forward pass, on 2 real gloo ranks (dp2, several
micro-batches per rank), and is refused where the batch would go off-policy."""

from __future__ import annotations

import pytest
import torch

from rlframe.config.schema import AlgorithmConfig
from rlframe.utils.spawn import run_distributed
from rlframe.workers.losses import actor_loss_fn, check_on_policy
from tests.workers.engines.reference import make_batch

TOL = 1e-6


def _train_both(rank, world, path):
    from rlframe.workers.engines import TrainEngineConfig, get_train_engine
    from rlframe.workers.rollout import logprob_diff_metrics

    batch = make_batch(batch_size=8, seed=3)
    n = 8 // world
    mine = {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}
    g = torch.Generator().manual_seed(rank)
    mine["rollout_log_probs"] = -torch.rand(mine["responses"].shape, generator=g)
    algo = AlgorithmConfig(name="grpo", adv_estimator="grpo", policy_loss="ppo", loss_agg_mode="token-mean")
    results = {}
    for mode in ("forward", "on_policy"):
        engine = get_train_engine("fsdp")(TrainEngineConfig(model_path=path, dp=world, lr=1e-3, eps=1e-6,
                                                            micro_batch_size=2))
        data = dict(mine)
        if mode == "forward":
            data["old_log_probs"] = engine.forward_log_probs(data)["log_probs"]
            old = data["old_log_probs"]
        m = engine.train_step(actor_loss_fn(algo, on_policy=mode == "on_policy"), data, with_entropy=True)
        state = {k: v.numpy().copy() for k, v in engine.full_state_dict().items()}
        results[mode] = {"metrics": m, "state": state}
    expected_diff = logprob_diff_metrics(mine["rollout_log_probs"], old, mine["response_mask"])
    return {"results": results, "diff": expected_diff["rollout/logprob_diff_mean"],
            "tokens": float(mine["response_mask"].sum())}


def test_on_policy_update_equals_update_with_old_log_probs(tmp_path):
    from rlframe.data.tiny_model import build_random_model

    path = str(build_random_model(tmp_path / "m", preset="test", seed=0))
    out = run_distributed(_train_both, world_size=2, args=(path,), timeout_s=300)
    fwd, onp = out[0]["results"]["forward"], out[0]["results"]["on_policy"]
    worst = max(float(abs(fwd["state"][k] - onp["state"][k]).max()) for k in fwd["state"])
    assert worst <= TOL, f"weights differ by {worst}"
    for key in ("loss", "actor/pg_loss", "grad_norm", "actor/entropy"):
        assert onp["metrics"][key] == pytest.approx(fwd["metrics"][key], abs=TOL), key
    assert onp["metrics"]["actor/ppo_kl"] == 0.0 and onp["metrics"]["actor/pg_clipfrac"] == 0.0
    # the rollout-vs-training alarm still reports: the token mean over both ranks
    tokens = [o["tokens"] for o in out]
    expected = sum(o["diff"] * t for o, t in zip(out, tokens)) / sum(tokens)
    assert onp["metrics"]["rollout/logprob_diff_mean"] == pytest.approx(expected, abs=1e-5)


def test_on_policy_refused_when_the_update_takes_several_steps():
    check_on_policy(ppo_epochs=1, mini_batch_rows=8, rows=8)
    with pytest.raises(ValueError, match="off-policy"):
        check_on_policy(ppo_epochs=2, mini_batch_rows=8, rows=8)
    with pytest.raises(ValueError, match="mini-batches of 4"):
        check_on_policy(ppo_epochs=1, mini_batch_rows=4, rows=8)
