"""The PPO-family trainer: one dataflow over the worker groups, configured into PPO (GAE + critic),
GRPO, Dr.GRPO, RLOO, REINFORCE++(-baseline), Lite PPO, ReMax and DAPO by `algorithm.*` alone.

One step, as the driver sees it (each line one call on a worker group, or a pure function here):

    prompts = next(dataloader)                          # (B prompts)
    batch   = actor.generate_sequences(prompts)         # reshard train->gen, vLLM, n samples each
    batch   = [ReMax] + greedy baseline generation      # reward_baselines
    batch   = score(batch)                              # rule verifiers / reward models
    batch   = [DAPO] keep groups with reward variance, sample again until full
    batch   = ref.compute_ref_log_prob(batch)           # when a KL term is on
    batch   = actor.compute_log_prob(batch)             # old_log_probs (skipped when exactly on-policy)
    batch   = critic.compute_values(batch)              # GAE only
    batch   = advantages(batch)                         # KL-in-reward, estimator by name
    critic.update_critic(batch); actor.update_actor(batch)
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from rlframe.config.algorithms import estimator_traits
from rlframe.algos.kl import make_kl_controller
from rlframe.config.build import to_dict
from rlframe.config.schema import RunConfig
from rlframe.config.resources import process_count, role_world_sizes
from rlframe.utils import startup
from rlframe.controller.trainers import phases
from rlframe.controller.trainers.agent_loop import build_agent
from rlframe.controller.trainers.async_rollout import RolloutPipeline
from rlframe.controller.lifecycle.checkpoint import CheckpointManager, driver_rng_state, restore_driver_rng
from rlframe.utils.console import say
from rlframe.controller.trainers.generations import GenerationDump
from rlframe.controller.trainers.metrics import batch_metrics, gathered, overhead, throughput
from rlframe.controller.trainers.partial_rollout import PartialRollouts
from rlframe.controller.lifecycle.preemption import Preempted, PreemptionWatch
from rlframe.controller.trainers.prepare import build_data, model_line, model_path
from rlframe.controller.trainers.roles import build_roles
from rlframe.controller.trainers.stream_rollout import StreamingRollouts
from rlframe.controller.lifecycle.tracking import Tracker, format_console, progress
from rlframe.controller.trainers.validation import validate
from rlframe.single_controller.worker_group import record_calls
from rlframe.data.dataloader import to_dataproto
from rlframe.protocol.step import STEP_KEY, StepSettings
from rlframe.protocol import DataProto
from rlframe.rewards.manager import RewardManager
from rlframe.rewards.registry import RewardFnSpec
from rlframe.utils import trace
from rlframe.utils.timing import timed
from rlframe.workers.rollout.stops import end_of_sequence_ids


class PPOTrainer:
    def __init__(self, cfg: RunConfig, *, run_dir: Path):
        from transformers import AutoTokenizer

        self.cfg, self.run_dir = cfg, Path(run_dir)
        say(model_line(cfg))  # where the model comes from: model.path, or the tiny preset's shipped or built copy
        self.actor_path = model_path(cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(self.actor_path)
        self.end_ids = end_of_sequence_ids(self.tokenizer, self.actor_path)  # every id a response may end with
        self.loader, self.val_set = build_data(cfg, self.tokenizer)
        startup.mark("tokenizer, data")
        say(f"data: {len(self.loader.dataset)} train prompts, {len(self.val_set) if self.val_set else 0} held out")
        spec = RewardFnSpec(path=cfg.reward.function_path, name=cfg.reward.function_name) \
            if cfg.reward.function_path else None
        self.reward = RewardManager(fn_spec=spec, num_workers=cfg.reward.num_workers,
                                    max_error_fraction=cfg.reward.max_error_fraction)
        self.agent = build_agent(cfg, self.tokenizer) if cfg.agent.enabled else None  # before any worker
        alg = cfg.algorithm
        self.kl_ctrl = make_kl_controller(kind="adaptive" if alg.kl_target else "fixed", kl_coef=alg.kl_coef,
                                          target_kl=alg.kl_target, horizon=alg.kl_horizon)
        from rlframe.controller.lifecycle.prelaunch import run_hosts

        say(worker_groups_line(cfg, run_hosts(cfg)))
        self.roles = build_roles(cfg, actor_path=self.actor_path, critic_path=cfg.model.critic_path or self.actor_path)
        self.tracker = Tracker(self.run_dir, sinks=cfg.trainer.loggers, experiment=cfg.trainer.experiment,
                               config=to_dict(cfg), plot=cfg.trainer.plot)
        self.generations = GenerationDump(cfg, self.tokenizer, self.tracker, end_ids=self.end_ids)
        from rlframe.plan.memory_estimate import estimated_checkpoint_bytes

        self.ckpt = CheckpointManager(self.run_dir, keep=cfg.trainer.keep_checkpoints,
                                      estimate_bytes=estimated_checkpoint_bytes(cfg))  # the first one's free space
        self.step = 0
        self._last_save, self._save_s = time.monotonic(), 0.0  # when the last checkpoint ended; how long it took
        self.saved: Path | None = None  # the checkpoint of this run last written or resumed from
        self.resumed_from: Path | None = None
        self.observer = None  # rlframe preflight's checks (controller/preflight), when it runs this trainer
        self.pipeline = None  # made after resume (asynchronous rollouts, trainer.max_staleness > 0)
        self.stream_state = None  # streaming rollouts: the pool a resumed checkpoint holds
        self.pending_weight_checks: list = []  # who waits for the next weight comparison (request_weight_check)
        self.weight_check_metrics: dict[str, float] = {}  # trainer.check_weight_sync_every: this step's
        budget, stream = cfg.rollout.partial_budget, cfg.trainer.async_mode == "stream"
        self.partial = PartialRollouts(self, budget=budget) if budget > 0 and not stream else None

    # ---- the loop ------------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg = self.cfg.trainer
        self.resume()
        startup.mark("checkpoint resume")
        if self.step == 0 and cfg.val_every > 0:
            val = self.validate()
            self.tracker.log(val, step=0)
            say(format_console(0, cfg.total_steps, val))
            startup.mark("validation at step 0")
        say(startup.summary())
        if cfg.max_staleness > 0 and cfg.async_mode == "stream":
            self.pipeline = StreamingRollouts(self, max_staleness=cfg.max_staleness,
                                              budget=self.cfg.rollout.partial_budget, state=self.stream_state)
        elif cfg.max_staleness > 0:
            self.pipeline = RolloutPipeline(self, max_staleness=cfg.max_staleness)
        first = self.step + 1
        bar = progress(total=cfg.total_steps, initial=self.step, enabled=cfg.progress_bar)
        try:
            with PreemptionWatch(grace_s=cfg.preempt_grace_s) as preemption:
                self.loop(first, bar, preemption)
        except Preempted:
            bar.close()
            self.tracker.close()  # every logged step reaches its files before the workers stop
            raise
        finally:
            if isinstance(self.pipeline, StreamingRollouts):  # its thread stops after its round, even on an error
                self.pipeline.drain()
        bar.close()
        if isinstance(self.pipeline, RolloutPipeline):
            self.pipeline.drain()
        return self.finish()

    def loop(self, first: int, bar, preemption: PreemptionWatch) -> None:
        """Steps first .. total_steps: train, check, validate, log, checkpoint (every save_every steps,
        every save_every_minutes, at the end, and on a preemption signal)."""
        cfg = self.cfg.trainer
        for self.step in range(first, cfg.total_steps + 1):
            trace.at_step(self.step)  # trainer.trace: the events from here on belong to this step
            metrics = self.train_step()
            if self.observer is not None:
                self.observer.after_step(self, metrics)
            every = cfg.check_weight_sync_every  # and at the last step: a run that checks ends checked
            if every > 0 and (self.step % every == 0 or self.step == cfg.total_steps):
                self.request_weight_check(self.stop_on_weight_mismatch)
            metrics.update(self.weight_check_metrics)  # a check run in this step (the batch pipeline's: in next())
            self.weight_check_metrics = {}
            if self.step == first:  # the start-up stages, once, with the first step's metrics
                metrics.update(startup.metrics())
            if cfg.val_every > 0 and (self.step % cfg.val_every == 0 or self.step == cfg.total_steps):
                metrics.update(self.validate())
                with self.generation_paused():
                    metrics.update(self.roles.memory())  # peaks so far: at the validation steps, one call a group
            self.tracker.log(metrics, step=self.step)
            bar.update(metrics)
            due = cfg.save_every_minutes > 0 and time.monotonic() - self._last_save >= 60 * cfg.save_every_minutes
            if self.step == cfg.total_steps or (cfg.save_every > 0 and self.step % cfg.save_every == 0) or due:
                self.save()
            if preemption.requested:
                self.stop_on_signal(preemption)

    def train_step(self) -> dict:
        t: dict[str, float] = {}
        alg, m = self.cfg.algorithm, {}
        kl_coef = self.kl_ctrl.value  # read before the advantages phase updates an adaptive controller
        with record_calls() as calls, timed(t, "step"):
            with timed(t, "gen"):
                batch, gen_m = self.next_rollout()
            train_start = time.time()  # wall clock: asynchronous generation overlaps from here
            with timed(t, "reward"):
                batch, reward_m = self.score(batch)
            if alg.dynamic_sampling:
                with timed(t, "dynamic_sampling"):
                    batch, ds_m = self.fill_with_informative_groups(batch)
                m.update(ds_m)
                reward_m = phases.reward_metrics(batch)  # the trained rows, not the first round's
            # reference log-probs, old log-probs and values need only the batch: issued together, so
            # groups in their own processes (split placement) compute them at once
            on_policy = phases.update_is_on_policy(self.cfg, rows=len(batch))
            # every log-prob of the sampled tokens (reference, old, the update's) is taken at the
            # rollout's temperature: stamped before the first call that computes one
            batch.meta_info = self.step_meta(on_policy=on_policy)
            pending = {}
            if self.roles.ref is not None:
                pending["ref"] = self.roles.ref.compute_ref_log_prob(batch, blocking=False)
            if phases.needs_old_log_probs(self.cfg, rows=len(batch)):  # on-policy: the update's own, detached
                pending["old_log_prob"] = self.roles.actor.compute_log_prob(batch, blocking=False)
            elif not on_policy:  # off-policy, behaviour correction: the rollout engine's log-probs
                batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"].clone()
            if self.roles.critic is not None:
                pending["values"] = self.roles.critic.compute_values(batch, blocking=False)
            for name, out in phases.wait_in_order(pending, t):
                batch = batch.union(out.select(batch_keys=["old_log_probs"]) if name == "old_log_prob" else out)
            with timed(t, "adv"):
                batch, adv_m = phases.advantages(batch, cfg=self.cfg, kl_ctrl=self.kl_ctrl)
                if self.cfg.off_policy:  # the rollouts may be older than the weights being trained
                    batch, is_m = phases.off_policy_correction(batch, cfg=self.cfg)
                    adv_m.update(is_m)
            adv_m.update(phases.reference_kl(batch))
            batch.meta_info = self.step_meta(on_policy=on_policy)
            if self.observer is not None:  # preflight: invariants checked on the batch the update gets
                self.observer.before_update(self, batch)
            updates = {}  # independent: the critic and the actor update at once when in separate groups
            if self.roles.critic is not None:
                updates["update_critic"] = self.roles.critic.update_critic(batch, blocking=False)
            if self.step > self.cfg.trainer.critic_warmup:  # critic warm-up: the value head learns first
                updates["update_actor"] = self.roles.actor.update_actor(phases.for_actor(batch), blocking=False)
            self.generations.train(self.step, batch)  # trainer.rollout_dump_every, while the workers update
            for _, out in phases.wait_in_order(updates, t):
                m.update(gathered(out))
            if self.pipeline is not None:
                m.update({"async/train_start_unix": train_start, "async/train_end_unix": time.time()})
        t["timing_s/update_weights"] = gen_m.pop("timing_s/update_weights", 0.0)
        m.update({**gen_m, **reward_m, **adv_m, **t, **phases.logprob_consistency(batch),
                  **batch_metrics(batch, response_length=self.cfg.data.response_length, end_ids=self.end_ids),
                  **throughput(batch, step_time=t["timing_s/step"], world_size=self.roles.actor.world_size),
                  **overhead(calls, step_time=t["timing_s/step"])})
        if alg.kl_in_reward:  # the coefficient this step's rewards used (the controller has moved on since)
            m["actor/kl_coef"] = kl_coef
        return m

    # ---- phases --------------------------------------------------------------------------------
    def step_meta(self, **extra) -> dict:
        """The `meta_info` of this step's batch: its StepSettings (rlframe/protocol/step.py), which every
        worker call on it reads: the step (mini-batch shuffling) and the rollout's sampling temperature
        (log-probs are of logits / T), with `extra` (on_policy)."""
        return {STEP_KEY: StepSettings(global_step=self.step, temperature=self.cfg.rollout.temperature, **extra)}

    def next_rollout(self) -> tuple[DataProto, dict]:
        """This step's batch: generated now by the current weights (synchronous), or earlier by weights
        at most trainer.max_staleness updates older (asynchronous: async_rollout.RolloutPipeline), or
        continued over several steps (partial rollouts: partial_rollout.PartialRollouts)."""
        if self.pipeline is not None:
            return self.pipeline.next(self.step)
        if self.partial is not None:
            return self.partial.next(self.step)
        return self.rollout(self.next_prompts())

    def next_prompts(self) -> DataProto:
        # group ids from where the batch sits in the data (epoch, position): unique across DAPO refills and
        # async look-ahead, and the same after a resume (they also seed partial rollouts' segments)
        where = f"e{self.loader.epoch}-p{self.loader.position}"
        prompts = to_dataproto(next(self.loader))
        prompts.non_tensor_batch["uid"] = phases.uids(where, len(prompts))
        return prompts

    def sample_seed(self, salt: int = 0, step: int | None = None) -> int:
        step = self.step if step is None else step
        return (self.cfg.trainer.seed * 1_000_003 + step * 101 + salt) % (2**31)

    def rollout(self, prompts: DataProto, salt: int = 0) -> tuple[DataProto, dict]:
        alg = self.cfg.algorithm
        sampling = phases.sampling_for(self.cfg, n=alg.n_samples, temperature=self.cfg.rollout.temperature,
                                       seed=self.sample_seed(salt))
        batch, metrics = self.generate(prompts, sampling)
        traits = estimator_traits(alg)
        if traits is not None and traits.extra_rollout == "greedy":  # its baseline_rewards (ReMax's)
            batch.batch["reward_baselines"] = self.greedy_baseline(prompts).repeat_interleave(alg.n_samples)
        return batch, metrics

    def greedy_baseline(self, prompts: DataProto) -> torch.Tensor:
        """ReMax (Li et al. 2023): the reward of the greedy response is each prompt's baseline."""
        greedy = phases.sampling_for(self.cfg, n=1, temperature=0.0, seed=self.sample_seed(7))
        batch, _ = self.generate(prompts, greedy)
        batch, _ = self.score(batch)
        return batch.batch["token_level_scores"].sum(-1)

    def generate(self, prompts: DataProto, sampling) -> tuple[DataProto, dict]:
        """n samples per prompt from the current policy: one generation, or a multi-turn loop with
        tools (agent.enabled) whose turns are generations."""
        def one_call(gen_in, s):
            return phases.generate(self.roles, gen_in, sampling=s, replicas=self.roles.replicas)

        if self.agent is None:
            return one_call(prompts, sampling)
        return self.agent.run(prompts, sampling, one_call, replicas=self.roles.replicas)

    def score(self, batch: DataProto) -> tuple[DataProto, dict]:
        return phases.score(batch, cfg=self.cfg, tokenizer=self.tokenizer, reward_manager=self.reward,
                            reward_model=self.roles.reward_model)

    def fill_with_informative_groups(self, batch: DataProto) -> tuple[DataProto, dict]:
        """DAPO dynamic sampling: keep the groups whose rewards differ, sample more prompts until
        the batch is full or `max_gen_batches` ran; a batch still short is handled by
        `algorithm.dynamic_sampling_at_cap` (refill / train_kept / stop: dynamic_sampling.py), and
        the console says what it did with the numbers."""
        from rlframe.algos.registry import resolve_loss_agg_mode
        from rlframe.controller.trainers.dynamic_sampling import fill_with_informative_groups, row_unit

        alg = self.cfg.algorithm

        def more(rounds: int) -> DataProto:
            scored, _ = self.score(self.rollout(self.next_prompts(), salt=rounds)[0])
            return scored

        batch, metrics, capped = fill_with_informative_groups(
            batch, more, max_gen_batches=alg.max_gen_batches, at_cap=alg.dynamic_sampling_at_cap,
            unit=row_unit(self.cfg), step=self.step)
        if capped is not None:
            say(capped.line(loss_agg_mode=resolve_loss_agg_mode(policy_loss=alg.policy_loss,
                                                                 loss_agg_mode=alg.loss_agg_mode)))
        return batch, metrics

    def validate(self) -> dict:
        if self.val_set is None:
            return {}
        with self.generation_paused():
            out = validate(self, self.val_set)
            if isinstance(self.pipeline, StreamingRollouts):  # validation generated with (so pushed) these weights
                self.pipeline.weights_pushed(self.step)
            return out

    def generation_paused(self):
        """Streaming rollouts generate in a thread of their own: pause it (at a round's boundary) around
        the trainer's own calls on the generation group and around checkpoints of its pool."""
        return self.pipeline.paused() if isinstance(self.pipeline, StreamingRollouts) else contextlib.nullcontext()

    def request_weight_check(self, take) -> None:
        """Compare the rollout engine's weights with the trainer's (weight_check.py) where that means
        something, right after a sync, and hand `take` the result:
        - synchronous training: now, completing the pending sync (what the next generation uses);
        - streaming rollouts: now, at a round's boundary, pushing the current weights (as validation does;
          the later rounds record that version);
        - the batch pipeline: right after its next push, before it launches (at most k steps later), so
          the check neither stalls the overlap nor makes batches fresher than their recorded version;
          now when nothing is in flight (the last step, where a request still waiting is served too:
          the pipeline pushes no more). A request waiting at a preemption is dropped.
        After an update and before the next push the generation side rightly holds older weights: a
        check there would compare nothing."""
        if take not in self.pending_weight_checks:  # the same taker asking again gets one result
            self.pending_weight_checks.append(take)
        if isinstance(self.pipeline, RolloutPipeline) and self.pipeline.inflight:
            return  # RolloutPipeline.next runs it after its push
        with self.generation_paused():
            result = self.compare_weights(sync_first=True)
            if isinstance(self.pipeline, StreamingRollouts):  # before any taker can raise: later rounds
                self.pipeline.weights_pushed(self.step)  # record the version they generate with
        self.hand_out_weight_check(result)

    def compare_weights(self, *, sync_first: bool) -> dict:
        """weight_check.check_weight_sync now; a comparison that found nothing to compare (a sync still
        pending) would pass unseen, so it is an error of the caller's timing."""
        from rlframe.controller.trainers.weight_check import check_weight_sync

        result = check_weight_sync(self.roles, sync_first=sync_first)
        if result["skipped"]:
            raise RuntimeError(f"step {self.step}: the weight check ran where it compares nothing: {result['skipped']}")
        return result

    def hand_out_weight_check(self, result: dict) -> None:
        """Give the comparison's result to everyone waiting (see request_weight_check)."""
        waiting, self.pending_weight_checks = self.pending_weight_checks, []
        for take in waiting:
            take(result)

    def stop_on_weight_mismatch(self, result: dict) -> None:
        """trainer.check_weight_sync_every: the rollout engine must hold exactly the trainer's weights
        after a sync (per-slice checksums, weight_check.py); a mismatch stops the run."""
        from rlframe.controller.preflight.checks import InvariantViolation
        from rlframe.controller.trainers.weight_check import weight_check_metrics

        if result.get("sync/mismatched_slices"):
            raise InvariantViolation(
                f"step {self.step}: after the weight sync the rollout engine holds other weights than the trainer "
                f"in {result['sync/mismatched_slices']} of {result['sync/checked_slices']} slices (first: "
                f"{', '.join(result['mismatched'])}); every generation since the last check used wrong weights. "
                "Run `rlframe preflight` with this config to see which settings are involved")
        self.weight_check_metrics.update(weight_check_metrics(result))

    # ---- checkpoints ---------------------------------------------------------------------------
    def stop_on_signal(self, preemption: PreemptionWatch) -> None:
        """The step is done: checkpoint it unless that would outlast the grace period (or it is saved
        already), then stop the run with one line (Preempted)."""
        saved = self.saved  # the last checkpoint written or resumed from (no re-hashing of its files)
        if saved is None or saved.name != f"step_{self.step:06d}":
            if preemption.time_left() > self._save_s:
                self.save()
                saved = self.saved
            else:
                say(f"no checkpoint of step {self.step}: the last one took {self._save_s:.0f} s and "
                    f"{max(0.0, preemption.time_left()):.0f} s of trainer.preempt_grace_s are left")
        where = f"checkpoint {saved}" if saved is not None else "no checkpoint yet"
        raise Preempted(f"stopped on a signal after step {self.step}; {where}; run the same command again "
                        "(trainer.resume=auto) to continue", preemption.code)

    def save(self) -> None:
        t0 = time.monotonic()
        try:
            self._save()
        finally:
            self._last_save, self._save_s = time.monotonic(), time.monotonic() - t0

    def _save(self) -> None:
        """Writes the checkpoint of this step; `self.saved` is then its path (verified by the manager)."""
        def save_roles(tmp: Path):
            self.roles.actor.save_checkpoint(str(tmp / "actor"))
            if self.roles.critic is not None:
                self.roles.critic.save_checkpoint(str(tmp / "critic"))

        with self.generation_paused():  # the pool and the data loader as one consistent picture
            state = {"dataloader": self.loader.state_dict() if self.pipeline is None else self.pipeline.loader_state(),
                     "kl_ctrl": self.kl_ctrl.state_dict(), "rng": driver_rng_state()}
            if self.partial is not None:  # responses in progress continue after a resume
                state["partial_rollouts"] = self.partial.state_dict()
            if isinstance(self.pipeline, StreamingRollouts):
                state["stream_rollouts"] = self.pipeline.state_dict()
        self.saved = self.ckpt.save(self.step, save_roles=save_roles, state=state)

    def resume(self) -> None:
        """Continue from the checkpoint trainer.resume names (auto: this run's newest that verifies).
        What the user set applies (docs/checkpoints.md, "Resume policy"): the checkpoint gives the
        weights, optimizer moments, schedule position, data position, RNG states and an adaptive KL
        controller's coefficient; learning rates, a fixed KL coefficient and total_steps come from
        the config, each change said in one line."""
        from rlframe.controller.lifecycle.run_identity import claim_run, config_dict, resume_changes

        # this run's record (refuses a directory of another run); checkpoints record it and the config
        self.ckpt.bind(claim_run(self.run_dir, self.cfg), config=config_dict(self.cfg))
        path = self.ckpt.resolve(self.cfg.trainer.resume)
        if path is None:  # a fresh run: lines a previous run left in metrics.jsonl are dropped
            self.tracker.resume_history(-1)
            return
        state = self.ckpt.load_state(path)
        _check_in_flight(state, self.cfg, checkpoint=path)
        for line in resume_changes(self.ckpt.run_info(path), self.cfg, checkpoint=path):
            say(line)
        self.roles.actor.load_checkpoint(str(path / "actor"))
        if self.roles.critic is not None:
            self.roles.critic.load_checkpoint(str(path / "critic"))
        self.loader.load_state_dict(state["dataloader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])  # fixed: the config's; adaptive: kept unless kl_target changed
        restore_driver_rng(state["rng"])
        if self.partial is not None:
            self.partial.load_state_dict(state.get("partial_rollouts", {"started": 0, "completed_first": 0, "pool": []}))
        self.stream_state = state.get("stream_rollouts")
        self.step = int(state["step"])
        self.saved = self.resumed_from = path
        self.tracker.resume_history(self.step)
        print(f"resumed from {path} at step {self.step}", flush=True)
        if self.step >= self.cfg.trainer.total_steps:
            say(f"the checkpoint is at step {self.step}, trainer.total_steps={self.cfg.trainer.total_steps}: "
                "no step left to train (raise trainer.total_steps to continue)")

    def finish(self) -> dict:
        summary = {"run_dir": str(self.run_dir), "steps": self.step}
        if self.cfg.trainer.export_hf:
            export = self.run_dir / "hf_actor"
            self.roles.actor.export_hf(str(export))
            self.tokenizer.save_pretrained(str(export))
            summary["hf_export"] = str(export)
        vals = [r for r in self.tracker.history if "val/accuracy" in r]
        if vals:
            start, end = vals[0]["val/accuracy"], vals[-1]["val/accuracy"]
            summary.update({"val_accuracy_start": start, "val_accuracy_end": end})
            say(f"held-out accuracy (greedy, {len(self.val_set)} prompts): {start:.1%} at step {vals[0]['step']} "
                f"-> {end:.1%} at step {vals[-1]['step']} ({100 * (end - start):+.1f} points)")
        self.tracker.close()
        return summary

    def close(self) -> None:
        self.roles.shutdown()
        self.reward.close()
        if self.agent is not None:
            self.agent.close()


def worker_groups_line(cfg: RunConfig, hosts: list[str]) -> str:
    """The start-up's line of the worker groups: placement, processes (and, across hosts, the hosts:
    "hostname (ip)" each), the roles' layouts."""
    hosts = list(dict.fromkeys(hosts))  # Ray nodes on one machine are one host
    where = f" on {len(hosts)} hosts: {', '.join(hosts)}" if len(hosts) > 1 else ""
    critic = f", critic {_layout_text(cfg.critic)}" if cfg.uses_critic else ""
    return (f"starting worker groups ({cfg.resources.placement}, {process_count(cfg)} processes{where}): "
            f"actor {_layout_text(cfg.actor)}{critic}, rollout {cfg.rollout.backend} tp={cfg.rollout.tp}"
            + (f" in its own {role_world_sizes(cfg)['rollout']} process(es)" if cfg.resources.placement == "split" else ""))


def _layout_text(role) -> str:
    return (f"{role.strategy} dp={role.dp} tp={role.tp}" + (f" pp={role.pp}" if role.pp > 1 else "")
            + (f" sp={role.sp}" if role.sp > 1 else ""))


def _check_in_flight(state: dict, cfg: RunConfig, *, checkpoint: Path) -> None:
    """Responses in progress in a checkpoint continue only in the mode that wrote them: resumed in another,
    their prompts (drawn from the data loader already) would never be trained."""
    stream = cfg.trainer.max_staleness > 0 and cfg.trainer.async_mode == "stream"
    partial = cfg.rollout.partial_budget > 0 and not stream
    for key, setting, same in (("stream_rollouts", "trainer.async_mode=stream (with max_staleness > 0)", stream),
                               ("partial_rollouts", "rollout.partial_budget > 0 (without async_mode=stream)", partial)):
        pool = (state.get(key) or {}).get("pool") or []
        if pool and not same:
            raise ValueError(f"{checkpoint} holds {len(pool)} prompt groups in progress of {key.replace('_', ' ')}, "
                             f"which this run would drop; resume it with {setting} as it was written, or start "
                             "a fresh run in another trainer.output_dir")
