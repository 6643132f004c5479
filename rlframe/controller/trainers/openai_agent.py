"""agent.mode=openai: the rollout is the user's environment driving the policy through the OpenAI-compatible
endpoint (rlframe/agents/openai_endpoint.py), one episode per sample.

    for each prompt row, n episodes (samples of a prompt adjacent):
        episode(client, row) with row = {"prompt": the row's chat messages, "ground_truth", "data_source",
                                         "extra_info", "index", "sample"}
        its requests -> batched generate calls; every turn recorded token for token (episodes.py)
    the batch: each episode's first prompt and everything after it in one response row (the model's turns
        response mask 1, the environment's 0, rollout log-probs of the sampled tokens), as the in-process
        agent loop builds it; `env_reward` (the episode's return) replaces the reward function

The endpoint lives as long as the trainer (one server, one token); each rollout fixes the sampling every
request must use (the trainer's log-probs assume rollout.temperature, top_p, top_k) and seeds each episode's
turns from (the call's seed, its sample, the turn), as the in-process loop does. An episode that failed
(raised, timed out, returned no number) is scored 0 and keeps whatever turns it recorded; one that recorded
none trains nothing (an empty response).
"""

from __future__ import annotations

import uuid
import numpy as np
import torch

from rlframe.agents.environment import Running, episode_metrics, load_environment, run_episodes
from rlframe.agents.openai_endpoint import EndpointLimits, OpenAIEndpoint
from rlframe.controller.trainers.phases import REWARD_EXTRA
from rlframe.protocol import DataProto
from rlframe.rewards.manager import RewardErrorsExceeded
from rlframe.workers.rollout import SamplingConfig
from rlframe.workers.rollout.batch import assemble_batch, left_pad

ENV_REWARD, ENV_FAILED = "env_reward", "env_failed"
MODEL_NAME = "policy"


class EpisodeErrorsExceeded(RewardErrorsExceeded):
    """More than reward.max_error_fraction of a rollout's episodes failed (the environment is the
    run's reward), or none recorded a token to train on: the run stops as for a failing reward
    function (exit code 1, one message: how many failed and how, the first failure, what to check)."""

    def __init__(self, message: str, *, failed: int, total: int, max_error_fraction: float | None, first: str):
        super().__init__(failed=failed, total=total, max_error_fraction=max_error_fraction, first_traceback=first,
                         message=message)


def check_episodes(results: list, *, trained_tokens: int, max_error_fraction: float | None) -> None:
    """EpisodeErrorsExceeded when more than `max_error_fraction` of the episodes failed (None: never),
    or when no episode left a model token to train on (whatever the fraction: a step with no response
    token cannot train)."""
    failed = [r for r in results if r.status != "ok"]
    n = len(results)
    too_many = bool(failed) and max_error_fraction is not None and len(failed) > max_error_fraction * n
    if not (too_many or (n and trained_tokens == 0)):
        return
    kinds = ", ".join(f"{k} {sum(r.status == k for r in failed)}" for k in ("error", "timeout", "bad_return")
                      if any(r.status == k for r in failed))
    first = " ".join(f"episode {failed[0].id} ({failed[0].status}): {failed[0].error}".split())[:600] \
        if failed else "none failed"
    why = (f"more than reward.max_error_fraction={max_error_fraction} allows, so the run stops instead of training "
           "on zeros" if too_many else "and no episode recorded a model turn, so this step has nothing to train on")
    raise EpisodeErrorsExceeded(
        f"the environment's episodes failed on {len(failed)} of {n} episodes of a batch ({kinds or 'no failure'}), "
        f"{why}. The first failure: {first}. Check agent.environment (the episode function), whether the "
        "endpoint refused its requests (the reason is in the failure: e.g. the prompt longer than data.prompt_length "
        "or sampling settings it does not take), agent.episode_timeout_s for timeouts; set "
        "reward.max_error_fraction=1.0 to train on the episodes that did not fail",
        failed=len(failed), total=n, max_error_fraction=max_error_fraction, first=first)


class OpenAIAgentLoop:
    def __init__(self, cfg, tokenizer):
        agent = cfg.agent
        self.tokenizer, self.response_length = tokenizer, cfg.data.response_length
        self.environment = load_environment(agent.environment)
        self.max_error_fraction = cfg.reward.max_error_fraction  # of the episodes (the run's reward)
        self.concurrency, self.timeout_s = agent.concurrency, agent.episode_timeout_s
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._generate = None
        self.turn_checks: list | None = None  # preflight's append-only check: a record only appends by construction
        self.endpoint = OpenAIEndpoint(self._call, tokenizer, model=MODEL_NAME, response_length=self.response_length,
                                       host=agent.endpoint_host,
                                       limits=EndpointLimits(request_timeout_s=agent.episode_timeout_s,
                                                             max_prompt_tokens=cfg.data.prompt_length,
                                                             # while some episode runs its tools the others
                                                             # wait for it, up to a 0.2 s lull; no tighter cap
                                                             # than 5 s while requests keep coming (a rollout's
                                                             # first turns arrive over ~0.5 s: one call, not two)
                                                             batch_window_s=0.2, batch_max_wait_s=5.0)).start()

    def _call(self, gen_in, sampling):
        return self._generate(gen_in, sampling)

    def close(self) -> None:
        self.endpoint.close()

    def run(self, prompts: DataProto, sampling: SamplingConfig, generate, *, replicas: int = 1) -> tuple[DataProto, dict]:
        """`replicas`: the generation replicas `generate` spreads a call over (an episode's requests go to one)."""
        nt, n = prompts.non_tensor_batch, sampling.n
        rows = [{"prompt": list(nt["raw_prompt"][i]), "ground_truth": nt["ground_truth"][i],
                 "data_source": nt["data_source"][i], "extra_info": nt["extra_info"][i],
                 "index": int(nt["index"][i]) if "index" in nt else i, "sample": j}
                for i in range(len(prompts)) for j in range(n)]
        prefix = uuid.uuid4().hex[:12]
        seed = sampling.seed if sampling.seed is not None else int(np.random.randint(0, 2**31 - 1))
        batcher = self.endpoint.batcher
        self._generate, batcher.replicas = generate, replicas
        self.endpoint.plan(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                           seeds={f"{prefix}-{k}": (seed, k) for k in range(len(rows))})
        calls_before, rows_before = batcher.calls, batcher.rows
        running = Running(on_finish=batcher.wake)  # a batch closes once every unfinished episode waits for a reply
        batcher.ready, batcher.max_batch = (lambda waiting: waiting >= running.count), max(1, len(rows))
        results = run_episodes(self.environment, rows, base_url=self.endpoint.base_url, token=self.endpoint.token,
                               concurrency=self.concurrency, timeout_s=self.timeout_s, prefix=prefix, running=running)
        episodes = self.endpoint.store.pop_all()
        batch = self._batch(prompts, [episodes.get(r.id) for r in results], results, n)
        check_episodes(results, trained_tokens=int(batch.batch["response_mask"].sum()),
                       max_error_fraction=self.max_error_fraction)
        metrics = episode_metrics(results)
        recorded = [episodes[r.id] for r in results if r.id in episodes]
        metrics.update({"agent/turns_mean": float(np.mean([e.turns for e in recorded])) if recorded else 0.0,
                        "agent/no_turns_frac": float(np.mean([r.id not in episodes or not episodes[r.id].turns
                                                              for r in results])),
                        "agent/env_tokens_mean": float(np.mean([len(e.mask) - sum(e.mask) for e in recorded]))
                        if recorded else 0.0,
                        "agent/generate_calls": float(batcher.calls - calls_before),
                        "agent/replica_moved_turns": float(batcher.affinity.moved),
                        "agent/requests": float(batcher.rows - rows_before)})
        return batch, metrics

    def _batch(self, prompts: DataProto, episodes: list, results: list, n: int) -> DataProto:
        ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
        width = ids.shape[1]
        firsts, responses, log_probs, masks = [], [], [], []
        for k, ep in enumerate(episodes):
            if ep is None or not ep.turns:  # nothing generated: the row's own prompt, an empty response
                firsts.append(ids[k // n][mask[k // n].bool()].tolist())
                responses.append([]), log_probs.append([]), masks.append([])
                continue
            firsts.append(ep.prompt)
            responses.append(ep.tokens), log_probs.append(ep.log_probs), masks.append(ep.mask)
        # an episode's prompt is its environment's first messages: each row keeps its own (samples may differ)
        pid, pmask = left_pad(firsts, pad_id=self.pad_id, width=width)
        tensors = assemble_batch(prompt_ids=pid, prompt_mask=pmask, responses=responses, log_probs=log_probs, n=1,
                                 response_length=self.response_length, pad_token_id=self.pad_id)
        policy = torch.zeros_like(tensors["response_mask"])
        for i, m in enumerate(masks):
            policy[i, :len(m)] = torch.as_tensor(m, dtype=policy.dtype)
        tensors["response_mask"] = policy  # attention_mask keeps the environment's turns: context, not trained
        tensors["agent_turns"] = torch.tensor([ep.turns if ep else 0 for ep in episodes], dtype=torch.long)
        tensors[ENV_REWARD] = torch.tensor([r.reward for r in results], dtype=torch.float32)
        tensors[ENV_FAILED] = torch.tensor([r.status != "ok" for r in results], dtype=torch.float32)
        for key in sorted({k for r in results for k in r.metrics}):  # reward/<key>/mean in the step's metrics
            tensors[REWARD_EXTRA + key] = torch.tensor([r.metrics.get(key, float("nan")) for r in results])
        out = prompts.select(batch_keys=[], non_tensor_keys=prompts.non_tensor_keys).repeat(n)
        return out.union(DataProto.from_dict(tensors=tensors))
