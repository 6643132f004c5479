"""LR schedule shapes and the gradient-norm weighting rule (single process)."""

import math

import pytest

from rlframe.workers.engines.optim import lr_lambda


def test_constant_with_warmup():
    f = [lr_lambda(s, schedule="constant", warmup_steps=4, total_steps=0, min_lr_ratio=0.0) for s in range(6)]
    assert f == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_warmup_then_decay_to_floor():
    kw = dict(schedule="cosine", warmup_steps=2, total_steps=12, min_lr_ratio=0.1)
    assert lr_lambda(0, **kw) == 0.5 and lr_lambda(1, **kw) == 1.0
    assert lr_lambda(2, **kw) == pytest.approx(1.0)
    assert lr_lambda(7, **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_lambda(12, **kw) == pytest.approx(0.1) and lr_lambda(50, **kw) == pytest.approx(0.1)
    values = [lr_lambda(s, **kw) for s in range(2, 13)]
    assert all(a >= b for a, b in zip(values, values[1:]))
