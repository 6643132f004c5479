import pytest
import torch

from rlframe.algos.registry import get_policy_loss

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _inputs(token_batch, seed, *, per_sequence_advantages=False):
    _, mask, _ = token_batch(B=10, R=6, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    old = -torch.rand(10, 6, generator=g, dtype=torch.float64) * 3
    new = (old + 0.4 * torch.randn(10, 6, generator=g, dtype=torch.float64)).requires_grad_(True)
    if per_sequence_advantages:
        adv = torch.randn(10, 1, generator=g, dtype=torch.float64).expand(10, 6).clone()
    else:
        adv = torch.randn(10, 6, generator=g, dtype=torch.float64)
    return old, new, adv, mask


def reference_token_losses(old, new, adv, mask, low, high, c=None):
    """Per-token PPO / dual-clip loss as scalar tensors, one token at a time."""
    per_token, clipped, lower = {}, 0, 0
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[i, t]:
                continue
            ratio = torch.exp(new[i, t] - old[i, t])
            a = float(adv[i, t])
            l1, l2 = -a * ratio, -a * torch.clamp(ratio, 1 - low, 1 + high)
            loss = torch.maximum(l1, l2)
            clipped += int(l2 > l1)
            if c is not None and a < 0 and loss > -a * c:
                loss = -a * c * torch.ones_like(loss)
                lower += 1
            per_token[(i, t)] = loss
    return per_token, clipped, lower


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,low,high,c", [("ppo", 0.2, 0.2, None), ("ppo", 0.2, 0.28, None),
                                             ("dual_clip", 0.2, 0.2, 1.5)])
def test_ppo_and_dual_clip_match_reference(token_batch, ref_agg, mode, name, low, high, c):
    old, new, adv, mask = _inputs(token_batch, seed=11)
    loss, metrics = get_policy_loss(name)(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask,
                                          loss_agg_mode=mode, clip_ratio_low=low, clip_ratio_high=high,
                                          clip_ratio_c=c)
    (grad,) = torch.autograd.grad(loss, new)
    per_token, clipped, lower = reference_token_losses(old, new, adv, mask, low, high, c)
    ref_loss = ref_agg(per_token, mask, mode)
    (ref_grad,) = torch.autograd.grad(ref_loss, new)
    n_tokens = int(mask.sum())
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-10)
    assert torch.allclose(grad, ref_grad, rtol=1e-9, atol=1e-12)
    assert metrics["pg_clipfrac"].item() == pytest.approx(clipped / n_tokens)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(lower / n_tokens)
    assert 0 < clipped < n_tokens and (lower > 0) == (c is not None)  # the inputs exercise every branch
    ref_kl = sum(float(old[i, t] - new[i, t].detach()) for (i, t) in per_token) / n_tokens
    assert metrics["ppo_kl"].item() == pytest.approx(ref_kl, rel=1e-10)


def test_clip_higher_lets_positive_advantage_tokens_rise_further():
    old = torch.zeros(1, 1)
    new = torch.log(torch.full((1, 1), 1.25)).requires_grad_(True)
    adv, mask = torch.ones(1, 1), torch.ones(1, 1)
    ppo = get_policy_loss("ppo")
    sym, m_sym = ppo(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask,
                     clip_ratio_low=0.2, clip_ratio_high=0.2)
    asym, m_asym = ppo(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask,
                       clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert sym.item() == pytest.approx(-1.2) and m_sym["pg_clipfrac"].item() == 1.0
    assert asym.item() == pytest.approx(-1.25) and m_asym["pg_clipfrac"].item() == 0.0


def test_dual_clip_bounds_the_loss_of_negative_advantage_tokens_with_huge_ratios():
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[5.0, 5.0, 1.1]])).requires_grad_(True)
    adv = torch.tensor([[-0.1, 0.1, -0.1]])
    loss, metrics = get_policy_loss("dual_clip")(old_log_prob=old, log_prob=new, advantages=adv,
                                                 response_mask=torch.ones(1, 3), loss_agg_mode="seq-mean-token-sum",
                                                 clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    # token 0: -A * r = 0.5 > -A * c = 0.3, so bounded at 0.3 (no gradient); token 1: clipped at
    # -A * 1.2 = -0.12; token 2: -A * r = 0.11, untouched.
    assert loss.item() == pytest.approx(0.3 - 0.12 + 0.11)
    loss.backward()
    assert new.grad[0, 0] == 0 and new.grad[0, 1] == 0 and new.grad[0, 2].item() == pytest.approx(0.11)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 3)


def reference_gspo(old, new, adv, mask, low, high):
    """Sequence-level GSPO: one ratio per response, the geometric mean of its token ratios."""
    losses = []
    for i in range(mask.shape[0]):
        pos = [t for t in range(mask.shape[1]) if mask[i, t]]
        if not pos:
            continue
        s = torch.exp(sum(new[i, t] - old[i, t] for t in pos) / len(pos))
        a = float(adv[i, pos[0]])
        losses.append(torch.maximum(-a * s, -a * torch.clamp(s, 1 - low, 1 + high)))
    return sum(losses) / len(losses)


def test_gspo_value_and_gradient_equal_sequence_level_gspo(token_batch):
    old, new, adv, mask = _inputs(token_batch, seed=12, per_sequence_advantages=True)
    new = (old + 0.1 * (new - old)).detach().requires_grad_(True)  # sequence ratios near 1: some clipped
    low, high = 0.01, 0.02
    loss, metrics = get_policy_loss("gspo")(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask,
                                            clip_ratio_low=low, clip_ratio_high=high)
    (grad,) = torch.autograd.grad(loss, new)
    ref = reference_gspo(old, new, adv, mask, low, high)
    (ref_grad,) = torch.autograd.grad(ref, new)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-10)
    assert torch.allclose(grad, ref_grad, rtol=1e-9, atol=1e-12)
    assert 0 < metrics["pg_clipfrac"].item() < 1


@pytest.mark.parametrize("name,c", [("ppo", None), ("dual_clip", 3.0), ("gspo", None)])
def test_all_masked_batch_gives_zero_loss_and_gradient(name, c):
    old, new = torch.zeros(2, 3), torch.randn(2, 3, requires_grad=True)
    loss, metrics = get_policy_loss(name)(old_log_prob=old, log_prob=new, advantages=torch.randn(2, 3),
                                          response_mask=torch.zeros(2, 3), clip_ratio_low=0.2,
                                          clip_ratio_high=0.2, clip_ratio_c=c)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(new.grad, torch.zeros(2, 3))
    assert all(v.item() == 0.0 for v in metrics.values())


def test_argument_errors():
    kw = dict(old_log_prob=torch.zeros(1, 2), log_prob=torch.zeros(1, 2), advantages=torch.zeros(1, 2),
              response_mask=torch.ones(1, 2), clip_ratio_low=0.2, clip_ratio_high=0.2)
    with pytest.raises(ValueError, match="only the dual-clip loss uses"):
        get_policy_loss("ppo")(**kw, clip_ratio_c=3.0)
    with pytest.raises(ValueError, match="dual_clip needs clip_ratio_c > 1"):
        get_policy_loss("dual_clip")(**kw, clip_ratio_c=None)
    with pytest.raises(ValueError, match=r"clip_ratio_low must be in \[0, 1\)"):
        get_policy_loss("ppo")(**{**kw, "clip_ratio_low": 1.0})
    with pytest.raises(ValueError, match=r"advantages has shape \(1, 3\)"):
        get_policy_loss("ppo")(**{**kw, "advantages": torch.zeros(1, 3)})


@pytest.mark.parametrize("mode", MODES)
def test_micro_batch_gradients_sum_to_the_mini_batch_gradient(token_batch, mode):
    """1 x 12 == 3 x 4: with the mini-batch's counts, accumulating micro-batch gradients is exact."""
    old, new, adv, mask = _inputs(token_batch, seed=21)
    kw = dict(loss_agg_mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.28)
    loss, _ = get_policy_loss("ppo")(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask, **kw)
    (full_grad,) = torch.autograd.grad(loss, new)
    counts = dict(global_token_count=int(mask.sum()), global_seq_count=int((mask.sum(-1) > 0).sum()))
    acc = torch.zeros_like(new)
    for rows in (slice(0, 4), slice(4, 8), slice(8, 10)):
        micro, _ = get_policy_loss("ppo")(old_log_prob=old[rows], log_prob=new[rows], advantages=adv[rows],
                                          response_mask=mask[rows], **kw, **counts)
        (g,) = torch.autograd.grad(micro, new)
        acc += g
    assert torch.allclose(acc, full_grad, rtol=1e-12, atol=1e-15)
