"""Forward-only passes every engine shares: `forward_log_probs` / `forward_values` over micro-batches,
in eval mode (BatchedForward)."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from rlframe.workers.engines.micro_batch import plan_micro_batches


class BatchedForward:
    """`forward_log_probs` / `forward_values` of an engine that implements
    `_forward_batch(batch, *, temperature, with_entropy, micro_batch_size, max_tokens)` -> {name: (B, R)}
    (or None on ranks that hold no output, e.g. pipeline stages before the last), with `config`,
    `dp_group` and `device`."""

    def _plan(self, batch_or_list, *, micro_batch_size=None, max_tokens=None) -> "list":
        """Micro-batches on the engine's device; explicit sizes override the config's."""
        if micro_batch_size is None and max_tokens is None:
            micro_batch_size, max_tokens = self.config.micro_batch_size, self.config.max_tokens_per_micro_batch
        if max_tokens is not None:  # a rank's budget; the sp ranks of a replica share a micro-batch
            max_tokens *= self.config.sp
        mbs = plan_micro_batches(batch_or_list, micro_batch_size=micro_batch_size, max_tokens=max_tokens,
                                 dp_group=self.dp_group)
        for mb in mbs:
            mb.data = {k: v.to(self.device) for k, v in mb.data.items()}
        return mbs

    def forward_log_probs(self, batch, *, temperature: float = 1.0, with_entropy: bool = False,
                          micro_batch_size: int | None = None, max_tokens_per_micro_batch: int | None = None,
                          disable_adapter: bool = False):
        if self.config.head != "lm":
            raise ValueError("forward_log_probs needs an engine with head='lm' (this one is a critic)")
        with self.adapters_disabled() if disable_adapter else nullcontext(), eval_mode(self):
            return self._forward_batch(batch, temperature=temperature, with_entropy=with_entropy,
                                       micro_batch_size=micro_batch_size, max_tokens=max_tokens_per_micro_batch)

    def forward_values(self, batch, *, micro_batch_size: int | None = None,
                       max_tokens_per_micro_batch: int | None = None):
        if self.config.head != "value":
            raise ValueError("forward_values needs an engine with head='value' (a critic)")
        with eval_mode(self):
            out = self._forward_batch(batch, temperature=1.0, with_entropy=False, micro_batch_size=micro_batch_size,
                                      max_tokens=max_tokens_per_micro_batch)
        return None if out is None else out["values"]


@contextmanager
def eval_mode(engine):
    """Forward-only passes run every module in eval mode: the log-probs and values they compute are
    functions of the weights, never of a dropout mask (a LoRA adapter's dropout stays active in
    train mode, which would make old log-probs and a critic's values random). Each module's own
    mode is restored afterwards, so training keeps exactly the modes it had."""
    models = getattr(engine, "model", None)
    models = models if isinstance(models, (list, tuple)) else [models]
    modes = [(m, m.training) for model in models if isinstance(model, torch.nn.Module) for m in model.modules()]
    for m, _ in modes:
        m.training = False
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training
