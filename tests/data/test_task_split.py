"""`data.seed` orders the training prompts; it never changes the train/test split of a synthetic task."""

import json

import pyarrow.parquet as pq
import pytest

from rlframe.config.schema import RunConfig
from rlframe.controller.trainers import prepare
from rlframe.data.pretrain import PRETRAIN_SEED, SFTConfig, sft_examples
from rlframe.rewards.registry import default_compute_score


def _cfg(tmp_path, *, seed: int, task: str = "arithmetic") -> RunConfig:
    cfg = RunConfig()
    cfg.model.cache_dir, cfg.data.seed, cfg.data.task = str(tmp_path), seed, task
    return cfg


def _prompts(path: str) -> list[str]:
    return [row["prompt"][0]["content"] for row in pq.ParquetFile(path).read().to_pylist()]


@pytest.mark.parametrize("task", ["arithmetic", "countdown", "series"])
def test_data_seed_keeps_the_split(tmp_path, task):
    (train_a,), (test_a,) = prepare.task_files(_cfg(tmp_path, seed=0, task=task))
    (train_b,), (test_b,) = prepare.task_files(_cfg(tmp_path, seed=7, task=task))
    assert set(_prompts(train_a)) == set(_prompts(train_b))
    assert set(_prompts(test_a)) == set(_prompts(test_b))
    assert not set(_prompts(train_a)) & set(_prompts(test_a))


@pytest.mark.parametrize("task", ["arithmetic", "countdown", "series"])
def test_held_out_never_meets_the_pretraining_data(tmp_path, task):
    pretrain_train, _ = sft_examples(task, seed=PRETRAIN_SEED, cfg=SFTConfig())
    seen = {prompt for prompt, _ in pretrain_train}
    for seed in (0, 3, 11):
        (train,), (test,) = prepare.task_files(_cfg(tmp_path, seed=seed, task=task))
        assert not set(_prompts(test)) & seen
        assert set(_prompts(train)) <= seen  # RL trains on the problems the model was pre-trained on


def test_countdown_pretrains_on_a_solution_of_each_problem():
    from rlframe.rewards.verifiers import countdown_score

    train, test = sft_examples("countdown", seed=PRETRAIN_SEED, cfg=SFTConfig())
    assert len(train) == 5000 and len(test) == 500
    for prompt, answer in train[:300] + test[:100]:  # "6,4,9->90:" -> "(6+4)*9"
        numbers, target = prompt.rstrip(":").split("->")
        truth = json.dumps({"target": int(target), "numbers": [int(n) for n in numbers.split(",")]})
        assert countdown_score(answer, truth) == 1.0


def test_series_pretrains_on_the_written_series_the_reward_accepts():
    train, test = sft_examples("series", seed=PRETRAIN_SEED, cfg=SFTConfig())
    assert len(train) == 5000 and len(test) == 500
    for prompt, answer in train[:300] + test[:100]:  # "94+9x3=" -> "2:103,1:112,0:121"
        start, rest = prompt.rstrip("=").split("+")
        step, terms = map(int, rest.split("x"))
        values = [int(term.split(":")[1]) for term in answer.split(",")]
        assert values == [int(start) + step * i for i in range(1, terms + 1)]
        assert default_compute_score("series", answer, answer) == 1.0


def test_data_seed_changes_the_order_of_the_prompts(tmp_path):
    from rlframe.data.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    firsts = []
    for seed in (0, 1):
        loader, _ = prepare.build_data(_cfg(tmp_path, seed=seed), tok)
        firsts.append(next(loader)["input_ids"].tolist())
    assert firsts[0] != firsts[1]


def test_the_cached_folder_records_its_settings_and_is_rebuilt_when_they_differ(tmp_path):
    cfg = _cfg(tmp_path, seed=0)
    (train,), _ = prepare.task_files(cfg)
    folder = prepare.Path(train).parent
    recorded = json.loads((folder / prepare.SETTINGS_FILE).read_text())
    assert recorded == prepare.data_settings(cfg) and "seed" not in recorded
    (folder / prepare.SETTINGS_FILE).write_text(json.dumps({**recorded, "split_seed": 99}))
    (folder / "test.parquet").write_bytes(b"stale")
    prepare.task_files(cfg)
    assert json.loads((folder / prepare.SETTINGS_FILE).read_text()) == recorded
    assert len(_prompts(str(folder / "test.parquet"))) == cfg.data.val_size


def test_unknown_task_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="not a synthetic task"):
        prepare.task_files(_cfg(tmp_path, seed=0, task="poetry"))


def test_the_series_config_fits_every_problem_of_the_task():
    from rlframe.config.load import load_config
    from rlframe.config.validate import validate
    from rlframe.data.tokenizer import build_char_tokenizer

    cfg = validate(load_config("grpo_series", []))
    tok = build_char_tokenizer()
    train, test = sft_examples("series", seed=PRETRAIN_SEED, cfg=SFTConfig())
    assert max(len(tok.encode(p, add_special_tokens=False)) for p, _ in train + test) <= cfg.data.prompt_length
    longest = max(len(tok.encode(a, add_special_tokens=False)) for _, a in train + test)
    assert longest + 1 <= cfg.data.response_length < longest + 16  # the answer and EOS, no more than a little over
