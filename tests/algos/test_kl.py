import math

import pytest
import torch

from rlframe.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_kl_loss,
    kl_penalty,
    make_kl_controller,
)

SCALAR_KL = {
    "k1": lambda lp, ref: lp - ref,
    "abs": lambda lp, ref: abs(lp - ref),
    "k2": lambda lp, ref: 0.5 * (lp - ref) ** 2,
    "k3": lambda lp, ref: math.exp(ref - lp) - 1 - (ref - lp),
}


@pytest.mark.parametrize("name", list(SCALAR_KL))
def test_estimators_match_scalar_formulas(name):
    torch.manual_seed(1)
    lp, ref = -torch.rand(4, 5, dtype=torch.float64) * 2, -torch.rand(4, 5, dtype=torch.float64) * 2
    got = kl_penalty(log_prob=lp, ref_log_prob=ref, estimator=name)
    for i in range(4):
        for t in range(5):
            assert got[i, t].item() == pytest.approx(SCALAR_KL[name](float(lp[i, t]), float(ref[i, t])), rel=1e-12)


def test_k1_and_k3_are_unbiased_estimates_of_the_true_kl():
    torch.manual_seed(2)
    p_logits, q_logits = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    p, q = torch.log_softmax(p_logits, 0), torch.log_softmax(q_logits, 0)
    true_kl = (p.exp() * (p - q)).sum().item()
    samples = torch.multinomial(p.exp(), 200_000, replacement=True)
    for name in ("k1", "k3"):
        est = kl_penalty(log_prob=p[samples].unsqueeze(0), ref_log_prob=q[samples].unsqueeze(0), estimator=name)
        assert est.mean().item() == pytest.approx(true_kl, abs=0.01)


def test_k3_is_clamped_where_the_reference_is_far_more_likely():
    out = kl_penalty(log_prob=torch.tensor([[-50.0]]), ref_log_prob=torch.tensor([[0.0]]), estimator="k3")
    assert out.item() == 10.0


def test_apply_kl_penalty_matches_reference(token_batch):
    scores, mask, _ = token_batch(B=8, R=5, seed=14)
    g = torch.Generator().manual_seed(14)
    old, ref = -torch.rand(8, 5, generator=g), -torch.rand(8, 5, generator=g)
    rewards, metrics = apply_kl_penalty(token_level_scores=scores, old_log_prob=old, ref_log_prob=ref,
                                        response_mask=mask, kl_coef=0.1, estimator="k1")
    seq_kls = []
    for i in range(8):
        kls = [float(old[i, t] - ref[i, t]) for t in range(5) if mask[i, t]]
        if kls:
            seq_kls.append(sum(kls) / len(kls))
        for t in range(5):
            expected = float(scores[i, t]) - 0.1 * float(old[i, t] - ref[i, t]) if mask[i, t] else 0.0
            assert rewards[i, t].item() == pytest.approx(expected, abs=1e-6)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(sum(seq_kls) / len(seq_kls), rel=1e-5)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1


def test_kl_loss_is_the_aggregated_estimate_and_differentiable(token_batch):
    _, mask, _ = token_batch(B=6, R=4, seed=15)
    lp = (-torch.rand(6, 4, dtype=torch.float64)).requires_grad_(True)
    ref = -torch.rand(6, 4, dtype=torch.float64)
    loss = compute_kl_loss(log_prob=lp, ref_log_prob=ref, response_mask=mask, estimator="k3")
    d = (ref - lp).detach()
    vals = [math.exp(float(d[i, t])) - 1 - float(d[i, t]) for i in range(6) for t in range(4) if mask[i, t]]
    assert loss.item() == pytest.approx(sum(vals) / len(vals), rel=1e-10)
    loss.backward()
    assert lp.grad[mask.bool()].abs().sum() > 0 and lp.grad[~mask.bool()].abs().sum() == 0


def test_adaptive_controller_follows_ziegler_et_al():
    ctrl = AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10_000)
    ctrl.update(current_kl=9.0, n_steps=256)  # error clipped to +0.2
    assert ctrl.value == pytest.approx(0.2 * (1 + 0.2 * 256 / 10_000))
    ctrl.update(current_kl=5.4, n_steps=100)  # error -0.1
    assert ctrl.value == pytest.approx(0.2 * (1 + 0.2 * 256 / 10_000) * (1 - 0.1 * 100 / 10_000))
    restored = AdaptiveKLController(init_kl_coef=1.0, target_kl=6.0, horizon=10_000)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value


def test_fixed_controller_and_factory():
    fixed = make_kl_controller(kind="fixed", kl_coef=0.05)
    fixed.update(current_kl=100.0, n_steps=10)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.05
    assert isinstance(make_kl_controller(kind="adaptive", kl_coef=0.1, target_kl=3, horizon=100), AdaptiveKLController)
    with pytest.raises(ValueError, match="needs target_kl and horizon"):
        make_kl_controller(kind="adaptive", kl_coef=0.1)
    with pytest.raises(ValueError, match="unknown KL controller kind 'pid'"):
        make_kl_controller(kind="pid", kl_coef=0.1)
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(log_prob=torch.zeros(1, 1), ref_log_prob=torch.zeros(1, 1), estimator="k4")
