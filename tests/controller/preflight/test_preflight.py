"""`rlframe preflight` end to end on a fixed subset of the pairwise sweep (real Ray, worker groups,
vLLM, resharding; 2 steps each): every invariant holds on each row. The rows are two of
`pairwise_rows(seed=1)` (as it stood before streaming rollouts joined the sweep) chosen to meet defects preflight was built for (temperature 0.7 with several
mini-batches, LoRA dropout, an agent written against the OpenAI API, with split placement and with
PPO's critic on megatron, Ulysses sequence parallelism, bf16, activation recompute, delta weight
syncs) in little time (partial rollouts over 2 replicas, chained fan-out, tp 2, asynchronous training
and the in-process agent loop have end-to-end tests of their own); benchmarks/preflight_sweep.py runs
the whole sweep."""

import pytest

from rlframe.config import load_config, validate
from rlframe.controller.preflight.run import run_preflight
from rlframe.controller.preflight.sweep import FACTORS, config_for, describe, valid

# two rows of pairwise_rows(seed=1) as it stood before the streaming level joined the sweep, written out
# so that new levels (which change the greedy cover) leave the suite's rows as they are
SUITE_ROWS = (
    {"algorithm": "grpo", "temperature": 0.7, "minibatches": "2x2", "layout": "sp2", "replicas": 2, "placement": "split",
     "strategy": "fsdp", "lora": "dropout", "partial": "off", "agent": "openai", "async": 0, "precision": "bf16",
     "recompute": "off", "sync": "delta", "fanout": "direct", "correction": "none"},
    {"algorithm": "ppo", "temperature": 1.0, "minibatches": "2x2", "layout": "dp2", "replicas": 1, "placement": "colocated",
     "strategy": "megatron", "lora": "off", "partial": "off", "agent": "openai", "async": 0, "precision": "fp32",
     "recompute": "on", "sync": "full", "fanout": "direct", "correction": "none"},
)
ALWAYS = {"rollout vs training engine log-prob gap (mean)", "reward function repeats its score",
          "no policy token after an end-of-sequence id", "rollout weights equal the trainer's after a sync"}


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("row", SUITE_ROWS, ids=["grpo-split-openai", "ppo-megatron-openai"])
def test_preflight_row_holds_every_invariant(row, ray_cluster):
    assert set(row) == set(FACTORS) and valid(row)
    name, overrides = config_for(row)
    report = run_preflight(validate(load_config(name, overrides)), steps=2, config_name=name)
    assert not report.failed, f"{describe(row)}\n{report.text()}"
    ran = {c.name for c in report.results}
    missing = {n for n in ALWAYS if n not in ran}
    assert not missing, f"{describe(row)}: checks that did not run: {missing}"
    if row["temperature"] > 0 and row["algorithm"] == "grpo":
        assert any(c.name.startswith("duplicate samples") for c in report.results)
