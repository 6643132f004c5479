"""Supervised fine-tuning over the same worker groups: the prompt dataset's ground-truth answers
are the targets (answer + EOS), the loss is the mean NLL of the response tokens.

    prompts = next(dataloader)
    batch   = prompts + tokenized ground truths         # responses right-padded, response_mask
    actor.update_sft(batch)                             # one optimizer step

Validation, checkpoints, resume, metrics and the HF export are the PPO trainer's.
"""

from __future__ import annotations

import torch

from rlframe.controller.trainers.metrics import gathered, throughput
from rlframe.controller.trainers.ppo import PPOTrainer
from rlframe.protocol import DataProto
from rlframe.utils.masks import position_ids_from_mask
from rlframe.utils.timing import timed
from rlframe.protocol.step import STEP_KEY, StepSettings


class SFTTrainer(PPOTrainer):
    def train_step(self) -> dict:
        t: dict[str, float] = {}
        with timed(t, "step"):
            batch = self.with_targets(self.next_prompts())
            batch.meta_info = {STEP_KEY: StepSettings(global_step=self.step)}  # nothing sampled: no temperature
            with timed(t, "update_actor"):
                m = gathered(self.roles.actor.update_sft(batch))
        return {**m, **t, **throughput(batch, step_time=t["timing_s/step"], world_size=self.roles.actor.world_size)}

    def with_targets(self, prompts: DataProto) -> DataProto:
        """Append each row's ground truth + EOS as its response (right-padded to response_length)."""
        tok, width = self.tokenizer, self.cfg.data.response_length
        resp = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, answer in enumerate(prompts.non_tensor_batch["ground_truth"]):
            ids = (tok.encode(str(answer), add_special_tokens=False) + [tok.eos_token_id])[:width]
            resp[i, : len(ids)] = torch.tensor(ids)
            mask[i, : len(ids)] = 1
        attn = torch.cat([prompts.batch["attention_mask"], mask], dim=1)
        tensors = {"prompts": prompts.batch["input_ids"], "responses": resp, "response_mask": mask,
                   "input_ids": torch.cat([prompts.batch["input_ids"], resp], dim=1), "attention_mask": attn,
                   "position_ids": position_ids_from_mask(attn)}
        return DataProto.from_dict(tensors=tensors, non_tensors=dict(prompts.non_tensor_batch))
