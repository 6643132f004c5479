"""Split placement: vLLM in its own worker group (2 processes, tp2), the actor's training group
elsewhere (fsdp dp2, 2 processes); after an update the training shards go over the weight channel
straight into vLLM's tp slices. Real Ray, gloo, vLLM."""

from math import prod

import pytest
import torch
from transformers import AutoTokenizer

from rlframe.config.schema import AlgorithmConfig, RolloutSection, TrainRoleConfig
from rlframe.single_controller import RayWorkerGroup, ResourcePool
from rlframe.controller.trainers.roles import RunRoles, open_weight_channel
from rlframe.data.tiny_model import build_random_model
from rlframe.workers.actor import ActorWorker
from rlframe.workers.generator import GeneratorWorker
from rlframe.workers.rollout.weight_sync import vllm_tp_box
from rlframe.workers.rollout import SamplingConfig
from tests.workers.test_hybrid_engine import NEW_TOKENS, hf_greedy, prompts, responses_equal, sft_batch

pytest.importorskip("vllm", reason="split placement generates with vLLM")


def _vllm_box_bytes(model_dir, *, tp_rank: int, tp: int) -> int:
    """What a generation rank must receive when it holds nothing: its whole vLLM box, fp32."""
    from rlframe.workers.rollout.vllm_engine import hf_param_shapes

    shapes, hf = hf_param_shapes(str(model_dir))
    head_dim = hf.hidden_size // hf.num_attention_heads
    return sum(prod(vllm_tp_box(n, s, tp_rank=tp_rank, tp_size=tp, num_kv_heads=hf.num_key_value_heads,
                                head_dim=head_dim).sizes) for n, s in shapes.items()) * 4


def greedy_input(batch):
    gen_in = batch.select(batch_keys=["input_ids", "attention_mask", "position_ids"])
    gen_in.meta_info = {"sampling": SamplingConfig(n=1, temperature=0.0, max_new_tokens=NEW_TOKENS)}
    return gen_in


@pytest.mark.slow
def test_split_generation_group_gets_the_trained_weights(tmp_path, ray_cluster):
    model_dir = build_random_model(tmp_path / "model", preset="demo", seed=3)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rollout = RolloutSection(tp=2, kv_cache_bytes=32 << 20)
    pools = [ResourcePool(procs_per_node=[2], name="split-actor"), ResourcePool(procs_per_node=[2], name="split-gen")]
    actor_cfg = TrainRoleConfig(dp=2, lr=5e-2, mini_batch_size=16, micro_batch_size=8)
    actor = RayWorkerGroup(pools[0], ActorWorker, name="actor", timeout=600, kwargs=dict(
        model_path=str(model_dir), actor=actor_cfg, algorithm=AlgorithmConfig(), rollout=None, max_model_len=64,
        total_steps=1))
    generator = RayWorkerGroup(pools[1], GeneratorWorker, name="rollout", timeout=600, kwargs=dict(
        model_path=str(model_dir), rollout=rollout, max_model_len=64, actor=actor_cfg))
    roles = RunRoles(actor=actor, critic=None, ref=None, reward_model=None, pools=pools, rollout_tp=2,
                     generator=generator)
    try:
        open_weight_channel(actor, generator, gen_tp=2, bucket_bytes=1 << 20, timeout_s=300)
        batch = prompts(tok)
        assert all(generator.awaits_full_sync())  # started with dummy weights: the first generation pushes first
        before = roles.generate_sequences(greedy_input(batch))
        assert not any(generator.awaits_full_sync())
        assert responses_equal(before, hf_greedy(model_dir, batch), tok.eos_token_id)

        actor.update_sft(sft_batch(batch, tok.convert_tokens_to_ids("7")))  # a large step: greedy output changes
        assert all(actor.weights_stale())
        sync = roles.push_weights()
        assert not any(actor.weights_stale())
        after = roles.generate_sequences(greedy_input(batch))
        actor.export_hf(str(tmp_path / "updated"))
        tok.save_pretrained(str(tmp_path / "updated"))
        assert not torch.equal(before.batch["responses"], after.batch["responses"]), "weights did not reach vLLM"
        assert responses_equal(after, hf_greedy(tmp_path / "updated", batch), tok.eos_token_id)

        # each generation rank received exactly its vLLM tp slice (it held nothing), in 1 MiB buckets
        planned = generator.planned_bytes_received()
        assert planned == [_vllm_box_bytes(model_dir, tp_rank=r, tp=2) for r in range(2)]
        assert sync["reshard/bytes_received_mb"] == pytest.approx(max(planned) / 2**20)
        assert sync["reshard/peak_extra_mb"] <= 1.0 and sync["reshard/buckets"] > 1
    finally:
        roles.shutdown()
