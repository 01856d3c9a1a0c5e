from __future__ import annotations

import math

import pytest
import torch

from tiertrain.config import OptimConfig
from tiertrain.optim.adamw import clip_coefficient, lr_at


def test_schedules_by_hand():
    c = OptimConfig(lr=1.0, schedule="cosine", warmup_steps=4, min_lr=0.1)
    assert [lr_at(k, c, 14) for k in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, c, 14) == 1.0
    assert lr_at(13, c, 14) == pytest.approx(0.1)  # the last step reaches min_lr
    assert lr_at(4 + 9 / 2, c, 14) == pytest.approx(0.55)  # halfway: the mean of lr and min_lr
    c = OptimConfig(lr=0.5, schedule="constant", warmup_steps=0)
    assert {lr_at(k, c, 10) for k in range(10)} == {0.5}


def test_clip_like_torch():
    grads = [torch.randn(5, 3), torch.randn(7)]
    params = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    want = torch.nn.utils.clip_grad_norm_(params, 0.5)
    norm, coef = clip_coefficient([torch.linalg.vector_norm(g) for g in grads], 0.5)
    assert norm == pytest.approx(float(want), rel=1e-6)
    for p, g in zip(params, grads):
        torch.testing.assert_close(g * coef, p.grad)
    assert clip_coefficient([torch.tensor(0.1)], 1.0)[1] == 1.0
    assert clip_coefficient([torch.tensor(5.0)], 0.0) == (5.0, 1.0)  # 0 = off


def test_diverged_training_stops_with_a_message():
    from tiertrain.errors import UserError

    with pytest.raises(UserError, match="diverged.*optim.lr"):
        clip_coefficient([torch.tensor(math.inf)], 1.0)
