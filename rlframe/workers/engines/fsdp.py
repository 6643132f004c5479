"""The torch-native training engine: FSDP2 over dp, DTensor tensor parallelism over tp.

Dataflow of `train_step(loss_fn, micro_batches)`:
  plan micro-batches (same count on every dp rank) -> for each: pack valid tokens -> model forward
  -> vocab-parallel log-probs (or critic values) in fp32 -> loss_fn -> (loss * weight).backward()
  (FSDP2 reduce-scatters and averages gradients over dp) -> global grad norm -> skip the step if it
  is not finite, else clip -> AdamW step -> LR scheduler step.
Micro-batch weights make the accumulated gradient that of one big batch: with
`loss_weighting="tokens"` a micro-batch's mean-per-token loss counts in proportion to its response
tokens out of all response tokens of all micro-batches of all dp ranks (so 1 x 8 == 8 x 1 and
dp2 == dp1); "samples" weights by samples; "none" sums the losses as given (the loss function
normalises globally itself).

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
from rlframe.workers.engines.base import LOSS_WEIGHTINGS, TrainEngine, TrainEngineConfig, require_keys
from rlframe.workers.engines.micro_batch import MicroBatch, plan_micro_batches, restore_order
from rlframe.workers.engines.modeling import load_config, load_model
from rlframe.workers.engines.optim import (
    build_optimizer, build_scheduler, global_grad_norm, scale_grads_,
)
from rlframe.workers.engines.packing import pack_inputs, padded_inputs, response_slice
from rlframe.workers.engines.parallelize import (
    apply_fsdp, apply_tensor_parallel, build_mesh, check_mesh, check_model_fits, decoder_layers,
)
from rlframe.workers.engines.shards import local_shards
from rlframe.workers.engines.vocab_parallel import vocab_parallel_log_probs

_FORWARD_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")
# The HF output's logits are views; the engine never modifies them in place, which is the case
# this FSDP2 warning is about.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


class FSDPTrainEngine(TrainEngine):
    """See the module docstring. `device_mesh` (dims ("dp", "tp")) overrides the default mesh
    over all ranks, e.g. to run several independent engines in one process group."""

    def __init__(self, config: TrainEngineConfig, *, device_mesh=None):
        if not dist.is_initialized():
            raise ValueError("FSDPTrainEngine needs an initialised torch.distributed process group")
        self.config = config
        hf_config = load_config(config.model_path)
        check_model_fits(hf_config, tp=config.tp, model_type_path=f"{hf_config.model_type} at {config.model_path}")
        on_gpu = dist.get_backend() == "nccl"
        if on_gpu and "LOCAL_RANK" in os.environ:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self.mesh = device_mesh if device_mesh is not None else build_mesh(
            dp=config.dp, tp=config.tp, device_type=self.device.type)
        check_mesh(self.mesh, dp=config.dp, tp=config.tp)
        self.dp_group = self.mesh.get_group("dp")
        self.tp_group = self.mesh.get_group("tp")
        self._flat_group = self.mesh._flatten("dp_tp").get_group()
        self.mixed_precision = on_gpu if config.mixed_precision is None else config.mixed_precision
        self.model = self._build_model()
        self.optimizer = build_optimizer(self.model, config)
        self.scheduler = build_scheduler(self.optimizer, config)
        self.steps = 0

    def _build_model(self):
        cfg = self.config
        model = load_model(cfg.model_path, head=cfg.head, seed=cfg.seed, attn_implementation=cfg.attn_implementation)
        decoder_layers(model)  # fails early on an unsupported architecture
        model.to(self.device)
        if cfg.tp > 1:
            apply_tensor_parallel(model, self.mesh["tp"], head=cfg.head)
        apply_fsdp(model, self.mesh["dp"], mixed_precision=self.mixed_precision)
        self.pad_token_id = int(model.config.pad_token_id or 0)
        self.vocab_size = int(model.config.vocab_size)
        return model

    # ---- forward -------------------------------------------------------------------------
    def _model_inputs(self, data: dict[str, torch.Tensor]):
        require_keys(data, _FORWARD_KEYS, what="the engine's forward")
        args = (data["input_ids"], data["attention_mask"], data["position_ids"])
        if self.config.remove_padding:
            return pack_inputs(*args, pad_token_id=self.pad_token_id)
        return padded_inputs(*args)

    def _forward(self, data: dict[str, torch.Tensor], *, temperature: float, with_entropy: bool):
        """Per-response-token outputs of one micro-batch: log_probs[/entropy] or values, (b, R)."""
        inputs = self._model_inputs(data)
        out = self.model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                         position_ids=inputs.position_ids, use_cache=False)
        resp_len = data["responses"].shape[1]
        stats = {"tokens_valid": inputs.tokens_valid, "tokens_computed": inputs.tokens_computed,
                 "tokens_padded": data["input_ids"].numel()}
        if self.config.head == "value":
            values = out.logits.squeeze(-1).float()  # (rows, C)
            return {"values": response_slice(inputs.unpack(values), resp_len)}, stats
        logits = out.logits  # (rows, C, V / tp): this rank's vocab slice
        if temperature != 1.0:
            logits = logits / temperature
        v_local = logits.shape[-1]
        log_prob, entropy = vocab_parallel_log_probs(
            logits.reshape(-1, v_local), inputs.labels.reshape(-1),
            vocab_start=self.mesh.get_local_rank("tp") * v_local,
            group=self.tp_group if self.config.tp > 1 else None, with_entropy=with_entropy,
        )
        rows_shape = inputs.input_ids.shape
        outputs = {"log_probs": response_slice(inputs.unpack(log_prob.view(rows_shape)), resp_len)}
        if with_entropy:
            outputs["entropy"] = response_slice(inputs.unpack(entropy.view(rows_shape)), resp_len)
        return outputs, stats

    def _plan(self, batch_or_list, *, micro_batch_size=None, max_tokens=None) -> list[MicroBatch]:
        """Micro-batches on the engine's device; explicit sizes override the config's."""
        if micro_batch_size is None and max_tokens is None:
            micro_batch_size, max_tokens = self.config.micro_batch_size, self.config.max_tokens_per_micro_batch
        mbs = plan_micro_batches(batch_or_list, micro_batch_size=micro_batch_size, max_tokens=max_tokens,
                                 dp_group=self.dp_group)
        for mb in mbs:
            mb.data = {k: v.to(self.device) for k, v in mb.data.items()}
        return mbs

    @torch.no_grad()
    def _forward_batch(self, batch, *, temperature: float, with_entropy: bool, **sizes) -> dict[str, torch.Tensor]:
        mbs = self._plan(batch, **sizes)
        per_mb = [self._forward(mb.data, temperature=temperature, with_entropy=with_entropy)[0] for mb in mbs]
        # Without a backward, FSDP2 leaves the root's parameters unsharded after forward.
        self.model.reshard()
        return {k: restore_order([o[k] for o in per_mb], mbs).float().cpu() for k in per_mb[0]}

    def forward_log_probs(self, batch, *, temperature: float = 1.0, with_entropy: bool = False,
                          micro_batch_size: int | None = None, max_tokens_per_micro_batch: int | None = None):
        if self.config.head != "lm":
            raise ValueError("forward_log_probs needs an engine with head='lm' (this one is a critic)")
        return self._forward_batch(batch, temperature=temperature, with_entropy=with_entropy,
                                   micro_batch_size=micro_batch_size, max_tokens=max_tokens_per_micro_batch)

    def forward_values(self, batch, *, micro_batch_size: int | None = None,
                       max_tokens_per_micro_batch: int | None = None) -> torch.Tensor:
        if self.config.head != "value":
            raise ValueError("forward_values needs an engine with head='value' (a critic)")
        return self._forward_batch(batch, temperature=1.0, with_entropy=False, micro_batch_size=micro_batch_size,
                                   max_tokens=max_tokens_per_micro_batch)["values"]

    # ---- training ------------------------------------------------------------------------
    def _weights(self, mbs: list[MicroBatch], loss_weighting: str) -> list[float]:
        """Per micro-batch loss multipliers; with FSDP's dp average they give one global mean."""
        if loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(f"loss_weighting {loss_weighting!r} is unknown; use one of {LOSS_WEIGHTINGS}")
        dp = self.config.dp
        if loss_weighting == "none":
            return [dp * mb.weight_scale for mb in mbs]
        if loss_weighting == "tokens":
            require_keys(mbs[0].data, ("response_mask",), what="loss_weighting='tokens'")
            units = [float(mb.data["response_mask"].sum()) * mb.weight_scale for mb in mbs]
        else:
            units = [float(mb.size) * mb.weight_scale for mb in mbs]
        total = torch.tensor([sum(units)], dtype=torch.float64, device=self.device)
        if dp > 1:
            dist.all_reduce(total, group=self.dp_group)
        if float(total) <= 0:
            raise ValueError(f"loss_weighting={loss_weighting!r}: the batch has no response tokens/samples to weight")
        return [u * dp / float(total) for u in units]

    def train_step(self, loss_fn, micro_batches, *, temperature: float = 1.0,
                   loss_weighting: str = "tokens", with_entropy: bool = False) -> dict[str, float]:
        mbs = self._plan(micro_batches)
        weights = self._weights(mbs, loss_weighting)
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, torch.Tensor] = {}
        tokens = {"tokens_valid": 0, "tokens_computed": 0, "tokens_padded": 0}
        for mb, w in zip(mbs, weights):
            outputs, stats = self._forward(mb.data, temperature=temperature, with_entropy=with_entropy)
            loss, metrics = loss_fn(outputs, mb.data)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar tensor as its loss, got {type(loss).__name__} "
                                 f"{getattr(loss, 'shape', '')}")
            (loss * w).backward()
            for k, v in {"loss": loss, **dict(metrics)}.items():
                sums[k] = sums.get(k, 0.0) + torch.as_tensor(v, dtype=torch.float64).detach().cpu() * w
            if mb.weight_scale:
                tokens = {k: tokens[k] + stats[k] for k in tokens}
        result = self._reduce_metrics(sums, tokens)
        result.update(self._optimizer_step())
        return result

    def _reduce_metrics(self, sums: dict[str, torch.Tensor], tokens: dict[str, int]) -> dict[str, float]:
        """Weighted metric sums -> global values (all-reduced over dp; identical over tp)."""
        keys = sorted(sums) + sorted(tokens)
        # Metric sums carry weight dp / total each; dividing by dp turns the dp-sum into the mean.
        vec = torch.stack([sums[k].double() / self.config.dp for k in sorted(sums)]
                          + [torch.tensor(float(tokens[k]), dtype=torch.float64) for k in sorted(tokens)])
        vec = vec.to(self.device)
        if self.config.dp > 1:
            dist.all_reduce(vec, group=self.dp_group)
        return {k: float(v) for k, v in zip(keys, vec.cpu().tolist())}

    def _optimizer_step(self) -> dict[str, float]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = global_grad_norm(params, groups=(self.dp_group, self.tp_group), num_ranks=self.config.dp * self.config.tp)
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

    # ---- layout, checkpoints, export -------------------------------------------------------
    def local_shards(self):
        self.model.reshard()  # report the sharded (training) layout, never a transient all-gather
        return local_shards(self.model)

    def layout(self) -> dict[str, Any]:
        return {
            "backend": "fsdp", "dim_names": ("dp", "tp"), "dp": self.config.dp, "tp": self.config.tp,
            "dp_rank": self.mesh.get_local_rank("dp"), "tp_rank": self.mesh.get_local_rank("tp"),
            "rank": dist.get_rank(), "mesh": self.mesh.mesh.tolist(),
        }

    def resharding_layout(self):
        """This engine's layout as the resharding planner's `Layout` (tp fastest, FSDP dim-0 shards)."""
        from rlframe.resharding.layout import Layout

        return Layout(tp=self.config.tp, dp=self.config.dp, fsdp=True,
                      ranks=tuple(int(r) for r in self.mesh.mesh.flatten().tolist()))

    @property
    def is_first_rank(self) -> bool:
        """Rank (0, 0) of the engine's mesh: the one that writes single-writer files."""
        return tuple(self.mesh.get_coordinate()) == (0, 0)

    def layout_meta(self) -> dict[str, Any]:
        return {"head": self.config.head, "dp": self.config.dp, "tp": self.config.tp,
                "model_path": self.config.model_path}

    def _barrier(self) -> None:
        # All-reduce over dp then tp reaches every rank of the mesh (and no other rank).
        t = torch.zeros(1, device=self.device)
        for g in (self.dp_group, self.tp_group):
            dist.all_reduce(t, group=g)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return ckpt.gather_full_state(self.model)

    def save_checkpoint(self, path: str) -> None:
        ckpt.save_checkpoint(self, path, barrier=self._barrier, process_group=self._flat_group)

    def load_checkpoint(self, path: str) -> None:
        ckpt.load_checkpoint(self, path, process_group=self._flat_group)

    def export_hf(self, path: str) -> None:
        ckpt.export_hf(self, path, barrier=self._barrier)
