"""GeneratorWorker: the rollout engine in its own worker group (split placement). Its processes
hold only vLLM; after each actor update the training group sends the new weights over a
`P2PChannel` straight into vLLM's tp slices (`receive_weights`, collective with the actor's
`send_weights`), bucket by bucket, never through the driver and never as full gathers."""

from __future__ import annotations

import time

import torch

from rlframe.config.schema import RolloutSection, TrainRoleConfig
from rlframe.single_controller import Dispatch, Mesh, Worker, register
from rlframe.single_controller.dispatch import METRICS_KEY
from rlframe.protocol import DataProto
from rlframe.resharding.channel import P2PChannel
from rlframe.resharding.executor import execute_plan
from rlframe.resharding.layout import Layout
from rlframe.utils.timing import timed
from rlframe.workers.common import delta_state, lora_sync_config, rollout_config
from rlframe.workers.engines.base import precision_dtype
from rlframe.workers.rollout import build_rollout_engine
from rlframe.workers.weight_plan import relay_of, split_generation_layout
from rlframe.workers.rollout.config import sampling_of


class GeneratorWorker(Worker):
    def __init__(self, *, model_path: str, rollout: RolloutSection, max_model_len: int, seed: int = 0,
                 actor: TrainRoleConfig | None = None):
        """actor: the actor's settings; with its LoRA on, this engine serves the adapters it is sent."""
        on_gpu = torch.cuda.is_available()
        dtype = precision_dtype(actor.precision if actor else "auto", on_gpu=on_gpu)  # as the actor trains
        self.model_path, self.tp = model_path, rollout.tp
        self.lora_config = lora_sync_config(actor) if actor is not None and actor.lora_rank > 0 else None
        self.set_mesh(Mesh.of(dp=self.world_size // rollout.tp, tp=rollout.tp))
        self.rollout = build_rollout_engine(model_path, config=rollout_config(
            rollout, max_model_len=max_model_len, seed=seed, compute_dtype=dtype, on_gpu=on_gpu, actor=actor))

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def join_weight_channel(self, *, addr: str, port: int, train_layout: Layout, metas: dict, bucket_bytes: int,
                            timeout_s: float, delta_full_every: int | None = None, transport: str = "gloo",
                            directory: str | None = None, chain: bool = False) -> None:
        """Join the channel after the training group's ranks and plan the same sync they planned."""
        self._channel = P2PChannel(addr=addr, port=port, rank=train_layout.size + self.rank,
                                   world_size=train_layout.size + self.world_size, timeout_s=timeout_s,
                                   transport=transport, directory=directory, ring_room=4 * bucket_bytes)
        dst = split_generation_layout(train_layout, tp=self.tp, world=self.world_size, chain=chain)
        self._plan = self.rollout.spec.weight_plan(metas, src=train_layout, dst=dst, model_path=self.model_path)
        self._relay = relay_of(train_layout, tp=self.tp, world=self.world_size,
                               channel_rank=self._channel.rank) if chain else None
        self.bucket_bytes = bucket_bytes
        self._delta = delta_state(delta_full_every, lora=self.lora_config is not None)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def receive_weights(self) -> dict[str, float]:
        update = self.rollout.weight_update() if self.lora_config is None else self.rollout.lora_update(self.lora_config)
        with update as consume:
            stats = execute_plan(self._plan, local={}, consumer=consume, bucket_bytes=self.bucket_bytes,
                                 channel=self._channel, delta=self._delta, relay=self._relay)
        recv = self.rollout.last_sync_stats
        return {"reshard/bytes_received_mb": stats.bytes_received / 2**20,
                "reshard/peak_extra_mb": stats.peak_extra_bytes / 2**20, "reshard/buckets": stats.num_buckets,
                "reshard/recv_peak_held_mb": recv.peak_held_bytes / 2**20}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def awaits_full_sync(self) -> bool:
        """The engine holds no usable weights yet (started with dummy weights): push before generating."""
        return self.rollout.awaits_full_sync

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def planned_bytes_received(self) -> int:
        """What the plan says this rank receives (its whole vLLM box: it holds nothing before); in a
        chain, what the first replica's rank at its tp position receives, which it receives too."""
        return self._plan.bytes_received(self._relay.mirror if self._relay else self._channel.rank)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def rollout_weight_digests(self) -> dict:
        """{"slices": [SliceDigest] of the vLLM slices this rank holds, read back, "not_covered": [what
        is not read back]} (rollout/checksum.py); compare them after a push."""
        return {"slices": self.rollout.weight_slice_digests(), "not_covered": self.rollout.unchecked_weights()}

    @register(dispatch=Dispatch.DP_COMPUTE)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample responses for this replica's prompts (`meta_info["sampling"]`), as the actor does
        in the hybrid engine."""
        sampling = sampling_of(prompts)
        timing: dict[str, float] = {"async/gen_start_unix": time.time()}  # wall clock: overlap with training
        with timed(timing, "gen_local"):
            out = self.rollout.generate(prompts, sampling)
        timing["async/gen_end_unix"] = time.time()
        out.meta_info = {METRICS_KEY: timing}
        return out

    def close(self) -> None:
        self.rollout.shutdown()
