"""Dry runs of cluster configs on a laptop: no GPUs, no weights, no Ray."""

import pytest

from rlframe.config import load_config, validate
from rlframe.controller.dry_run import describe_run


@pytest.mark.parametrize("name", ["ppo_llama70b", "grpo_qwen7b", "ppo_tiny", "grpo_tiny"])
def test_cluster_configs_pass_the_dry_run(name):
    cfg = validate(load_config(name, ["trainer.dry_run=true"]))
    text = describe_run(cfg)
    assert "placement:" in text and "resharding" in text and "memory estimate per device" in text


def test_llama70b_plan_is_hybridflow_and_smaller_than_gather():
    cfg = validate(load_config("ppo_llama70b", ["trainer.dry_run=true"]))
    text = describe_run(cfg)
    assert "70.554B parameters" in text
    assert "HybridFlow (micro-DP groups)" in text
    line = next(l for l in text.splitlines() if l.startswith("resharding"))
    received = float(line.split("GiB, mean ")[1].split(" GiB")[0])  # stages differ slightly; the mean is exact
    full = float(line.split("would receive ")[1].split(" GiB")[0])
    # training tp=8, pp=4 -> gen tp=8: d_g = 4 and each rank receives (d_g - 1) / (t * p) of the model
    assert received == pytest.approx(full * 3 / 32, rel=0.01)
    assert "fits in 80 GiB" in text
