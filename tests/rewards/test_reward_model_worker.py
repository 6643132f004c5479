"""RewardModelWorker with the real tiny reward model (rlframe/data/tiny_rm.py): a stock pooled
Qwen2ForSequenceClassification whose tokenizer is not the policy's, a per-token head made from the same
weights, the policy's ids reused when the tokenizers agree, and the ensemble."""

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from rlframe.data.pretrain import PRETRAIN_SEED, SFTConfig, build_pretrained_model, sft_examples
from rlframe.data.tiny_rm import build_reward_model, rm_texts as tiny_rm_texts, score_texts, wrong_answer
from rlframe.protocol import DataProto
from rlframe.rewards.reward_model import check_reward_model_dir, pack_right, sequence_scores
from rlframe.workers.reward_model import RewardModelWorker, rm_placement


@pytest.fixture(scope="module")
def rm_dir():
    return build_reward_model()


@pytest.fixture(scope="module")
def policy_dir():
    return build_pretrained_model(preset="demo")


@pytest.fixture(scope="module")
def items():
    """(prompt, answer) of 24 held-out problems: each with its right answer, then with a wrong one."""
    import random

    test = sft_examples("arithmetic", seed=PRETRAIN_SEED, cfg=SFTConfig())[1][:24]
    rng = random.Random(3)
    return test + [(p, wrong_answer(a, rng)) for p, a in test]


def policy_batch(tok, items, *, user_texts=None, response_suffix=None, prompt_len=16, resp_len=8) -> DataProto:
    """What the trainer hands the reward model: left-padded prompts, right-padded responses (+ EOS)."""
    suffix = tok.eos_token if response_suffix is None else response_suffix
    b = len(items)
    prompts = torch.full((b, prompt_len), tok.pad_token_id)
    responses = torch.full((b, resp_len), tok.pad_token_id)
    pmask, rmask = torch.zeros(b, prompt_len, dtype=torch.long), torch.zeros(b, resp_len, dtype=torch.long)
    for i, (p, a) in enumerate(items):
        text = user_texts[i] if user_texts else tok.apply_chat_template([{"role": "user", "content": p}],
                                                                       add_generation_prompt=True, tokenize=False)
        pid = tok.encode(text, add_special_tokens=False)
        rid = tok.encode(a + suffix, add_special_tokens=False)
        prompts[i, prompt_len - len(pid):], pmask[i, prompt_len - len(pid):] = torch.tensor(pid), 1
        if rid:
            responses[i, :len(rid)], rmask[i, :len(rid)] = torch.tensor(rid), 1
    raw = np.empty(b, dtype=object)
    raw[:] = [[{"role": "user", "content": p}] for p, _ in items]
    return DataProto.from_dict(tensors={"prompts": prompts, "responses": responses, "response_mask": rmask,
                                        "attention_mask": torch.cat([pmask, rmask], 1)},
                               non_tensors={"raw_prompt": raw})


def test_tiny_rm_is_a_valid_reward_model_dir(rm_dir):
    assert check_reward_model_dir("reward.model_paths[0]", rm_dir) is None


def test_pooled_head_retokenizes_from_text(rm_dir, policy_dir, items):
    worker = RewardModelWorker(model_paths=[str(rm_dir)], policy_tokenizer_path=str(policy_dir), micro_batch_size=16)
    assert worker.retokenize == [True]  # the RM's vocabulary is the policy's in another order
    pol = AutoTokenizer.from_pretrained(str(policy_dir))
    out = worker.compute_rm_score(policy_batch(pol, items)).batch
    assert out["rm_scores"].shape == (len(items),) and out["rm_scores_per_model"].shape == (len(items), 1)
    # the same numbers as the RM scoring its own chat text directly
    rm_tok = AutoTokenizer.from_pretrained(str(rm_dir))
    torch.testing.assert_close(out["rm_scores"], score_texts(worker.models[0], rm_tok, items), rtol=1e-4, atol=1e-4)
    n = len(items) // 2
    right, wrong = out["rm_scores"][:n], out["rm_scores"][n:]
    assert right.mean() > wrong.mean() + 0.5, (right, wrong)
    assert (right > wrong).float().mean() >= 0.6


def test_same_tokenizer_reuses_the_ids(rm_dir, items):
    rm_tok = AutoTokenizer.from_pretrained(str(rm_dir))
    worker = RewardModelWorker(model_paths=[str(rm_dir)], policy_tokenizer_path=str(rm_dir))
    assert worker.retokenize == [False]
    assert {(p.device.type, p.dtype) for p in worker.models[0].parameters()} == {("cpu", torch.float32)}
    # the policy's ids are the RM's own: prompt in its template, response ending with its EOS
    batch = policy_batch(rm_tok, items, resp_len=5)
    inputs = worker.rm_inputs(batch)[0]
    assert inputs["input_ids"].shape[1] == 16 + 5  # nothing re-encoded: prompt and response columns
    torch.testing.assert_close(worker.compute_rm_score(batch).batch["rm_scores"],
                               score_texts(worker.models[0], rm_tok, items), rtol=1e-4, atol=1e-4)
    texts = tiny_rm_texts(rm_tok, items)
    packed = pack_right(inputs)
    assert rm_tok.decode(packed["input_ids"][0][packed["attention_mask"][0] > 0]) == texts[0]


def test_per_token_head_and_ensemble(rm_dir, policy_dir, items, tmp_path):
    from transformers import Qwen2ForTokenClassification

    tok_model = Qwen2ForTokenClassification.from_pretrained(str(rm_dir), num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        tok_model.score.bias.zero_()  # the pooled head has none: same weights, same scores
    tok_model.save_pretrained(str(tmp_path))
    AutoTokenizer.from_pretrained(str(rm_dir)).save_pretrained(str(tmp_path))
    assert check_reward_model_dir("k", tmp_path) is None
    worker = RewardModelWorker(model_paths=[str(rm_dir), str(tmp_path)], policy_tokenizer_path=str(policy_dir),
                               ensemble="mean")
    assert type(worker.models[1]).__name__ == "Qwen2ForTokenClassification"
    out = worker.compute_rm_score(policy_batch(AutoTokenizer.from_pretrained(str(policy_dir)), items)).batch
    per = out["rm_scores_per_model"]
    torch.testing.assert_close(per[:, 0], per[:, 1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out["rm_scores"], per.mean(1))


def test_reward_models_go_on_the_process_gpu_in_bf16_else_cpu_fp32():
    assert rm_placement(None) == (torch.device("cpu"), torch.float32)
    assert rm_placement(0) == (torch.device("cuda", 0), torch.bfloat16)
    assert rm_placement(3)[0] == torch.device("cuda", 3)


@pytest.mark.gpu
def test_reward_model_scores_on_the_gpu(rm_dir, policy_dir, items):
    """On the GPU in bf16, the scores (back on CPU) stay those of the fp32 model on CPU."""
    from transformers import AutoModelForSequenceClassification

    worker = RewardModelWorker(model_paths=[str(rm_dir)], policy_tokenizer_path=str(policy_dir), micro_batch_size=16)
    assert {(p.device.type, p.dtype) for p in worker.models[0].parameters()} == {("cuda", torch.bfloat16)}
    batch = policy_batch(AutoTokenizer.from_pretrained(str(policy_dir)), items)
    got = worker.compute_rm_score(batch).batch["rm_scores"]
    cpu_model = AutoModelForSequenceClassification.from_pretrained(str(rm_dir), dtype=torch.float32).eval()
    want = score_texts(cpu_model, AutoTokenizer.from_pretrained(str(rm_dir)), items)
    assert got.device.type == "cpu" and got.dtype == torch.float32
    assert float((got - want).abs().max()) < 0.05 * float(want.abs().max()) + 0.05, (got, want)
    n = len(items) // 2
    assert got[:n].mean() > got[n:].mean() + 0.5


def test_pack_right_and_sequence_scores():
    inputs = {"input_ids": torch.tensor([[0, 5, 6, 7, 0], [8, 9, 0, 0, 0]]),
              "attention_mask": torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]])}
    packed = pack_right(inputs)
    assert packed["input_ids"].tolist() == [[0, 0, 5, 6, 7], [0, 0, 0, 8, 9]]
    assert packed["attention_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]
    assert packed["position_ids"].tolist() == [[0, 0, 0, 1, 2], [0, 0, 0, 0, 1]]
    per_token = torch.arange(10.0).view(2, 5)
    assert sequence_scores(per_token, inputs["attention_mask"]).tolist() == [3.0, 6.0]
    assert sequence_scores(per_token.unsqueeze(-1), inputs["attention_mask"]).tolist() == [3.0, 6.0]
    assert sequence_scores(torch.tensor([[1.5], [-2.0]]), inputs["attention_mask"]).tolist() == [1.5, -2.0]
