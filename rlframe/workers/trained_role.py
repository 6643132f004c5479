"""TrainedRole: what the actor and the critic share as owners of a training engine: PPO-style
epochs over shuffled mini-batches, and checkpoints / HF export as registered methods."""

from __future__ import annotations

from rlframe.config.schema import TrainRoleConfig
from rlframe.single_controller import Dispatch, Worker, register
from rlframe.protocol import DataProto
from rlframe.workers.common import mean_metrics, metrics_only, prefixed
from rlframe.protocol.step import step_settings


class TrainedRole(Worker):
    cfg: TrainRoleConfig

    def run_epochs(self, data: DataProto, loss_fn, *, prefix: str, loss_weighting: str, seed_salt: int = 0,
                   minibatches=None, **step_kwargs) -> DataProto:
        """`cfg.ppo_epochs` passes over this rank's chunk, one optimizer step per mini-batch of
        `cfg.mini_batch_size / dp` rows (shuffled, seeded by the global step so a resumed run
        draws the same mini-batches). `minibatches(data, per_rank)` replaces the shuffled split
        where rows must stay in order (e.g. DPO's pairs)."""
        per_rank = self.cfg.rows_per_rank
        settings = step_settings(data)
        step = settings.global_step
        rows = []
        for epoch in range(self.cfg.ppo_epochs):
            split = minibatches(data, per_rank) if minibatches is not None else data.iter_minibatches(
                per_rank, shuffle=True, seed=step * 1000 + epoch + seed_salt)
            for mb in split:
                m = self.engine.train_step(loss_fn, mb, loss_weighting=loss_weighting, **step_kwargs)
                rows.append(prefixed(m, prefix))
        self.after_update()
        # a mini-batch skipped for having no token left (allow_empty) is counted, not averaged in
        empty = sum(1 for r in rows if r.get(f"{prefix}/empty"))
        metrics = mean_metrics([r for r in rows if not r.get(f"{prefix}/empty")] or rows)
        if empty:
            metrics[f"{prefix}/empty"] = float(empty)
        if settings.report_first_minibatch and rows:  # preflight: the first step's own values
            metrics.update({k.replace("/", "/first_mb_", 1): v for k, v in rows[0].items()})
        return metrics_only(metrics, self.rank_info().dp_rank)

    def after_update(self) -> None:
        """Hook: the weights changed (an optimizer step or a checkpoint load)."""

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        self.engine.save_checkpoint(path)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        self.engine.load_checkpoint(path)
        self.after_update()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def export_hf(self, path: str) -> None:
        self.engine.export_hf(path)
