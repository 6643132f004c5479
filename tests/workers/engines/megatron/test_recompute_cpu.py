"""activation_checkpointing on the megatron engine (megatron-core's full recompute, one layer per
unit) on CPU at tp2: one training step gives the loss, gradient norm and new weights of the same
step without it, and the backward does recompute every layer."""

import pytest

pytest.importorskip("megatron.core")

from rlframe.utils.spawn import run_distributed  # noqa: E402
from tests.workers.engines.megatron.models import build_hf_model  # noqa: E402


def _step(rank, world, path):
    from rlframe.workers.engines import TrainEngineConfig, get_train_engine
    from tests.workers.engines.reference import make_batch, policy_loss

    batch = make_batch(batch_size=4, vocab=64, seed=3)
    out = {}
    for on in (False, True):
        engine = get_train_engine("megatron")(TrainEngineConfig(
            model_path=path, tp=2, lr=2e-3, eps=1e-3, grad_clip=None, activation_checkpointing=on))
        calls = []  # forwards of the first layer's MLP: once per micro-batch, twice with recompute
        engine.model.module.decoder.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
        before = engine.full_state_dict()
        metrics = engine.train_step(policy_loss, batch, with_entropy=True)
        after = engine.full_state_dict()
        out[on] = {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "mlp_forwards": len(calls),
                   "after": after, "moved": max(float((after[k] - before[k]).abs().max()) for k in after)}
    return {"forwards": (out[False]["mlp_forwards"], out[True]["mlp_forwards"]),
            "loss": abs(out[True]["loss"] - out[False]["loss"]),
            "grad_norm": abs(out[True]["grad_norm"] - out[False]["grad_norm"]),
            "weights": max(float((out[True]["after"][k] - out[False]["after"][k]).abs().max()) for k in out[False]["after"]),
            "moved": out[False]["moved"]}


def test_full_recompute_gives_the_same_step(tmp_path):
    path = build_hf_model(str(tmp_path / "lm"), "qwen2")
    for res in run_distributed(_step, world_size=2, args=(path,), timeout_s=300):
        off, on = res["forwards"]
        assert off >= 1 and on == 2 * off, res
        assert res["moved"] > 1e-4, res
        assert res["loss"] <= 1e-6 and res["grad_norm"] <= 1e-6 and res["weights"] <= 1e-6, res
