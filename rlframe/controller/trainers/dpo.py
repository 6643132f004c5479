"""Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback"): sample two
responses per prompt from the current policy, let the reward rank them, and take a DPO step on the
(chosen, rejected) pairs against the frozen reference.

    prompts = next(dataloader)
    batch   = actor.generate_sequences(prompts)        # n = 2 samples per prompt
    batch   = score(batch)                             # rule verifiers / reward models
    pairs   = make_preference_pairs(scores, uid)       # ties carry no preference: dropped
    pairs   = ref.compute_ref_log_prob(pairs)
    actor.update_actor_pairs(pairs)                    # DPO loss, rows (chosen, rejected) adjacent

Same workers as PPO; only the dataflow differs.
"""

from __future__ import annotations

import torch

from rlframe.algos.preference import make_preference_pairs
from rlframe.controller.trainers.metrics import batch_metrics, gathered, throughput
from rlframe.controller.trainers.ppo import PPOTrainer
from rlframe.utils.timing import timed


class OnlineDPOTrainer(PPOTrainer):
    def train_step(self) -> dict:
        t: dict[str, float] = {}
        m: dict[str, float] = {}
        with timed(t, "step"):
            with timed(t, "gen"):
                batch, gen_m = self.next_rollout()  # asynchronous too: DPO's loss has no ratio to correct
            with timed(t, "reward"):
                batch, reward_m = self.score(batch)
            self.generations.train(self.step, batch)  # trainer.rollout_dump_every: the sampled pairs
            scores = batch.batch["token_level_scores"].sum(-1)
            chosen, rejected = make_preference_pairs(scores=scores, index=batch.non_tensor_batch["uid"])
            m["dpo/pairs"] = float(len(chosen))
            if len(chosen) == 0:  # every pair tied: nothing to learn from this batch
                m.update({**gen_m, **reward_m, **t})
                return m
            pairs = self.pair_batch(batch, chosen, rejected)
            pairs.meta_info = self.step_meta()  # before the reference's log-probs: both at the temperature
            with timed(t, "ref"):
                pairs = pairs.union(self.roles.ref.compute_ref_log_prob(pairs))
            pairs.meta_info = self.step_meta()
            if self.observer is not None:
                self.observer.before_update(self, pairs)
            with timed(t, "update_actor"):
                m.update(gathered(self.roles.actor.update_actor_pairs(pairs)))
        t["timing_s/update_weights"] = gen_m.pop("timing_s/update_weights", 0.0)
        m.update({**gen_m, **reward_m, **t,  # the scored batch's, before pairing
                  **batch_metrics(batch, response_length=self.cfg.data.response_length, end_ids=self.end_ids),
                  **throughput(batch, step_time=t["timing_s/step"], world_size=self.roles.actor.world_size)})
        return m

    def pair_batch(self, batch, chosen: torch.Tensor, rejected: torch.Tensor):
        """Rows (chosen_0, rejected_0, chosen_1, ...), pairs repeated from the start until their
        count is a multiple of the actor's dp size, so every rank gets whole pairs."""
        dp = self.cfg.actor.dp
        idx = torch.stack([chosen, rejected], dim=1)
        short = (-len(idx)) % dp
        if short:
            idx = torch.cat([idx, idx[torch.arange(short) % len(idx)]])
        return batch.index(idx.reshape(-1))
