"""Shared by the role workers: engine settings from the run config, batch helpers."""

from __future__ import annotations


from rlframe.config.schema import RolloutSection, TrainRoleConfig
from rlframe.workers.engines import TrainEngineConfig, get_train_engine
from rlframe.workers.engines.base import mixed_precision_setting
from rlframe.workers.rollout import RolloutConfig
from rlframe.workers.rollout.config import CPU_KV_CACHE_BYTES

# The RL losses normalise by the mini-batch's global counts, which the engine gives each micro-batch
# (engines/accumulate.py): the sum over micro-batches and dp ranks is then the whole mini-batch's loss
# for every loss mode, with empty rows and uneven splits alike (workers/losses.py).
RL_LOSS_WEIGHTING = "global"


def build_train_engine(role: TrainRoleConfig, *, model_path: str, head: str, total_steps: int, seed: int,
                       lr: float | None = None, frozen: bool = False):
    """The training engine `role.strategy` names, with the role's layout and optimiser."""
    cfg = TrainEngineConfig(
        model_path=model_path, head=head, dp=role.dp, tp=role.tp, pp=role.pp, sp=role.sp,
        sequence_parallel=role.sequence_parallel, lr=role.lr if lr is None else lr,
        weight_decay=role.weight_decay, grad_clip=role.grad_clip, lr_schedule=role.lr_schedule,
        warmup_steps=role.warmup_steps, total_steps=max(total_steps, role.warmup_steps + 1),
        min_lr_ratio=role.min_lr_ratio,
        micro_batch_size=role.micro_batch_size, max_tokens_per_micro_batch=role.max_tokens_per_micro_batch,
        seed=seed, frozen=frozen, mixed_precision=mixed_precision_setting(role.precision),
        # A frozen engine (a reference policy) is the plain model: adapters would only add zeros.
        lora_rank=0 if frozen else role.lora_rank, lora_alpha=role.lora_alpha,
        lora_target_modules=tuple(role.lora_target_modules), lora_dropout=role.lora_dropout,
        # Nothing to recompute without a backward.
        activation_checkpointing=role.activation_checkpointing and not frozen,
    )
    return get_train_engine(role.strategy)(cfg)


def train_mesh(role: TrainRoleConfig):
    """The training layout as the role's dispatch mesh (pp only when pipelined, sp only when split):
    the sp ranks of a dp replica get the same batch chunk, like its tp ranks."""
    from rlframe.single_controller import Mesh

    return Mesh.of(**({"pp": role.pp} if role.pp > 1 else {}), **({"sp": role.sp} if role.sp > 1 else {}),
                   dp=role.dp, tp=role.tp)


def rollout_config(section: RolloutSection, *, max_model_len: int, seed: int, compute_dtype,
                   on_gpu: bool, actor: TrainRoleConfig | None = None) -> RolloutConfig:
    """The rollout engine's settings: it computes in the training engine's dtype (bf16 on GPU, so the
    synced weights are what training computes with) and, unless `kv_cache_bytes` is set, on GPU its KV
    cache takes what `gpu_memory_utilization` leaves after the weights (on CPU: CPU_KV_CACHE_BYTES).
    With the actor's LoRA on, the engine serves its adapter (only adapters are synced)."""
    lora = {} if actor is None or actor.lora_rank == 0 else dict(
        lora_rank=actor.lora_rank, lora_alpha=actor.lora_alpha, lora_target_modules=tuple(actor.lora_target_modules))
    return RolloutConfig(**lora,
        backend=section.backend, tensor_parallel_size=section.tp, max_model_len=max_model_len,
        dtype=str(compute_dtype).removeprefix("torch."), max_num_seqs=section.max_num_seqs,
        gpu_memory_utilization=section.gpu_memory_utilization,
        kv_cache_bytes=kv_cache_bytes(section, on_gpu=on_gpu), seed=seed,
        enforce_eager=(not on_gpu) if section.enforce_eager is None else section.enforce_eager,
        enable_prefix_caching=on_gpu if section.enable_prefix_caching is None else section.enable_prefix_caching,
        load_format=rollout_load_format(section, actor), vllm_kwargs=dict(section.engine_kwargs),
    )


def rollout_load_format(section: RolloutSection, actor: TrainRoleConfig | None) -> str:
    """vLLM's load_format for the run's rollout engine: "dummy" (random weights, no checkpoint read on
    any rank) when the actor syncs every weight before the first generation, else "auto" (the
    checkpoint). The actor syncs in full unless it trains LoRA adapters (then only they are synced
    and the base must be the checkpoint's); an engine without an actor is never synced. The actor
    and the driver sync before the first generation when the engine `awaits_full_sync`
    (ActorWorker.__init__, RunRoles.push_weights). rollout.load_format=real keeps the checkpoint."""
    if section.load_format == "real" or actor is None or actor.lora_rank > 0:
        return "auto"
    return "dummy"


def delta_state(full_every: int | None, *, lora: bool):
    """A sync's delta state (kept from sync to sync on each rank), or None for full syncs: always for a
    LoRA sync, whose adapters change whole at every step (both sides of a sync decide alike)."""
    from rlframe.resharding.delta import DeltaState

    return None if full_every is None or lora else DeltaState(full_every=full_every)


def sync_metrics(stats, delta) -> dict[str, float]:
    """What a sync sent, from the executor's stats (and, for a delta sync, what it really moved)."""
    out = {"reshard/bytes_sent_mb": stats.bytes_sent / 2**20}
    if delta is not None:
        d = delta.stats
        out.update({"reshard/delta_sent_mb": d.sent_bytes / 2**20, "reshard/delta_changed_fraction": d.changed_fraction,
                    "reshard/delta_full_sync": float(delta.full_sync)})
    return out


def lora_sync_config(role: TrainRoleConfig) -> dict:
    """The adapter settings a LoRA sync sends with the factors (PEFT's keys)."""
    return {"r": role.lora_rank, "lora_alpha": role.lora_alpha, "target_modules": list(role.lora_target_modules)}


def kv_cache_bytes(section: RolloutSection, *, on_gpu: bool) -> int | None:
    """The rollout's explicit KV-cache size: the configured one, else the CPU default on CPU and none
    on GPU (vLLM sizes it from gpu_memory_utilization)."""
    if section.kv_cache_bytes is not None:
        return section.kv_cache_bytes
    return None if on_gpu else CPU_KV_CACHE_BYTES


def prefixed(metrics: dict, prefix: str) -> dict[str, float]:
    return {k if "/" in k else f"{prefix}/{k}": float(v) for k, v in metrics.items()}


def mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for r in rows for k in r}
    return {k: sum(r[k] for r in rows if k in r) / sum(1 for r in rows if k in r) for k in sorted(keys)}


def metrics_only(metrics: dict[str, float], dp_rank: int):
    """A one-row batch carrying this rank's metrics in meta_info (DP_COMPUTE gathers them per dp
    rank), for methods whose result is a measurement rather than per-sample data."""
    import torch

    from rlframe.single_controller.dispatch import METRICS_KEY
    from rlframe.protocol import DataProto

    return DataProto.from_dict(tensors={"dp_rank": torch.tensor([dp_rank])}, meta_info={METRICS_KEY: metrics})
