"""What a step reports about rewards: accuracy is the verifier's verdict (never the shaped reward),
extras are averaged over every sample with their count, booleans count 0/1, and the metrics describe
exactly the rows of the batch they are taken on (DAPO's refills)."""

import numpy as np
import pytest
import torch

from rlframe.config import load_config
from rlframe.controller.trainers import phases
from rlframe.controller.trainers.metrics import batch_metrics
from rlframe.controller.trainers.prepare import model_path
from rlframe.protocol import DataProto
from rlframe.rewards.manager import RewardManager
from rlframe.rewards.registry import RewardFnSpec

R = 8


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path(load_config("grpo_tiny", [])))


def _batch(tokenizer, texts, truths):
    rows = [tokenizer.encode(t, add_special_tokens=False)[:R - 1] + [tokenizer.eos_token_id] for t in texts]
    responses = torch.full((len(rows), R), tokenizer.pad_token_id)
    mask = torch.zeros(len(rows), R)
    for i, r in enumerate(rows):
        responses[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    prompt = torch.ones(len(rows), 2, dtype=torch.long)
    return DataProto.from_dict(
        tensors={"responses": responses, "response_mask": mask, "prompts": prompt,
                 "attention_mask": torch.cat([prompt, mask.long()], dim=1)},
        non_tensors={"data_source": np.array(["arithmetic"] * len(rows), dtype=object),
                     "ground_truth": np.array(truths, dtype=object),
                     "extra_info": np.array([None] * len(rows), dtype=object)})


def test_accuracy_is_the_verdict_not_the_shaped_reward(tokenizer):
    cfg = load_config("grpo_tiny", ["algorithm.overlong_buffer_len=4", f"data.response_length={R}"])
    # right answers long enough (7 tokens > 8 - 4) to be shaped below 1 by the overlong penalty
    batch = _batch(tokenizer, ["    12", "    70", "5"], ["12", "7", "5"])
    batch, m = phases.score(batch, cfg=cfg, tokenizer=tokenizer, reward_manager=RewardManager())
    shaped = batch.batch["token_level_scores"].sum(-1)
    assert (shaped[:1] < 1).all() and batch.batch["acc"].tolist() == [1.0, 0.0, 1.0]
    assert m["critic/accuracy"] == pytest.approx(2 / 3) and m["reward/overlong_penalty_mean"] < 0
    part = batch.index(torch.tensor([1, 2]))
    assert phases.reward_metrics(part)["critic/accuracy"] == pytest.approx(0.5)  # the rows it is taken on
    # the row ending in EOS at the limit is not "clipped"; a row cut without it is
    assert batch_metrics(_with_advantages(batch), response_length=R, end_ids={tokenizer.eos_token_id})[
        "response_length/clip_ratio"] == 0.0


def _with_advantages(batch):
    for k in ("token_level_rewards", "advantages", "returns"):
        batch.batch[k] = torch.zeros_like(batch.batch["response_mask"])
    return batch


def test_extras_over_all_samples_with_counts_and_booleans(tmp_path, tokenizer):
    fn = tmp_path / "reward.py"
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                  "    out = {'score': float(solution_str.strip() == ground_truth), 'exact': solution_str == ground_truth}\n"
                  "    if ground_truth == '1':\n"
                  "        out['rare'] = 1.0\n"
                  "    return out\n")
    cfg = load_config("grpo_tiny", [])
    batch = _batch(tokenizer, ["1", "2", "9"], ["1", "2", "3"])
    manager = RewardManager(fn_spec=RewardFnSpec(path=str(fn), name="compute_score"))
    _, m = phases.score(batch, cfg=cfg, tokenizer=tokenizer, reward_manager=manager)
    assert m["reward/exact/mean"] == pytest.approx(2 / 3) and m["reward/exact/count"] == 3  # booleans 0/1
    assert m["reward/rare/mean"] == pytest.approx(1 / 3) and m["reward/rare/count"] == 1  # not 1.0
