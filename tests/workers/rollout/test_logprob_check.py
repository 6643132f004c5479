"""Rollout-vs-training log-prob metrics against a direct computation."""

from __future__ import annotations

import pytest
import torch

from rlframe.workers.rollout.logprob_check import logprob_diff_metrics


def test_metrics_count_only_response_tokens():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    mask = (torch.rand(5, 7, generator=g) > 0.3).long()
    b_masked_out = b.clone()
    b_masked_out[mask == 0] = 1e6  # padding garbage must not count
    m = logprob_diff_metrics(a, b_masked_out, mask)
    diffs = [abs(float(a[i, j] - b[i, j])) for i in range(5) for j in range(7) if mask[i, j]]
    assert m["rollout/logprob_diff_mean"] == pytest.approx(sum(diffs) / len(diffs), rel=1e-5)
    assert m["rollout/logprob_diff_max"] == pytest.approx(max(diffs), rel=1e-6)
    assert logprob_diff_metrics(a, b, torch.zeros_like(mask)) == {"rollout/logprob_diff_mean": 0.0,
                                                                  "rollout/logprob_diff_max": 0.0}
    with pytest.raises(ValueError, match="must all be"):
        logprob_diff_metrics(a, b[:, :3], mask)
