"""A rollout backend in one file: a plain-torch sampler, every sample drawing from its own generator.

The transformers backend (`rollout.backend=hf`) draws from torch's global RNG, so when the driver
sends per-row seeds (it always does: rollout/seeds.py) it generates each prompt row alone to keep a
sample independent of the rows that share its call: one `generate` per row. This backend decodes
the whole chunk at once, with a KV cache, and gives each sample its own `torch.Generator` seeded with
`seed + j` (the seed of its row, sample j): the batch is one forward per token, while which tokens a
sample draws depends only on its seed and its own logits. The sampling is written out here (temperature,
top-k, nucleus, stop ids and strings, greedy), so it is also a readable reference to check another
backend's sampling against.

Log-probs follow `rollout.logprobs_mode` like the other backends: "processed" is log_softmax of
the distribution a token was drawn from (logits / temperature, top-k and top-p applied; the raw
logits when greedy), "raw" log_softmax of the unprocessed logits. A sample ends after EOS, a stop id
or the token that completes a stop string (included); later tokens are cut off by the response mask.
Weight syncs (full and LoRA) and the weights' digests are the transformers backend's: the model is
the same whole module on each rank.

Run it (one config line; the module is imported in the driver and every worker process):

    python -m rlframe.main imports=[examples.plugins.torch_sampler] rollout.backend=torch_sampler
"""

from __future__ import annotations

import time

import torch

from rlframe.plugins import BackendSpec, register_rollout_backend
from rlframe.workers.rollout import vllm_spec
from rlframe.workers.rollout.batch import assemble_batch, read_prompts, read_row_seeds, to_data_proto
from rlframe.workers.rollout.config import SamplingConfig
from rlframe.workers.rollout.hf_engine import HFRolloutEngine


def filtered_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """(B, V) fp32 logits -> those a token is drawn from: / temperature, then top-k, then top-p (the
    smallest set of most likely tokens whose probability reaches top_p; the most likely is always kept),
    the rest -inf."""
    logits = logits / sampling.temperature
    if sampling.top_k != -1 and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(-1) - probs  # mass of the more likely tokens
        drop_sorted = before >= sampling.top_p
        drop_sorted[:, 0] = False
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return logits


class TorchSamplerEngine(HFRolloutEngine):
    """See the module docstring; construction, weight sync and LoRA are HFRolloutEngine's."""

    backend = "torch_sampler"

    @torch.no_grad()
    def generate(self, prompts, sampling: SamplingConfig):
        ids, mask = read_prompts(prompts)
        n = sampling.n
        seeds = read_row_seeds(prompts, sampling)
        if seeds is None:  # unseeded: draw the call's base seed from torch's RNG
            base = int(torch.randint(0, 2**31 - 1 - ids.shape[0] * n, ()))
            seeds = [base + b * n for b in range(ids.shape[0])]
        generators = None if sampling.greedy else [
            torch.Generator().manual_seed(int(s) + j) for s in seeds for j in range(n)]
        t0 = time.perf_counter()
        responses, log_probs = self._decode(ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0), sampling,
                                            generators)
        gen_s = time.perf_counter() - t0
        tensors = assemble_batch(prompt_ids=ids, prompt_mask=mask, responses=responses, log_probs=log_probs,
                                 n=n, response_length=sampling.max_new_tokens, pad_token_id=self.pad_token_id)
        return to_data_proto(tensors, meta_info={"rollout_backend": self.backend, "gen_time_s": gen_s,
                                                 "gen_tokens": int(tensors["response_mask"].sum()),
                                                 "lora_version": self.lora_version})

    def _decode(self, ids: torch.Tensor, mask: torch.Tensor, sampling: SamplingConfig, generators
                ) -> tuple[list[list[int]], list[list[float]]]:
        """Each row's tokens up to its stop and each token's log-prob; one forward per new token over
        the rows that have not stopped yet."""
        device = next(self.model.parameters()).device
        stop_ids = set(self._stop_ids(sampling))
        rows = ids.shape[0]
        tokens = torch.zeros(rows, sampling.max_new_tokens, dtype=torch.long)
        token_lp = torch.zeros(rows, sampling.max_new_tokens)
        done = torch.zeros(rows, dtype=torch.bool)
        mask = mask.to(device)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids.to(device), attention_mask=mask, position_ids=positions, use_cache=True)
        steps = 0
        for t in range(sampling.max_new_tokens):
            raw = out.logits[:, -1].float().cpu()
            if sampling.greedy:
                drawn_from = raw
                nxt = raw.argmax(-1)
            else:
                drawn_from = filtered_logits(raw, sampling)
                probs = torch.softmax(drawn_from, dim=-1)
                nxt = torch.stack([torch.multinomial(probs[r], 1, generator=generators[r])[0] for r in range(rows)])
            scored = drawn_from if self.config.logprobs_mode == "processed" else raw
            tokens[:, t] = nxt
            token_lp[:, t] = torch.log_softmax(scored, dim=-1).gather(-1, nxt[:, None])[:, 0]
            done |= torch.tensor([int(x) in stop_ids for x in nxt.tolist()], dtype=torch.bool)
            steps = t + 1
            if bool(done.all()) or steps == sampling.max_new_tokens:
                break
            mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
            positions = positions[:, -1:] + 1
            out = self.model(input_ids=nxt[:, None].to(device), attention_mask=mask, position_ids=positions,
                             past_key_values=out.past_key_values, use_cache=True)
        responses, log_probs = [], []
        for row, row_lp in zip(tokens[:, :steps].tolist(), token_lp[:, :steps].tolist()):
            k = self._response_length(row, stop_ids, sampling.stop)
            responses.append(row[:k])
            log_probs.append(row_lp[:k])
        return responses, log_probs


TORCH_SAMPLER = register_rollout_backend(BackendSpec(
    name="torch_sampler", target="examples.plugins.torch_sampler:TorchSamplerEngine",
    summary="a plain-torch batched sampler with a generator per sample (one whole model per process)",
    weight_plan=vllm_spec.weight_plan))
