import math

import torch

from rlframe.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten, reverse_discounted_cumsum


def _valid_values(x, mask):
    return [float(x[i, t]) for i in range(x.shape[0]) for t in range(x.shape[1]) if mask[i, t]]


def test_reductions_match_lists_of_valid_entries(token_batch):
    _, mask, _ = token_batch(B=9, R=6, seed=1)
    x = torch.randn(9, 6, dtype=torch.float64)
    x[mask == 0] = float("nan")  # padding may hold garbage; it must not leak
    vals = _valid_values(x, mask)
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    assert math.isclose(masked_sum(x, mask).item(), sum(vals), rel_tol=1e-12)
    assert math.isclose(masked_mean(x, mask).item(), mean, rel_tol=1e-12)
    assert math.isclose(masked_var(x, mask).item(), var, rel_tol=1e-12)
    w = masked_whiten(x, mask, epsilon=0.0)
    for i in range(9):
        for t in range(6):
            expected = (x[i, t].item() - mean) / math.sqrt(var) if mask[i, t] else 0.0
            assert math.isclose(w[i, t].item(), expected, rel_tol=1e-9, abs_tol=1e-12)
    rows = masked_mean(x, mask, dim=-1)
    assert rows[0].item() == 0.0  # the all-masked row: 0, not nan
    assert torch.isfinite(rows).all()


def test_degenerate_masks_give_zeros_not_nan():
    x = torch.randn(2, 3)
    none = torch.zeros(2, 3, dtype=torch.long)
    one = torch.tensor([[0, 1, 0], [0, 0, 0]])
    assert masked_mean(x, none).item() == 0.0
    assert masked_whiten(x, none).abs().sum().item() == 0.0
    assert masked_var(x, one).item() == 0.0
    assert masked_whiten(x, one).abs().sum().item() == 0.0


def test_reverse_discounted_cumsum_skips_masked_positions():
    x = torch.tensor([[1.0, 2.0, 3.0, 9.0], [1.0, 0.0, 5.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0]])  # row 1 has a hole in the middle
    out = reverse_discounted_cumsum(x, mask, gamma=0.5)
    assert torch.allclose(out[0], torch.tensor([1 + 0.5 * (2 + 0.5 * 3), 2 + 0.5 * 3, 3.0, 0.0]))
    assert torch.allclose(out[1], torch.tensor([1 + 0.5 * 5, 0.0, 5.0, 0.0]))
