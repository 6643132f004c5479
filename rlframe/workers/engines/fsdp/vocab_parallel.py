"""Log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits for a contiguous vocab slice [start, start + V/tp). The
softmax normaliser, the target logit and the entropy need sums over the whole vocabulary: three
all-reduces of (N,) vectors instead of an all-gather of (N, V) logits (the vocab-parallel
cross-entropy of Megatron-LM, Shoeybi et al. 2019, section 3, extended with the entropy).

Backward needs no communication: with p = softmax(z) over the full vocabulary,
  d log p_y / d z_j = 1[j = y] - p_j
  d H / d z_j       = -p_j (z_j - sum_k p_k z_k)          (H = -sum_k p_k log p_k)
and p_j, sum_k p_k z_k are known on every rank after the forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_start, group, with_entropy):
        z = logits.float() if logits.element_size() < 4 else logits  # bf16/fp16 -> fp32; keep fp64
        vl = z.shape[-1]
        zmax = _all_reduce(z.max(dim=-1).values, group, dist.ReduceOp.MAX)
        z = z - zmax.unsqueeze(-1)  # shift-invariant; keeps exp() finite
        exp = z.exp()
        sum_exp = _all_reduce(exp.sum(dim=-1), group)
        local = labels - vocab_start
        in_slice = (local >= 0) & (local < vl)
        z_y = z.gather(-1, local.clamp(0, vl - 1).unsqueeze(-1)).squeeze(-1) * in_slice
        z_y = _all_reduce(z_y, group)
        log_z = sum_exp.log()
        log_prob = z_y - log_z
        if with_entropy:
            probs = exp / sum_exp.unsqueeze(-1)
            mean_z = _all_reduce((probs * z).sum(dim=-1), group)
            entropy = log_z - mean_z
        else:
            mean_z = entropy = torch.zeros_like(log_prob)
        # probs are recomputed in backward from z and log_z: one (N, V/tp) tensor saved, not two.
        ctx.save_for_backward(z, log_z, mean_z, local, in_slice)
        ctx.logits_dtype = logits.dtype
        ctx.with_entropy = with_entropy
        # An output the loss does not use (entropy only logged) gets None, not a zero tensor, so its
        # (N, V/tp) backward term is skipped.
        ctx.set_materialize_grads(False)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        z, log_z, mean_z, local, in_slice = ctx.saved_tensors
        probs = (z - log_z.unsqueeze(-1)).exp()
        if grad_log_prob is not None:
            grad = -probs * grad_log_prob.unsqueeze(-1)
            rows = torch.nonzero(in_slice, as_tuple=True)[0]
            grad[rows, local[rows]] += grad_log_prob[rows]
        else:
            grad = torch.zeros_like(probs)
        if ctx.with_entropy and grad_entropy is not None:
            grad = grad - grad_entropy.unsqueeze(-1) * probs * (z - mean_z.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float, tp_rank: int, group=None,
                    with_entropy: bool = False) -> dict[str, torch.Tensor]:
    """{"log_probs"[, "entropy"]} shaped like `labels` (..., C) from this tp rank's logits (..., C, V/tp),
    which are divided by `temperature` first (the sampling temperature of the rollout)."""
    if temperature != 1.0:
        logits = logits / temperature
    v_local = logits.shape[-1]
    log_prob, entropy = vocab_parallel_log_probs(logits.reshape(-1, v_local), labels.reshape(-1),
                                                 vocab_start=tp_rank * v_local, group=group, with_entropy=with_entropy)
    out = {"log_probs": log_prob.view(labels.shape)}
    if with_entropy:
        out["entropy"] = entropy.view(labels.shape)
    return out


def vocab_parallel_log_probs(
    logits: torch.Tensor, labels: torch.Tensor, *, vocab_start: int, group=None, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(labels) (N,) and entropy (N,) or None, from this rank's logit slice (N, V_local).

    `labels` (N,) are global vocab ids; `group` is the tensor-parallel group (None: whole vocab here).
    Computed in fp32 when the logits are bf16/fp16.
    """
    assert logits.dim() == 2 and labels.shape == logits.shape[:1], (logits.shape, labels.shape)
    log_prob, entropy = _VocabParallelLogProb.apply(logits, labels, vocab_start, group, with_entropy)
    return log_prob, (entropy if with_entropy else None)
