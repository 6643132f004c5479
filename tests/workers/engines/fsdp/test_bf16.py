"""bf16 mixed precision on CPU (precision=bf16): the fsdp engine at dp2 on real gloo ranks computes
in bf16 with fp32 master weights, fp32 log-probs and fp32 attention (CPU_BF16_ATTENTION), agrees with
the fp32 single-process reference up to bf16 rounding, and learns."""

from __future__ import annotations

import pytest
import torch

from rlframe.utils.spawn import run_distributed
from tests.workers.engines.reference import (
    build_reference, dp_slice, engine_on_mesh, make_batch, reference_outputs, reference_step, sft_loss,
)

HP = dict(lr=1e-3, weight_decay=0.0, eps=1e-6, grad_clip=1.0)


def _bf16_dp2(rank, world, path):
    from rlframe.workers.engines.fsdp.modeling import CPU_BF16_ATTENTION

    batch = make_batch(batch_size=8, seed=5)
    engine = engine_on_mesh(path, dp=2, tp=1, world=world, mixed_precision=True, micro_batch_size=2, **HP)
    mine, rows = dp_slice(batch, engine)
    out = engine.forward_log_probs(mine)
    first = engine.train_step(sft_loss, mine)
    state = {k: v.numpy().copy() for k, v in engine.full_state_dict().items()}  # tensors do not cross processes
    losses = [first["loss"]] + [engine.train_step(sft_loss, mine)["loss"] for _ in range(5)]
    model = engine.model
    return {
        "rows": (rows.start, rows.stop), "log_probs": out["log_probs"].numpy().copy(),
        "log_probs_dtype": str(out["log_probs"].dtype), "first": first, "losses": losses,
        "state": state, "attention": model.config._attn_implementation, "expected_attention": CPU_BF16_ATTENTION,
        "master_dtypes": sorted({str(p.to_local().dtype) for p in model.parameters()}),
    }


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from rlframe.data.tiny_model import build_random_model

    return str(build_random_model(tmp_path_factory.mktemp("bf16") / "m", preset="test", seed=0))


def test_bf16_engine_on_cpu_matches_fp32_reference_and_learns(model_path):
    out = run_distributed(_bf16_dp2, world_size=2, args=(model_path,), timeout_s=300)
    batch = make_batch(batch_size=8, seed=5)
    model = build_reference(model_path, head="lm")
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ref = reference_outputs(model, batch, head="lm")["log_probs"]
    ref_step = reference_step(model, batch, sft_loss, head="lm", **HP)
    mask = batch["response_mask"].bool()
    for r in out:
        assert r["attention"] == r["expected_attention"]
        assert r["master_dtypes"] == ["torch.float32"], "the sharded master weights stay fp32"
        assert r["log_probs_dtype"] == "torch.float32"
        a, b = r["rows"]
        diff = (torch.from_numpy(r["log_probs"]) - ref[a:b])[mask[a:b]].abs()
        # bf16 rounds to 8 bits of mantissa: close to fp32, but not equal
        assert 0 < float(diff.max()) < 0.02, float(diff.max())  # measured 0.002
        assert r["first"]["loss"] == pytest.approx(float(ref_step["loss"]), rel=1e-3)
        assert r["first"]["grad_norm"] == pytest.approx(float(ref_step["grad_norm"]), rel=1e-2)
        assert r["losses"][-1] < 0.9 * r["losses"][0], r["losses"]
    # the first update moves the fp32 weights the way the fp32 reference's update does
    state = out[0]["state"]
    moved = torch.cat([(torch.from_numpy(state[k]) - init[k]).flatten() for k in init])
    expected = torch.cat([(ref_step["state"][k] - init[k]).flatten() for k in init])
    cos = float(torch.nn.functional.cosine_similarity(moved, expected, dim=0))
    assert cos > 0.98, cos  # measured 0.998
