"""The default PPO job with megatron-core actor, reference and critic on CPU (tp2, and pp2 with the
1F1B schedule): real Ray, gloo, vLLM, the actor's weights resharded from the megatron layout into
vLLM each step. The same job on the fsdp engine gives the same step-1 numbers (both equal one
process). Colocated megatron roles share one model-parallel state per process: same tp and pp."""

import json
import math
from math import prod
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlframe.plan.dry_run import model_dims
from rlframe.controller.trainers.prepare import model_path
from rlframe.resharding.formats import hf_param_shapes
from rlframe.resharding.layout import Layout
from tests.controller.trainers.test_end_to_end import run

LAYOUTS = {
    "tp2": ["actor.strategy=megatron", "actor.dp=1", "actor.tp=2", "critic.strategy=megatron", "critic.dp=1",
            "critic.tp=2"],
    "pp2": ["actor.strategy=megatron", "actor.dp=1", "actor.pp=2", "critic.strategy=megatron", "critic.dp=1",
            "critic.pp=2"],
}
SHARED = ["data.train_batch_size=16", "trainer.save_every=0"]


def _steps(summary):
    rows = [json.loads(l) for l in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


def _hybridflow_mib(cfg) -> float:
    """The most any rank receives in HybridFlow's layout for vLLM tp 1 (the formula): the whole
    fp32 model minus the training shard the rank already holds, which lies inside it."""
    dims = model_dims(cfg)
    shapes = hf_param_shapes(dims)
    train = Layout(tp=cfg.actor.tp, pp=cfg.actor.pp, dp=cfg.actor.dp)
    total = sum(prod(s) for s in shapes.values())
    held = [sum(b.numel for n, s in shapes.items() if (b := train.box(n, s, r, num_layers=dims.num_layers)))
            for r in train.ranks]
    return max(total - h for h in held) * 4 / 2**20


@pytest.fixture(scope="module")
def fsdp_steps(tmp_path_factory, ray_cluster):
    _, summary = run("ppo_tiny", SHARED, tmp_path_factory.mktemp("fsdp"))
    return _steps(summary)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ppo_with_megatron_actor_and_critic(layout, fsdp_steps, tmp_path, ray_cluster):
    cfg, summary = run("ppo_tiny", SHARED + LAYOUTS[layout], tmp_path)
    steps = _steps(summary)
    assert sorted(steps) == [0, 1, 2]
    for r in steps.values():
        assert all(math.isfinite(v) for v in r.values()), r
    # step 2 generates with the weights step 1 trained: resharded from megatron into vLLM (tp1, dp2) ...
    assert cfg.rollout.tp == 1 and steps[2]["reshard/bytes_received_mb"] == pytest.approx(_hybridflow_mib(cfg), rel=1e-9)
    # ... and vLLM samples from exactly them: its log-probs equal the training engine's
    assert steps[2]["rollout/logprob_diff_mean"] < 1e-5, steps[2]["rollout/logprob_diff_mean"]
    start = load_file(str(Path(model_path(cfg)) / "model.safetensors"))
    end = load_file(str(Path(summary["hf_export"]) / "model.safetensors"))
    assert start.keys() == end.keys()
    assert not [k for k in start if torch.equal(start[k], end[k])], "the megatron actor left parameters unchanged"

    fsdp = fsdp_steps
    for key in ("actor/entropy", "actor/grad_norm", "critic/grad_norm", "critic/vf_loss"):
        assert abs(steps[1][key] - fsdp[1][key]) < 1e-4, (key, steps[1][key], fsdp[1][key])
    assert steps[1]["reward/mean"] == fsdp[1]["reward/mean"]
