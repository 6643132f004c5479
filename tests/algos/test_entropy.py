import torch

from rlframe.algos.aggregation import agg_loss
from rlframe.algos.entropy import entropy_from_logits


def test_matches_categorical_entropy_and_handles_banned_tokens():
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 11, dtype=torch.float64) * 3
    expected = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.allclose(entropy_from_logits(logits), expected)
    logits[..., 0] = float("-inf")  # a banned token: probability 0 must add 0, not nan
    assert torch.allclose(entropy_from_logits(logits), torch.distributions.Categorical(logits=logits).entropy())


def test_entropy_bonus_is_agg_loss_of_the_token_entropy():
    logits = torch.randn(2, 3, 5)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    ent = entropy_from_logits(logits)
    bonus = agg_loss(loss_mat=ent, loss_mask=mask, loss_agg_mode="token-mean")
    assert torch.isclose(bonus, (ent[0, 0] + ent[0, 1] + ent[1, 0]) / 3)
