"""Sampling seeds are a function of a sample's identity, not of the row's place in a replica's chunk."""

import torch

from rlframe.workers.rollout.seeds import mix_seed, row_seeds, seeds_for
from rlframe.workers.rollout.stops import end_of_sequence_ids


def test_mix_seed_is_stable_and_spreads():
    assert mix_seed(3, "1-2-5", 0, 1) == mix_seed(3, "1-2-5", 0, 1)
    seeds = {mix_seed(7, "uid", j, seg) for j in range(64) for seg in range(8)}
    assert len(seeds) == 64 * 8 and all(0 <= s < 2**31 for s in seeds)
    assert mix_seed(7, "a", 0) != mix_seed(7, "b", 0)


def test_row_seeds_give_every_sample_its_own():
    seeds = row_seeds(100, rows=4, n=3)
    per_sample = [int(s) + j for s in seeds for j in range(3)]
    assert len(set(per_sample)) == 12
    assert torch.equal(seeds_for([(1, "g", j) for j in range(4)]), seeds_for([(1, "g", j) for j in range(4)]))


def test_end_ids_include_the_generation_configs(tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    from rlframe.data.tiny_model import build_random_model

    path = build_random_model(tmp_path / "m", preset="test", seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    assert end_of_sequence_ids(tok) == {tok.eos_token_id}
    gen = GenerationConfig.from_pretrained(path)
    gen.eos_token_id = [tok.eos_token_id, 5, 9]
    gen.save_pretrained(path)
    assert end_of_sequence_ids(AutoTokenizer.from_pretrained(path)) == {tok.eos_token_id, 5, 9}
