"""RewardModelWorker: scores prompt+response with one or more sequence-classification models.

Each rank holds full copies of the reward models (they are frozen and usually small next to the
policy; pure data parallelism) and scores its share of the batch: the score is the model's output
at the last real token (`rlframe.rewards.reward_model`). Several models are combined by `ensemble`
(mean or min). The reward models must share the policy's tokenizer (same token ids).
"""

from __future__ import annotations

import torch

from rlframe.controller import Dispatch, Worker, register
from rlframe.protocol import DataProto
from rlframe.rewards.reward_model import build_rm_inputs, ensemble_scores, last_token_scores


class RewardModelWorker(Worker):
    def __init__(self, *, model_paths: list[str], ensemble: str = "mean", micro_batch_size: int = 64):
        from transformers import AutoModelForSequenceClassification

        if not model_paths:
            raise ValueError("RewardModelWorker needs at least one reward model path (reward.model_paths)")
        self.models = [AutoModelForSequenceClassification.from_pretrained(p, num_labels=1, torch_dtype=torch.float32).eval()
                       for p in model_paths]
        self.ensemble, self.micro_batch_size = ensemble, micro_batch_size

    @torch.no_grad()
    def _score(self, model, inputs: dict) -> torch.Tensor:
        out = []
        n = inputs["input_ids"].shape[0]
        for s in range(0, n, self.micro_batch_size):
            part = {k: v[s:s + self.micro_batch_size] for k, v in inputs.items()}
            logits = model(input_ids=part["input_ids"], attention_mask=part["attention_mask"],
                           position_ids=part["position_ids"]).logits
            out.append(last_token_scores(logits, part["attention_mask"]))
        return torch.cat(out)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """`rm_scores` (B,): the (ensembled) reward-model score of each prompt+response."""
        b = data.batch
        prompt_len = b["prompts"].shape[1]
        inputs = build_rm_inputs(b["prompts"], b["attention_mask"][:, :prompt_len], b["responses"], b["response_mask"])
        scores = torch.stack([self._score(m, inputs) for m in self.models])
        return DataProto.from_dict(tensors={"rm_scores": ensemble_scores(scores, mode=self.ensemble)})
