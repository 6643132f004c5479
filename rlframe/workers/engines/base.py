"""The training-engine interface every backend implements ("fsdp" and "megatron").

A training engine owns one model replica spread over a (dp, tp) layout of the ranks of its worker
group, plus its optimizer and LR scheduler. Roles (actor, critic, reference) call it; the engine
does not know PPO: losses come in as `loss_fn(outputs, micro_batch) -> (loss, metrics)`.

Batches follow docs/contracts.md: `input_ids` = cat(left-padded prompts (B, P), right-padded
responses (B, R)), `attention_mask`, `position_ids`, `responses` (B, R), `response_mask` (B, R).
They may be plain dicts of tensors or objects with a `.batch` TensorDict (DataProto).
Per-token outputs are aligned with `responses`: `log_probs[:, r]` is log p(responses[:, r] | prefix).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from rlframe.config.ranges import LR_SCHEDULES, PRECISIONS
from rlframe.resharding.box import Box

# loss_fn(outputs, micro_batch) -> (scalar loss, {name: float or 0-d tensor})
LossFn = Callable[[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]], tuple[torch.Tensor, Mapping[str, Any]]]

HEADS = ("lm", "value")
LOSS_WEIGHTINGS = ("tokens", "samples", "none", "global")


@dataclass
class TrainEngineConfig:
    """Schema of a training engine; validated on construction (before any process group work).

    head: "lm" (causal LM, for actor/reference) or "value" (critic: Linear(hidden, 1) on the
        last hidden state, built as AutoModelForTokenClassification with num_labels=1).
    dp, tp, pp: data-, tensor- and pipeline-parallel sizes; dp * sp * tp * pp must equal the ranks
        given (pp > 1 and sequence_parallel only on the megatron backend).
    sp (fsdp): Ulysses sequence parallelism: sp ranks split each micro-batch's positions (and
        FSDP2 shards the weights over dp x sp); a token budget (max_tokens_per_micro_batch) is per
        rank, so a micro-batch holds up to sp times as many tokens (fsdp/ulysses.py).
    mixed_precision: None = bf16 compute with fp32 master weights on GPU, fp32 on CPU.
    lr_schedule: "constant" or "cosine" (linear warmup over warmup_steps, cosine decay to
        min_lr_ratio * lr at total_steps).
    micro_batch_size / max_tokens_per_micro_batch: how `train_step` and the forward methods split
        a whole batch when not given a list of micro-batches (token budget counts valid tokens).
    remove_padding: pack the valid tokens of a micro-batch into as few rows as possible (fsdp).
    attn_implementation: "auto" = flash_attention_2 on GPU when flash-attn is installed, else sdpa.
    frozen: forward only (a reference policy): backends may skip gradient buffers and optimizer
        state, and `train_step` refuses to run.
    gather_once_per_step (fsdp): True gathers each layer's parameters once per micro-batch (kept
        from forward to backward) and reduce-scatters the gradients once per optimizer step (they
        accumulate unsharded over the micro-batches): the fewest collectives, at the memory of full
        parameters and gradients per rank during a step. False is FSDP's ZeRO-3 schedule (gather in
        forward and again in backward, reduce-scatter every micro-batch): the least memory.
        None: True on CPU (collectives there are memory copies and the models small), False on GPU.
    shm_collectives (fsdp, CPU): FSDP's all-gathers and reduce-scatters through a shared-memory
        buffer when every dp rank is on this host (fsdp/shm_comm.py), gloo's barriers around them;
        None: wherever it applies; False: gloo for everything.
    lora_rank (fsdp): > 0 trains LoRA adapters of this rank on `lora_target_modules` (projection
        names) instead of the whole model; the base weights stay frozen (engines/lora.py).
        lora_alpha scales the adapters' output by lora_alpha / lora_rank; lora_dropout is applied
        to their input.
    activation_checkpointing: each decoder layer's activations are recomputed in the backward
        instead of kept from the forward (fsdp: torch.utils.checkpoint per decoder layer; megatron:
        full recompute, one layer at a time): the memory of one layer's activations instead of all
        layers', for about one more forward per training step. Same numbers either way.
    """

    model_path: str
    head: str = "lm"
    dp: int = 1
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    sp: int = 1
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float | None = 1.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 0
    min_lr_ratio: float = 0.0
    micro_batch_size: int | None = None
    max_tokens_per_micro_batch: int | None = None
    remove_padding: bool = True
    mixed_precision: bool | None = None
    attn_implementation: str = "auto"
    seed: int = 0
    frozen: bool = False
    gather_once_per_step: bool | None = None
    shm_collectives: bool | None = None
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj")
    lora_dropout: float = 0.0
    activation_checkpointing: bool = False

    def __post_init__(self):
        if self.head not in HEADS:
            raise ValueError(f"engine head {self.head!r} is unknown; use one of {HEADS}")
        if self.dp < 1 or self.tp < 1 or self.pp < 1 or self.sp < 1:
            raise ValueError(f"dp ({self.dp}), sp ({self.sp}), tp ({self.tp}) and pp ({self.pp}) must be >= 1")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule {self.lr_schedule!r} is unknown; use one of {LR_SCHEDULES}")
        if self.lr_schedule == "cosine" and self.total_steps <= self.warmup_steps:
            raise ValueError(
                f"cosine schedule needs total_steps ({self.total_steps}) > warmup_steps "
                f"({self.warmup_steps}); set total_steps to the number of optimizer steps of the run"
            )
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {self.max_tokens_per_micro_batch}")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"grad_clip must be > 0 or None (no clipping), got {self.grad_clip}")
        self.betas = tuple(self.betas)
        from rlframe.workers.engines.lora import check_lora_settings

        check_lora_settings(rank=self.lora_rank, alpha=self.lora_alpha, target_modules=self.lora_target_modules,
                            dropout=self.lora_dropout, where="TrainEngineConfig")
        self.lora_target_modules = tuple(self.lora_target_modules)

    @property
    def lora(self):
        """The LoraSettings of this engine, or None when LoRA is off (lora_rank 0)."""
        from rlframe.workers.engines.lora import LoraSettings

        if self.lora_rank == 0:
            return None
        return LoraSettings(rank=self.lora_rank, alpha=self.lora_alpha, target_modules=self.lora_target_modules,
                            dropout=self.lora_dropout)


class TrainEngine(abc.ABC):
    """One model replica over a (dp, tp[, pp]) layout, with optimizer, scheduler and checkpoints.

    What the roles call is declared here; what the engine supports (parallelisms, LoRA, its memory
    model, its checkpoint reader, its config checks) is its spec's (rlframe.plugins.EngineSpec)."""

    config: TrainEngineConfig
    compute_dtype: torch.dtype  # of forward/backward: bf16 under mixed precision, else fp32
    device: torch.device  # where its parameters live (cpu, or this rank's cuda device)

    @abc.abstractmethod
    def forward_log_probs(self, batch, *, temperature: float = 1.0, with_entropy: bool = False,
                          micro_batch_size: int | None = None,
                          max_tokens_per_micro_batch: int | None = None,
                          disable_adapter: bool = False) -> dict[str, torch.Tensor]:
        """{"log_probs": (B, R)[, "entropy": (B, R)]} of this rank's batch, no gradient, on CPU.

        Logits are divided by `temperature` first (the rollout's sampling temperature). Micro-batch
        sizes default to the config's. disable_adapter=True computes the base model of a LoRA engine
        (its reference policy; see `adapters_disabled`).
        """

    @abc.abstractmethod
    def forward_values(self, batch, *, micro_batch_size: int | None = None,
                       max_tokens_per_micro_batch: int | None = None) -> torch.Tensor:
        """Critic values (B, R) on CPU, no gradient: values[:, r] is the value of the state before
        response token r (read at position P + r - 1, like the log-probs)."""

    @abc.abstractmethod
    def train_step(self, loss_fn: LossFn, micro_batches, *, temperature: float = 1.0,
                   loss_weighting: str = "tokens", with_entropy: bool = False,
                   allow_empty: bool = False) -> dict[str, float]:
        """Accumulate gradients over micro-batches, clip, step optimizer and scheduler; return metrics.
        `allow_empty`: a mini-batch with no response token on any dp rank (an off-policy correction
        dropped them all) is skipped, nothing stepped (`accumulate.empty_step`), instead of an error."""

    @abc.abstractmethod
    def local_shards(self) -> dict[str, tuple[tuple[int, ...], Box, torch.Tensor]]:
        """HF name -> (global shape, Box this rank holds, local tensor without copy)."""

    def param_metas(self) -> dict:
        """HF name -> ParamMeta(global shape, dtype) of every parameter of the model, the same on all
        ranks (for the resharding planner). Default: from `local_shards` (every rank holds every name)."""
        from rlframe.resharding.planner import ParamMeta

        return {name: ParamMeta(tuple(shape), t.dtype) for name, (shape, _, t) in self.local_shards().items()}

    @abc.abstractmethod
    def layout(self) -> dict[str, Any]:
        """The parallel layout and this rank's coordinates in it (for the resharding planner)."""

    @abc.abstractmethod
    def resharding_layout(self):
        """The `rlframe.resharding.Layout` whose boxes are exactly this engine's `local_shards` (the
        source of every weight sync; the engine asserts its shards match it)."""

    @abc.abstractmethod
    def layout_meta(self) -> dict[str, Any]:
        """What a checkpoint's layout.json records: "backend" (the spec's name), "head", the layout
        sizes, "model_path" and the LoRA settings (None without LoRA)."""

    def lora_param_metas(self) -> dict:
        """HF name -> ParamMeta of the trained LoRA adapters (what a LoRA weight sync sends)."""
        raise ValueError(f"{type(self).__name__} has no LoRA adapters (lora_rank={self.config.lora_rank})")

    def lora_local_shards(self) -> dict:
        """Like `local_shards`, for the LoRA adapters only."""
        raise ValueError(f"{type(self).__name__} has no LoRA adapters (lora_rank={self.config.lora_rank})")

    @abc.abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Gathered full HF-named tensors on every rank (collective; small models and tests)."""

    @abc.abstractmethod
    def save_checkpoint(self, path: str) -> None:
        """Atomically write model, optimizer and scheduler shards to `path` (collective)."""

    @abc.abstractmethod
    def load_checkpoint(self, path: str) -> None:
        """Restore what `save_checkpoint` wrote, into an engine of the same layout (collective)."""

    @abc.abstractmethod
    def export_hf(self, path: str) -> None:
        """Write a full HF checkpoint that `from_pretrained` loads (collective; rank 0 writes)."""

    @property
    @abc.abstractmethod
    def lr(self) -> float:
        """The learning rate the next optimizer step uses."""

    def adapters_disabled(self):
        """Context manager: forwards inside it compute the base model, every LoRA adapter off (the
        reference policy of a LoRA run). Engines without LoRA have no adapters to turn off."""
        raise ValueError(f"{type(self).__name__} has no LoRA adapters to disable (lora_rank="
                         f"{self.config.lora_rank}); build it with lora_rank > 0, or compute reference "
                         "log-probs with a separate reference engine")




def mixed_precision_setting(precision: str) -> bool | None:
    """A role's `precision` (auto | fp32 | bf16) as the engine's `mixed_precision` (None | False | True)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: use one of {PRECISIONS}")
    return {"auto": None, "fp32": False, "bf16": True}[precision]


def resolve_mixed_precision(setting: bool | None, *, on_gpu: bool) -> bool:
    """`mixed_precision` None (the default): bf16 compute with fp32 master weights on GPU, fp32 on
    CPU (the same numbers on every CPU; bf16 is fast only where the CPU has AMX, and asked for with
    precision=bf16). Every engine, the rollout's dtype and the dry run's memory estimate resolve it here."""
    return on_gpu if setting is None else setting


def compute_dtype(mixed_precision: bool) -> torch.dtype:
    """The dtype forward and backward run in: bf16 under mixed precision, else fp32."""
    return torch.bfloat16 if mixed_precision else torch.float32


def precision_dtype(precision: str, *, on_gpu: bool) -> torch.dtype:
    """The dtype a role with this `precision` computes in (for the actor, its rollout engine's too)."""
    return compute_dtype(resolve_mixed_precision(mixed_precision_setting(precision), on_gpu=on_gpu))


def check_trainable(config: TrainEngineConfig) -> None:
    if config.frozen:
        raise ValueError("train_step on a frozen engine (a reference policy has no optimizer); "
                         "build it with frozen=False to train")


def as_tensor_dict(batch) -> Mapping[str, torch.Tensor]:
    """Tensors of a batch given as a dict or as a DataProto-like object with `.batch`."""
    inner = getattr(batch, "batch", None)
    if inner is not None:
        return {k: inner[k] for k in inner.keys()}
    if isinstance(batch, Mapping):
        return batch
    raise ValueError(
        f"a batch must be a dict of tensors or have a `.batch` TensorDict, got {type(batch).__name__}"
    )


def require_keys(batch: Mapping[str, torch.Tensor], keys: Sequence[str], *, what: str) -> None:
    missing = [k for k in keys if k not in batch]
    if missing:
        raise ValueError(f"{what} needs batch keys {list(keys)}; missing {missing} (have {sorted(batch)})")
