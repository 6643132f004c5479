"""The megatron-core training engine: tensor, pipeline and data parallelism (+ sequence parallelism),
megatron-core's DDP with the distributed optimizer, behind the same interface as the fsdp engine.

Dataflow of `train_step(loss_fn, micro_batches)`:
  plan micro-batches (same count on every dp rank; pipeline peers get the same data) -> megatron's
  pipeline schedule (1F1B for pp > 1, plain accumulation for pp = 1) runs, per micro-batch, the
  model forward on its rows left-aligned and cut to its longest sample (`inputs`; shapes may differ
  between micro-batches: variable_seq_lengths) with an explicit causal + padding mask -> on the last
  stage vocab-parallel log-probs (or critic values) in fp32 -> loss_fn -> loss * weight (see `accumulate`)
  -> backward through the pipeline -> DDP reduce-scatters gradients over dp -> global grad norm (all
  model-parallel ranks) -> skip the step if it is not finite, else clip -> Adam step on the fp32 main
  shards -> all-gather updated bf16 parameters -> LR for the next step.
Forward-only passes (log-probs, values) use the same schedule with `forward_only=True`; their
per-token outputs exist on the last pipeline stage, which is the rank the dispatcher collects from.

Runs on GPUs (NCCL) and on CPU (gloo): without CUDA, `cpu_compat` redirects megatron-core's
CUDA-only calls (every call into megatron-core goes through `_megatron`). Needs a process group over
exactly dp * tp * pp ranks in Megatron's order (tp fastest, then dp, then pp).
"""

from __future__ import annotations

import functools
import math
import os
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from rlframe.resharding.layout import Layout
from rlframe.workers.engines.accumulate import MetricSums, check_scalar_loss, empty_step, micro_batch_weights
from rlframe.workers.engines.base import (
    TrainEngine, TrainEngineConfig, check_trainable, compute_dtype, resolve_mixed_precision,
)
from rlframe.workers.engines.forward import BatchedForward
from rlframe.workers.engines.megatron import checkpoint as mckpt
from rlframe.workers.engines.megatron import cpu_compat
from rlframe.workers.engines.megatron.inputs import MegatronInputs, megatron_inputs
from rlframe.workers.engines.megatron.model import (
    build_model, check_hf_config, init_model_parallel, transformer_config,
)
from rlframe.workers.engines.megatron.weights import hf_param_metas, hf_shards, load_hf_weights
from rlframe.workers.engines.micro_batch import MicroBatch, restore_order
from rlframe.workers.engines.fsdp.modeling import load_config
from rlframe.workers.engines.optim import lr_lambda
from rlframe.workers.engines.packing import response_slice
from rlframe.workers.engines.fsdp.vocab_parallel import token_log_probs


def _megatron(method):
    """Run an engine method with megatron-core's CUDA-only calls redirected (on CPU; see cpu_compat)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with cpu_compat.redirect():
            return method(self, *args, **kwargs)

    return wrapper


class MegatronTrainEngine(BatchedForward, TrainEngine):
    """See the module docstring."""

    def __init__(self, config: TrainEngineConfig):
        if not dist.is_initialized():
            raise ValueError("MegatronTrainEngine needs an initialised torch.distributed process group")
        if config.lora_rank:
            raise ValueError(f"lora_rank={config.lora_rank}: LoRA is not supported by the megatron engine; use "
                             "strategy=fsdp (or lora_rank=0 to train the whole model)")
        if config.sp != 1:
            raise ValueError(f"sp={config.sp}: Ulysses sequence parallelism is built into the fsdp engine; megatron's "
                             "context parallelism needs TransformerEngine's attention (CUDA); use strategy=fsdp")
        world = dist.get_world_size()
        if config.dp * config.tp * config.pp != world:
            raise ValueError(f"dp({config.dp}) * tp({config.tp}) * pp({config.pp}) != the {world} ranks of the "
                             "process group; megatron-core lays its parallel groups over all of them")
        self.config = config
        self.on_gpu = not cpu_compat.needed()
        if self.on_gpu:
            if "LOCAL_RANK" in os.environ:
                torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self.hf_config = load_config(config.model_path)
        self.dims = check_hf_config(self.hf_config, tp=config.tp, pp=config.pp, where=config.model_path)
        init_model_parallel(tp=config.tp, pp=config.pp, seed=config.seed)  # applies cpu_compat without CUDA
        self.rank = dist.get_rank()
        self.layout_ = Layout(tp=config.tp, dp=config.dp, pp=config.pp)
        self._check_coords()
        mixed = resolve_mixed_precision(config.mixed_precision, on_gpu=self.on_gpu)
        self.params_dtype = self.compute_dtype = compute_dtype(mixed)
        with cpu_compat.redirect():
            self.model, self.optimizer = self._build()
        self.pad_token_id = int(self.hf_config.pad_token_id or 0)
        self.steps = 0
        if self.optimizer is not None:
            self._set_lr()

    @property
    def module(self):
        """The GPTModel (inside DDP when the engine trains)."""
        return self.model if self.config.frozen else self.model.module

    # ---- construction ----------------------------------------------------------------------
    def _check_coords(self) -> None:
        from megatron.core import parallel_state as ps

        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.is_last_stage = ps.is_pipeline_last_stage()
        mine = (ps.get_pipeline_model_parallel_rank(), self.tp_rank, ps.get_data_parallel_rank())
        if mine != self.layout_.coords_of(self.rank):
            raise AssertionError(f"rank {self.rank}: megatron-core's (pp, tp, dp) {mine} != the layout's "
                                 f"{self.layout_.coords_of(self.rank)}")

    def _build(self):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg = self.config
        tcfg = transformer_config(self.hf_config, tp=cfg.tp, pp=cfg.pp, sequence_parallel=cfg.sequence_parallel,
                                  params_dtype=self.params_dtype, cpu_init=not self.on_gpu,
                                  activation_checkpointing=cfg.activation_checkpointing)
        model = build_model(self.hf_config, head=cfg.head, config=tcfg, pre_process=ps.is_pipeline_first_stage(),
                            post_process=self.is_last_stage, device=self.device)
        load_hf_weights(model, model_path=cfg.model_path, dims=self.dims, head=cfg.head, layout=self.layout_,
                        rank=self.rank, seed=cfg.seed)
        if cfg.frozen:  # forward only: no gradient buffers, no optimizer state
            model.requires_grad_(False)
            return model, None
        ddp = DistributedDataParallel(tcfg, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_grad_reduce=False), model)
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.betas[0],
            adam_beta2=cfg.betas[1], adam_eps=cfg.eps, bf16=self.params_dtype == torch.bfloat16,
            params_dtype=self.params_dtype, use_distributed_optimizer=True,
            clip_grad=0.0,  # clipped in _optimizer_step, after the finite check
        ), [ddp])
        tcfg.finalize_model_grads_func = finalize_model_grads
        tcfg.grad_scale_func = optimizer.scale_loss
        tcfg.no_sync_func = ddp.no_sync
        return ddp, optimizer

    # ---- schedule --------------------------------------------------------------------------
    def _run_schedule(self, mbs: list[MicroBatch], on_output, *, forward_only: bool):
        """megatron's schedule over `mbs`; `on_output(mb, inputs, output)` -> (loss, dict) on the last stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        multiple = self.config.tp if self.config.sequence_parallel else 1
        prepared = [(mb, megatron_inputs(mb.data, pad_token_id=self.pad_token_id, multiple_of=multiple))
                    for mb in mbs]

        def forward_step(data_iterator, model):
            mb, x = next(data_iterator)
            out = model(x.input_ids, x.position_ids, attention_mask=x.mask)
            return out, partial(on_output, mb, x)

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(prepared), model=[self.model],
            num_microbatches=len(prepared), seq_length=max(x.input_ids.shape[1] for _, x in prepared),
            micro_batch_size=max(x.input_ids.shape[0] for _, x in prepared), forward_only=forward_only,
        )

    def _outputs(self, output: torch.Tensor, x: MegatronInputs, *, resp_len: int, temperature: float,
                 with_entropy: bool) -> dict[str, torch.Tensor]:
        """Per-response-token outputs of one micro-batch from the last stage's (b, s, V/tp | 1) output."""
        if self.config.head == "value":
            return {"values": response_slice(x.to_batch(output[:, :, 0].float()), resp_len)}
        per_token = token_log_probs(output, x.labels, temperature=temperature, tp_rank=self.tp_rank,
                                    group=self.tp_group if self.config.tp > 1 else None, with_entropy=with_entropy)
        return {k: response_slice(x.to_batch(v), resp_len) for k, v in per_token.items()}

    # ---- forward ---------------------------------------------------------------------------
    @torch.no_grad()
    @_megatron
    def _forward_batch(self, batch, *, temperature: float, with_entropy: bool, micro_batch_size=None,
                       max_tokens=None):
        mbs = self._plan(batch, micro_batch_size=micro_batch_size, max_tokens=max_tokens)
        per_mb: dict[int, dict[str, torch.Tensor]] = {}

        def collect(mb, x, output):
            per_mb[id(mb)] = self._outputs(output, x, resp_len=mb.data["responses"].shape[1],
                                           temperature=temperature, with_entropy=with_entropy)
            return output.new_zeros(()), {}

        self.model.eval()
        try:
            self._run_schedule(mbs, collect, forward_only=True)
        finally:
            self.model.train()
        if not self.is_last_stage:
            return None  # the dispatcher collects from the last pipeline stage
        outs = [per_mb[id(mb)] for mb in mbs]
        return {k: restore_order([o[k] for o in outs], mbs).float().cpu() for k in outs[0]}

    # ---- training --------------------------------------------------------------------------
    @_megatron
    def train_step(self, loss_fn, micro_batches, *, temperature: float = 1.0,
                   loss_weighting: str = "tokens", with_entropy: bool = False,
                   allow_empty: bool = False) -> dict[str, float]:
        check_trainable(self.config)
        mbs = self._plan(micro_batches)
        per_mb = micro_batch_weights(mbs, loss_weighting, dp=self.config.dp, dp_group=self.dp_group,
                                     device=self.device, allow_empty=allow_empty)
        if per_mb is None:  # the same on every rank: tp and pp peers hold the dp rank's rows
            return empty_step(self.lr)
        weights = {id(mb): w for mb, w in zip(mbs, per_mb)}
        sums = MetricSums()

        def loss_on_output(mb, x, output):
            outputs = self._outputs(output, x, resp_len=mb.data["responses"].shape[1], temperature=temperature,
                                    with_entropy=with_entropy)
            loss, metrics = loss_fn(outputs, mb.data)
            check_scalar_loss(loss)
            w = weights[id(mb)]
            sums.add(loss, metrics, w, x.stats, mb.weight_scale)
            # megatron's schedule divides each micro-batch's loss by their number; undo that
            return loss * (w * len(mbs)), {}

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._run_schedule(mbs, loss_on_output, forward_only=False)
        result = sums.reduce(dp=self.config.dp, dp_group=self.dp_group, device=self.device)
        result.update(self._optimizer_step())
        return result

    def _optimizer_step(self) -> dict[str, float]:
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        lr = self.lr
        found_inf = self.optimizer.prepare_grads()
        norm = float(self.optimizer.get_grad_norm())
        if found_inf or not math.isfinite(norm):
            # Skip-and-report: a NaN/Inf gradient would poison the Adam moments for good.
            self.optimizer.zero_grad()
            return {"grad_norm": norm, "lr": lr, "skipped": 1.0}
        clip = self.config.grad_clip
        if clip is not None and norm > clip:
            for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                params = opt.get_parameters()
                if params:
                    clip_grad_by_total_norm_fp32(params, clip, norm)
        self.optimizer.step_with_ready_grads()
        self.steps += 1
        self._set_lr()
        return {"grad_norm": norm, "lr": lr, "skipped": 0.0}

    def _set_lr(self) -> None:
        cfg = self.config
        lr = cfg.lr * lr_lambda(self.steps, schedule=cfg.lr_schedule, warmup_steps=cfg.warmup_steps,
                                total_steps=cfg.total_steps, min_lr_ratio=cfg.min_lr_ratio)
        for group in self.optimizer.param_groups:
            # megatron-core's groups carry multipliers: wd_mult=0 for biases and norms (no decay)
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = cfg.weight_decay * group.get("wd_mult", 1.0)

    @property
    def lr(self) -> float:
        return 0.0 if self.optimizer is None else float(self.optimizer.param_groups[0]["lr"])

    # ---- layout, checkpoints, export -------------------------------------------------------
    def local_shards(self):
        return hf_shards(self.module, dims=self.dims, head=self.config.head, layout=self.layout_, rank=self.rank)

    def param_metas(self) -> dict:
        """Every parameter (pipeline stages hold only theirs, so `local_shards` would not list all)."""
        return hf_param_metas(self.dims, head=self.config.head, dtype=self.params_dtype)

    def layout(self) -> dict[str, Any]:
        pp, tp, dp = self.layout_.coords_of(self.rank)
        return {"backend": "megatron", "dim_names": ("pp", "dp", "tp"), "dp": self.config.dp, "tp": self.config.tp,
                "pp": self.config.pp, "dp_rank": dp, "tp_rank": tp, "pp_rank": pp, "rank": self.rank}

    def resharding_layout(self) -> Layout:
        """Megatron's layout for the resharding planner: tp slices, pipeline stages, dp replicas."""
        return self.layout_

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    def layout_meta(self) -> dict[str, Any]:
        return {"backend": "megatron", "head": self.config.head, "dp": self.config.dp, "tp": self.config.tp,
                "pp": self.config.pp, "model_path": self.config.model_path}

    def engine_state(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_engine_state(self, state: dict[str, Any]) -> None:
        """The step count (the schedule's position) comes from the checkpoint; lr and weight decay
        (`_set_lr`), betas and eps from this engine's config, as in the fsdp engine."""
        self.steps = int(state["steps"])
        for group in self.optimizer.param_groups:
            if "betas" in group:
                group["betas"] = tuple(self.config.betas)
            if "eps" in group:
                group["eps"] = self.config.eps
        self._set_lr()

    def extra_rng_state(self) -> dict:
        """megatron-core's model-parallel RNG tracker (dropout inside tensor-parallel regions), per rank."""
        from megatron.core import tensor_parallel

        return {"tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}

    def load_extra_rng_state(self, state: dict) -> None:
        from megatron.core import tensor_parallel

        if state.get("tracker"):
            tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return mckpt.gather_full_state(self)

    @_megatron
    def save_checkpoint(self, path: str) -> None:
        mckpt.save_checkpoint(self, path)

    @_megatron
    def load_checkpoint(self, path: str) -> None:
        mckpt.load_checkpoint(self, path)

    def export_hf(self, path: str) -> None:
        mckpt.export_hf(self, path)
