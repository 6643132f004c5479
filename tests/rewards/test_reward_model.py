import pytest
import torch

from rlframe.data.tokenizer import build_char_tokenizer
from rlframe.rewards.reward_model import build_rm_inputs, ensemble_scores, last_token_scores, retokenize_for_rm


def test_build_rm_inputs_concatenates_and_positions():
    prompts = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    pmask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    resp = torch.tensor([[11, 12, 0], [13, 0, 0]])
    rmask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = build_rm_inputs(prompts, pmask, resp, rmask)
    assert out["input_ids"].tolist() == [[0, 0, 5, 6, 11, 12, 0], [7, 8, 9, 10, 13, 0, 0]]
    assert out["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0]]
    assert out["position_ids"].tolist() == [[0, 0, 0, 1, 2, 3, 3], [0, 1, 2, 3, 4, 4, 4]]
    with pytest.raises(ValueError, match="shape mismatch"):
        build_rm_inputs(prompts, pmask[:, :3], resp, rmask)


def test_last_token_scores_matches_loop_reference():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 9, 1, generator=gen)
    mask = torch.zeros(5, 9, dtype=torch.long)
    for i, (a, b) in enumerate([(0, 9), (3, 9), (0, 4), (2, 6), (8, 9)]):
        mask[i, a:b] = 1
    ref = torch.stack([logits[i, mask[i].nonzero()[-1, 0], 0] for i in range(5)])
    torch.testing.assert_close(last_token_scores(logits, mask), ref)
    torch.testing.assert_close(last_token_scores(logits.squeeze(-1), mask), ref)
    with pytest.raises(ValueError, match="no real token"):
        last_token_scores(logits, torch.zeros(5, 9))
    with pytest.raises(ValueError, match="one value per token"):
        last_token_scores(torch.zeros(5, 9, 2), mask)


def test_ensemble_mean_and_min():
    s = torch.tensor([[1.0, -1.0, 3.0], [2.0, 0.0, -3.0]])
    torch.testing.assert_close(ensemble_scores(s, mode="mean"), torch.tensor([1.5, -0.5, 0.0]))
    torch.testing.assert_close(ensemble_scores(s, mode="min"), torch.tensor([1.0, -1.0, -3.0]))
    with pytest.raises(ValueError, match="unknown reward-model ensemble mode"):
        ensemble_scores(s, mode="max")


def test_retokenize_keeps_the_end_and_left_pads():
    tok = build_char_tokenizer()
    out = retokenize_for_rm(tok, ["12+3=", "1+1="], ["15", "2"], max_length=6)
    assert tok.decode(out["input_ids"][0][out["attention_mask"][0] > 0]) == "2+3=15"
    assert out["attention_mask"][1].tolist() == [0, 1, 1, 1, 1, 1]
    assert out["position_ids"][1].tolist() == [0, 0, 1, 2, 3, 4]
