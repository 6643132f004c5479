"""Preflight must fail: rows of the sweep with one defect put back (tests/controller/preflight/defects.py:
a worker or engine subclass, never a switch in the product), each caught by the check that names it.
The rows are as small as the defect allows (one step where one update and sync show it)."""

import pytest

from rlframe.config import load_config, validate
from rlframe.controller.preflight.run import run_preflight
from rlframe.controller.preflight.sweep import DEFAULTS, config_for

DEFECTS = "tests.controller.preflight.defects"

# id: (sweep row settings, defect overrides, steps, the checks (by name prefix) that must fail)
CASES = {
    "old_log_probs_at_temperature_1": (
        {"temperature": 0.7, "minibatches": "2x2"}, [f"actor.worker_cls={DEFECTS}:OldLogProbsAtTemperature1"], 1,
        {"rollout vs the run's old log-prob gap (mean)", "first mini-batch ppo_kl"}),
    # one prompt a step, so its 4 samples (rows of one sample each under partial rollouts) are split over the
    # 2 replicas, rows 0 and 1 of each: docs/preflight.md's case
    "one_seed_shared_across_replicas": (
        {"partial": "on", "temperature": 2.0}, [f"actor.worker_cls={DEFECTS}:SeedsByRowInChunk", "data.train_batch_size=1",
                                                "actor.mini_batch_size=4", "actor.micro_batch_size=2"], 3,
        {"duplicate samples in a group"}),
    "reference_at_the_wrong_temperature": (
        {"temperature": 0.7}, ["actor.strategy=fsdp_reference_at_t1"], 1,
        {"actor vs reference at step 1 (k1 KL)"}),
    "a_continuation_past_an_end_id": (
        {}, [f"actor.worker_cls={DEFECTS}:ContinuesPastEnd"], 1,
        {"no policy token after an end-of-sequence id"}),
    "dropout_on_in_forward_only_passes": (
        {"lora": "dropout", "minibatches": "2x2"}, ["actor.strategy=fsdp_dropout_in_forward", "actor.lora_dropout=0.5",
                                                    "actor.lr=1e-2"], 2,
        {"rollout vs training engine log-prob gap (mean)"}),
    "a_weight_sync_that_skips_a_tensor": (
        {}, [f"actor.worker_cls={DEFECTS}:SyncSkipsATensor"], 1,
        {"rollout weights equal the trainer's after a sync"}),
}


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_preflight_catches_the_defect(case, ray_cluster):
    settings, defect, steps, must_fail = CASES[case]
    name, overrides = config_for({**DEFAULTS, **settings})
    report = run_preflight(validate(load_config(name, overrides + [f"imports=[{DEFECTS}]"] + defect)), steps=steps,
                           config_name=name)
    failed = {c.name for c in report.failed}
    missed = {want for want in must_fail if not any(f.startswith(want) for f in failed)}
    assert not missed, f"{case}: preflight did not catch it with {sorted(missed)}\n{report.text()}"
