"""End-to-end runs of every dataflow on the tiny model with short budgets (real Ray, FSDP, vLLM).

Each run must: finish, change every actor parameter, produce no NaN metric, and write every phase
timer of its dataflow to metrics.jsonl. Each run is made once per session (conftest.dataflow_run):
test_metric_definitions.py checks the logged metrics of the "ppo", "dapo" and "online_dpo" runs.
"""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlframe.config import load_config, validate
from rlframe.controller.run import run_training
from rlframe.controller.trainers.prepare import model_path

# The demo model with its default pre-training (built once, cached in ~/.cache/rlframe and shared by
# every test and `make demo`): partially competent, so rewards are not all zero.
COMMON = ["model.tiny_preset=demo", "data.train_batch_size=8",
          "data.response_length=6", "data.val_size=16", "actor.mini_batch_size=16", "actor.micro_batch_size=8",
          "critic.mini_batch_size=16", "critic.micro_batch_size=8", "trainer.total_steps=2", "trainer.val_every=2",
          "trainer.loggers=[jsonl]", "trainer.plot=false", "rollout.val_n=2", "rollout.kv_cache_bytes=33554432"]

# One epoch of one mini-batch is exactly on-policy: no separate old-log-prob forward (rloo below
# takes two mini-batches, so it needs one).
BASE_TIMERS = {"timing_s/gen", "timing_s/reward", "timing_s/adv", "timing_s/update_actor", "timing_s/update_weights",
               "timing_s/step"}

CASES = {
    # with critic warm-up: step 1 updates only the critic, steps 2 and 3 both; the KL to the reference in
    # the reward with an adaptive coefficient (which needs the old log-probs)
    "ppo": ("ppo_tiny", ["data.train_batch_size=16", "trainer.critic_warmup=1", "trainer.total_steps=3",
                         "trainer.val_every=3", "actor.mini_batch_size=8", "actor.micro_batch_size=4",
                         "critic.mini_batch_size=8", "critic.micro_batch_size=4", "algorithm.kl_in_reward=true",
                         "algorithm.kl_coef=0.05", "algorithm.kl_target=0.001", "rollout.temperature=0.9"],
            BASE_TIMERS - {"timing_s/update_actor"} | {"timing_s/ref", "timing_s/old_log_prob", "timing_s/values",
                                                       "timing_s/update_critic"}),
    "grpo": ("grpo_tiny", ["data.train_batch_size=4", "trainer.check_weight_sync_every=1"],
             BASE_TIMERS | {"timing_s/ref", "timing_s/weight_check"}),
    "rloo": ("grpo_tiny", ["data.train_batch_size=4", "algorithm.name=rloo", "algorithm.adv_estimator=rloo",
                           "algorithm.use_kl_loss=false", "actor.mini_batch_size=8", "actor.micro_batch_size=4"],
             BASE_TIMERS | {"timing_s/old_log_prob"}),
    "remax": ("ppo_tiny", ["algorithm.name=remax", "algorithm.adv_estimator=remax", "data.train_batch_size=16"],
              BASE_TIMERS),
    "dapo": ("grpo_tiny", ["data.train_batch_size=4", "algorithm.name=dapo", "algorithm.dynamic_sampling=true",
                           "algorithm.max_gen_batches=3", "algorithm.clip_ratio_high=0.28", "algorithm.use_kl_loss=false",
                           "algorithm.overlong_buffer_len=3", "rollout.temperature=0.9"], BASE_TIMERS | {"timing_s/dynamic_sampling"}),
    "online_dpo": ("grpo_tiny", ["data.train_batch_size=8", "algorithm.name=online_dpo", "algorithm.n_samples=2",
                                 "algorithm.use_kl_loss=false", "rollout.temperature=1.5"],
                   {"timing_s/gen", "timing_s/reward", "timing_s/step"}),
    "sft": ("sft_tiny", ["data.train_batch_size=16"], {"timing_s/update_actor", "timing_s/step"}),
    # bf16 mixed precision on CPU: actor and reference compute in bf16, vLLM generates in bf16
    "grpo_bf16": ("grpo_tiny", ["data.train_batch_size=4", "actor.precision=bf16"], BASE_TIMERS | {"timing_s/ref"}),
    # vLLM in its own process, weights pushed over the channel (the actor's fp32 shards into a bf16 vLLM);
    # critic and actor each in their own
    "ppo_split": ("ppo_tiny", ["data.train_batch_size=16", "resources.placement=split", "actor.dp=1", "critic.dp=1",
                               "+resources.split_procs={actor: 1, rollout: 1}", "actor.precision=bf16"],
                  BASE_TIMERS | {"timing_s/values", "timing_s/update_critic"}),
}


def run(name, overrides, tmp_path):
    cfg = validate(load_config(name, COMMON + overrides + [f"trainer.output_dir={tmp_path}"]))
    return cfg, run_training(cfg, config_name=name)


@pytest.mark.slow
@pytest.mark.parametrize("algo", list(CASES))
def test_dataflow_trains(algo, dataflow_run):
    _, overrides, timers = CASES[algo]
    cfg, summary, _ = dataflow_run(algo)
    rows = [json.loads(l) for l in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 1]
    assert [r["step"] for r in steps] == list(range(1, cfg.trainer.total_steps + 1))
    for r in rows:
        assert all(math.isfinite(v) for v in r.values()), r
    for r in steps:
        missing = timers - set(r)
        assert not missing, f"{algo}: step {r['step']} lacks {sorted(missing)}"
        if "trainer.critic_warmup=1" in overrides:
            assert ("actor/pg_loss" in r) == (r["step"] > 1), r
        if "trainer.check_weight_sync_every=1" in overrides:  # the rollout holds the trainer's weights
            assert r["sync/checked_slices"] > 0 and r["sync/mismatched_slices"] == 0, r
    start = load_file(str(Path(model_path(cfg)) / "model.safetensors"))
    end = load_file(str(Path(summary["hf_export"]) / "model.safetensors"))
    unchanged = [k for k in start if torch.equal(start[k], end[k])]
    assert not unchanged, f"{algo}: parameters did not change: {unchanged}"
    if algo.startswith("grpo_bf16"):  # fp32 master weights exported; vLLM (bf16) samples what training computes
        assert {str(t.dtype) for t in end.values()} == {"torch.float32"}
        diffs = [r["rollout/logprob_diff_mean"] for r in steps]
        print(f"\nbf16 rollout vs training log-prob gap per step: {diffs}")
        assert all(0 < d < 0.05 for d in diffs), diffs
