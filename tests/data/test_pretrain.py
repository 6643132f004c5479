import json

import torch

from rlframe.data.pretrain import SFTConfig, build_pretrained_model, encode_sft_batch
from rlframe.data.tiny_eval import evaluate_model_dir
from rlframe.data.tokenizer import build_char_tokenizer

TINY = SFTConfig(steps=4, batch_size=8, num_train=200, num_test=20, warmup=2)


def test_sft_batch_masks_the_prompt():
    tok = build_char_tokenizer()
    ids, mask, labels = encode_sft_batch(tok, [("1+2=", "3"), ("10+20=", "30")])
    assert tok.decode(ids[1][mask[1] > 0]) == "10+20=30" + tok.eos_token
    assert labels[0].tolist()[:4] == [-100] * 4
    assert labels[0].tolist()[4:6] == [tok.convert_tokens_to_ids("3"), tok.eos_token_id]
    assert (labels[0, 6:] == -100).all() and (mask[0, 6:] == 0).all()


def test_pretrained_model_is_cached_deterministic_and_loads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = build_pretrained_model(preset="test", seed=0, cfg=TINY, cache_dir=tmp_path / "a")
    info = json.loads((a / "rlframe_pretrain.json").read_text())
    assert info["sft"]["steps"] == 4 and info["preset"] == "test"
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert build_pretrained_model(preset="test", seed=0, cfg=TINY, cache_dir=tmp_path / "a") == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime  # served from the cache
    assert [p.name for p in a.parent.iterdir()] == [a.name]  # no temp dir left behind

    b = build_pretrained_model(preset="test", seed=0, cfg=TINY, cache_dir=tmp_path / "b")
    c = build_pretrained_model(preset="test", seed=1, cfg=TINY, cache_dir=tmp_path / "b")
    assert a.name == b.name and b != c
    ma, mb, mc = (AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32) for p in (a, b, c))
    sa, sb, sc = ma.state_dict(), mb.state_dict(), mc.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    assert ma.config.tie_word_embeddings is False and ma.config.model_type == "qwen2"

    tok = AutoTokenizer.from_pretrained(str(a))
    text = "23+58=81 Hello, World! {json: [1, 2]}"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    res = evaluate_model_dir(a, [("1+2=", "3"), ("4+5=", "9")], k=2, max_new_tokens=3)
    assert res.n == 2 and 0.0 <= res.greedy_acc <= 1.0 and res.k == 2


def test_unknown_task_and_preset_are_errors(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="unknown pre-training task"):
        build_pretrained_model(task="poetry", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown model preset"):
        build_pretrained_model(preset="huge", cfg=TINY, cache_dir=tmp_path)


def test_stale_temp_dirs_are_removed(tmp_path):
    import os
    import time

    from rlframe.data.pretrain import STALE_TEMP_S, cache_key

    models = tmp_path / "models"
    name = cache_key(preset="test", task="arithmetic", seed=0, cfg=TINY)
    old, fresh = models / f".{name}.old", models / f".{name}.fresh"
    old.mkdir(parents=True)
    fresh.mkdir()
    os.utime(old, (time.time() - STALE_TEMP_S - 60,) * 2)
    path = build_pretrained_model(preset="test", seed=0, cfg=TINY, cache_dir=tmp_path)
    assert path.name == name and not old.exists() and fresh.exists()


def test_length_classes_make_each_batch_of_one_class_and_keep_every_item_equally_likely():
    import torch

    from rlframe.data.pretrain import BatchDraw

    sizes = [5, 40, 200, 755]  # items per class, as uneven as the series' lengths
    train = [c for c, n in enumerate(sizes) for _ in range(n)]
    gen = torch.Generator().manual_seed(0)
    draw = BatchDraw(train, 8, bucket_of=lambda item: item)
    counts = [0] * len(train)
    for _ in range(4000):
        idx = draw(gen)
        assert len(idx) == 8 and len({train[i] for i in idx}) == 1
        for i in idx:
            counts[i] += 1
    per_class = [sum(counts[i] for i in range(len(train)) if train[i] == c) / (32000 * n / len(train))
                 for c, n in enumerate(sizes)]
    assert all(0.8 < r < 1.2 for r in per_class), per_class  # each class drawn in proportion to its items
    plain = BatchDraw(train, 8)  # without classes: the draws of before, unchanged
    a, b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert plain(a) == torch.randint(len(train), (8,), generator=b).tolist()
