from transformers import AutoTokenizer

from rlframe.data.tiny_model import build_random_model
from rlframe.data.tokenizer import ALPHABET, build_char_tokenizer

TEXTS = ["23+58=81", "a b, c\nHello World! {\"json\": [1, 2]}", "1+1=2<eos>", "  leading and trailing  ", ALPHABET]


def test_one_token_per_character_and_round_trip():
    tok = build_char_tokenizer()
    for text in TEXTS[:2] + TEXTS[3:]:
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == len(text)
        assert tok.decode(ids) == text
    assert tok.encode("<eos>", add_special_tokens=False) == [tok.eos_token_id]
    assert tok.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True, tokenize=False) == "1+2="


def test_model_directory_loader_agrees(tmp_path):
    # A qwen2 config.json makes AutoTokenizer build a Qwen2Tokenizer; ids and text must not change.
    build_random_model(tmp_path, preset="test", seed=0)
    ours, loaded = build_char_tokenizer(), AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert loaded.encode(text, add_special_tokens=False) == ids
        assert loaded.decode(ids) == text
    assert (loaded.eos_token_id, loaded.pad_token_id) == (ours.eos_token_id, ours.pad_token_id)
    assert len(loaded) == len(ours)
