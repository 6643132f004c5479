"""Defects preflight was built to catch, each put back by a worker or engine subclass (never by a switch
in the product): test_defects.py runs a preflight row with one of them and requires the check that
names it to fail. A run imports this module (`imports=[tests.controller.preflight.defects]`), so the
engines register in the driver and every worker; the workers are chosen with `actor.worker_cls`.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext

import torch

from rlframe.plugins import register_train_engine
from rlframe.protocol import DataProto
from rlframe.single_controller import Dispatch, register
from rlframe.workers.actor import ActorWorker
from rlframe.workers.engines.fsdp.engine import FSDPTrainEngine
from rlframe.workers.engines.fsdp.spec import FSDP
from rlframe.workers.rollout.config import sampling_of

HERE = "tests.controller.preflight.defects"


class OldLogProbsAtTemperature1(ActorWorker):
    """The old log-probs are taken at temperature 1 whatever the rollout sampled at."""

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        out = self.engine.forward_log_probs(data, temperature=1.0, with_entropy=True)
        if out is None:
            return None
        return DataProto.from_dict(tensors={"old_log_probs": out["log_probs"], "entropy": out["entropy"]})


class SeedsByRowInChunk(ActorWorker):
    """Each generation replica seeds its rows by their place in its own chunk (seed + row * n), so row i
    of every replica draws with the same seed: the defect rollout/seeds.py fixed."""

    @register(dispatch=Dispatch.DP_COMPUTE, mesh="rollout")
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        sampling = sampling_of(prompts)
        rows = len(prompts)
        prompts.batch["seed"] = (sampling.seed or 0) + torch.arange(rows, dtype=torch.long) * sampling.n
        return super().generate_sequences(prompts)


class ContinuesPastEnd(ActorWorker):
    """A response that ended on an end-of-sequence id gets one more policy token after it (what a stop
    test that knows fewer end ids than the engine stops at lets through)."""

    @register(dispatch=Dispatch.DP_COMPUTE, mesh="rollout")
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        out = super().generate_sequences(prompts)
        b = out.batch
        resp, mask = b["responses"], b["response_mask"]
        width = resp.shape[1]
        lengths = mask.sum(-1).long()
        for i, n in enumerate(lengths.tolist()):
            if 0 < n < width:  # it stopped early: on an end id
                resp[i, n] = resp[i, n - 1]  # the end id again, as a policy token
                mask[i, n] = 1
                b["attention_mask"][i, -width + n] = 1
                b["input_ids"][i, -width + n] = resp[i, n]
                b["rollout_log_probs"][i, n] = b["rollout_log_probs"][i, n - 1]
        b["position_ids"] = (b["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        return out


class SyncSkipsATensor(ActorWorker):
    """A weight sync never sends the final norm's new values: the rollout keeps the first ones it got."""

    SKIPPED = "model.norm.weight"

    def _synced_shards(self) -> dict:
        shards = super()._synced_shards()
        if not hasattr(self, "_stale"):
            self._stale = shards[self.SKIPPED].clone()
        return {**shards, self.SKIPPED: self._stale}


class ReferenceAtTemperature1(FSDPTrainEngine):
    """The frozen reference's log-probs are taken at temperature 1; the actor's are right."""

    def forward_log_probs(self, batch, *, temperature: float = 1.0, **kwargs):
        return super().forward_log_probs(batch, temperature=1.0 if self.config.frozen else temperature, **kwargs)


class DropoutInForwardOnly(FSDPTrainEngine):
    """Forward-only passes (old log-probs, the reference's) run the modules in train mode: LoRA's dropout
    draws a mask in each, so they are random functions of the weights."""

    def forward_log_probs(self, batch, *, temperature: float = 1.0, with_entropy: bool = False,
                          micro_batch_size=None, max_tokens_per_micro_batch=None, disable_adapter: bool = False):
        with self.adapters_disabled() if disable_adapter else nullcontext():
            return self._forward_batch(batch, temperature=temperature, with_entropy=with_entropy,
                                       micro_batch_size=micro_batch_size, max_tokens=max_tokens_per_micro_batch)


for _name, _cls in (("fsdp_reference_at_t1", ReferenceAtTemperature1), ("fsdp_dropout_in_forward", DropoutInForwardOnly)):
    register_train_engine(dataclasses.replace(FSDP, name=_name, target=f"{HERE}:{_cls.__name__}",
                                              summary=f"the fsdp engine with a defect: {_cls.__doc__.split(':')[0]}"))
