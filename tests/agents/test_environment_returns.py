"""What an OpenAI-SDK environment's episode may return besides its reward: numbers and booleans, logged as
agent/env/<key> metrics, a boolean as 0/1 exactly as a reward function's boolean extras are."""

import math

import pytest

from rlframe.agents.environment import EpisodeResult, _score, episode_metrics
from rlframe.rewards.manager import _score_one


def test_booleans_count_as_0_or_1_like_the_reward_functions():
    returned = {"reward": 1.0, "solved": True, "used_tool": False, "turns": 2, "note": "free text", "bad": math.inf}
    reward, metrics = _score(dict(returned))
    assert reward == 1.0
    assert metrics == {"solved": 1.0, "used_tool": 0.0, "turns": 2.0}
    # the reward function's path treats the same values the same way
    fn_extras = _score_one(lambda *a: {"score": 1.0, **{k: v for k, v in returned.items() if k != "reward"}},
                           "src", "response", "truth", None)[1]
    assert {k: fn_extras[k] for k in ("solved", "used_tool", "turns")} == metrics


def test_episode_metrics_average_the_booleans():
    results = [EpisodeResult(id=f"e-{i}", reward=r, metrics=_score({"reward": r, "solved": r > 0})[1], status="ok")
               for i, r in enumerate((1.0, 0.0, 1.0, 1.0))]
    assert episode_metrics(results)["agent/env/solved"] == pytest.approx(0.75)


def test_a_boolean_reward_is_still_refused():
    with pytest.raises(ValueError, match="finite 'reward'"):
        _score({"reward": True})
