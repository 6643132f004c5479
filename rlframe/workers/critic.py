"""CriticWorker: the value model (a scalar head on the last hidden state) for PPO with GAE."""

from __future__ import annotations

from rlframe.config.schema import TrainRoleConfig
from rlframe.controller import Dispatch, Mesh, Worker, register
from rlframe.protocol import DataProto
from rlframe.workers.common import LOSS_WEIGHTING, build_train_engine, mean_metrics, metrics_only, prefixed
from rlframe.workers.losses import critic_loss_fn


class CriticWorker(Worker):
    def __init__(self, *, model_path: str, critic: TrainRoleConfig, loss_agg_mode: str, total_steps: int,
                 seed: int = 0):
        self.cfg, self.loss_agg_mode = critic, loss_agg_mode
        self.engine = build_train_engine(critic, model_path=model_path, head="value", total_steps=total_steps, seed=seed)
        self.set_mesh(Mesh.of(dp=critic.dp, tp=critic.tp))

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_values(self, data: DataProto) -> DataProto:
        """V(s_t) (B, R): the value of the state before each response token."""
        return DataProto.from_dict(tensors={"values": self.engine.forward_values(data)})

    @register(dispatch=Dispatch.DP_COMPUTE)
    def update_critic(self, data: DataProto) -> DataProto:
        loss_fn = critic_loss_fn(cliprange_value=self.cfg.cliprange_value, loss_agg_mode=self.loss_agg_mode)
        per_rank = self.cfg.mini_batch_size // self.cfg.dp
        step = int(data.meta_info.get("global_step", 0))
        rows = []
        for epoch in range(self.cfg.ppo_epochs):
            for mb in data.iter_minibatches(per_rank, shuffle=True, seed=step * 1000 + epoch + 7):
                m = self.engine.train_step(loss_fn, mb, loss_weighting=LOSS_WEIGHTING[self.loss_agg_mode])
                rows.append(prefixed(m, "critic"))
        return metrics_only(mean_metrics(rows), self.rank_info().dp_rank)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        self.engine.save_checkpoint(path)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        self.engine.load_checkpoint(path)
