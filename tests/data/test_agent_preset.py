import json

import pytest

from rlframe.controller.trainers.agent_eval import default_response_length, evaluate_agent
from rlframe.data.pretrain import DEFAULT_SFT, SFTConfig, build_pretrained_model, chat_sft_examples, encode_chat_batch
from rlframe.data.tiny_model import PRESETS, count_parameters

TINY = SFTConfig(steps=3, batch_size=4, num_train=60, num_test=6, warmup=2)


def test_chat_batch_trains_only_the_assistant_turns():
    from rlframe.data.bpe_tokenizer import build_bpe_tokenizer

    tok = build_bpe_tokenizer()
    train, _ = chat_sft_examples("tool_arithmetic", seed=0, cfg=TINY)
    ids, mask, labels = encode_chat_batch(tok, train[:4])
    for i in range(4):
        trained = tok.decode(labels[i][labels[i] != -100].tolist())
        answer = train[i][-1]["content"]
        calls = "".join(m["content"] for m in train[i][2:-1] if m["role"] == "assistant")
        assert trained == calls + (tok.eos_token if calls else "") + answer + tok.eos_token
        assert (labels[i][mask[i] == 0] == -100).all()


def test_agent_preset_builds_loads_and_runs_the_tool_loop(tmp_path):
    from rlframe.workers.rollout.config import RolloutConfig
    from rlframe.workers.rollout.hf_engine import HFRolloutEngine

    path = build_pretrained_model(preset="agent", task="tool_arithmetic", seed=0, cfg=TINY, cache_dir=tmp_path)
    info = json.loads((path / "rlframe_pretrain.json").read_text())
    assert info["preset"] == "agent" and info["task"] == "tool_arithmetic"
    assert build_pretrained_model(preset="agent", task="tool_arithmetic", seed=0, cfg=TINY, cache_dir=tmp_path) == path
    engine = HFRolloutEngine(str(path), config=RolloutConfig(backend="hf", dtype="float32"))
    tok, model = engine.tokenizer, engine.model
    assert sum(p.numel() for p in model.parameters()) == count_parameters("agent")
    assert model.config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    # The default budget: 3 turns of 48 tokens and 2 tool turns of a 5-digit result (18 tokens each).
    assert default_response_length(tok, max_turns=3, max_new_tokens=48) == 3 * 48 + 2 * 18
    assert default_response_length(tok, max_turns=1, max_new_tokens=48) == 48
    _, test = chat_sft_examples("tool_arithmetic", seed=0, cfg=TINY)
    for use_tools in (True, False):
        res = evaluate_agent(engine, test, use_tools=use_tools, max_new_tokens=8)
        assert res.n == len(test) and 0.0 <= res.accuracy <= 1.0 and 0.0 <= res.tool_call_rate <= 1.0


def test_task_and_preset_must_fit(tmp_path):
    with pytest.raises(ValueError, match="do not fit"):
        build_pretrained_model(preset="agent", task="arithmetic", cfg=TINY, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="do not fit"):
        build_pretrained_model(preset="test", task="tool_arithmetic", cfg=TINY, cache_dir=tmp_path)
    assert PRESETS["agent"].tokenizer == "bpe" and "tool_arithmetic" in DEFAULT_SFT
