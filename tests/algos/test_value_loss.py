import pytest
import torch

from rlframe.algos.value_loss import compute_value_loss


@pytest.mark.parametrize("cliprange", [None, 0.2])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_matches_reference(token_batch, ref_agg, cliprange, mode):
    _, mask, _ = token_batch(B=9, R=5, seed=13)
    g = torch.Generator().manual_seed(13)
    values = torch.randn(9, 5, generator=g, dtype=torch.float64)
    returns = torch.randn(9, 5, generator=g, dtype=torch.float64)
    vpreds = (values + 0.5 * torch.randn(9, 5, generator=g, dtype=torch.float64)).requires_grad_(True)
    loss, metrics = compute_value_loss(vpreds=vpreds, values=values, returns=returns, response_mask=mask,
                                       cliprange_value=cliprange, loss_agg_mode=mode)
    per_token, clipped = {}, 0
    for i in range(9):
        for t in range(5):
            if mask[i, t]:
                v, old, ret = vpreds[i, t], float(values[i, t]), float(returns[i, t])
                l1 = (v - ret) ** 2
                if cliprange is None:
                    per_token[(i, t)] = 0.5 * l1
                    continue
                l2 = (torch.clamp(v, old - cliprange, old + cliprange) - ret) ** 2
                clipped += int(l2 > l1)
                per_token[(i, t)] = 0.5 * torch.maximum(l1, l2)
    ref = ref_agg(per_token, mask, mode)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-10)
    (g1,) = torch.autograd.grad(loss, vpreds)
    (g2,) = torch.autograd.grad(ref, vpreds)
    assert torch.allclose(g1, g2)
    assert metrics["vf_clipfrac"].item() == pytest.approx(clipped / int(mask.sum()))
    assert (clipped > 0) == (cliprange is not None)


def test_negative_cliprange_is_an_error():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="cliprange_value must be >= 0"):
        compute_value_loss(vpreds=x, values=x, returns=x, response_mask=torch.ones(1, 2), cliprange_value=-1)


def test_clipfrac_counts_no_token_inside_the_range():
    import torch

    from rlframe.algos.value_loss import compute_value_loss

    g = torch.Generator().manual_seed(0)
    # predictions of different magnitudes, all within c = 0.5 of the old values: values + (vpreds -
    # values) rounds away from vpreds for a third of them, which once counted as clipped
    values = (torch.rand(100, 1000, generator=g) * 2 - 1) * 0.2
    vpreds = (torch.rand(100, 1000, generator=g) * 2 - 1) * 0.2
    returns = torch.randn(100, 1000, generator=g)
    _, m = compute_value_loss(vpreds=vpreds, values=values, returns=returns, response_mask=torch.ones(100, 1000),
                              cliprange_value=0.5)
    assert float(m["vf_clipfrac"]) == 0.0
    outside = values + 0.5  # every prediction beyond the range: clipped where that raises the loss
    _, m = compute_value_loss(vpreds=outside, values=values, returns=returns, response_mask=torch.ones(100, 1000),
                              cliprange_value=0.2)
    assert 0.0 < float(m["vf_clipfrac"]) < 1.0
