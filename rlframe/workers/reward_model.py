"""RewardModelWorker: scores prompt+response with one or more sequence-classification models.

Each rank holds full copies of the reward models (they are frozen and usually small next to the
policy; pure data parallelism) and scores its share of the batch, on its own GPU where it has one
(every process of the reward pool gets one) in the engines' GPU compute dtype (bf16), else on CPU
in fp32 (`rm_placement`). A model is a stock HF
`*ForSequenceClassification` with one label (a pooled (B, 1) output, read at the last non-pad token)
or a `*ForTokenClassification` / value head with one value per token (read at the last real token):
`rlframe.rewards.reward_model.sequence_scores`. Inputs are packed so that every row's last real token
is its last column, which is where both kinds read.

A reward model whose tokenizer equals the policy's (same vocabulary and chat template) scores the
policy's ids as they are; any other gets the text instead: the prompt's messages and the decoded
response rendered with the RM's own chat template, encoded with its own tokenizer
(docs/reward_models.md). Several models are combined by `ensemble` (mean or min); each model's own
scores come back too, for the metrics.
"""

from __future__ import annotations

import itertools

import torch

from rlframe.single_controller import Dispatch, Worker, register
from rlframe.protocol import DataProto
from rlframe.rewards.reward_model import (build_rm_inputs, ensemble_scores, pack_right, retokenize_for_rm, rm_texts,
                                          same_tokenizer, sequence_scores)


def _auto_class(model_path: str):
    """AutoModelForTokenClassification for per-token heads, AutoModelForSequenceClassification otherwise."""
    import json
    from pathlib import Path

    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    archs = json.loads((Path(model_path).expanduser() / "config.json").read_text()).get("architectures") or []
    per_token = any(a.endswith("ForTokenClassification") for a in archs)
    return AutoModelForTokenClassification if per_token else AutoModelForSequenceClassification


def rm_placement(cuda_device: int | None) -> tuple[torch.device, torch.dtype]:
    """(device, dtype) of the reward models: GPU `cuda_device` (this process's, None without CUDA)
    in the compute dtype every engine uses there by default, or CPU in fp32."""
    from rlframe.workers.engines.base import precision_dtype

    on_gpu = cuda_device is not None
    device = torch.device("cuda", cuda_device) if on_gpu else torch.device("cpu")
    return device, precision_dtype("auto", on_gpu=on_gpu)


class RewardModelWorker(Worker):
    def __init__(self, *, model_paths: list[str], ensemble: str = "mean", micro_batch_size: int = 64,
                 policy_tokenizer_path: str | None = None):
        """`policy_tokenizer_path`: the directory of the policy's tokenizer (the actor's model path); None:
        the reward models are taken to share it (ids reused as they are)."""
        from transformers import AutoTokenizer

        if not model_paths:
            raise ValueError("RewardModelWorker needs at least one reward model path (reward.model_paths)")
        self.device, self.dtype = rm_placement(torch.cuda.current_device() if torch.cuda.is_available() else None)
        self.models, self.tokenizers, self.retokenize = [], [], []
        self.policy_tokenizer = AutoTokenizer.from_pretrained(policy_tokenizer_path) if policy_tokenizer_path else None
        for p in model_paths:
            model = _auto_class(p).from_pretrained(p, dtype=self.dtype).to(self.device).eval()
            tok = AutoTokenizer.from_pretrained(p)
            if getattr(model.config, "pad_token_id", None) is None and tok.pad_token_id is not None:
                model.config.pad_token_id = tok.pad_token_id  # the pooled head finds the last token by it
            self.models.append(model)
            self.tokenizers.append(tok)
            self.retokenize.append(self.policy_tokenizer is not None and not same_tokenizer(tok, self.policy_tokenizer))
        self.ensemble, self.micro_batch_size = ensemble, micro_batch_size

    @torch.no_grad()
    def _score(self, model, inputs: dict) -> torch.Tensor:
        out = []
        n = inputs["input_ids"].shape[0]
        for s in range(0, n, self.micro_batch_size):
            part = pack_right({k: v[s:s + self.micro_batch_size].to(self.device) for k, v in inputs.items()})
            logits = model(input_ids=part["input_ids"], attention_mask=part["attention_mask"],
                           position_ids=part["position_ids"]).logits
            out.append(sequence_scores(logits, part["attention_mask"]).cpu())
        return torch.cat(out)

    def _texts(self, data: DataProto, rm_tokenizer) -> list[str]:
        """Prompt + response as the reward model reads them: its chat template over the prompt's messages
        (`raw_prompt`) and the response decoded with the policy's tokenizer (special tokens dropped)."""
        b = data.batch
        prompt_len = b["prompts"].shape[1]
        dec = self.policy_tokenizer
        pmask = b["attention_mask"][:, :prompt_len].bool().tolist()
        prompts = dec.batch_decode([list(itertools.compress(r, m)) for r, m in zip(b["prompts"].tolist(), pmask)],
                                   skip_special_tokens=True)
        rmask = b["response_mask"].bool().tolist()
        responses = dec.batch_decode([list(itertools.compress(r, m)) for r, m in zip(b["responses"].tolist(), rmask)],
                                     skip_special_tokens=True)
        raw = data.non_tensor_batch.get("raw_prompt")
        return rm_texts(rm_tokenizer, None if raw is None else list(raw), prompts, responses)

    def rm_inputs(self, data: DataProto) -> list[dict]:
        """Each reward model's (B, T) input_ids, attention_mask and position_ids for `data`."""
        b = data.batch
        prompt_len = b["prompts"].shape[1]
        shared = build_rm_inputs(b["prompts"], b["attention_mask"][:, :prompt_len], b["responses"], b["response_mask"])
        out = []
        for model, tok, retok in zip(self.models, self.tokenizers, self.retokenize):
            if not retok:
                out.append(shared)
                continue
            texts = self._texts(data, tok)
            limit = getattr(model.config, "max_position_embeddings", None) or tok.model_max_length
            out.append(retokenize_for_rm(tok, texts, [""] * len(texts), max_length=int(min(limit, 1 << 20))))
        return out

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """`rm_scores` (B,): the ensembled reward-model score of each prompt+response; `rm_scores_per_model`
        (B, M): each model's own."""
        scores = torch.stack([self._score(m, x) for m, x in zip(self.models, self.rm_inputs(data))])
        return DataProto.from_dict(tensors={"rm_scores": ensemble_scores(scores, mode=self.ensemble),
                                            "rm_scores_per_model": scores.T.contiguous()})
