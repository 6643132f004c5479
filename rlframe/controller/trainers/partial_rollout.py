"""Partial rollouts (rollout.partial_budget = b > 0; Kimi k1.5, Team Kimi 2025): each generation
round gives every unfinished response at most b more tokens; responses still unfinished are carried
over and continued in later rounds, after the next update with the newer weights, so one long
response never holds a whole step back.

One step, as the driver sees it (B = data.train_batch_size groups of n samples):

    while fewer than B groups are complete (short by S):
        serve every unfinished sample that has no segment from this step's weights yet, and start
            S - (groups in progress) new groups (prompts drawn from the loader as needed)
        when all in progress were served: start S / p more groups (p: the share of groups that
            completed in their first segment so far), or, with B groups in progress,
            give every unfinished sample one more segment (the same weights: chunked generation)
        one batched call: <= b tokens each (its prompt + its tokens so far as the prompt, n=1)
        a sample is complete at EOS or after data.response_length tokens; a group when all n are
    train on the B oldest complete groups; the rest stay in the pool for later steps

So a sample gets one segment per step from that step's weights, as in Kimi's replay buffer, unless
a whole batch is in progress. Pick b above most responses' length: then only the long tail is cut
and carried over to the next steps. With b below most lengths, a batch of groups is soon in
progress and the step completes it with further segments: plain chunked generation, nothing
carried over.

Bookkeeping across the cut: a continued sample's response is its segments concatenated; its
`rollout_log_probs` are each segment's own, from the weights that sampled it (the behaviour policy),
and its response mask covers exactly its tokens. `policy_version` is the oldest version among its
segments (the updates made when its first token was sampled), so staleness = (step - 1) - version.
The pool is part of the checkpoint (trainer_state.json): a resumed run continues the same responses,
so nothing is lost or trained twice.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from rlframe.controller.trainers import phases
from rlframe.protocol import DataProto
from rlframe.workers.rollout.batch import assemble_batch, left_pad, prompts_from_rows
from rlframe.workers.rollout.seeds import SEED_KEY, seeds_for

POOL_GROUPS = 1  # batches' worth of groups in progress before the pool chunks on instead of starting more


@dataclass
class Sample:
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the policy version of each segment
    done: bool = False

    def served(self, version: int) -> bool:
        """Whether it got a segment from the weights of `version` already."""
        return bool(self.versions) and self.versions[-1] == version


@dataclass
class Group:
    prompt: list[int]  # the prompt's real tokens (no padding)
    fields: dict  # the prompt's non-tensor fields (ground truth, uid, ...)
    samples: list[Sample]

    @property
    def done(self) -> bool:
        return all(s.done for s in self.samples)

    @property
    def started(self) -> bool:
        return any(s.versions for s in self.samples)


class PartialRollouts:
    """The pool of groups in progress and complete; `next(step)` is the trainer's batch for a step."""

    def __init__(self, trainer, *, budget: int):
        self.trainer, self.budget = trainer, budget
        tok = trainer.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        self.eos_ids = trainer.end_ids  # every id a response may end with (rollout/stops.py)
        self.pool: list[Group] = []  # oldest first
        self.started = self.completed_first = 0  # groups started, and of those complete after one segment

    # ---- the step's batch ----------------------------------------------------------------------
    def next(self, step: int) -> tuple[DataProto, dict]:
        t = self.trainer
        want, version = t.cfg.data.train_batch_size, step - 1
        metrics: dict[str, float] = {}
        rounds = discarded = 0
        while (done := sum(g.done for g in self.pool)) < want:
            short = want - done
            in_progress = [g for g in self.pool if g.started and not g.done]
            todo = [s for g in in_progress for s in g.samples if not s.done and not s.served(version)]
            if todo:
                start = max(0, short - len(in_progress))
            else:  # S more complete groups take about S / p new ones
                room = POOL_GROUPS * want - len(in_progress)
                rate = self.completed_first / self.started if self.started else 1.0
                start = max(0, min(room, math.ceil(short / max(rate, 1.0 / want))))
            new = self._unstarted(start)
            for g in new:
                todo += g.samples
            if not todo:  # the pool is full and all of it was served: chunk on with these weights
                todo = [s for g in in_progress for s in g.samples if not s.done]
            rounds += 1
            discarded += self._generate_round(todo, step, version, salt=rounds, metrics=metrics)
            self.started += len(new)
            self.completed_first += sum(g.done for g in new)
        ready = [g for g in self.pool if g.done][:want]
        self.pool = [g for g in self.pool if not any(g is r for r in ready)]
        batch = self._batch(ready)
        samples = [s for g in ready for s in g.samples]
        segments = torch.tensor([len(s.versions) for s in samples], dtype=torch.float32)
        metrics.update(stamp_versions(batch, samples, version))
        metrics.update({
            "partial/rounds": float(rounds), "partial/discarded_tokens": float(discarded),
            "partial/segments_mean": float(segments.mean()), "partial/continued_frac": float((segments > 1).float().mean()),
            "partial/pool_groups": float(len(self.pool)),
            "partial/unfinished_samples": float(sum(bool(s.versions) and not s.done for g in self.pool for s in g.samples)),
            "partial/first_segment_complete_frac": self.completed_first / max(self.started, 1),
        })
        return batch, metrics

    def _groups(self, prompts: DataProto) -> list[Group]:
        n = self.trainer.cfg.algorithm.n_samples
        ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
        nt = prompts.non_tensor_batch
        return [Group(prompt=ids[i][mask[i].bool()].tolist(), fields={k: v[i] for k, v in nt.items()},
                      samples=[Sample() for _ in range(n)])
                for i in range(len(prompts))]

    def _unstarted(self, count: int) -> list[Group]:
        """The `count` oldest groups without a segment yet, drawing prompts from the loader as needed."""
        while count and sum(not g.started for g in self.pool) < count:
            self.pool.extend(self._groups(self.trainer.next_prompts()))
        return [g for g in self.pool if not g.started][:count]

    def _generate_round(self, samples: list[Sample], step: int, version: int, *, salt: int, metrics: dict) -> int:
        """<= budget more tokens for each of `samples`, sampled by the current weights; returns the
        tokens sampled past data.response_length (cut off, never trained)."""
        pending = self.launch_round(samples, step, salt=salt)
        out, gen_m = pending.result()
        phases.add_generation_metrics(metrics, gen_m)
        return self.apply_round(samples, out, version, budget=pending.budget)

    def launch_round(self, samples: list[Sample], step: int, *, salt: int, push: bool = True) -> phases.PendingGeneration:
        """Start the generation of <= budget more tokens for each of `samples` (the prompt and its
        tokens so far as the prompt, n=1) without waiting; `.budget` is the round's token budget."""
        t, limit = self.trainer, self.trainer.cfg.data.response_length
        where = {id(s): (g, j) for g in self.pool for j, s in enumerate(g.samples)}
        rows = [where[id(s)][0].prompt + s.tokens for s in samples]
        budget = min(self.budget, max(limit - len(s.tokens) for s in samples))
        gen_in = DataProto.from_dict(tensors=prompts_from_rows(rows, pad_id=self.pad_id))
        sampling = phases.sampling_for(t.cfg, n=1, temperature=t.cfg.rollout.temperature,
                                       seed=t.sample_seed(salt=1000 + salt, step=step))
        sampling = dataclasses.replace(sampling, max_new_tokens=budget)
        # a segment's seed: the step, the group, the sample and the segment (never the row's position)
        gen_in.batch[SEED_KEY] = seeds_for([(t.sample_seed(step=step), str(where[id(s)][0].fields.get("uid", "")),
                                             where[id(s)][1], len(s.versions)) for s in samples])
        pending = phases.launch_generation(t.roles, gen_in, sampling=sampling, replicas=t.roles.replicas, push=push)
        pending.budget = budget
        return pending

    def apply_round(self, samples: list[Sample], out: DataProto, version: int, *, budget: int) -> int:
        """Append a round's tokens (`out`, rows in the order of `samples`) to its samples, the tokens
        sampled by the weights of `version`; returns the tokens past data.response_length (dropped)."""
        limit = self.trainer.cfg.data.response_length
        resp, rmask = out.batch["responses"], out.batch["response_mask"].bool()
        lps = out.batch["rollout_log_probs"]
        discarded = 0
        for i, s in enumerate(samples):
            toks, lp = resp[i][rmask[i]].tolist(), lps[i][rmask[i]].tolist()
            room = limit - len(s.tokens)
            discarded += max(0, len(toks) - room)
            toks, lp = toks[:room], lp[:room]
            stopped = len(toks) < budget or bool(toks and toks[-1] in self.eos_ids)
            s.tokens += toks
            s.log_probs += lp
            s.versions.append(version)
            s.done = stopped or len(s.tokens) >= limit
        return discarded

    def _batch(self, groups: list[Group]) -> DataProto:
        """The contract rollout batch of complete groups (samples of a group adjacent), prompts
        left-padded to data.prompt_length, responses right-padded to data.response_length."""
        cfg = self.trainer.cfg
        n = cfg.algorithm.n_samples
        ids, mask = left_pad([g.prompt for g in groups], pad_id=self.pad_id,
                             width=max(cfg.data.prompt_length, max(len(g.prompt) for g in groups)))
        samples = [s for g in groups for s in g.samples]
        tensors = assemble_batch(prompt_ids=ids, prompt_mask=mask, responses=[s.tokens for s in samples],
                                 log_probs=[s.log_probs for s in samples], n=n,
                                 response_length=cfg.data.response_length, pad_token_id=self.pad_id)
        keys = groups[0].fields.keys()
        non_tensors = {}
        for k in keys:  # filled one by one: values that are lists must stay objects, not a 2-d array
            col = np.empty(len(samples), dtype=object)
            for i, g in enumerate(groups):
                for j in range(n):
                    col[i * n + j] = g.fields[k]
            non_tensors[k] = col
        return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)

    # ---- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The pool and the completion counts as JSON-able data (trainer_state.json)."""
        return {"started": self.started, "completed_first": self.completed_first,
                "pool": [{"prompt": g.prompt, "fields": {k: plain_json(v) for k, v in g.fields.items()},
                          "samples": [dataclasses.asdict(s) for s in g.samples]} for g in self.pool]}

    def load_state_dict(self, state: dict) -> None:
        self.started, self.completed_first = int(state["started"]), int(state["completed_first"])
        self.pool = [Group(prompt=list(g["prompt"]), fields=dict(g["fields"]),
                           samples=[Sample(**s) for s in g["samples"]]) for g in state["pool"]]


def stamp_versions(batch: DataProto, samples: list[Sample], version: int) -> dict[str, float]:
    """Sets each row's `policy_version` (its oldest segment's: the version of its first tokens) and
    returns the staleness metrics against the trainer's `version`."""
    oldest = torch.tensor([min(s.versions) for s in samples], dtype=torch.long)
    staleness = version - oldest
    batch.batch["policy_version"] = oldest
    return {"async/staleness": float(staleness.max()), "async/staleness_mean": float(staleness.float().mean()),
            "async/policy_version": float(oldest.min())}


def plain_json(value):
    """A non-tensor field as JSON-able Python (numpy scalars and arrays to their Python form)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {k: plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_json(v) for v in value]
    return value
