"""agent.mode=openai: a rollout whose episodes failed stops the run as a failing reward function does
(the environment is the run's reward), with one message, never with the loss's internal error."""

import pytest

from rlframe.agents.environment import EpisodeResult
from rlframe.controller.trainers.openai_agent import EpisodeErrorsExceeded, check_episodes
from rlframe.rewards.manager import RewardErrorsExceeded

REFUSED = ("BadRequestError: Error code: 400 - {'error': {'message': 'the prompt has 700 tokens, more than\n"
           "data.prompt_length=512', 'type': 'invalid_request_error'}}")


def results(ok: int, failed: int) -> list[EpisodeResult]:
    return ([EpisodeResult(id=f"e-{i}", reward=1.0, status="ok") for i in range(ok)]
            + [EpisodeResult(id=f"e-{ok + i}", status="error", error=REFUSED) for i in range(failed)])


def test_a_step_whose_episodes_all_failed_stops_with_the_fraction_the_first_error_and_the_keys():
    with pytest.raises(EpisodeErrorsExceeded) as caught:
        check_episodes(results(0, 8), trained_tokens=0, max_error_fraction=0.5)
    err = caught.value
    assert isinstance(err, RewardErrorsExceeded)  # main ends the run with it: exit code 1, one message
    text = str(err)
    assert "\n" not in text and "no response tokens" not in text
    assert "failed on 8 of 8 episodes of a batch (error 8)" in text
    assert "more than reward.max_error_fraction=0.5 allows" in text
    assert "The first failure: episode e-0 (error): BadRequestError: Error code: 400" in text
    assert "more than data.prompt_length=512" in text
    assert "agent.environment" in text and "reward.max_error_fraction=1.0" in text
    assert (err.failed, err.total) == (8, 8)


def test_some_failed_episodes_train_on_and_none_left_to_train_stops_whatever_the_fraction():
    check_episodes(results(5, 3), trained_tokens=40, max_error_fraction=0.5)  # 3 of 8: within the limit
    check_episodes(results(0, 8), trained_tokens=12, max_error_fraction=1.0)  # 1.0: never stop, tokens recorded
    with pytest.raises(EpisodeErrorsExceeded, match=r"failed on 8 of 8 .*no episode recorded a model turn, so this "
                                                    r"step has nothing to train on"):
        check_episodes(results(0, 8), trained_tokens=0, max_error_fraction=1.0)


def test_main_ends_the_run_with_the_one_message_and_exit_code_1(monkeypatch, capsys, tmp_path):
    import rlframe.controller.run as run
    from rlframe.main import main

    def all_failed(cfg, *, config_name=""):
        check_episodes(results(0, 4), trained_tokens=0, max_error_fraction=0.5)

    monkeypatch.setattr(run, "run_training", all_failed)
    monkeypatch.setattr("rlframe.controller.cpu_precision.check_cpu_precision", lambda cfg: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main([f"trainer.output_dir={tmp_path}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("rlframe: the environment's episodes failed on 4 of 4 episodes") and err.count("\n") == 1
    assert "Traceback" not in err
