"""A training engine in one file: plain data parallelism, every rank holding the whole model.

For models that fit on one device, replicated weights are the cheapest layout there is: a forward-only
pass (old log-probs, the reference's log-probs, a critic's values) runs with no collective at all,
and a training step costs one all-reduce of the gradients (in one flat buffer) instead of FSDP's
all-gather of every layer's weights in the forward and the backward and a reduce-scatter of its
gradients. The price is memory: weights, gradients and AdamW's two moments are whole on every rank,
which the spec's memory model (`weights_sharded_over_dp=False`) tells the memory estimate and the
planner, so they refuse or rank it accordingly. Everything else (packing, vocab-parallel log-probs in
fp32, micro-batch weights, loss weighting, the skip of a non-finite step, clipping, LoRA adapters,
DCP checkpoints, HF export) is the torch-native engine's, which this one extends: only where the
weights live and how the gradients meet differ.

The weight sync reads `local_shards` (whole tensors) through `resharding_layout` (dp replicas, no
FSDP split): the planner sends each rollout rank its slice from one replica. Checkpoints are DCP's,
so a checkpoint of this engine loads into the fsdp engine and back (DCP reshards on load), and
`rlframe export` reads it with the fsdp reader.

Run it (one config line; the module is imported in the driver and every worker process):

    python -m rlframe.main imports=[examples.plugins.ddp_engine] actor.strategy=ddp critic.strategy=ddp
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlframe.plugins import EngineSpec, register_train_engine
from rlframe.workers.engines.fsdp import spec as fsdp_spec
from rlframe.workers.engines.fsdp.engine import FSDPTrainEngine
from rlframe.workers.engines.fsdp.parallelize import apply_activation_checkpointing
from rlframe.workers.engines.fsdp.sharded_load import load_shards


class DDPTrainEngine(FSDPTrainEngine):
    """The whole model on every rank; gradients averaged over dp once per optimizer step."""

    strategy = "ddp"

    def __init__(self, config, *, device_mesh=None):
        if config.tp != 1 or config.sp != 1:
            raise ValueError(f"the ddp engine replicates the whole model on each rank: tp ({config.tp}) and sp "
                             f"({config.sp}) must be 1; use strategy=fsdp to split the model")
        super().__init__(config, device_mesh=device_mesh)

    def _build_model(self):
        """The model on the meta device (LoRA adapters injected there), then every parameter allocated
        whole on this rank and filled from the checkpoint, as the fsdp engine's load fills its shards."""
        cfg = self.config
        model = self._model_on_meta()
        if cfg.activation_checkpointing:
            apply_activation_checkpointing(model)
        load_shards(model, model_path=cfg.model_path, device=self.device, seed=cfg.seed)
        self.gather_once = False  # nothing is gathered: the weights are whole
        self.shm_collectives = False
        self.pad_token_id = int(model.config.pad_token_id or 0)
        self.vocab_size = int(model.config.vocab_size)
        return model

    def _forward(self, data, *, temperature: float, with_entropy: bool):
        """Under mixed precision the forward and backward run in bf16 autocast over fp32 weights (what
        FSDP's MixedPrecisionPolicy does with its gathered copies); log-probs are fp32 either way."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.mixed_precision):
            return super()._forward(data, temperature=temperature, with_entropy=with_entropy)

    def _optimizer_step(self) -> dict[str, float]:
        """Average the gradients over dp (one all-reduce of a flat buffer), then the fsdp engine's step:
        the global norm (each rank holds all of it), the skip of a non-finite step, clipping, AdamW."""
        grads = [p.grad for p in self.model.parameters() if p.requires_grad and p.grad is not None]
        if self.config.dp > 1 and grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.dp_group)
            flat /= self.config.dp
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        return super()._optimizer_step()

    def resharding_layout(self):
        """dp replicas of the whole model, no FSDP split: any replica can send any slice."""
        from rlframe.resharding.layout import Layout

        return Layout(tp=1, dp=self.config.dp, fsdp=False,
                      ranks=tuple(int(r) for r in self.mesh.mesh.flatten().tolist()))


DDP = register_train_engine(EngineSpec(
    name="ddp", target="examples.plugins.ddp_engine:DDPTrainEngine",
    summary="plain data parallelism: the whole model on every rank, one gradient all-reduce a step",
    parallelisms={"dp"}, lora_targets=fsdp_spec.LORA_TARGETS,
    weights_sharded_over_dp=False, fp32_params=True, gathers_layers=False, activations="transformers",
    check_model=fsdp_spec.check_model, read_checkpoint=fsdp_spec.read_checkpoint))
