"""The invariants `rlframe preflight` checks, as pure functions of one step's batch and metrics.

Each returns a `Check`: its name, whether it held, the measured value against its limit, and when it
failed the likely cause and the settings involved. Shapes: log-probs, advantages, masks (B, R);
`uid` (B,) groups the samples of one prompt. DESIGN.md section 11 states the invariants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

# (mean, max) per-token |log p_rollout - log p_train| a correct run stays under, by compute precision.
# Measured on the sweep's rows (docs/benchmarks.md "Preflight sweep", AMD EPYC): fp32 at most 5e-7 mean
# and 4e-6 max; bf16 at most 0.016 mean and 0.11 max (0.16 in an earlier sweep). The bf16 limits are
# about twice the worst seen (0.03 mean, 0.3 max): a bf16 engine on another CPU (AMX) rounds otherwise,
# so they leave that margin; a defect moves the gap far more (a wrong temperature or a stale tensor: > 0.5).
LOGPROB_LIMITS = {"fp32": (2e-3, 5e-2), "bf16": (3e-2, 0.3)}
# |mean k1| of actor vs reference at step 1, and first-mini-batch |ppo_kl| / clip fraction
SAME_POLICY_LIMITS = {"fp32": 1e-4, "bf16": 1e-2}
CLIPFRAC_LIMITS = {"fp32": 0.0, "bf16": 0.01}


class InvariantViolation(RuntimeError):
    """A run-time invariant check failed (e.g. trainer.check_weight_sync_every): the run stops rather
    than train on silently wrong numbers."""


@dataclass
class Check:
    name: str
    ok: bool
    value: float
    limit: float
    detail: str = ""
    cause: str = ""  # what most likely breaks it, naming the settings; shown when it fails
    step: int = 0
    at_least: bool = False  # the rule is value >= limit (a floor), not value <= limit
    measure: str = ""  # what the value is, printed before it (e.g. "chance")

    def line(self) -> str:
        status = "ok  " if self.ok else "FAIL"
        value = f"{self.measure} {self.value:.3g}" if self.measure else f"{self.value:.3g}"
        rule = f"must be >= {self.limit:.3g}" if self.at_least else f"limit {self.limit:.3g}"
        text = f"{status} step {self.step} {self.name}: {value} ({rule})"
        text += f" {self.detail}" if self.detail else ""
        return text + ("" if self.ok else f"\n       likely cause: {self.cause}")


def logprob_match(rollout: torch.Tensor, train: torch.Tensor, mask: torch.Tensor, *, precision: str,
                  what: str, cause: str) -> list[Check]:
    """Per-token |rollout - training| log-probs of the sampled tokens: mean and max under the mask."""
    diff = (rollout.float() - train.float()).abs()[mask.bool()]
    mean = float(diff.mean()) if diff.numel() else 0.0
    worst = float(diff.max()) if diff.numel() else 0.0
    lim_mean, lim_max = LOGPROB_LIMITS[precision]
    tokens = f"over {diff.numel()} tokens"
    return [Check(f"{what} log-prob gap (mean)", mean <= lim_mean, mean, lim_mean, tokens, cause),
            Check(f"{what} log-prob gap (max)", worst <= lim_max, worst, lim_max, tokens, cause)]


def same_policy(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, *, precision: str, name: str,
                cause: str) -> Check:
    """|mean over response tokens of (a - b)| (a k1 KL estimate) of two log-probs that must agree."""
    m = mask.bool()
    kl = float((a.float() - b.float())[m].mean()) if m.any() else 0.0
    worst = float((a.float() - b.float()).abs()[m].max()) if m.any() else 0.0
    limit = SAME_POLICY_LIMITS[precision]
    return Check(name, abs(kl) <= limit and worst <= LOGPROB_LIMITS[precision][1], abs(kl), limit,
                 f"(max per token {worst:.3g})", cause)


def first_minibatch_ratio(metrics: dict, *, precision: str) -> list[Check]:
    """On-policy, the first mini-batch's ratio is 1: ppo_kl 0 and nothing clipped."""
    cause = ("the old log-probs are not the update's own: a different temperature (the step settings' temperature), "
             "a forward pass with dropout on, or different weights (actor.* micro-batching, precision)")
    kl, clip = abs(metrics["actor/first_mb_ppo_kl"]), metrics["actor/first_mb_pg_clipfrac"]
    return [Check("first mini-batch ppo_kl", kl <= SAME_POLICY_LIMITS[precision], kl, SAME_POLICY_LIMITS[precision],
                  cause=cause),
            Check("first mini-batch clip fraction", clip <= CLIPFRAC_LIMITS[precision], clip,
                  CLIPFRAC_LIMITS[precision], cause=cause)]


def _sequences(responses: torch.Tensor, mask: torch.Tensor) -> list[tuple[int, ...]]:
    return [tuple(r[m.bool()].tolist()) for r, m in zip(responses, mask)]


def duplicate_counts(batch, *, rare: float = 0.1) -> dict[str, float]:
    """Duplicate pairs inside groups, seen and expected by chance, over all samples and over unlikely
    ones. Two draws of a group coincide with probability sum_s p(s)^2, whose unbiased estimate is the
    mean of p(s_i) over the group's samples (p from the rollout's log-probs of the sampling
    distribution); coinciding on a sequence with p < `rare` has the estimate mean(p_i * [p_i < rare])."""
    b = batch.batch
    seqs = _sequences(b["responses"], b["attention_mask"][:, -b["responses"].shape[1]:])
    seq_p = torch.exp((b["rollout_log_probs"].double() * b["response_mask"]).sum(-1)).tolist()
    groups: dict = {}
    for i, uid in enumerate(batch.non_tensor_batch["uid"]):
        groups.setdefault(uid, []).append(i)
    out = {"seen": 0.0, "seen_rare": 0.0, "expected": 0.0, "expected_rare": 0.0, "groups": float(len(groups))}
    for rows in groups.values():
        pairs = len(rows) * (len(rows) - 1) / 2
        for a, i in enumerate(rows):
            for j in rows[a + 1:]:
                if seqs[i] == seqs[j]:
                    out["seen"] += 1
                    out["seen_rare"] += seq_p[i] < rare
        if pairs:
            out["expected"] += pairs * float(np.mean([seq_p[i] for i in rows]))
            out["expected_rare"] += pairs * float(np.mean([seq_p[i] * (seq_p[i] < rare) for i in rows]))
    return out


DUPLICATE_CHANCE_FLOOR = 1e-3  # duplicates less likely than this by chance fail


def duplicate_samples(counts: dict[str, float], *, temperature: float, scope: str = "") -> Check:
    """Samples of one group are independent draws: fails when the duplicates seen, all of them or those
    of unlikely samples, are beyond chance (Poisson tail below 1e-3), i.e. shared seeds rather than a
    confident model. `counts`: duplicate_counts of one batch, or their sums over several. Its value is
    that chance (the smaller of the two), its limit the floor 1e-3 it must reach."""
    tail = min(_poisson_tail(int(counts["seen"]), counts["expected"]),
               _poisson_tail(int(counts["seen_rare"]), counts["expected_rare"]))
    return Check(f"duplicate samples in a group{scope} (temperature {temperature})", tail >= DUPLICATE_CHANCE_FLOOR,
                 tail, DUPLICATE_CHANCE_FLOOR,
                 f"(chance of this many duplicate pairs or more: {counts['seen']:.0f} seen where "
                 f"{counts['expected']:.2g} are expected over {counts['groups']:.0f} groups; of unlikely samples "
                 f"(p < 0.1) {counts['seen_rare']:.0f} seen, {counts['expected_rare']:.2g} expected; the smaller chance decides)",
                 "samples of one group drawn with the same seed: seeds must follow the sample's global identity "
                 "(rollout/seeds.py), not its row in a generation replica's chunk (generation replicas, "
                 "rollout.partial_budget, agent.enabled)", at_least=True, measure="chance")


def _poisson_tail(k: int, mean: float) -> float:
    """P(X >= k) for X ~ Poisson(mean)."""
    if k <= 0:
        return 1.0
    mean = max(mean, 1e-12)
    below = sum(math.exp(-mean + i * math.log(mean) - math.lgamma(i + 1)) for i in range(k))
    return max(0.0, 1.0 - below)


def group_zero_mean(batch, *, estimator: str) -> Check | None:
    """Advantages of a group-normalised estimator (its traits' zero_mean_groups) have zero mean inside
    each group (per sample: the mean advantage over its response tokens; groups with an empty response
    are skipped)."""
    from rlframe.algos.registry import estimator_spec

    if not estimator_spec(estimator).zero_mean_groups:
        return None
    b = batch.batch
    mask = b["response_mask"].float()
    lengths = mask.sum(-1)
    per_sample = (b["advantages"].float() * mask).sum(-1) / lengths.clamp(min=1)
    groups: dict = {}
    for i, uid in enumerate(batch.non_tensor_batch["uid"]):
        groups.setdefault(uid, []).append(i)
    worst = 0.0
    for rows in groups.values():
        if all(lengths[i] > 0 for i in rows):
            worst = max(worst, abs(float(per_sample[rows].mean())))
    scale = 1e-4 * (1 + float(per_sample.abs().max())) if len(per_sample) else 1e-4
    return Check(f"group advantages zero-mean ({estimator})", worst <= scale, worst, scale,
                 cause="advantages computed over other rows than the group (uid), or changed after the estimator "
                       "(off-policy weights, algorithm.adv_estimator)")


def reward_repeats(first: torch.Tensor, second: torch.Tensor) -> Check:
    """The reward function gives the same score twice for the same input."""
    diff = float((first.float() - second.float()).abs().max()) if first.numel() else 0.0
    return Check("reward function repeats its score", diff == 0.0, diff, 0.0,
                 f"(over {first.numel()} samples)",
                 "the reward function depends on something besides its input (randomness, time, state): "
                 "reward.function_path / reward.function_name")


def nothing_after_end(batch, *, end_ids: frozenset[int]) -> Check:
    """A response that sampled an end-of-sequence id (any of the generation config's) has no policy
    token after it in the same turn: what follows is a tool turn (response_mask 0) or padding."""
    b = batch.batch
    resp, pmask = b["responses"], b["response_mask"].bool()
    att = b["attention_mask"][:, -resp.shape[1]:].bool()
    ends = torch.zeros_like(pmask)
    for e in end_ids:
        ends |= resp == e
    ends &= pmask
    following = torch.zeros_like(pmask)
    following[:, :-1] = ends[:, :-1] & pmask[:, 1:] & att[:, 1:]
    rows = int(following.any(-1).sum())
    return Check("no policy token after an end-of-sequence id", rows == 0, rows, 0,
                 f"(rows of {len(resp)}; end ids {sorted(end_ids)})",
                 "a response was continued past its end: the code that decides whether a response ended tests "
                 "fewer end ids than the engine stops at (generation_config.json eos_token_id lists; "
                 "rollout.partial_budget, agent.enabled)")


def turns_append_only(snapshots: list[list[list[int]]], final: list[list[int]]) -> Check:
    """Multi-turn: the tokens a trajectory had after each turn are a prefix of its tokens after every
    later turn and of the response row the batch holds (text is never re-tokenised)."""
    broken = 0
    for turns, row in zip(snapshots, final):
        later = turns[1:] + [row]
        broken += sum(later[k][:len(t)] != t for k, t in enumerate(turns))
    return Check("multi-turn tokens never change once recorded", broken == 0, broken, 0,
                 f"(over {len(final)} trajectories)",
                 "a turn re-tokenised earlier text (agent loop, chat template): keep token ids, never re-encode")
