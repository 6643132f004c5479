"""The end-to-end runs of test_end_to_end.CASES, each made once per session and shared by the tests
that check it: a run records every step's batch (as the update gets it) and metrics on the way."""

import pytest

from rlframe.controller import trainers
from rlframe.workers.rollout.stops import end_of_sequence_ids


class Recorder:
    """Keeps each step's batch (as the update gets it) and metrics, and what they need to be checked."""

    def __init__(self):
        self.steps, self.batch, self.scored, self.scored_batches = [], None, None, []

    def after_score(self, batch):
        self.scored = batch

    def before_update(self, trainer, batch):
        self.tokenizer, self.end_ids, self.cfg = trainer.tokenizer, end_of_sequence_ids(trainer.tokenizer,
                                                                                        trainer.actor_path), trainer.cfg
        self.batch = batch

    def after_step(self, trainer, metrics):
        if self.batch is not None:  # a step with no update (SFT's, a DPO step with every pair tied) has none
            self.steps.append((self.batch, dict(metrics)))
            self.scored_batches.append(self.scored)  # the step's last scored batch (online DPO's before pairing)
        self.batch = None


def observed(trainer_cls, observer):
    class Observed(trainer_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.observer = observer

        def score(self, batch):
            out = super().score(batch)
            observer.after_score(out[0])
            return out

    return Observed


@pytest.fixture(scope="session")
def dataflow_run(tmp_path_factory, ray_cluster):
    """dataflow_run(case) -> (cfg, summary, Recorder) of test_end_to_end.CASES[case], run on first use."""
    from tests.controller.trainers.test_end_to_end import CASES, run

    done = {}

    def get(case):
        if case not in done:
            name, overrides, _ = CASES[case]
            recorder, choose = Recorder(), trainers.trainer_class
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(trainers, "trainer_class", lambda cfg: observed(choose(cfg), recorder))
                cfg, summary = run(name, overrides, tmp_path_factory.mktemp(case))
            done[case] = cfg, summary, recorder
        return done[case]

    return get
