import json

import pytest
import torch

from rlframe.data.agent_eval import evaluate_agent, parse_calls, run_tool
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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_pretrained_model(preset="agent", task="tool_arithmetic", seed=0, cfg=TINY, cache_dir=tmp_path)
    info = json.loads((path / "rlframe_pretrain.json").read_text())
    assert info["preset"] == "agent" and info["task"] == "tool_arithmetic"
    assert build_pretrained_model(preset="agent", task="tool_arithmetic", seed=0, cfg=TINY, cache_dir=tmp_path) == path
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert sum(p.numel() for p in model.parameters()) == count_parameters("agent")
    assert model.config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    _, test = chat_sft_examples("tool_arithmetic", seed=0, cfg=TINY)
    res = evaluate_agent(model, tok, test, max_new_tokens=8)
    assert res.n == len(test) and 0.0 <= res.accuracy <= 1.0


def test_task_and_preset_must_fit(tmp_path):
    with pytest.raises(ValueError, match="do not fit"):
        build_pretrained_model(preset="agent", task="arithmetic", cfg=TINY, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="do not fit"):
        build_pretrained_model(preset="test", task="tool_arithmetic", cfg=TINY, cache_dir=tmp_path)
    assert PRESETS["agent"].tokenizer == "bpe" and "tool_arithmetic" in DEFAULT_SFT


def test_tool_calls_are_parsed_and_run():
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "47*382"}}\n</tool_call><tool_call>{bad</tool_call>'
    assert parse_calls(text) == [("calculator", {"expression": "47*382"})]
    assert run_tool("calculator", {"expression": "47*382"}) == "17954"
    assert run_tool("search", {}).startswith("error:")
