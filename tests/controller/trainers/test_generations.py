"""Generation dumps (trainer.rollout_dump_*): one row per sample of the batch's first whole groups
with its texts, reward and its parts, advantage, length, end, policy version and agent turns; every
N-th step to generations/train.jsonl, each evaluation to val.jsonl, the first rows to TensorBoard as
a markdown table. Real tokenizer, reward manager and advantage estimator on a hand-made rollout
batch; no Ray. (Rotation: test_step_files.py; resume, full disk, wandb, mlflow: test_tracking.py.)"""

import json

import numpy as np
import pytest
import torch

from rlframe.config import load_config
from rlframe.controller.trainers import phases
from rlframe.controller.trainers.generations import GenerationDump, first_groups, sample_rows
from rlframe.controller.trainers.prepare import model_path
from rlframe.controller.lifecycle.step_files import read_jsonl
from rlframe.controller.lifecycle.tracking import SINK_ROWS, Tracker
from rlframe.protocol import DataProto
from rlframe.rewards.manager import RewardManager
from rlframe.rewards.registry import RewardFnSpec
from rlframe.workers.rollout.batch import assemble_batch, left_pad

R = 8  # response length
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info):
    if solution_str.strip() == "boom":
        return {"score": 0.0}
    return {"score": float(solution_str.strip() == ground_truth), "answered": bool(solution_str.strip())}
'''


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path(load_config("grpo_tiny", [])))


@pytest.fixture
def cfg():
    return load_config("grpo_tiny", [f"data.response_length={R}", "algorithm.n_samples=2",
                                     "trainer.rollout_dump_every=2", "trainer.rollout_dump_rows=4"])


def rollout(tokenizer, cfg, tmp_path, *, versions=None, reward=REWARD):
    """3 prompts x 2 samples, scored by a reward function with an extra value and GRPO's advantages.
    Sample texts: right, wrong; right, "boom" (no extra); a response cut at the limit, empty."""
    prompts = ["1+1=", "2+3=", "4+4="]
    truths = ["2", "5", "8"]
    texts = [["2", "3"], ["5", "boom"], ["8888888888888", ""]]
    eos = tokenizer.eos_token_id
    responses = []
    for group in texts:
        for t in group:
            ids = tokenizer.encode(t, add_special_tokens=False)
            responses.append(ids[:R] if len(ids) >= R else ids + [eos])
    ids, mask = left_pad([tokenizer.encode(p, add_special_tokens=False) for p in prompts], pad_id=tokenizer.pad_token_id)
    tensors = assemble_batch(prompt_ids=ids, prompt_mask=mask, responses=responses,
                             log_probs=[[-0.5 - j for j in range(len(r))] for r in responses], n=2,
                             response_length=R, pad_token_id=tokenizer.pad_token_id)
    if versions is not None:
        tensors["policy_version"] = torch.tensor(versions)
    batch = DataProto.from_dict(tensors=tensors, non_tensors={
        "uid": np.array([f"e0-p0-{i}" for i in range(3) for _ in range(2)], dtype=object),
        "data_source": np.array(["arithmetic"] * 6, dtype=object),
        "ground_truth": np.array([t for t in truths for _ in range(2)], dtype=object),
        "extra_info": np.array([None] * 6, dtype=object)})
    fn = tmp_path / "reward_fn.py"
    fn.write_text(reward)
    batch, _ = phases.score(batch, cfg=cfg, tokenizer=tokenizer, reward_manager=RewardManager(
        fn_spec=RewardFnSpec(path=str(fn), name="compute_score")))
    batch, _ = phases.advantages(batch, cfg=cfg, kl_ctrl=None)
    return batch


def test_first_groups_keeps_whole_groups_in_order():
    assert first_groups(["a", "a", "b", "b", "c", "c"], 5) == [0, 1, 2, 3]
    assert first_groups(["a", "b", "a", "b"], 2) == [0, 2]  # a group's rows need not be adjacent
    assert first_groups(["a", "a", "a"], 2) == [0, 1]  # not even one group fits: its first rows
    assert first_groups(range(5), 3) == [0, 1, 2]
    assert first_groups([], 3) == []


def test_rows_hold_each_sample_with_its_fields(tokenizer, cfg, tmp_path):
    batch = rollout(tokenizer, cfg, tmp_path)
    rows = sample_rows(batch, tokenizer, step=6, version=5, end_ids={tokenizer.eos_token_id}, response_length=R,
                       limit=5, logprobs=True)
    assert [(r["step"], r["index"], r["uid"]) for r in rows] == [(6, 0, "e0-p0-0"), (6, 1, "e0-p0-0"),
                                                                (6, 2, "e0-p0-1"), (6, 3, "e0-p0-1")]
    right, wrong, _, boom = rows
    assert right["prompt"] == "1+1=" and right["response"] == "2" and right["ground_truth"] == "2"
    assert right["reward"] == 1.0 and wrong["reward"] == 0.0
    assert right["score_parts"] == {"verifier_score": 1.0, "acc": 1.0, "reward_failed": 0.0, "answered": 1.0}
    assert "answered" not in boom["score_parts"]  # the function returned no extra for it
    adv = batch.batch["advantages"][0][batch.batch["response_mask"][0].bool()]
    assert right["advantage"] == pytest.approx(float(adv.mean())) and right["advantage"] > 0 > wrong["advantage"]
    assert right["response_length"] == 2 and right["finished"] and not right["truncated"]
    assert right["policy_version"] == 5 and right["data_source"] == "arithmetic"
    assert right["logprobs"] == [-0.5, -1.5]
    assert "turns" not in right
    json.dumps(rows)  # every field is JSON

    cut = sample_rows(batch.index(torch.tensor([4, 5])), tokenizer, step=6, version=5, end_ids={tokenizer.eos_token_id},
                      response_length=R, limit=4)
    assert cut[0]["truncated"] and not cut[0]["finished"] and cut[0]["response_length"] == R
    assert cut[1]["response"] == "" and cut[1]["finished"] and "logprobs" not in cut[1]


REASONED = REWARD.replace(
    '"answered": bool(solution_str.strip())}',
    '"answered": bool(solution_str.strip()), **({} if solution_str.strip() == ground_truth else '
    '{"reason": f"expected {ground_truth}"})}')


def test_string_extras_reach_score_parts_per_sample(tokenizer, cfg, tmp_path):
    """docs/generations.md: every extra value the reward returned is in score_parts: a string (a reason) too,
    for the samples that returned one; not a metric. DAPO's rounds with and without it still concatenate."""
    batch = rollout(tokenizer, cfg, tmp_path, reward=REASONED)
    rows = sample_rows(batch, tokenizer, step=1, version=0, end_ids={tokenizer.eos_token_id}, response_length=R,
                       limit=6)
    right, wrong, _, boom, _, _ = rows
    assert wrong["score_parts"]["reason"] == "expected 2" and "reason" not in right["score_parts"]
    assert "reason" not in boom["score_parts"] and boom["score_parts"]["verifier_score"] == 0.0
    assert not any("reason" in k for k in phases.reward_metrics(batch))
    json.dumps(rows)
    (tmp_path / "plain").mkdir()
    plain = rollout(tokenizer, cfg, tmp_path / "plain", reward=REWARD)  # a round whose samples returned no string
    both = DataProto.concat(phases.align_reward_extras([batch, plain]))
    assert both.non_tensor_batch["reward_text:reason"].tolist()[6:] == [None] * 6
    rows = sample_rows(both.index(torch.arange(6, 12)), tokenizer, step=1, version=0, end_ids={tokenizer.eos_token_id},
                       response_length=R, limit=6)
    assert not any("reason" in r["score_parts"] for r in rows)


def test_rows_take_the_batch_policy_version_and_agent_turns(tokenizer, cfg, tmp_path):
    batch = rollout(tokenizer, cfg, tmp_path, versions=[3, 3, 4, 4, 4, 4])
    batch.batch["agent_turns"] = torch.tensor([1, 2, 1, 1, 3, 1])
    batch.non_tensor_batch["agent_tool_statuses"] = np.empty(6, dtype=object)
    for i, s in enumerate([[], ["ok"], [], [], ["ok", "error"], []]):
        batch.non_tensor_batch["agent_tool_statuses"][i] = s
    rows = sample_rows(batch, tokenizer, step=6, version=5, end_ids={tokenizer.eos_token_id}, response_length=R,
                       limit=6)
    assert [r["policy_version"] for r in rows] == [3, 3, 4, 4, 4, 4]
    assert [r["turns"] for r in rows] == [1, 2, 1, 1, 3, 1]
    assert rows[4]["tool_statuses"] == ["ok", "error"] and rows[4]["tool_calls"] == 2
    assert rows[0]["transcript"].startswith("2")


def test_dump_every_n_steps_to_the_run_files_and_tensorboard(tokenizer, cfg, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    batch = rollout(tokenizer, cfg, tmp_path)
    tracker = Tracker(tmp_path / "run", sinks=["jsonl", "tensorboard"], experiment="t", config={}, plot=False)
    dump = GenerationDump(cfg, tokenizer, tracker, end_ids={tokenizer.eos_token_id})
    for step in (1, 2, 3, 4):
        dump.train(step, batch)
    dump.val(4, batch)
    tracker.close()
    train = read_jsonl(tmp_path / "run" / "generations" / "train.jsonl")
    assert [(r["step"], r["index"]) for r in train] == [(s, i) for s in (2, 4) for i in range(4)]
    assert [r["policy_version"] for r in train] == [1] * 4 + [3] * 4
    val = read_jsonl(tmp_path / "run" / "generations" / "val.jsonl")
    assert [r["step"] for r in val] == [4] * 4 and val[0]["policy_version"] == 4

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors("generations/train/text_summary")
    assert [e.step for e in texts] == [2, 4]
    table = texts[0].tensor_proto.string_val[0].decode()
    assert table.startswith("| step | index |") and len(table.splitlines()) == 2 + min(SINK_ROWS, 4)
    assert "1+1=" in table
