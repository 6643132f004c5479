"""ReferenceWorker: the frozen initial policy, for KL penalties and online DPO."""

from __future__ import annotations

from rlframe.config.schema import TrainRoleConfig
from rlframe.single_controller import Dispatch, Worker, register
from rlframe.protocol import DataProto
from rlframe.protocol.step import log_prob_temperature
from rlframe.workers.common import build_train_engine, train_mesh


class ReferenceWorker(Worker):
    def __init__(self, *, model_path: str, layout: TrainRoleConfig, seed: int = 0):
        # Same layout as the actor, forward only (no gradient buffers or optimizer state).
        self.engine = build_train_engine(layout, model_path=model_path, head="lm", total_steps=1, seed=seed, lr=0.0,
                                         frozen=True)
        self.set_mesh(train_mesh(layout))

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        out = self.engine.forward_log_probs(data, temperature=log_prob_temperature(data))
        if out is None:
            return None  # not the last pipeline stage: the dispatcher collects from that one
        return DataProto.from_dict(tensors={"ref_log_prob": out["log_probs"]})
