"""Streaming rollouts (trainer.async_mode=stream, split placement; AReaL, Fu et al. 2025): the
generation group never waits for the trainer. A thread of the driver keeps it generating in rounds
of at most rollout.partial_budget tokens per response, admitting new prompt groups as groups
complete; the trainer takes a batch as soon as enough complete groups exist.

    generation thread, round after round:             trainer, step t (its weights: version t-1):
        new weights published? load them (the             wait until the batch is ready and the
          requests in progress continue from their         generation group holds version t-1
          tokens so far with the new weights)             train on it, publish version t
        admit groups while admitted < (v + k + 1) B
        and fewer than B groups are generating
        one round: <= budget more tokens each

Staleness bound by admission (k = trainer.max_staleness, B = data.train_batch_size, v = the version
of the weights the generation group holds): a group starts only while admitted < (v + k + 1) B. The
batch of step t takes first every group that started at version <= t-1-k ("due": the next step would
make it too old; at most B exist, by the admission rule), waits for those to complete, and fills the
rest with the oldest complete groups. So every sample's staleness, (t-1) minus the version of its first
token, is at most k, and no finished sample is dropped for age.

The weights load at a round's boundary (a token boundary of every request): a response in progress
continues from its tokens so far as its prompt, and each round's tokens carry the version and the
log-probs of the weights that sampled them (the behaviour policy, `rollout_log_probs`), exactly as
partial rollouts (partial_rollout.py, whose pool, rounds and batch assembly this reuses) record them.

Only one thread calls each worker group at a time: the generation thread calls the generation group,
and the actor group only to push weights, which it does while the trainer waits in `next`; validation,
weight checks and checkpoints pause it at a round's boundary (`paused`). A checkpoint holds the pool
(every group admitted and not yet trained, with its tokens so far) and the data loader after the last
prompt drawn, so a resumed run continues the same responses: no prompt is lost or trained twice.
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch

from rlframe.controller.trainers import phases
from rlframe.controller.trainers.partial_rollout import Group, PartialRollouts, stamp_versions
from rlframe.protocol import DataProto
from rlframe.utils import trace


class StreamingRollouts:
    def __init__(self, trainer, *, max_staleness: int, budget: int, state: dict | None = None):
        self.trainer, self.k = trainer, max_staleness
        self.want = trainer.cfg.data.train_batch_size
        self.parts = PartialRollouts(trainer, budget=budget)  # the pool of groups and their rounds
        if state is not None:
            _check_resumable(state, batch_size=self.want, max_staleness=max_staleness)
            self.parts.load_state_dict(state)
        self.start_version: dict[int, int] = {}  # id(group) -> the version of its first tokens
        for g in self.parts.pool:
            if g.started:
                self.start_version[id(g)] = min(v for s in g.samples for v in s.versions[:1])
        self.admitted = trainer.step * self.want + len(self.parts.pool)  # groups drawn since the run began
        trainer.roles.push_weights()  # after a resume the generation group still holds the initial model
        self.gen_version = self.published = trainer.step
        self.cond = threading.Condition()
        self.busy = self.stopping = False
        self.pause_requests = 0
        self.error: BaseException | None = None
        self.rounds = 0
        self.totals = _zero_totals()  # since the last batch
        self.sync_metrics: dict[str, float] = {}
        self.thread = threading.Thread(target=self._run, name="streaming rollouts", daemon=True)
        self.thread.start()

    # ---- the trainer's side ------------------------------------------------------------------------
    def next(self, step: int) -> tuple[DataProto, dict]:
        """The batch of training step `step`; first publishes the actor's weights (version step-1) and
        waits until the generation group holds them, so no actor call of this step overlaps the push."""
        version = step - 1
        t0 = time.perf_counter()
        with self.cond:
            self.published = version
            self.cond.notify_all()
            self._wait(lambda: self.gen_version == version and self._ready(version) is not None)
            ready = self._ready(version)
            self.parts.pool = [g for g in self.parts.pool if not any(g is r for r in ready)]
            starts = [self.start_version.pop(id(g)) for g in ready]
            totals, self.totals = self.totals, _zero_totals()
            sync, self.sync_metrics = self.sync_metrics, {}
            in_pool = len(self.parts.pool)
            generating = sum(g.started and not g.done for g in self.parts.pool)
        batch = self.parts._batch(ready)
        samples = [s for g in ready for s in g.samples]
        ages = stamp_versions(batch, samples, version)
        # the bound the admission rule guarantees, per sample (each one's first tokens are its group's start)
        staleness = version - batch.batch["policy_version"]
        assert all(min(s.versions) == v for v, g in zip(starts, ready) for s in g.samples), starts
        assert int(staleness.max()) <= self.k and int(staleness.min()) >= 0, (staleness.tolist(), self.k)
        segments = torch.tensor([len(s.versions) for s in samples], dtype=torch.float32)
        mixed = torch.tensor([len(set(s.versions)) > 1 for s in samples], dtype=torch.float32)
        metrics = {
            **sync,
            "timing_s/wait_for_rollout": time.perf_counter() - t0, **ages,
            "stream/pool_groups": float(in_pool), "stream/generating_groups": float(generating),
            "stream/segments_mean": float(segments.mean()), "stream/versions_mixed_frac": float(mixed.mean()),
            "stream/gen_tokens": float(totals["tokens"]), "stream/gen_busy_s": totals["gen_s"],
            "stream/gen_idle_s": totals["idle_s"], "stream/push_s": totals["push_s"],
        }
        return batch, metrics

    def _ready(self, version: int) -> list[Group] | None:
        """The batch for the trainer at `version` if it can be formed now: every due group (first
        tokens from version <= version - k) and the oldest other complete groups, B in all."""
        due = [g for g in self.parts.pool if id(g) in self.start_version and self.start_version[id(g)] <= version - self.k]
        assert len(due) <= self.want, (len(due), self.want)  # the admission rule's guarantee
        if not all(g.done for g in due):
            return None
        rest = [g for g in self.parts.pool if g.done and not any(g is d for d in due)]
        if len(due) + len(rest) < self.want:
            return None
        return due + rest[: self.want - len(due)]

    @contextlib.contextmanager
    def paused(self):
        """No generation round or push runs inside: for calls on the generation group from the
        trainer's thread (validation, weight checks) and for a consistent checkpoint of the pool."""
        with self.cond:
            self.pause_requests += 1
            self._wait(lambda: not self.busy)
        try:
            yield
        finally:
            with self.cond:
                self.pause_requests -= 1
                self.cond.notify_all()

    def state_dict(self) -> dict:
        """The pool (call inside `paused`): every admitted group not yet trained, with its tokens so far,
        and the batch size and bound its admission counted with."""
        return {**self.parts.state_dict(), "train_batch_size": self.want, "max_staleness": self.k}

    def weights_pushed(self, version: int) -> None:
        """The trainer's thread pushed the weights of `version` itself (validation generates with the
        current weights, inside `paused`): later rounds record that version."""
        with self.cond:
            self.gen_version = self.published = max(self.gen_version, version)

    def loader_state(self) -> dict:
        """Where a checkpoint's data loader resumes: after the last prompt drawn (those not yet trained are
        in the pool, which the checkpoint holds too)."""
        return self.trainer.loader.state_dict()

    def drain(self) -> None:
        """Stop the generation thread after its round (the run ends: the groups can be shut down)."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join()

    def _wait(self, predicate) -> None:
        """Wait on the condition (held) until `predicate()`, failing at once when the generation thread did."""
        while not predicate():
            if self.error is not None:
                raise RuntimeError(f"the streaming rollouts' generation thread failed: {self.error!r}") from self.error
            self.cond.wait(timeout=1.0)

    # ---- the generation thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._one_round():
                pass
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread, which raises it
            with self.cond:
                self.error = exc
                self.cond.notify_all()

    def _one_round(self) -> bool:
        idle0 = time.perf_counter()
        with self.cond:
            while not self.stopping and (self.pause_requests or not self._has_work()):
                self.cond.wait()
            if self.stopping:
                return False
            self.busy = True
            push = self.published > self.gen_version
            target = self.published
            self.totals["idle_s"] += time.perf_counter() - idle0
        try:
            if push:  # the trainer waits in next(): the actor group is free
                t0 = time.perf_counter()
                sync = self.trainer.roles.push_weights()
                with self.cond:
                    self.gen_version = target
                    self.sync_metrics.update(sync)
                    self.totals["push_s"] += time.perf_counter() - t0
                    self.cond.notify_all()
            with self.cond:
                self._admit()
                todo = [s for g in self.parts.pool if id(g) in self.start_version for s in g.samples if not s.done]
                version = self.gen_version
            if todo:
                self.rounds += 1
                t0 = time.perf_counter()
                with trace.span("stream round", samples=len(todo), version=version):
                    pending = self.parts.launch_round(todo, step=version + 1, salt=self.rounds, push=False)
                    out, _ = pending.result()
                with self.cond:
                    self.parts.apply_round(todo, out, version, budget=pending.budget)
                    self.totals["tokens"] += int(out.batch["response_mask"].sum())
                    self.totals["gen_s"] += time.perf_counter() - t0
        finally:
            with self.cond:
                self.busy = False
                self.cond.notify_all()
        return True

    def _has_work(self) -> bool:
        """(condition held) Something to do: weights to load, samples to continue or groups to admit."""
        can_start = self._generating() < self.want and (self._may_admit() or any(
            id(g) not in self.start_version for g in self.parts.pool))
        return self.published > self.gen_version or can_start or self._generating() > 0

    def _generating(self) -> int:
        return sum(1 for g in self.parts.pool if id(g) in self.start_version and not g.done)

    def _may_admit(self) -> bool:
        return self.admitted < (self.gen_version + self.k + 1) * self.want

    def _admit(self) -> None:
        """(condition held) Start groups while the staleness bound and the capacity (B groups generating)
        allow; groups restored from a checkpoint without tokens yet start first."""
        waiting = [g for g in self.parts.pool if id(g) not in self.start_version]
        while self._generating() < self.want:
            if not waiting:
                if not self._may_admit():
                    break
                new = self.parts._groups(self.trainer.next_prompts())
                self.parts.pool.extend(new)
                self.admitted += len(new)
                waiting = new
            g = waiting.pop(0)
            self.start_version[id(g)] = self.gen_version


def _zero_totals() -> dict:
    return {"tokens": 0, "gen_s": 0.0, "idle_s": 0.0, "push_s": 0.0}


def _check_resumable(state: dict, *, batch_size: int, max_staleness: int) -> None:
    """The pool of a checkpoint was admitted for its batch size and staleness bound: resuming it with
    another batch size, or a tighter bound, could leave groups older than the bound allows."""
    was_b, was_k = state.get("train_batch_size", batch_size), state.get("max_staleness", max_staleness)
    if was_b != batch_size or was_k > max_staleness:
        raise ValueError(
            f"the checkpoint holds {len(state.get('pool', []))} prompt groups of streaming rollouts admitted with "
            f"data.train_batch_size={was_b} and trainer.max_staleness={was_k}; this run has {batch_size} and "
            f"{max_staleness}. Resume with data.train_batch_size={was_b} and trainer.max_staleness >= {was_k}, "
            "or start a fresh run in another trainer.output_dir")
