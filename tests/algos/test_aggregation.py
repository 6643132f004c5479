import pytest
import torch

from rlframe.algos.aggregation import agg_loss

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("mode", MODES)
def test_modes_match_reference(mode, token_batch, ref_agg):
    _, mask, _ = token_batch(B=10, R=6, seed=2)
    loss_mat = torch.randn(10, 6, dtype=torch.float64)
    per_token = {(i, t): float(loss_mat[i, t]) for i in range(10) for t in range(6)}
    assert agg_loss(loss_mat=loss_mat, loss_mask=mask, loss_agg_mode=mode).item() == pytest.approx(
        ref_agg(per_token, mask, mode), rel=1e-12)
    if mode == "seq-mean-token-sum-norm":
        got = agg_loss(loss_mat=loss_mat, loss_mask=mask, loss_agg_mode=mode, loss_scale_factor=16)
        assert got.item() == pytest.approx(ref_agg(per_token, mask, mode, scale=16), rel=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_all_masked_gives_zero_loss_and_zero_gradients(mode):
    loss_mat = torch.randn(3, 4, requires_grad=True)
    loss = agg_loss(loss_mat=loss_mat, loss_mask=torch.zeros(3, 4), loss_agg_mode=mode)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(loss_mat.grad, torch.zeros(3, 4))


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_with_global_counts_sum_to_the_full_batch_loss(mode, token_batch):
    _, mask, _ = token_batch(B=12, R=5, seed=3)
    loss_mat = torch.randn(12, 5, dtype=torch.float64)
    full = agg_loss(loss_mat=loss_mat, loss_mask=mask, loss_agg_mode=mode)
    tokens, seqs = int(mask.sum()), int((mask.sum(-1) > 0).sum())
    parts = sum(
        agg_loss(loss_mat=loss_mat[i:i + 4], loss_mask=mask[i:i + 4], loss_agg_mode=mode,
                 global_token_count=tokens, global_seq_count=seqs)
        for i in range(0, 12, 4)
    )
    assert parts.item() == pytest.approx(full.item(), rel=1e-12)


def test_padding_holding_nan_does_not_leak_into_loss_or_gradient():
    loss_mat = torch.tensor([[1.0, 2.0, float("nan")]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    loss = agg_loss(loss_mat=loss_mat, loss_mask=mask, loss_agg_mode="token-mean")
    loss.backward()
    assert loss.item() == 1.5 and loss_mat.grad.tolist() == [[0.5, 0.5, 0.0]]


def test_errors():
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'mean'"):
        agg_loss(loss_mat=torch.zeros(1, 2), loss_mask=torch.ones(1, 2), loss_agg_mode="mean")
    with pytest.raises(ValueError, match=r"must both be \(B, R\)"):
        agg_loss(loss_mat=torch.zeros(1, 2), loss_mask=torch.ones(1, 3), loss_agg_mode="token-mean")
