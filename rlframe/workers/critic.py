"""CriticWorker: the value model (a scalar head on the last hidden state) for PPO with GAE."""

from __future__ import annotations

from rlframe.config.schema import TrainRoleConfig
from rlframe.single_controller import Dispatch, register
from rlframe.protocol import DataProto
from rlframe.workers.common import RL_LOSS_WEIGHTING, build_train_engine, train_mesh
from rlframe.workers.losses import critic_loss_fn
from rlframe.workers.trained_role import TrainedRole


class CriticWorker(TrainedRole):
    def __init__(self, *, model_path: str, critic: TrainRoleConfig, loss_agg_mode: str, total_steps: int,
                 seed: int = 0, loss_scale_factor: float | None = None):
        self.cfg, self.loss_agg_mode, self.loss_scale_factor = critic, loss_agg_mode, loss_scale_factor
        self.engine = build_train_engine(critic, model_path=model_path, head="value", total_steps=total_steps, seed=seed)
        self.set_mesh(train_mesh(critic))

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_values(self, data: DataProto) -> DataProto:
        """V(s_t) (B, R): the value of the state before each response token."""
        values = self.engine.forward_values(data)
        if values is None:
            return None  # not the last pipeline stage: the dispatcher collects from that one
        return DataProto.from_dict(tensors={"values": values})

    @register(dispatch=Dispatch.DP_COMPUTE)
    def update_critic(self, data: DataProto) -> DataProto:
        loss_fn = critic_loss_fn(cliprange_value=self.cfg.cliprange_value, loss_agg_mode=self.loss_agg_mode,
                                 loss_scale_factor=self.loss_scale_factor)
        return self.run_epochs(data, loss_fn, prefix="critic", loss_weighting=RL_LOSS_WEIGHTING,
                               seed_salt=7)
