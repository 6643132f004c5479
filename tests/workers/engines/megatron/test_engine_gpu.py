"""The megatron engine on a GPU (NCCL), against the fsdp engine on the same weights.

- log-probs: fp32 engines agree within 1e-4; bf16 engines (each in its own bf16 arithmetic) within
  a mean absolute difference of 2e-2 and a max of 0.25 nats (bf16 has 8 bits of mantissa: logits of
  size ~10 carry errors ~0.05, and the two backends round in different places); more left padding
  leaves megatron's bf16 log-probs unchanged, bit for bit.
- one PPO step with TP=1 (fp32): same loss and gradient norm as the fsdp engine (1e-4 relative), the
  weights change, the new log-probs agree with fsdp's after its step (1e-3).
- weights: the engine's full state (resharded out of its training layout) equals the checkpoint
  (bf16-rounded where the engine trains in bf16).
Run with `pytest -m gpu tests/workers/engines/megatron` on a machine with CUDA and megatron-core.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

from rlframe.utils.spawn import run_distributed  # noqa: E402
from tests.workers.engines.megatron.models import build_hf_model  # noqa: E402


def _batch(vocab: int, *, seed: int = 0, b: int = 8, p: int = 12, r: int = 10):
    """Left-padded prompts + right-padded responses, the rollout's layout."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (b, p + r), generator=g)
    am = torch.ones(b, p + r, dtype=torch.long)
    for i in range(b):
        am[i, : i % 4] = 0  # left padding of the prompt
        am[i, p + r - (i % 3):] = 0  # right padding of the response
    ids[am == 0] = 0
    pos = (am.cumsum(1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": am, "position_ids": pos, "responses": ids[:, p:],
            "response_mask": am[:, p:], "old_log_probs": torch.zeros(b, r), "advantages": torch.randn(b, r, generator=g)}


def _engines(model_path, *, mixed_precision, lr=0.0):
    from rlframe.workers.engines import TrainEngineConfig, get_train_engine

    cfg = dict(model_path=model_path, lr=lr, mixed_precision=mixed_precision, micro_batch_size=4, grad_clip=1e9)
    return (get_train_engine("fsdp")(TrainEngineConfig(**cfg)), get_train_engine("megatron")(TrainEngineConfig(**cfg)))


def _log_probs(rank, world, model_path, mixed_precision):
    fsdp, meg = _engines(model_path, mixed_precision=mixed_precision)
    batch = _batch(64)
    a, b = fsdp.forward_log_probs(batch, with_entropy=True), meg.forward_log_probs(batch, with_entropy=True)
    mask = batch["response_mask"].bool()
    out = {k: ((a[k] - b[k]).abs()[mask].mean().item(), (a[k] - b[k]).abs()[mask].max().item()) for k in a}
    # 7 more padding columns left of every prompt: megatron computes the same left-aligned rows
    padded = {**batch, **{k: torch.cat([batch[k].new_zeros(batch[k].shape[0], 7), batch[k]], 1)
                          for k in ("input_ids", "attention_mask", "position_ids")}}
    out["left_padding"] = (meg.forward_log_probs(padded)["log_probs"] - b["log_probs"]).abs().max().item()
    return out


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_hf_model(str(tmp_path_factory.mktemp("meg_gpu") / "qwen2"), "qwen2")


def test_log_probs_match_fsdp_fp32(model_path):
    diffs = run_distributed(_log_probs, world_size=1, args=(model_path, False), backend="nccl")[0]
    assert diffs["log_probs"][1] < 1e-4 and diffs["entropy"][1] < 1e-4, diffs


def test_log_probs_match_fsdp_bf16(model_path):
    diffs = run_distributed(_log_probs, world_size=1, args=(model_path, True), backend="nccl")[0]
    assert diffs["log_probs"][0] < 2e-2 and diffs["log_probs"][1] < 0.25, diffs
    assert diffs["left_padding"] == 0.0, diffs


def _ppo_step(rank, world, model_path):
    from rlframe.workers.losses import actor_loss_fn
    from rlframe.config.schema import AlgorithmConfig

    fsdp, meg = _engines(model_path, mixed_precision=False, lr=1e-3)
    batch = _batch(64, seed=1)
    old = fsdp.forward_log_probs(batch)["log_probs"]
    batch["old_log_probs"] = old
    loss_fn = actor_loss_fn(AlgorithmConfig())
    before = {n: t.clone() for n, t in meg.full_state_dict().items()}
    ma, mb = fsdp.train_step(loss_fn, batch), meg.train_step(loss_fn, batch)
    after = meg.full_state_dict()
    changed = sum(not torch.equal(before[n], after[n]) for n in before)
    new_a, new_b = fsdp.forward_log_probs(batch)["log_probs"], meg.forward_log_probs(batch)["log_probs"]
    return {"fsdp": ma, "megatron": mb, "changed": changed, "total": len(before),
            "moved": (new_b - old).abs().max().item(), "after_diff": (new_a - new_b).abs().max().item()}


def test_one_ppo_step_tp1_matches_fsdp(model_path):
    out = run_distributed(_ppo_step, world_size=1, args=(model_path,), backend="nccl")[0]
    fsdp, meg = out["fsdp"], out["megatron"]
    assert meg["skipped"] == 0.0 and out["changed"] == out["total"], out
    assert abs(meg["loss"] - fsdp["loss"]) <= 1e-4 * max(1.0, abs(fsdp["loss"])), out
    assert abs(meg["grad_norm"] - fsdp["grad_norm"]) <= 1e-4 * fsdp["grad_norm"], out
    assert out["moved"] > 1e-3 and out["after_diff"] < 1e-3, out


def _full_state(rank, world, model_path):
    from safetensors.torch import load_file

    from rlframe.workers.engines import TrainEngineConfig, get_train_engine

    meg = get_train_engine("megatron")(TrainEngineConfig(model_path=model_path))  # bf16 on GPU
    full = meg.full_state_dict()
    src = load_file(f"{model_path}/model.safetensors")
    return max((full[n].float() - src[n].to(torch.bfloat16).float()).abs().max().item() for n in src)


def test_synced_weights_equal_source(model_path):
    assert run_distributed(_full_state, world_size=1, args=(model_path,), backend="nccl")[0] == 0.0
