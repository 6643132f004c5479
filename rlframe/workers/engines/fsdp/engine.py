"""The torch-native training engine: FSDP2 over dp, DTensor tensor parallelism over tp, Ulysses
sequence parallelism over sp (fsdp/ulysses.py).

Dataflow of `train_step(loss_fn, micro_batches)`:
  plan micro-batches (same count on every dp rank) -> for each: pack valid tokens -> model forward
  -> vocab-parallel log-probs (or critic values) in fp32 -> loss_fn -> (loss * weight).backward()
  (FSDP2 reduce-scatters and averages gradients over dp) -> global grad norm -> skip the step if it
  is not finite, else clip -> AdamW step -> LR scheduler step.
Micro-batch weights make the accumulated gradient that of one big batch (see `accumulate`).

With lora_rank > 0 the model gets LoRA adapters before tensor parallelism and FSDP (engines/lora.py):
only the adapters (and a critic's value head) train, so the optimizer, the gradient norm and the
checkpoints cover only them; `forward_log_probs(..., disable_adapter=True)` is the base model.

Example (inside an initialised process group of 4 ranks):
    engine = FSDPTrainEngine(TrainEngineConfig(model_path=path, dp=2, tp=2, lr=1e-4))
    out = engine.forward_log_probs(batch)            # {"log_probs": (B, R)}
    metrics = engine.train_step(loss_fn, batch)      # {"loss": ..., "grad_norm": ..., "lr": ...}
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from rlframe.workers.engines import checkpoint as ckpt
from rlframe.workers.engines.accumulate import MetricSums, check_scalar_loss, empty_step, micro_batch_weights
from rlframe.workers.engines.base import (
    TrainEngine, TrainEngineConfig, check_trainable, compute_dtype, require_keys,
    resolve_mixed_precision,
)
from rlframe.workers.engines.forward import BatchedForward
from rlframe.workers.engines.micro_batch import restore_order
from rlframe.workers.engines.fsdp.modeling import (
    cpu_attention, empty_model, load_config, resolve_attn_implementation, run_model,
)
from rlframe.workers.engines.optim import (
    build_optimizer, build_scheduler, global_grad_norm, scale_grads_,
)
from rlframe.workers.engines.packing import pack_inputs, padded_inputs, response_slice
from rlframe.workers.engines.fsdp.parallelize import (
    apply_activation_checkpointing, apply_fsdp, apply_tensor_parallel, build_mesh, check_mesh, check_model_fits,
    decoder_layers, fsdp_mesh, reshard_all,
)
from rlframe.workers.engines.fsdp.sharded_load import load_shards
from rlframe.workers.engines.fsdp import shm_comm, ulysses
from rlframe.workers.engines.fsdp.shards import local_shards
from rlframe.workers.engines.fsdp.vocab_parallel import token_log_probs

_FORWARD_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")
# The HF output's logits are views; the engine never modifies them in place, which is the case
# this FSDP2 warning is about.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


class FSDPTrainEngine(BatchedForward, TrainEngine):
    """See the module docstring. `device_mesh` (dims ("dp", "tp"), or ("dp", "sp", "tp") with sp > 1)
    overrides the default mesh over all ranks, e.g. to run several independent engines in one
    process group."""

    strategy = "fsdp"  # its spec's name, written into layouts and checkpoints

    def __init__(self, config: TrainEngineConfig, *, device_mesh=None):
        if not dist.is_initialized():
            raise ValueError("FSDPTrainEngine needs an initialised torch.distributed process group")
        if config.pp != 1 or config.sequence_parallel:
            raise ValueError(f"the fsdp engine has no pipeline or sequence parallelism (pp={config.pp}, "
                             f"sequence_parallel={config.sequence_parallel}); use the megatron engine")
        self.config = config
        hf_config = load_config(config.model_path)
        check_model_fits(hf_config, tp=config.tp, sp=config.sp,
                         model_type_path=f"{hf_config.model_type} at {config.model_path}")
        on_gpu = dist.get_backend() == "nccl"
        if on_gpu and "LOCAL_RANK" in os.environ:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self.mesh = device_mesh if device_mesh is not None else build_mesh(
            dp=config.dp, sp=config.sp, tp=config.tp, device_type=self.device.type)
        check_mesh(self.mesh, dp=config.dp, sp=config.sp, tp=config.tp)
        self.dp_group = self.mesh.get_group("dp")  # ranks with different data
        self.tp_group = self.mesh.get_group("tp")
        self.sp_group = self.mesh.get_group("sp") if config.sp > 1 else None
        self.fsdp_mesh = fsdp_mesh(self.mesh, sp=config.sp)  # ranks the weights are sharded over
        self._flat_group = self.mesh._flatten("_".join(self.mesh.mesh_dim_names)).get_group()
        self.mixed_precision = resolve_mixed_precision(config.mixed_precision, on_gpu=on_gpu)
        self.compute_dtype = compute_dtype(self.mixed_precision)
        self.gather_once = not on_gpu if config.gather_once_per_step is None else config.gather_once_per_step
        self.model = self._build_model()
        self.optimizer = build_optimizer(self.model, config)
        self.scheduler = build_scheduler(self.optimizer, config)
        self.steps = 0

    def _build_model(self):
        """The model on the meta device, LoRA adapters, tensor parallelism and FSDP2 applied there,
        then storage for this rank's shards only, filled from the checkpoint (fsdp/sharded_load.py):
        no rank ever holds the whole model."""
        cfg = self.config
        model = self._model_on_meta()
        if cfg.tp > 1:
            apply_tensor_parallel(model, self.mesh["tp"], head=cfg.head)
        if cfg.activation_checkpointing:
            apply_activation_checkpointing(model)
        apply_fsdp(model, self.fsdp_mesh, mixed_precision=self.mixed_precision,
                   reshard_after_forward=not self.gather_once)
        load_shards(model, model_path=cfg.model_path, device=self.device, seed=cfg.seed)
        self.shm_collectives = (self.device.type == "cpu" and cfg.shm_collectives is not False
                                and shm_comm.install(model, self.fsdp_mesh.get_group()))
        self.pad_token_id = int(model.config.pad_token_id or 0)
        self.vocab_size = int(model.config.vocab_size)
        return model

    def _model_on_meta(self):
        """The whole model on the meta device with its attention implementation, LoRA adapters injected
        (self.lora), before any parallelism is applied."""
        cfg = self.config
        attn = resolve_attn_implementation(cfg.attn_implementation, on_gpu=self.device.type == "cuda")
        if self.device.type == "cpu":
            attn = cpu_attention(attn, compute_dtype=self.compute_dtype)
        if cfg.sp > 1:
            attn = ulysses.attention_implementation(attn)
        model = empty_model(cfg.model_path, head=cfg.head, attn_implementation=attn)
        decoder_layers(model)  # fails early on an unsupported architecture
        self.lora = cfg.lora
        if self.lora is not None:
            from rlframe.workers.engines.lora import inject_lora
            from rlframe.workers.engines.value_head import VALUE_HEAD

            inject_lora(model, self.lora, seed=cfg.seed,
                        trainable_prefixes=tuple(VALUE_HEAD) if cfg.head == "value" else ())
        return model

    # ---- forward -------------------------------------------------------------------------
    def _model_inputs(self, data: dict[str, torch.Tensor]):
        require_keys(data, _FORWARD_KEYS, what="the engine's forward")
        args = (data["input_ids"], data["attention_mask"], data["position_ids"])
        if self.config.remove_padding:
            return pack_inputs(*args, pad_token_id=self.pad_token_id)
        return padded_inputs(*args)

    def _forward(self, data: dict[str, torch.Tensor], *, temperature: float, with_entropy: bool):
        """Per-response-token outputs of one micro-batch: log_probs[/entropy] or values, (b, R).
        Under Ulysses the model runs on this rank's columns and the per-token results are gathered
        into whole rows (ulysses.py)."""
        inputs = self._model_inputs(data)
        if self.sp_group is None:
            local, split, out = inputs, None, run_model(self.model, inputs)
        else:
            local, split = ulysses.split_inputs(inputs, group=self.sp_group, pad_token_id=self.pad_token_id)
            with ulysses.rank_rng(split):
                out = run_model(self.model, local)
        resp_len = data["responses"].shape[1]
        stats = {"tokens_valid": inputs.tokens_valid, "tokens_computed": inputs.tokens_computed,
                 "tokens_padded": data["input_ids"].numel()}

        def whole(per_token):  # (rows, C) -> (B, R)
            per_token = per_token if split is None else ulysses.gather_columns(per_token, split)
            return response_slice(inputs.unpack(per_token), resp_len)

        if self.config.head == "value":
            return {"values": whole(out.logits.squeeze(-1).float())}, stats  # (rows, C)
        per_token = token_log_probs(  # out.logits: (rows, C, V / tp), this rank's vocab slice
            out.logits, local.labels, temperature=temperature, tp_rank=self.mesh.get_local_rank("tp"),
            group=self.tp_group if self.config.tp > 1 else None, with_entropy=with_entropy)
        return {k: whole(v) for k, v in per_token.items()}, stats

    @torch.no_grad()
    def _forward_batch(self, batch, *, temperature: float, with_entropy: bool, micro_batch_size=None,
                       max_tokens=None) -> dict[str, torch.Tensor]:
        mbs = self._plan(batch, micro_batch_size=micro_batch_size, max_tokens=max_tokens)
        per_mb = [self._forward(mb.data, temperature=temperature, with_entropy=with_entropy)[0] for mb in mbs]
        # Without a backward, FSDP2 leaves the root's (and, gathering once, every layer's) parameters
        # unsharded after forward.
        reshard_all(self.model)
        ulysses.release()
        return {k: restore_order([o[k] for o in per_mb], mbs).float().cpu() for k in per_mb[0]}

    # ---- training ------------------------------------------------------------------------
    def train_step(self, loss_fn, micro_batches, *, temperature: float = 1.0,
                   loss_weighting: str = "tokens", with_entropy: bool = False,
                   allow_empty: bool = False) -> dict[str, float]:
        check_trainable(self.config)
        mbs = self._plan(micro_batches)
        weights = micro_batch_weights(mbs, loss_weighting, dp=self.config.dp, dp_group=self.dp_group,
                                      device=self.device, allow_empty=allow_empty)
        if weights is None:
            return empty_step(self.lr)
        self.optimizer.zero_grad(set_to_none=True)
        sums = MetricSums()
        for i, (mb, w) in enumerate(zip(mbs, weights)):
            if self.gather_once:  # keep parameters and unsharded gradients until the last micro-batch
                last = i == len(mbs) - 1
                self.model.set_requires_gradient_sync(last)
                self.model.set_reshard_after_backward(last)
            outputs, stats = self._forward(mb.data, temperature=temperature, with_entropy=with_entropy)
            loss, metrics = loss_fn(outputs, mb.data)
            check_scalar_loss(loss)
            (loss * w).backward()
            ulysses.release()  # the backward (and its recompute) is done with the micro-batch's split
            sums.add(loss, metrics, w, stats, mb.weight_scale)
        result = sums.reduce(dp=self.config.dp, dp_group=self.dp_group, device=self.device)
        result.update(self._optimizer_step())
        return result

    def _optimizer_step(self) -> dict[str, float]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = global_grad_norm(params, groups=(self.fsdp_mesh.get_group(), self.tp_group),
                                num_ranks=self.config.dp * self.config.sp * self.config.tp, device=self.device)
        lr = self.lr
        if not torch.isfinite(norm):
            # Skip-and-report: a NaN/Inf gradient would poison the AdamW moments for good.
            self.optimizer.zero_grad(set_to_none=True)
            return {"grad_norm": float(norm), "lr": lr, "skipped": 1.0}
        if self.config.grad_clip is not None and float(norm) > self.config.grad_clip:
            scale_grads_(params, self.config.grad_clip / (float(norm) + 1e-6))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {"grad_norm": float(norm), "lr": lr, "skipped": 0.0}

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def adapters_disabled(self):
        """Forwards inside compute the base model (the reference policy of a LoRA actor)."""
        if self.lora is None:
            return super().adapters_disabled()
        from rlframe.workers.engines.lora import adapters_disabled

        return adapters_disabled(self.model)

    # ---- layout, checkpoints, export -------------------------------------------------------
    def local_shards(self):
        """The model's own (HF, base) parameters; LoRA adapters are in `lora_local_shards`."""
        from rlframe.workers.engines.lora import is_adapter_name

        reshard_all(self.model)  # report the sharded (training) layout, never a transient all-gather
        return {k: v for k, v in local_shards(self.model).items() if not is_adapter_name(k)}

    def lora_local_shards(self):
        """Adapter name (`model.layers.0.self_attn.q_proj.lora_A.weight`) -> (global shape, Box held
        here, local tensor without copy), for syncing only the adapters."""
        from rlframe.workers.engines.lora import is_adapter_name

        if self.lora is None:
            raise ValueError("lora_local_shards on an engine without LoRA (lora_rank=0); use local_shards")
        reshard_all(self.model)
        return {k: v for k, v in local_shards(self.model).items() if is_adapter_name(k)}

    def lora_param_metas(self) -> dict:
        """Adapter name -> ParamMeta(global shape, dtype), the same on all ranks (for the planner)."""
        from rlframe.resharding.planner import ParamMeta

        return {name: ParamMeta(tuple(shape), t.dtype) for name, (shape, _, t) in self.lora_local_shards().items()}

    def layout(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "backend": self.strategy, "dim_names": tuple(self.mesh.mesh_dim_names), "dp": cfg.dp, "tp": cfg.tp, "sp": cfg.sp,
            "dp_rank": self.mesh.get_local_rank("dp"), "tp_rank": self.mesh.get_local_rank("tp"),
            "sp_rank": self.mesh.get_local_rank("sp") if cfg.sp > 1 else 0,
            "rank": dist.get_rank(), "mesh": self.mesh.mesh.tolist(),
        }

    def resharding_layout(self):
        """This engine's layout as the resharding planner's `Layout` (tp fastest, FSDP dim-0 shards);
        the sp ranks of a replica hold the weights as dp ranks do (FSDP shards over dp x sp)."""
        from rlframe.resharding.layout import Layout

        return Layout(tp=self.config.tp, dp=self.config.dp * self.config.sp, fsdp=True,
                      ranks=tuple(int(r) for r in self.mesh.mesh.flatten().tolist()))

    @property
    def is_first_rank(self) -> bool:
        """Rank (0, ..., 0) of the engine's mesh: the one that writes single-writer files."""
        return not any(self.mesh.get_coordinate())

    def layout_meta(self) -> dict[str, Any]:
        return {"backend": self.strategy, "head": self.config.head, "dp": self.config.dp, "tp": self.config.tp,
                "model_path": self.config.model_path,
                "lora": None if self.lora is None else self.lora.to_meta()}

    def _barrier(self) -> None:
        # An all-reduce over the flattened mesh reaches every rank of it (and no other rank).
        dist.all_reduce(torch.zeros(1, device=self.device), group=self._flat_group)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return ckpt.gather_full_state(self.model)

    def save_checkpoint(self, path: str) -> None:
        ckpt.save_checkpoint(self, path, barrier=self._barrier, process_group=self._flat_group)

    def load_checkpoint(self, path: str) -> None:
        ckpt.load_checkpoint(self, path, process_group=self._flat_group)

    def export_hf(self, path: str) -> None:
        """A full HF model at `path`; with LoRA the adapters merged into it, and PEFT's adapter
        directory (adapter_model.safetensors + adapter_config.json) at `path`/adapter."""
        full = ckpt.gather_full_state(self.model, keep=self.is_first_rank)  # the writer's alone
        if self.lora is None:
            ckpt.export_hf(self, path, full=full, hf_config=self.model.config, barrier=self._barrier)
            return
        from rlframe.workers.engines.lora import merge_state_dict, write_peft_adapter

        def write_adapter(out_dir):
            write_peft_adapter(os.path.join(out_dir, ckpt.ADAPTER_DIR), full, self.lora,
                               base_model_path=self.config.model_path, head=self.config.head)

        ckpt.export_hf(self, path, full=merge_state_dict(full, self.lora), hf_config=self.model.config,
                       barrier=self._barrier, write_extra=write_adapter)

    def engine_state(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "steps": self.steps}

    def load_engine_state(self, state: dict[str, Any]) -> None:
        """The schedule's position and the step count come from the checkpoint; the optimizer's
        hyper-parameters (lr, weight decay, betas, eps) and the schedule's shape from this engine's
        config, as the megatron engine does: a learning rate changed for a resumed run applies from
        its next step (the loaded optimizer state and LambdaLR's saved base LRs hold the old ones)."""
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps = int(state["steps"])
        self._apply_config_hyperparameters()

    def _apply_config_hyperparameters(self) -> None:
        cfg, sched = self.config, self.scheduler
        sched.base_lrs = [float(cfg.lr)] * len(self.optimizer.param_groups)
        lrs = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            decays = any(p.dim() >= 2 for p in group["params"])  # as build_optimizer groups them
            group.update(lr=lr, initial_lr=float(cfg.lr), weight_decay=cfg.weight_decay if decays else 0.0,
                         betas=tuple(cfg.betas), eps=cfg.eps)
        sched._last_lr = lrs
