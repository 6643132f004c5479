"""The contract batch built from per-sample responses."""

from __future__ import annotations

import torch

from rlframe.workers.rollout.batch import assemble_batch, unpad_prompts


def test_assemble_batch_contract():
    ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert unpad_prompts(ids, mask) == [[5, 6], [7, 8, 9]]
    out = assemble_batch(prompt_ids=ids, prompt_mask=mask, responses=[[1], [2, 3, 4], [], [5, 6]],
                         log_probs=[[-0.1], [-0.2, -0.3, -0.4], [], [-0.5, -0.6]], n=2, response_length=4,
                         pad_token_id=0)
    assert torch.equal(out["prompts"], torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [7, 8, 9]]))
    assert torch.equal(out["responses"], torch.tensor([[1, 0, 0, 0], [2, 3, 4, 0], [0, 0, 0, 0], [5, 6, 0, 0]]))
    assert torch.equal(out["response_mask"].sum(1), torch.tensor([1, 3, 0, 2]))
    assert torch.equal(out["input_ids"], torch.cat([out["prompts"], out["responses"]], 1))
    assert torch.equal(out["attention_mask"][1], torch.tensor([0, 1, 1, 1, 1, 1, 0]))
    assert torch.equal(out["position_ids"][1], torch.tensor([0, 0, 1, 2, 3, 4, 4]))
    assert torch.allclose(out["rollout_log_probs"][3], torch.tensor([-0.5, -0.6, 0.0, 0.0]))
    assert out["rollout_log_probs"].dtype == torch.float32
