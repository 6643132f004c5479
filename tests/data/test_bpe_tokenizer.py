import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rlframe.data.bpe_tokenizer import build_bpe_tokenizer, save_bpe_tokenizer
from rlframe.controller.trainers.agent_loop import tool_turn_text
from rlframe.data.chat_format import ADDED_TOKENS, format_tool_call, tool_system_prompt
from rlframe.data.pretrain import chat_segments
from rlframe.data.tiny_model import build_random_model
from rlframe.data.tool_task import CALCULATOR, conversation

TEXTS = ["What is 47*382?", "  leading and trailing  \n\n", 'x = {"a": [1, 2.5]}\tend', "naïve café ✓ 日本",
         "<answer>17954</answer>", "it's 12:30, isn't it?"]
ROOT = str(Path(__file__).resolve().parents[2])


@pytest.fixture(scope="module")
def tok():
    return build_bpe_tokenizer()


def test_round_trip_and_digits_are_single_tokens(tok):
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    ids = tok.encode("9876543210", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids] == list("9876543210")
    assert 256 + len(ADDED_TOKENS) < len(tok) <= 512  # byte alphabet + merges, a small vocabulary


def test_added_tokens_are_single_ids(tok):
    assert [tok.convert_tokens_to_ids(t) for t in ADDED_TOKENS] == list(range(7))
    for i, t in enumerate(ADDED_TOKENS):
        assert tok.encode(f"a{t}b", add_special_tokens=False)[1] == i
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id) == ("<|im_end|>", 2, "<|endoftext|>", 0)
    text = "<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|>"
    # Turn markers are special (dropped when skipping specials); tool tags stay in the text.
    assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=True) == "assistant\n<tool_call>\n{}\n</tool_call>"


def test_template_renders_a_tool_conversation_exactly(tok):
    msgs = conversation(47, 382, use_tool=True)
    system = msgs[0]["content"]
    assert tok.apply_chat_template(msgs, tokenize=False) == (
        f"<|im_start|>system\n{system}<|im_end|>\n"
        "<|im_start|>user\nWhat is 47*382?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "47*382"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n17954\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<answer>17954</answer><|im_end|>\n"
    )
    assert system.endswith('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    assert json.dumps(CALCULATOR) in system
    # tools= writes the same system turn; OpenAI-style tool_calls render like the raw call text.
    structured = [{"role": "system", "content": "Answer with <answer>number</answer>."}, msgs[1],
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "47*382"}}}]},
                  *msgs[3:]]
    assert tok.apply_chat_template(structured, tools=[CALCULATOR], tokenize=False) == tok.apply_chat_template(msgs, tokenize=False)
    prompt = tok.apply_chat_template(msgs[:2], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("What is 47*382?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs[1:2], tokenize=False) == "<|im_start|>user\nWhat is 47*382?<|im_end|>\n"


def test_tool_turns_append_and_match_tool_turn_text(tok):
    base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": format_tool_call("calculator", {"expression": "1+2"})}]
    before = tok.apply_chat_template(base, tokenize=False)
    after = tok.apply_chat_template(base + [{"role": "tool", "content": "3"}, {"role": "tool", "content": "4"}],
                                    add_generation_prompt=True, tokenize=False)
    assert after.startswith(before)
    cut = before.rindex("<|im_end|>") + len("<|im_end|>")
    assert before[cut:] + after[len(before):] == tool_turn_text(tok, ["3", "4"])
    assert tool_turn_text(tok, ["3"]) == "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_sft_segments_join_to_the_template_and_encode_piecewise(tok):
    msgs = conversation(47, 382, use_tool=True)
    segs = chat_segments(tok, msgs)
    assert "".join(t for t, _ in segs) == tok.apply_chat_template(msgs, tokenize=False)[:-1]
    assert [t for t, trained in segs if trained] == [format_tool_call("calculator", {"expression": "47*382"}) + "<|im_end|>",
                                                     "<answer>17954</answer><|im_end|>"]
    pieces = [i for t, _ in segs for i in tok.encode(t, add_special_tokens=False)]
    assert pieces == tok.encode("".join(t for t, _ in segs), add_special_tokens=False)


def _build_in_child(out: Path, hash_seed: str) -> None:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": ROOT}
    code = f"from rlframe.data.bpe_tokenizer import save_bpe_tokenizer; save_bpe_tokenizer({str(out)!r})"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)


def test_building_is_deterministic(tmp_path):
    # Another interpreter (other hash seeds, its own Rust hash maps) writes the same bytes.
    _build_in_child(tmp_path / "a", "1")
    save_bpe_tokenizer(tmp_path / "b")
    save_bpe_tokenizer(tmp_path / "c")
    digests = [{f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}
               for d in (tmp_path / "a", tmp_path / "b", tmp_path / "c")]
    assert set(digests[0]) == {"tokenizer.json", "tokenizer_config.json"}
    assert digests[0] == digests[1] == digests[2]
    assert "chat_template" in json.loads((tmp_path / "a" / "tokenizer_config.json").read_text())


def test_model_directory_loader_agrees(tmp_path, tok):
    # config.json says qwen2, so AutoTokenizer builds a Qwen2Tokenizer around the vocabulary.
    build_random_model(tmp_path, preset="agent", seed=0)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    msgs = conversation(12, 345, use_tool=True)
    for text in TEXTS + [tok.apply_chat_template(msgs, tokenize=False)]:
        ids = tok.encode(text, add_special_tokens=False)
        assert loaded.encode(text, add_special_tokens=False) == ids
        assert loaded.decode(ids) == text
    assert loaded.apply_chat_template(msgs, tokenize=False) == tok.apply_chat_template(msgs, tokenize=False)
    assert (loaded.eos_token_id, loaded.pad_token_id, len(loaded)) == (tok.eos_token_id, tok.pad_token_id, len(tok))
    assert json.loads((tmp_path / "config.json").read_text())["vocab_size"] == len(tok)
    assert tool_system_prompt([CALCULATOR], "s").startswith("s\n\n# Tools\n\n<tools>\n{")
