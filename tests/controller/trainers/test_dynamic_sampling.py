"""DAPO's dynamic sampling at its generation cap (algorithm.max_gen_batches): the loop on scored batches,
without worker groups. A batch left short of informative groups is refilled (and the console says
how much that shrinks the gradient), trained on as the smaller batch of kept groups, or ends the run,
as algorithm.dynamic_sampling_at_cap says."""

import numpy as np
import pytest
import torch

from rlframe.config import load_config
from rlframe.controller.trainers.dynamic_sampling import (
    DynamicSamplingExhausted, fill_with_informative_groups, row_unit,
)
from rlframe.protocol import DataProto

N, R = 4, 3  # samples per prompt, response tokens


def scored(rewards: list[list[float]], tag: str) -> DataProto:
    """A scored batch: one list of N rewards per prompt (its group), in the trainer's row order."""
    flat = torch.tensor([r for group in rewards for r in group], dtype=torch.float32)
    scores = torch.zeros(len(flat), R)
    scores[:, -1] = flat
    uid = np.array([f"{tag}-{g}" for g, group in enumerate(rewards) for _ in group], dtype=object)
    return DataProto.from_dict(
        tensors={"token_level_scores": scores, "response_mask": torch.ones(len(flat), R),
                 "verifier_score": flat.clone(), "acc": (flat > 0).float(), "reward_failed": torch.zeros(len(flat))},
        non_tensors={"uid": uid})


SAME, DIFFER = [1.0] * N, [1.0, 0.0, 0.0, 1.0]


def rounds_of(*later):
    """more(round) for the loop: the later rounds' batches, in order."""
    calls = []

    def more(round_no):
        calls.append(round_no)
        return later[round_no - 2]

    return more, calls


def test_a_full_batch_stops_generating_and_trains_on_informative_groups_only():
    first = scored([DIFFER, SAME, SAME, DIFFER], "a")  # 2 of 4 groups informative
    more, calls = rounds_of(scored([DIFFER, DIFFER, SAME, SAME], "b"))
    batch, m, capped = fill_with_informative_groups(first, more, max_gen_batches=4)
    assert calls == [2] and capped is None
    assert len(batch) == 16 and m["dapo/gen_batches"] == 2 and m["dapo/kept_ratio"] == 1.0
    assert m["dapo/informative_ratio"] == 1.0
    assert sorted(set(batch.non_tensor_batch["uid"])) == ["a-0", "a-3", "b-0", "b-1"]


def test_refill_at_the_cap_pads_with_equal_reward_groups_and_says_the_gradient_shrinks():
    first = scored([DIFFER, SAME, SAME, SAME], "a")  # 1 of 4 groups, and nothing more at the cap
    more, calls = rounds_of(scored([SAME] * 4, "b"))
    batch, m, capped = fill_with_informative_groups(first, more, max_gen_batches=2, step=1)
    assert calls == [2] and len(batch) == 16  # today's behaviour, the default
    assert m["dapo/gen_batches"] == 2 and m["dapo/kept_ratio"] == 0.25 and m["dapo/informative_ratio"] == 0.25
    assert batch.non_tensor_batch["uid"][:N].tolist() == ["a-0"] * N  # the kept group first
    line = capped.line(loss_agg_mode="token-mean")
    assert "\n" not in line
    assert ("step 1: after algorithm.max_gen_batches=2 generation rounds only 4 of the 16 rows (1 group(s)) "
            "have rewards that differ; 12 rows of equal-reward groups (advantage 0) refill the batch") in line
    assert "loss_agg_mode=token-mean this step's policy gradient is about 0.25x a full batch's" in line
    assert "dynamic_sampling_at_cap=train_kept" in line and "raise algorithm.max_gen_batches" in line


def test_train_kept_trains_on_the_kept_groups_rounded_to_what_every_dp_group_splits():
    first = scored([DIFFER, SAME, DIFFER, SAME], "a")
    batch, m, capped = fill_with_informative_groups(first, lambda r: None, max_gen_batches=1, at_cap="train_kept",
                                                    unit=4, step=3)
    assert len(batch) == 8 and m["dapo/trained_rows"] == 8 and m["dapo/informative_ratio"] == 1.0
    assert set(batch.non_tensor_batch["uid"]) == {"a-0", "a-2"}
    assert "training on a smaller batch of 8 rows (algorithm.dynamic_sampling_at_cap=train_kept)" in capped.line(loss_agg_mode="token-mean")
    # dp=8 with 4 samples per prompt: 8-row multiples, one equal-reward group added to split evenly
    one = scored([SAME, DIFFER, SAME, SAME], "c")
    batch, m, capped = fill_with_informative_groups(one, lambda r: None, max_gen_batches=1, at_cap="train_kept",
                                                    unit=8)
    assert len(batch) == 8 and batch.non_tensor_batch["uid"][:N].tolist() == ["c-1"] * N
    assert m["dapo/informative_ratio"] == 0.5
    assert "training on a smaller batch of 8 rows (with 4 rows of equal-reward groups, to split evenly)" in capped.line(
        loss_agg_mode="token-mean")
    # nothing informative at all: one unit, never an empty batch
    batch, _, _ = fill_with_informative_groups(scored([SAME] * 4, "d"), lambda r: None, max_gen_batches=1,
                                               at_cap="train_kept", unit=4)
    assert len(batch) == 4


def test_stop_ends_the_run_naming_the_numbers_and_the_settings():
    with pytest.raises(DynamicSamplingExhausted) as err:
        fill_with_informative_groups(scored([DIFFER, SAME, SAME, SAME], "a"), lambda r: scored([SAME] * 4, "b"),
                                     max_gen_batches=2, at_cap="stop", step=5)
    text = str(err.value)
    assert "at step 5: after algorithm.max_gen_batches=2 generation rounds only 4 of the 16 rows" in text
    assert "raise algorithm.max_gen_batches" in text and "dynamic_sampling_at_cap=refill" in text


def test_the_row_unit_is_whole_groups_split_evenly_over_every_dp_group():
    assert row_unit(load_config("ppo_tiny", ["algorithm=dapo"])) == 4  # n=4, actor dp 2, no critic
    assert row_unit(load_config("ppo_tiny", ["algorithm=dapo", "actor.dp=8"])) == 8
    assert row_unit(load_config("ppo_tiny", ["algorithm.n_samples=3", "critic.dp=4"])) == 12  # with a critic


def test_the_trainer_says_the_line_and_passes_the_setting(monkeypatch):
    """PPOTrainer.fill_with_informative_groups: the loop above with the trainer's rollouts, the console line."""
    from rlframe.controller.trainers import ppo

    said = []
    monkeypatch.setattr(ppo, "say", said.append)

    class Stub:
        cfg = load_config("ppo_tiny", ["algorithm=dapo", "algorithm.max_gen_batches=2"])
        step = 7

        def next_prompts(self):
            return "prompts"

        def rollout(self, prompts, salt=0):
            return scored([SAME] * 4, f"r{salt}"), {}

        def score(self, batch):
            return batch, {}

    batch, m = ppo.PPOTrainer.fill_with_informative_groups(Stub(), scored([DIFFER, SAME, SAME, SAME], "a"))
    assert len(batch) == 16 and m["dapo/gen_batches"] == 2
    [line] = said
    assert line.startswith("dynamic sampling step 7: after algorithm.max_gen_batches=2 generation rounds only 4 of "
                           "the 16 rows"), line
    assert "about 0.25x a full batch's" in line
