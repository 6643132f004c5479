import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rlframe.data import pretrain
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


@pytest.fixture(scope="module")
def seed0_model(tmp_path_factory):
    """The test preset's seed-0 model (TINY), built once in a cache of its own by the pre-training child: the
    first build of the determinism test below, and the files the stale-temp-dir test's build installs."""
    return build_pretrained_model(preset="test", seed=0, cfg=TINY, cache_dir=tmp_path_factory.mktemp("a"))


def test_pretrained_model_is_cached_deterministic_and_loads(seed0_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a, cache_a = seed0_model, seed0_model.parent.parent
    # b and c, each built by a pre-training child of its own, at the same time (and while `a` is checked)
    with ThreadPoolExecutor(max_workers=2) as pool:
        built_b = pool.submit(build_pretrained_model, preset="test", seed=0, cfg=TINY, cache_dir=tmp_path / "b")
        built_c = pool.submit(build_pretrained_model, preset="test", seed=1, cfg=TINY, cache_dir=tmp_path / "b")
        info = json.loads((a / "rlframe_pretrain.json").read_text())
        assert info["sft"]["steps"] == 4 and info["preset"] == "test"
        mtime = (a / "model.safetensors").stat().st_mtime_ns
        assert build_pretrained_model(preset="test", seed=0, cfg=TINY, cache_dir=cache_a) == a
        assert (a / "model.safetensors").stat().st_mtime_ns == mtime  # served from the cache
        assert [p.name for p in a.parent.iterdir()] == [a.name]  # no temp dir left behind
        b, c = built_b.result(), built_c.result()
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
    with pytest.raises(ValueError, match="unknown pre-training task"):
        build_pretrained_model(task="poetry", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown model preset"):
        build_pretrained_model(preset="huge", cfg=TINY, cache_dir=tmp_path)


def test_stale_temp_dirs_are_removed(tmp_path, monkeypatch, seed0_model):
    import os
    import time

    from rlframe.data.pretrain import STALE_TEMP_S, cache_key

    def train_seed0(tmp, **recipe):  # the module's build of this recipe, not a second training of it
        assert recipe == {"preset": "test", "task": "arithmetic", "seed": 0, "cfg": TINY}
        shutil.copytree(seed0_model, tmp, dirs_exist_ok=True)

    monkeypatch.setattr(pretrain, "_train_in_child", train_seed0)
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
