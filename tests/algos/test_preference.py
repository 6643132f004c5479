import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rlframe.algos.preference import make_preference_pairs, online_dpo_loss


def test_pairs_are_best_and_worst_of_each_group_and_ties_are_skipped():
    scores = torch.tensor([0.0, 1.0, 0.5, 0.5, 3.0, 3.0, -1.0])
    index = np.array(["a", "a", "tie", "tie", "b", "b", "b"], dtype=object)
    chosen, rejected = make_preference_pairs(scores=scores, index=index)
    assert chosen.tolist() == [1, 4] and rejected.tolist() == [0, 6]  # first of equal bests wins


def test_pairs_need_two_responses_per_group():
    with pytest.raises(ValueError, match=r"group 'c' has 1 sample\(s\)"):
        make_preference_pairs(scores=torch.zeros(3), index=["a", "a", "c"])


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_dpo_loss_matches_reference(token_batch, label_smoothing):
    _, mask_c, _ = token_batch(B=6, R=5, seed=16)
    _, mask_r, _ = token_batch(B=6, R=4, seed=17)
    g = torch.Generator().manual_seed(18)
    pc = (-torch.rand(6, 5, generator=g, dtype=torch.float64)).requires_grad_(True)
    pr = (-torch.rand(6, 4, generator=g, dtype=torch.float64)).requires_grad_(True)
    rc, rr = -torch.rand(6, 5, generator=g, dtype=torch.float64), -torch.rand(6, 4, generator=g, dtype=torch.float64)
    beta = 0.5
    loss, metrics = online_dpo_loss(chosen_log_prob=pc, rejected_log_prob=pr, ref_chosen_log_prob=rc,
                                    ref_rejected_log_prob=rr, chosen_mask=mask_c, rejected_mask=mask_r,
                                    beta=beta, label_smoothing=label_smoothing)
    terms, wins = [], 0
    for i in range(6):
        logratio_c = sum(pc[i, t] - rc[i, t] for t in range(5) if mask_c[i, t])
        logratio_r = sum(pr[i, t] - rr[i, t] for t in range(4) if mask_r[i, t])
        h = beta * (logratio_c - logratio_r)
        h = h if isinstance(h, torch.Tensor) else torch.tensor(float(h), dtype=torch.float64)
        wins += int(h > 0)
        terms.append(-(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h))
    ref = sum(terms) / 6
    assert loss.item() == pytest.approx(ref.item(), rel=1e-10)
    g1 = torch.autograd.grad(loss, (pc, pr))
    g2 = torch.autograd.grad(ref, (pc, pr))
    assert all(torch.allclose(a, b) for a, b in zip(g1, g2))
    assert metrics["reward_accuracy"].item() == pytest.approx(wins / 6)


def test_dpo_argument_errors():
    x = torch.zeros(2, 3)
    kw = dict(chosen_log_prob=x, rejected_log_prob=x, ref_chosen_log_prob=x, ref_rejected_log_prob=x,
              chosen_mask=torch.ones(2, 3), rejected_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="beta must be > 0"):
        online_dpo_loss(**kw, beta=0.0)
    with pytest.raises(ValueError, match="pairs must align"):
        online_dpo_loss(**{**kw, "rejected_log_prob": torch.zeros(3, 3), "ref_rejected_log_prob": torch.zeros(3, 3),
                           "rejected_mask": torch.ones(3, 3)})
