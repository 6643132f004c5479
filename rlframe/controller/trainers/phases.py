"""The driver-side pieces of a training step that are not a single worker call: generation with
padding to the rollout replicas, scoring (rule functions or reward models), KL and advantages,
validation. The trainers compose them; each is small and named for its phase."""

from __future__ import annotations

import itertools
import time

import numpy as np
import torch

from rlframe.algos import rollout_correction
from rlframe.algos.dapo import overlong_reward_penalty
from rlframe.algos.dataproto_glue import apply_kl_penalty_to_batch, compute_advantage
from rlframe.config.schema import RunConfig
from rlframe.controller.trainers.metrics import gathered
from rlframe.protocol import DataProto
from rlframe.rewards.manager import token_level_scores
from rlframe.utils import trace
from rlframe.utils.timing import timed
from rlframe.workers.rollout import SamplingConfig, logprob_diff_metrics
from rlframe.workers.rollout.seeds import SEED_KEY, row_seeds
from rlframe.protocol.step import step_settings, with_step
from rlframe.workers.rollout.config import SAMPLING_KEY

PROMPT_KEYS = ["input_ids", "attention_mask", "position_ids"]


def sampling_for(cfg: RunConfig, *, n: int, temperature: float, seed: int) -> SamplingConfig:
    return SamplingConfig(n=n, temperature=temperature, top_p=cfg.rollout.top_p if temperature > 0 else 1.0,
                          top_k=cfg.rollout.top_k if temperature > 0 else -1,
                          max_new_tokens=cfg.data.response_length, seed=seed)


class PendingGeneration:
    """A generation in flight (`launch_generation`); `result()` waits for it and returns the rollout
    batch and its metrics."""

    def __init__(self, prompts: DataProto, future, *, pad: int, n: int):
        self.prompts, self.future, self.pad, self.n = prompts, future, pad, n
        tracer = trace.current()
        self.launched = (time.time(), tracer.step) if tracer is not None else None

    def result(self) -> tuple[DataProto, dict]:
        out = self.future.get()
        if self.launched is not None:  # trainer.trace: in flight from its launch (an earlier step's, async) to here
            start, step = self.launched
            trace.interval("generation", start, time.time(), lane="generation rounds", launched_at_step=step,
                           samples=len(self.prompts) * self.n)
        metrics = gathered(out, reduce="max")  # the slowest replica sets the pace
        out.meta_info = {}
        out = out.unpad(self.pad * self.n)
        batch = self.prompts.select(batch_keys=[], non_tensor_keys=self.prompts.non_tensor_keys).repeat(self.n)
        return batch.union(out), metrics


def launch_generation(roles, prompts: DataProto, *, sampling: SamplingConfig, replicas: int,
                      push: bool = True) -> PendingGeneration:
    """Start n samples per prompt from `roles.generate_sequences` (RunRoles: the hybrid engine's
    actor, or the generation group after a weight push) without waiting for them."""
    keys = PROMPT_KEYS + ([SEED_KEY] if SEED_KEY in prompts.batch.keys() else [])
    gen_in = prompts.select(batch_keys=keys)
    if SEED_KEY not in keys and sampling.seed is not None:  # before the split: seeds follow the global row
        gen_in.batch[SEED_KEY] = row_seeds(sampling.seed, rows=len(gen_in), n=sampling.n)
    gen_in.meta_info = {SAMPLING_KEY: sampling}  # the SamplingConfig itself: typed across the process boundary
    gen_in, pad = gen_in.pad_to_divisor(replicas)
    return PendingGeneration(prompts, roles.generate_sequences(gen_in, blocking=False, push=push), pad=pad,
                             n=sampling.n)


def generate(roles, prompts: DataProto, *, sampling: SamplingConfig, replicas: int) -> tuple[DataProto, dict]:
    """n samples per prompt; prompt fields repeated alongside (samples of a prompt adjacent)."""
    return launch_generation(roles, prompts, sampling=sampling, replicas=replicas).result()


def add_generation_metrics(total: dict, metrics: dict) -> None:
    """Fold one of several generation calls' metrics into `total`: times add up, the rest is the
    latest call's (partial-rollout rounds, agent turns)."""
    for k, v in metrics.items():
        total[k] = total.get(k, 0.0) + v if k.startswith("timing_s/") else v


def wait_in_order(pending: dict, timing: dict):
    """Yield (name, result) of calls issued together (`blocking=False`), waiting for each in turn;
    `timing_s/<name>` is the wait for it, so the phase's wall time is the sum of its timers (with
    roles in one process the calls run one after another in issue order and each timer is its own)."""
    for name, future in pending.items():
        with timed(timing, name):
            out = future.get()
        yield name, out


def decode_responses(tokenizer, batch: DataProto) -> list[str]:
    """The text of each response's tokens under its mask (one batched decode: 3x faster than a
    decode per row on the demo's 256 rows)."""
    resp, mask = batch.batch["responses"].tolist(), batch.batch["response_mask"].bool().tolist()
    return tokenizer.batch_decode([list(itertools.compress(r, m)) for r, m in zip(resp, mask)],
                                  skip_special_tokens=True)


REWARD_EXTRA = "reward_extra:"  # batch keys of the reward function's extra values, per sample (NaN: absent)
# non-tensor keys of the reward function's string extras, per sample (None: absent): in the generation
# dumps' score_parts, not in the metrics
REWARD_TEXT = "reward_text:"


def score(batch: DataProto, *, cfg: RunConfig, tokenizer, reward_manager, reward_model=None) -> tuple[DataProto, dict]:
    """`token_level_scores` (B, R): the rule reward (or reward-model score) on the last token, plus
    what each sample's metrics are made of, per sample (B,): `verifier_score` (the reward function's
    score), `acc` (its verdict: score >= 1, before any shaping), `reward_failed`, the function's
    extras (its strings as non-tensors, for the generation dumps), `overlong_penalty`. `reward_metrics` derives the step's metrics from them, so that they
    describe exactly the rows a batch holds (after DAPO's refills too)."""
    nt, b = batch.non_tensor_batch, batch.batch
    if "env_reward" in b.keys():  # agent.mode=openai: each episode's environment scored it (openai_agent.py)
        scores = b["env_reward"].float()
        b["verifier_score"], b["acc"], b["reward_failed"] = scores, (scores >= 1.0).float(), b["env_failed"].float()
    else:
        result = reward_manager.compute(decode_responses(tokenizer, batch), data_sources=list(nt["data_source"]),
                                        ground_truths=list(nt["ground_truth"]), extra_infos=list(nt["extra_info"]))
        scores = torch.as_tensor(result.scores, dtype=torch.float32)
        b["verifier_score"], b["acc"] = scores, (scores >= 1.0).float()
        b["reward_failed"] = torch.as_tensor(result.failed, dtype=torch.float32)
        for k, v in result.extras.items():
            b[REWARD_EXTRA + k] = torch.as_tensor(v, dtype=torch.float32)
        for k, v in result.texts.items():
            nt[REWARD_TEXT + k] = v
    if reward_model is not None:
        rm = reward_model.compute_rm_score(batch).batch
        scores = b["rm_score"] = rm["rm_scores"].float()
        b["rm_score_per_model"] = rm["rm_scores_per_model"].float()  # (B, M): reward/rm/<i>/mean
    if cfg.algorithm.overlong_buffer_len > 0:
        b["overlong_penalty"] = overlong_reward_penalty(
            response_lengths=occupied_lengths(batch), max_response_length=cfg.data.response_length,
            overlong_buffer_len=cfg.algorithm.overlong_buffer_len, penalty_factor=cfg.algorithm.overlong_penalty_factor)
        scores = scores + b["overlong_penalty"]
    b["token_level_scores"] = token_level_scores(scores, b["response_mask"])
    return batch, reward_metrics(batch)


def align_reward_extras(batches: list[DataProto]) -> list[DataProto]:
    """Batches scored separately (DAPO's rounds) with the same extra keys (NaN where a round's
    reward function returned none; None for a string extra), so that they concatenate."""
    keys = {k for b in batches for k in b.batch.keys() if k.startswith(REWARD_EXTRA)}
    texts = {k for b in batches for k in b.non_tensor_batch if k.startswith(REWARD_TEXT)}
    for b in batches:
        for k in keys - set(b.batch.keys()):
            b.batch[k] = torch.full((len(b),), float("nan"))
        for k in texts - set(b.non_tensor_batch):
            b.non_tensor_batch[k] = np.array([None] * len(b), dtype=object)
    return batches


def reward_metrics(batch: DataProto) -> dict[str, float]:
    """The reward metrics of exactly these rows: `reward/mean` (the reward function's score),
    `reward/errors`, `critic/accuracy` (its verdict), `response_length/{correct,incorrect}_mean` (by
    the verdict), each extra's `reward/<k>/mean` over all rows
    (absent counts 0) and `reward/<k>/count`, `reward/rm/mean` (reward model; ensembled) and
    `reward/rm/<i>/mean` (each reward model of reward.model_paths), and
    `reward/overlong_penalty_mean`."""
    from rlframe.rewards.manager import reward_metrics as function_metrics

    b = batch.batch
    keys = [k for k in b.keys() if k.startswith(REWARD_EXTRA)]
    out = function_metrics(b["verifier_score"].numpy(), {k[len(REWARD_EXTRA):]: b[k].numpy() for k in keys},
                           b["reward_failed"].numpy() > 0)
    out["critic/accuracy"] = float(b["acc"].mean()) if len(batch) else 0.0
    lengths, correct = b["response_mask"].sum(-1).float(), b["acc"] > 0
    for name, rows in (("correct", correct), ("incorrect", ~correct)):  # Dr. GRPO's length bias shows here
        if rows.any():
            out[f"response_length/{name}_mean"] = float(lengths[rows].mean())
    if "rm_score" in b.keys():
        out["reward/rm/mean"] = float(b["rm_score"].mean())
    if "rm_score_per_model" in b.keys():
        for i, col in enumerate(b["rm_score_per_model"].unbind(1)):
            out[f"reward/rm/{i}/mean"] = float(col.mean())
    if "overlong_penalty" in b.keys():
        out["reward/overlong_penalty_mean"] = float(b["overlong_penalty"].mean())
    return out


def occupied_lengths(batch: DataProto) -> torch.Tensor:
    """(B,) tokens each response occupies of the data.response_length budget: the policy's tokens and,
    with the agent loop, the tool turns between them (attention 1 over the response). DAPO's overlong
    penalty compares this with the budget, so a trajectory cut off by tool output is penalised like
    one cut off by its own tokens; without tools it is the response's length."""
    resp = batch.batch["responses"]
    return batch.batch["attention_mask"][:, -resp.shape[1]:].sum(-1)


def advantages(batch: DataProto, *, cfg: RunConfig, kl_ctrl) -> tuple[DataProto, dict]:
    alg = cfg.algorithm
    metrics = {}
    if alg.kl_in_reward:
        metrics = apply_kl_penalty_to_batch(batch, kl_ctrl=kl_ctrl, estimator=alg.kl_estimator)
    else:
        batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
    compute_advantage(batch, estimator=alg.adv_estimator, gamma=alg.gamma, lam=alg.lam)
    return batch, metrics


def update_is_on_policy(cfg: RunConfig, *, rows: int) -> bool:
    """True when the actor update is exactly on-policy: one epoch of one mini-batch of a batch the
    current weights generated (this synchronous trainer), so its only optimizer step starts from
    the sampling weights and the PPO ratio is 1. The old log-probs are then the update's own,
    detached, and their separate forward pass is skipped. Not when something else needs them
    before the update: a KL penalty in the reward (computed from them on the driver)."""
    from rlframe.config.algorithms import algorithm_spec

    actor, alg = cfg.actor, cfg.algorithm
    return (actor.ppo_epochs == 1 and actor.mini_batch_size >= rows and not alg.kl_in_reward
            and algorithm_spec(alg).ppo_ratio and not cfg.off_policy)


def needs_old_log_probs(cfg: RunConfig, *, rows: int) -> bool:
    """Whether the actor must compute `old_log_probs` before the update: not when the update is
    exactly on-policy, nor when the behaviour policy's own log-probs (vLLM's) serve as them."""
    if update_is_on_policy(cfg, rows=rows):
        return False
    return not (cfg.off_policy and cfg.algorithm.off_policy_correction == "behaviour")


def off_policy_correction(batch: DataProto, *, cfg: RunConfig) -> tuple[DataProto, dict]:
    """Rollouts from older weights (asynchronous training, partial rollouts). `behaviour`: the PPO
    ratio is taken against the rollout engine's log-probs (the trainer made them `old_log_probs`);
    the other methods weight the advantages by importance ratios pi_old / pi_behaviour and mask
    tokens or responses (rlframe/algos/rollout_correction.py). A mask goes to the batch as
    `kept_mask`, which only the actor's update applies (`for_actor`). Metrics: the weights' mean
    and max over response tokens, what was truncated and masked."""
    alg, b = cfg.algorithm, batch.batch
    if alg.off_policy_correction == "behaviour":  # old_log_probs are the rollout's already
        return batch, {}
    adv, keep, m = rollout_correction.correct(
        b["old_log_probs"], b["rollout_log_probs"], b["advantages"], b["response_mask"],
        method=alg.off_policy_correction, tis_cap=alg.tis_cap, low=alg.mask_low, high=alg.mask_high,
        rejection_kl=alg.rejection_kl)
    b["advantages"] = adv
    if masks(cfg):
        b["kept_mask"] = keep
    return batch, m


def reweights(cfg: RunConfig) -> bool:
    """Whether the off-policy correction changes the advantages (weights or masks them)."""
    alg = cfg.algorithm
    return cfg.off_policy and (alg.off_policy_correction not in ("none", "behaviour") or alg.rejection_kl is not None)


def masks(cfg: RunConfig) -> bool:
    """Whether the off-policy correction can drop tokens from the actor's update."""
    alg = cfg.algorithm
    return cfg.off_policy and (alg.off_policy_correction in rollout_correction.MASKING or alg.rejection_kl is not None)


def for_actor(batch: DataProto) -> DataProto:
    """The batch the actor's update gets: with the correction's masked tokens out of `response_mask`
    (a shallow copy; the critic, metrics and dumps keep the full mask)."""
    if "kept_mask" not in batch.batch.keys():
        return batch
    out = batch.select()
    out.batch["response_mask"] = batch.batch["kept_mask"]
    # a mini-batch left empty is skipped
    with_step(out, step_settings(batch).but(allow_empty_minibatches=True))
    return out


def reference_kl(batch: DataProto) -> dict:
    """How far the policy has drifted from the reference: mean k1 KL estimate over response tokens
    (from the actor's update instead when the old log-probs were not computed)."""
    if "ref_log_prob" not in batch.batch.keys() or "old_log_probs" not in batch.batch.keys():
        return {}
    mask = batch.batch["response_mask"].bool()
    diff = (batch.batch["old_log_probs"] - batch.batch["ref_log_prob"])[mask]
    return {"actor/reference_kl": float(diff.mean()) if diff.numel() else 0.0}


def logprob_consistency(batch: DataProto) -> dict:
    """Rollout engine log-probs vs the training engine's for the same tokens (a silent-bug alarm)."""
    if "rollout_log_probs" not in batch.batch.keys() or "old_log_probs" not in batch.batch.keys():
        return {}  # on-policy updates report the mean difference themselves
    return logprob_diff_metrics(batch.batch["rollout_log_probs"], batch.batch["old_log_probs"],
                                batch.batch["response_mask"])


def uids(prefix: str, n: int) -> np.ndarray:
    """Group ids of a prompt batch: the n samples of prompt i share `{prefix}-{i}`."""
    return np.array([f"{prefix}-{i}" for i in range(n)], dtype=object)
