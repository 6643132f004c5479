"""AdamW, the LR schedule, and gradient clipping for parameters sharded as DTensors.

- AdamW (Loshchilov & Hutter 2019) with decoupled weight decay on matrices only (ndim >= 2),
  torch's kernel applied to the local shards (`LocalShardAdamW`);
  biases and norm weights are not decayed. Parameters live on two meshes (2-D (dp, tp) for the
  tensor-parallel layers, 1-D dp for norms and the critic head), so they go into separate param
  groups per mesh and foreach kernels never mix meshes.
- LR: "constant" (after optional linear warmup) or "cosine": linear warmup over `warmup_steps`,
  then cosine decay to `min_lr_ratio * lr` at `total_steps` (Loshchilov & Hutter 2017, SGDR,
  without restarts).
- Global gradient norm over every rank of the engine with one all-reduce per mesh dim: each rank
  adds the squared norm of its local shard weighted by (distinct shards / ranks), which counts
  every element once however often it is replicated.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate


def lr_lambda(step: int, *, schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the base LR at optimizer step `step` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _mesh_key(p: torch.Tensor):
    return p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else None


def build_optimizer(model, config) -> torch.optim.Optimizer:
    groups: dict[tuple, list] = {}
    for p in model.parameters():
        if p.requires_grad:
            groups.setdefault((_mesh_key(p), p.dim() >= 2), []).append(p)
    param_groups = [
        {"params": ps, "weight_decay": config.weight_decay if decay else 0.0}
        for (_, decay), ps in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), kv[0][1]))
    ]
    return LocalShardAdamW(param_groups, lr=config.lr, betas=config.betas, eps=config.eps)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class LocalShardAdamW(torch.optim.AdamW):
    """torch's AdamW, run on the local shards of DTensor parameters.

    Its state is torch's own (DTensors like the parameters, so checkpoints and `state_dict` are
    unchanged), and its arithmetic is the same kernel on the same local data, bit for bit: a DTensor
    op on sharded or replicated placements runs that op on the local tensor. What it saves is the
    DTensor dispatch of every elementwise op (about ten per parameter per step): on CPU, 12m preset,
    one rank, 2 x 147 parameters, the step took 74 ms with DTensor operands. A gradient whose
    placements differ from its parameter's (a partial sum) is redistributed first, as the DTensor op
    would do."""

    @torch.no_grad()
    def step(self, closure=None):
        from torch.optim.adam import adam

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
            has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
            for i, (p, g) in enumerate(zip(params, grads)):
                if isinstance(p, DTensor) and isinstance(g, DTensor) and g.placements != p.placements:
                    grads[i] = g.redistribute(device_mesh=p.device_mesh, placements=p.placements)
            beta1, beta2 = group["betas"]
            adam([_local(t) for t in params], [_local(t) for t in grads], [_local(t) for t in exp_avgs],
                 [_local(t) for t in exp_avg_sqs], [_local(t) for t in max_exp_avg_sqs], steps,
                 amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"],
                 weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                 foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
                 fused=group["fused"], grad_scale=None, found_inf=None,
                 decoupled_weight_decay=group["decoupled_weight_decay"])
        return loss


def build_scheduler(optimizer, config) -> torch.optim.lr_scheduler.LambdaLR:
    from functools import partial

    fn = partial(lr_lambda, schedule=config.lr_schedule, warmup_steps=config.warmup_steps,
                 total_steps=config.total_steps, min_lr_ratio=config.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def _local_grad(p: torch.Tensor) -> tuple[torch.Tensor, float]:
    """This rank's gradient shard and the fraction of the engine's ranks holding distinct data."""
    g = p.grad
    if not isinstance(g, DTensor):
        return g, 1.0
    if any(isinstance(pl, Partial) for pl in g.placements):
        g = g.redistribute(placements=[Replicate() if isinstance(pl, Partial) else pl for pl in g.placements])
    mesh = g.device_mesh
    distinct = 1
    for dim, pl in enumerate(g.placements):
        if not isinstance(pl, Replicate):
            distinct *= mesh.size(dim)
    return g.to_local(), float(distinct)


def global_grad_norm(params, *, groups, num_ranks: int, device: torch.device) -> torch.Tensor:
    """sqrt(sum of squares of all gradient elements), the same value on every rank (fp32), on
    `device` (the engine's: NCCL reduces only CUDA tensors, also on a rank whose parameters have no
    gradient, such as a frozen stage or LoRA's base weights)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if p.grad is None:
            continue
        local, distinct = _local_grad(p)
        total += local.detach().float().pow(2).sum().to(device) * (distinct / num_ranks)
    for g in groups:
        if g is not None and dist.get_world_size(g) > 1:
            dist.all_reduce(total, group=g)
    return total.sqrt()


def scale_grads_(params, factor: float) -> None:
    for p in params:
        if p.grad is not None:
            p.grad.mul_(factor)
