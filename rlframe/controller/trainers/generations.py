"""What the model generated, readable: every trainer.rollout_dump_every steps the step's samples, and
at every held-out evaluation its greedy responses, as jsonl rows in the run directory
(generations/train.jsonl, generations/val.jsonl; docs/generations.md lists the fields).

At most trainer.rollout_dump_rows rows per dump: the batch's first groups (the samples of a prompt,
`uid`), whole. The files rotate by size and a resumed run drops the rows of steps after its
checkpoint first (tracking.Tracker owns the files and the dashboards they also go to).
"""

from __future__ import annotations

import math

import torch

from rlframe.controller.trainers.metrics import ended_and_cut
from rlframe.controller.trainers.partial_rollout import plain_json
from rlframe.controller.trainers.phases import REWARD_EXTRA, REWARD_TEXT, decode_responses
from rlframe.protocol import DataProto

# per-sample values of the reward (phases.score), under score_parts when the batch has them
SCORE_PARTS = ("verifier_score", "acc", "reward_failed", "overlong_penalty", "rm_score")


def first_groups(uids, limit: int) -> list[int]:
    """Row indices of the first groups (rows sharing a uid, in order of first appearance) that fit in
    `limit` rows together; the first group's first `limit` rows when even it does not fit."""
    groups: dict = {}
    for i, u in enumerate(uids):
        groups.setdefault(u, []).append(i)
    picked: list[int] = []
    for rows in groups.values():
        if len(picked) + len(rows) > limit:
            break
        picked += rows
    if not picked and groups:
        picked = next(iter(groups.values()))[:limit]
    return sorted(picked)


def sample_rows(batch: DataProto, tokenizer, *, step: int, version: int, end_ids, response_length: int,
                limit: int, logprobs: bool = False) -> list[dict]:
    """One dict per sample of the batch's first groups (at most `limit` rows); `version` is the policy
    version of rows whose batch does not record its own (`policy_version`: asynchronous and partial
    rollouts)."""
    uids = batch.non_tensor_batch.get("uid")
    picked = first_groups(uids if uids is not None else range(len(batch)), limit)
    if not picked:
        return []
    sub = batch.index(picked)
    b, nt = sub.batch, sub.non_tensor_batch
    keys = set(b.keys())
    mask = b["response_mask"].bool()
    prompt_mask = b["attention_mask"][:, : b["prompts"].shape[1]].bool()
    prompts = tokenizer.batch_decode([p[m].tolist() for p, m in zip(b["prompts"], prompt_mask)],
                                     skip_special_tokens=True)
    responses = decode_responses(tokenizer, sub)
    ended, cut = ended_and_cut(sub, response_length=response_length, end_ids=end_ids)
    score = b["token_level_scores"].sum(-1) if "token_level_scores" in keys else None
    adv = None
    if "advantages" in keys:  # the sequence's: its mean over the response's tokens
        adv = (b["advantages"] * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    versions = b["policy_version"] if "policy_version" in keys else torch.full((len(sub),), version)
    agent = "agent_turns" in keys
    if agent:  # the whole trajectory: the policy's turns and the tool turns between them, markers kept
        resp = b["responses"]
        att = b["attention_mask"][:, -resp.shape[1]:].bool()
        transcripts = tokenizer.batch_decode([r[a].tolist() for r, a in zip(resp, att)], skip_special_tokens=False)
    extras = sorted(k for k in keys if k.startswith(REWARD_EXTRA))
    rows = []
    for i, index in enumerate(picked):
        row = {"step": step, "index": index, "uid": _field(nt, "uid", i), "data_source": _field(nt, "data_source", i),
               "prompt": prompts[i], "response": responses[i], "ground_truth": _field(nt, "ground_truth", i),
               "reward": _number(score[i]) if score is not None else None,
               "score_parts": _score_parts(b, keys, extras, i, nt),
               "advantage": _number(adv[i]) if adv is not None else None,
               "response_length": int(mask[i].sum()), "finished": bool(ended[i]), "truncated": bool(cut[i]),
               "policy_version": int(versions[i])}
        if agent:
            statuses = nt["agent_tool_statuses"][i] if "agent_tool_statuses" in nt else []
            row.update({"turns": int(b["agent_turns"][i]), "tool_calls": len(statuses),
                        "tool_statuses": list(statuses), "transcript": transcripts[i]})
        if logprobs and "rollout_log_probs" in keys:  # the rollout engine's, of the policy's tokens
            row["logprobs"] = [round(float(x), 5) for x in b["rollout_log_probs"][i][mask[i]]]
        rows.append(row)
    return rows


def _field(nt: dict, key: str, i: int):
    return plain_json(nt[key][i]) if key in nt else None


def _number(x) -> float | None:
    """A tensor element as a float; None for a non-finite one (JSON has no NaN)."""
    v = float(x)
    return v if math.isfinite(v) else None


def _score_parts(b, keys: set, extras: list[str], i: int, nt: dict | None = None) -> dict:
    """What the sample's reward is made of: the reward function's score and verdict, its extra values,
    numbers and strings (absent ones left out), an overlong penalty, the reward model's score (and each
    model's)."""
    parts = {k: _number(b[k][i]) for k in SCORE_PARTS if k in keys}
    for k in extras:
        if (v := _number(b[k][i])) is not None:
            parts[k[len(REWARD_EXTRA):]] = v
    for k in sorted(k for k in (nt or {}) if k.startswith(REWARD_TEXT)):
        if isinstance(v := nt[k][i], str):
            parts[k[len(REWARD_TEXT):]] = v
    if "rm_score_per_model" in keys:
        parts["rm_score_per_model"] = [_number(v) for v in b["rm_score_per_model"][i]]
    return parts


class GenerationDump:
    """The trainer's side: which steps are dumped and how (trainer.rollout_dump_*); the tracker writes."""

    def __init__(self, cfg, tokenizer, tracker, *, end_ids):
        t = cfg.trainer
        self.every, self.limit, self.logprobs = t.rollout_dump_every, t.rollout_dump_rows, t.rollout_dump_logprobs
        self.tokenizer, self.tracker, self.end_ids = tokenizer, tracker, end_ids
        self.response_length = cfg.data.response_length

    def train(self, step: int, batch: DataProto) -> None:
        """Step `step`'s batch, generated by the weights of `step - 1` updates unless it records its own."""
        if self.every > 0 and step % self.every == 0:
            self._dump("train", step, batch, version=step - 1)

    def val(self, step: int, batch: DataProto) -> None:
        """The held-out evaluation after step `step` (the weights of `step` updates): every one while dumps are on."""
        if self.every > 0:
            self._dump("val", step, batch, version=step)

    def _dump(self, kind: str, step: int, batch: DataProto, *, version: int) -> None:
        rows = sample_rows(batch, self.tokenizer, step=step, version=version, end_ids=self.end_ids,
                           response_length=self.response_length, limit=self.limit, logprobs=self.logprobs)
        self.tracker.log_generations(kind, rows, step)
