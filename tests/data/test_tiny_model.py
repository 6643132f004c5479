import torch

from rlframe.data.tiny_model import PRESETS, build_random_model, count_parameters


def test_presets_have_supported_head_dims():
    for name, shape in PRESETS.items():
        if name != "test":  # the unit-test preset (head_dim 16) is used with transformers only
            assert shape.hidden_size // shape.num_heads in (32, 64), name
        assert shape.num_heads % shape.num_kv_heads == 0, name


def test_random_model_is_seeded_and_matches_count(tmp_path):
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(str(build_random_model(tmp_path / "a", preset="test", seed=5)))
    b = AutoModelForCausalLM.from_pretrained(str(build_random_model(tmp_path / "b", preset="test", seed=5)))
    assert sum(p.numel() for p in a.parameters()) == count_parameters("test")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert a.config.tie_word_embeddings is False
