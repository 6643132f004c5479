"""The weight-sync check end to end (controller/trainers/weight_check.py): after an update and a
sync, every slice vLLM holds, read back from its live parameters, hashes like the same slice of the
trainer's weights; a rollout parameter changed after the sync is reported by name and rank, and
nothing else is. Real Ray and vLLM on CPU: FSDP2 dp2 (fp32 and bf16) into vLLM tp2 and megatron pp2
into vLLM tp1 dp2 in the same processes (the hybrid engine), and split placement."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from rlframe.config.schema import AlgorithmConfig, RolloutSection, TrainRoleConfig
from rlframe.single_controller import Dispatch, RayWorkerGroup, ResourcePool, register
from rlframe.controller.trainers.roles import RunRoles, open_weight_channel
from rlframe.controller.trainers.weight_check import check_weight_sync, weight_check_metrics
from rlframe.data.tiny_model import build_random_model
from rlframe.workers.actor import ActorWorker
from rlframe.workers.generator import GeneratorWorker
from rlframe.workers.rollout.vllm_engine import hf_param_shapes
from tests.workers.test_hybrid_engine import prompts, sft_batch

pytest.importorskip("vllm", reason="the weight-sync check reads vLLM's parameters back")

K_PROJ = "model.layers.1.self_attn.k_proj.weight"  # fused into qkv_proj: only its rows may be blamed


class PerturbableActor(ActorWorker):
    """An actor whose test can corrupt one rank's rollout copy of a parameter after the sync."""

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def perturb_rollout(self, name: str, rank: int) -> str | None:
        """Add 1 to this rank's slice of `name` inside vLLM's live tensor; returns its slice key."""
        from rlframe.workers.rollout.checksum import hf_slice_of_kernel_param, slice_key
        from rlframe.workers.rollout.vllm_engine import _kernel_param

        if self.rank != rank:
            return None
        needed = self.rollout.needed_boxes
        with torch.no_grad():
            hf_slice_of_kernel_param(name, needed, _kernel_param(self.rollout._runner.get_model(), name)).add_(1.0)
        return slice_key(name, needed[name])


LAYOUTS = {  # training layout, precision, vLLM tp (2 processes each)
    "fsdp-dp2-to-vllm-tp2": (dict(dp=2), "fp32", 2),
    "fsdp-dp2-bf16-to-vllm-tp2": (dict(dp=2), "bf16", 2),  # fp32 master weights, vLLM in bf16
    "megatron-pp2-to-vllm-dp2": (dict(strategy="megatron", dp=1, pp=2), "fp32", 1),
    "fsdp-dp2-lora-to-vllm-tp2": (dict(dp=2, lora_rank=8), "fp32", 2),  # base weights checked, adapters not
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LAYOUTS))
def test_rollout_holds_the_trainers_weights_after_a_sync_and_a_corruption_is_named(case, tmp_path, ray_cluster):
    layout, precision, gen_tp = LAYOUTS[case]
    model_dir = build_random_model(tmp_path / "model", preset="demo", seed=3)
    tok = AutoTokenizer.from_pretrained(model_dir)
    pool = ResourcePool(procs_per_node=[2], name=f"weight-check-{case}")
    group = RayWorkerGroup(pool, PerturbableActor, name="actor", timeout=600, kwargs=dict(
        model_path=str(model_dir), actor=TrainRoleConfig(**layout, lr=5e-2, mini_batch_size=16, micro_batch_size=8,
                                                        precision=precision),
        algorithm=AlgorithmConfig(), rollout=RolloutSection(tp=gen_tp, kv_cache_bytes=32 << 20), max_model_len=64,
        total_steps=2))
    roles = RunRoles(actor=group, critic=None, ref=None, reward_model=None, pools=[pool], rollout_tp=gen_tp)
    try:
        params = len(hf_param_shapes(str(model_dir))[0])
        start = check_weight_sync(roles)  # syncs first (vLLM started with dummy weights), then compares
        assert (start["sync/mismatched_slices"], start["sync/unverifiable_slices"]) == (0, 0), start
        assert start["sync/checked_slices"] >= 2 * params - 2  # every slice of both tp ranks (vocab may leave one empty)

        batch = prompts(tok)
        group.update_sft(sft_batch(batch, tok.convert_tokens_to_ids("7")))
        skipped = check_weight_sync(roles, sync_first=False)  # the sync is still pending: nothing to compare
        assert skipped["skipped"] and skipped["sync/checked_slices"] == 0
        after = check_weight_sync(roles)  # forces the pending sync, then compares the new weights
        assert weight_check_metrics(after)["sync/mismatched_slices"] == 0, after
        assert after["sync/checked_slices"] == start["sync/checked_slices"] and after["mismatched"] == []
        assert not any(group.weights_stale())
        dtypes = {d.dtype for r in group.rollout_weight_digests() for d in r["slices"]}
        assert dtypes == {"bfloat16" if precision == "bf16" else "float32"}  # hashed as vLLM holds them

        key = next(k for k in group.perturb_rollout(K_PROJ, 1) if k is not None)
        broken = check_weight_sync(roles)
        assert broken["sync/mismatched_slices"] == 1, broken
        assert broken["mismatched"] == [f"{key} (rollout rank 1)"]
        assert broken["skipped"] is None
        assert bool(broken["not_covered"]) == ("lora_rank" in layout), broken["not_covered"]
    finally:
        roles.shutdown()


@pytest.mark.slow
def test_split_placement_check_pushes_first_then_compares(tmp_path, ray_cluster):
    """vLLM in its own group (1 process) and the actor's training group (1 process): the check pushes
    the update the generation group has not received yet, then every slice agrees."""
    model_dir = build_random_model(tmp_path / "model", preset="demo", seed=3)
    tok = AutoTokenizer.from_pretrained(model_dir)
    pools = [ResourcePool(procs_per_node=[1], name="check-actor"), ResourcePool(procs_per_node=[1], name="check-gen")]
    actor = RayWorkerGroup(pools[0], ActorWorker, name="actor", timeout=600, kwargs=dict(
        model_path=str(model_dir), actor=TrainRoleConfig(dp=1, lr=5e-2, mini_batch_size=16, micro_batch_size=8),
        algorithm=AlgorithmConfig(), rollout=None, max_model_len=64, total_steps=1))
    generator = RayWorkerGroup(pools[1], GeneratorWorker, name="rollout", timeout=600, kwargs=dict(
        model_path=str(model_dir), rollout=RolloutSection(tp=1, kv_cache_bytes=32 << 20), max_model_len=64))
    roles = RunRoles(actor=actor, critic=None, ref=None, reward_model=None, pools=pools, rollout_tp=1,
                     generator=generator)
    try:
        open_weight_channel(actor, generator, gen_tp=1, bucket_bytes=1 << 20, timeout_s=300)
        params = len(hf_param_shapes(str(model_dir))[0])
        actor.update_sft(sft_batch(prompts(tok), tok.convert_tokens_to_ids("7")))
        assert check_weight_sync(roles, sync_first=False)["skipped"]  # not pushed yet
        result = check_weight_sync(roles)
        assert not any(actor.weights_stale())
        assert (result["sync/checked_slices"], result["sync/mismatched_slices"]) == (params, 0), result
        assert result["sync/unverifiable_slices"] == 0
    finally:
        roles.shutdown()
