"""ActorWorker: the policy, trained by a training engine and sampled by a rollout engine that share
its process (the hybrid engine).

Two meshes: "default" is the training layout (dp, tp) that `compute_log_prob` / `update_actor`
split batches over; "rollout" is the generation layout (dp_g = world / tp_g, tp_g) that
`generate_sequences` splits prompts over. Before each generation, the training shards are
resharded into the generation layout by the plan made once at start-up (rlframe.resharding) and
streamed bucket by bucket into the rollout engine; nothing touches the disk.

With LoRA (actor.lora_rank > 0) only the adapters train and only they are synced: the plan covers
the lora_A/lora_B factors, which go into the slices vLLM's LoRA layers keep, and the rollout engine
serves base + adapter. The reference policy is this worker's own model with the adapters off
(`compute_ref_log_prob`), so no second copy of the weights is loaded.
"""

from __future__ import annotations

from rlframe.protocol.step import log_prob_temperature, step_settings

from rlframe.config.schema import AlgorithmConfig, RolloutSection, TrainRoleConfig
from rlframe.single_controller import Dispatch, Mesh, register
from rlframe.single_controller.dispatch import METRICS_KEY
from rlframe.protocol import DataProto
from rlframe.resharding.channel import P2PChannel
from rlframe.resharding.executor import execute_plan
from rlframe.resharding.layout import generation_layout
from rlframe.workers.common import (
    RL_LOSS_WEIGHTING, build_train_engine, delta_state, lora_sync_config, metrics_only, prefixed, rollout_config,
    sync_metrics, train_mesh,
)
from rlframe.workers.losses import actor_loss_fn, check_on_policy, dpo_loss_fn, sft_loss_fn
from rlframe.workers.rollout import build_rollout_engine
from rlframe.utils.timing import timed
from rlframe.workers.trained_role import TrainedRole
from rlframe.plugins import backend_spec
from rlframe.workers.weight_plan import split_generation_layout
from rlframe.workers.rollout.config import sampling_of


class ActorWorker(TrainedRole):
    def __init__(self, *, model_path: str, actor: TrainRoleConfig, algorithm: AlgorithmConfig,
                 rollout: RolloutSection | None, max_model_len: int, total_steps: int, seed: int = 0):
        self.cfg, self.algo, self.model_path = actor, algorithm, model_path
        self.lora = actor.lora_rank > 0
        self.engine = build_train_engine(actor, model_path=model_path, head="lm", total_steps=total_steps, seed=seed)
        self.set_mesh(train_mesh(actor))
        self.rollout, self._delta = None, None
        if rollout is not None:
            self._delta = delta_state(rollout.delta_syncs(), lora=self.lora)
            self.set_mesh(Mesh.of(dp=self.world_size // rollout.tp, tp=rollout.tp), name="rollout")
            on_gpu = self.engine.device.type == "cuda"
            self.rollout = build_rollout_engine(model_path, config=rollout_config(
                rollout, max_model_len=max_model_len, seed=seed, compute_dtype=self.engine.compute_dtype, on_gpu=on_gpu,
                actor=actor))
            self.bucket_bytes = rollout.bucket_bytes
            self._plan = self._make_reshard_plan(gen_tp=rollout.tp)
            if self.rollout.awaits_full_sync:  # dummy weights: nothing to keep, and the first generation's
                self.rollout.sleep(full_sync_next=True)  # sync then runs as every later one (KV cache freed)
        # True after an update: the rollout engine holds older weights. At start-up it holds the checkpoint
        # the trainer starts from, or nothing usable (dummy weights: `_sync_pending` covers that case).
        self._weights_stale = False

    # ---- hybrid engine: training layout -> generation layout -----------------------------------
    def _make_reshard_plan(self, *, gen_tp: int):
        src = self.engine.resharding_layout()  # the engine asserts its shards match this layout
        dst, _ = generation_layout(src, tp=gen_tp)  # the same layout and scheme the dry run prints
        return self.rollout.spec.weight_plan(self._synced_metas(), src=src, dst=dst, model_path=self.model_path)

    def _synced_metas(self) -> dict:
        """What a sync sends: the adapters with LoRA (as trained), else every parameter in the rollout's
        dtype, which is the engine's compute dtype (HF name -> ParamMeta): vLLM's load would cast the
        fsdp engine's fp32 shards to it anyway, so a bf16 run moves half the bytes, and a delta sync
        compares what the rollout holds."""
        from rlframe.resharding.planner import ParamMeta

        if self.lora:
            return self.engine.lora_param_metas()
        dtype = self.engine.compute_dtype
        return {name: ParamMeta(m.shape, dtype) for name, m in self.engine.param_metas().items()}

    def _synced_shards(self) -> dict:
        """This rank's shards as held; the executor casts each piece to the plan's dtype as it sends it."""
        shards = self.engine.lora_local_shards() if self.lora else self.engine.local_shards()
        return {name: t for name, (_, _, t) in shards.items()}

    def _sync_pending(self) -> bool:
        """The rollout engine must be synced before it generates: the actor was updated since, or the
        engine holds no usable weights (started with dummy weights, or dropped them in a sleep)."""
        return self._weights_stale or (self.rollout is not None and self.rollout.awaits_full_sync)

    def _sync_weights(self) -> dict[str, float]:
        if not self._sync_pending():
            return {}
        update = self.rollout.lora_update(lora_sync_config(self.cfg)) if self.lora else self.rollout.weight_update()
        with update as consume:
            stats = execute_plan(self._plan, local=self._synced_shards(), consumer=consume,
                                 bucket_bytes=self.bucket_bytes, delta=self._delta)
        self._weights_stale = False
        recv = self.rollout.last_sync_stats  # measured on the receiving side (weight_sync.py)
        return {**sync_metrics(stats, self._delta), "reshard/bytes_received_mb": stats.bytes_received / 2**20,
                "reshard/peak_extra_mb": stats.peak_extra_bytes / 2**20, "reshard/buckets": stats.num_buckets,
                "reshard/recv_peak_held_mb": recv.peak_held_bytes / 2**20,
                # perf/: measurements of the process, which vary from run to run
                **{f"perf/weight_sync_peak_{k}_extra_mb": v / 2**20 for k, v in
                   (("rss", recv.peak_rss_extra_bytes), ("device", recv.peak_device_extra_bytes)) if v >= 0}}

    # ---- checking a sync: rollout slices read back vs the trainer's (rollout/checksum.py) --------
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def rollout_weight_digests(self, sync_first: bool = True) -> dict | None:
        """{"slices": [SliceDigest] this rank's rollout engine holds, "not_covered": [what is not read
        back]}. The hybrid engine syncs lazily, at the next generate: with `sync_first` a pending sync
        runs now (collective over the group, as in generate, whose own sync then has nothing to do),
        so the check sees the weights the next generation uses; without it a pending sync gives None
        (the engine still holds the previous version). A sleeping engine's weights are woken to be
        read and put back to sleep, keeping them (level 1), so the next generation uses what was checked."""
        if self.rollout is None:
            raise ValueError("this actor has no rollout engine (resources.placement=split): read the generation "
                             "group's rollout_weight_digests instead")
        if self._sync_pending() and not sync_first:
            return None
        asleep = self.rollout.sleeping
        self.rollout.wake(("weights",))
        try:
            self._sync_weights()  # nothing to do unless stale
            slices = self.rollout.weight_slice_digests()
        finally:
            if asleep:
                self.rollout.sleep()
        return {"slices": slices, "not_covered": self.rollout.unchecked_weights()}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def trainer_weight_digests(self, requests: list) -> dict[str, str] | None:
        """{slice key: sha256} of the current training weights' slices `requests` [(HF name, Box, rollout
        dtype name)], cast to that dtype as a sync casts; collective over the training ranks, answered
        by the first (None on the others). With LoRA these are the base weights (adapters are not
        compared)."""
        from transformers import AutoConfig

        from rlframe.resharding.formats import ModelDims
        from rlframe.workers.rollout.checksum import DEFAULT_BUCKET_BYTES, trainer_slice_digests

        layers = ModelDims.from_hf_config(AutoConfig.from_pretrained(self.model_path)).num_layers
        return trainer_slice_digests(self.engine, requests, num_layers=layers,
                                     bucket_bytes=getattr(self, "bucket_bytes", DEFAULT_BUCKET_BYTES))

    # ---- split placement: the generation group has its own processes ----------------------------
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def weight_plan_inputs(self):
        """(HF name -> ParamMeta, training Layout): what the generation group plans the sync from."""
        return self._synced_metas(), self.engine.resharding_layout()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def join_weight_channel(self, *, addr: str, port: int, backend: str, gen_tp: int, gen_world: int, bucket_bytes: int,
                            timeout_s: float, delta_full_every: int | None = None, transport: str = "gloo",
                            directory: str | None = None, chain: bool = False) -> None:
        """Join the channel to the generation group (this group's ranks first) and plan the sync;
        collective with the generation group's `join_weight_channel`. `backend`: the generation group's
        rollout.backend, whose spec says which slices its ranks hold."""
        src = self.engine.resharding_layout()
        self._channel = P2PChannel(addr=addr, port=port, rank=self.rank, world_size=src.size + gen_world,
                                   timeout_s=timeout_s, transport=transport, directory=directory,
                                   ring_room=4 * bucket_bytes)
        self._split_plan = backend_spec(backend).weight_plan(self._synced_metas(), src=src, model_path=self.model_path,
                                     dst=split_generation_layout(src, tp=gen_tp, world=gen_world, chain=chain))
        self.bucket_bytes = bucket_bytes
        self._delta = delta_state(delta_full_every, lora=self.lora)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def weights_stale(self) -> bool:
        return self._weights_stale

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def send_weights(self) -> dict[str, float]:
        """This rank's training shards straight to the generation ranks that need them (collective
        with the generation group's `receive_weights`)."""
        stats = execute_plan(self._split_plan, local=self._synced_shards(), consumer=_nothing_arrives,
                             bucket_bytes=self.bucket_bytes, channel=self._channel, delta=self._delta)
        self._weights_stale = False
        return {**sync_metrics(stats, self._delta), "reshard/send_peak_extra_mb": stats.peak_extra_bytes / 2**20}

    @register(dispatch=Dispatch.DP_COMPUTE, mesh="rollout")
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample responses for this generation replica's prompts; `meta_info["sampling"]` holds
        its SamplingConfig. Returns the rollout batch (n samples per prompt adjacent)."""
        sampling = sampling_of(prompts)
        timing: dict[str, float] = {}
        self.rollout.wake(("weights",))  # resident before the sync writes them (GPU sleep offloads them)
        with timed(timing, "update_weights"):
            sync = self._sync_weights()
        self.rollout.wake(("kv_cache",))  # after the sync's buffers are freed
        with timed(timing, "gen_local"):
            out = self.rollout.generate(prompts, sampling)
        # A full-weight sync rewrites every weight, so vLLM may drop them instead of copying them to host
        # memory and back (sleep level 2); the next wake then syncs even without an update in between
        # (validation, agent turns: `_sync_pending`). LoRA syncs only adapters: the base is kept.
        self.rollout.sleep(full_sync_next=not self.lora)
        out.meta_info = {METRICS_KEY: {**timing, **sync}}
        return out

    # ---- training ------------------------------------------------------------------------------
    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """Log-probs (B, R) of the responses under the current policy: `old_log_probs`."""
        out = self.engine.forward_log_probs(data, temperature=log_prob_temperature(data),
                                            with_entropy=True)
        if out is None:
            return None  # not the last pipeline stage: the dispatcher collects from that one
        return DataProto.from_dict(tensors={"old_log_probs": out["log_probs"], "entropy": out["entropy"]})

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """LoRA: the reference policy's log-probs (B, R), from this model with its adapters off."""
        if not self.lora:
            raise ValueError("the actor serves reference log-probs only with LoRA (its base model with adapters "
                             "off); without it the run has a reference worker group")
        out = self.engine.forward_log_probs(data, temperature=log_prob_temperature(data),
                                            disable_adapter=True)
        if out is None:
            return None
        return DataProto.from_dict(tensors={"ref_log_prob": out["log_probs"]})

    @register(dispatch=Dispatch.DP_COMPUTE)
    def update_actor(self, data: DataProto) -> DataProto:
        """PPO-style epochs over shuffled mini-batches; one optimizer step per mini-batch."""
        step = step_settings(data)
        if step.on_policy:  # set by the trainer: see actor_loss_fn
            check_on_policy(ppo_epochs=self.cfg.ppo_epochs, mini_batch_rows=self.cfg.rows_per_rank,
                            rows=len(data))
        loss_fn = actor_loss_fn(self.algo, on_policy=step.on_policy)
        return self.run_epochs(data, loss_fn, prefix="actor", loss_weighting=RL_LOSS_WEIGHTING,
                               temperature=log_prob_temperature(data), with_entropy=True,
                               allow_empty=step.allow_empty_minibatches)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def update_actor_pairs(self, data: DataProto) -> DataProto:
        """DPO's update on (chosen, rejected) rows kept adjacent: no shuffling, each mini-batch one
        micro-batch (an even number of rows, so no pair is split). The pair trainer calls it."""
        def in_order(batch, per_rank):
            return [[mb] for mb in batch.split(max(2, per_rank - per_rank % 2))]

        return self.run_epochs(data, dpo_loss_fn(beta=self.algo.dpo_beta), prefix="actor", loss_weighting="samples",
                               minibatches=in_order, temperature=log_prob_temperature(data))

    def after_update(self) -> None:
        self._weights_stale = True  # the rollout engine gets the new weights before its next generate

    @register(dispatch=Dispatch.DP_COMPUTE)
    def update_sft(self, data: DataProto) -> DataProto:
        """One optimizer step of supervised fine-tuning on (prompt, response) rows."""
        m = self.engine.train_step(sft_loss_fn(), data, loss_weighting="tokens")
        self.after_update()
        return metrics_only(prefixed(m, "sft"), self.rank_info().dp_rank)

    def close(self) -> None:
        if self.rollout is not None:
            self.rollout.shutdown()


def _nothing_arrives(pieces) -> None:
    raise AssertionError("a training rank received pieces of a sync into the generation group")
