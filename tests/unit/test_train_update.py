"""The shared update rule (rl_core/train/update.py): normalise, clip, refuse non-finite, step."""

from __future__ import annotations

import math

import pytest
import torch

from rl_core.train.update import local_update


def _model_with_grads(grad):
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    model.weight.grad = torch.tensor([grad], dtype=torch.float32)
    return model, torch.optim.SGD(model.parameters(), lr=1.0)


def test_normalises_clips_and_steps():
    model, opt = _model_with_grads([6.0, 8.0])  # summed over a step whose normaliser is 2 -> [3, 4], norm 5
    m = local_update(model, opt, normalizer=2.0, loss_sum=3.0, max_grad_norm=1.0, what="gradient norm at RL step 0")
    assert m == {"grad_norm": pytest.approx(5.0), "loss": 1.5, "skipped_update": 0.0}
    assert torch.allclose(model.weight, torch.tensor([[1 - 0.6, 1 - 0.8]]), atol=1e-6)  # clipped to norm 1
    assert model.weight.grad is None
    model, opt = _model_with_grads([6.0, 8.0])
    m = local_update(model, opt, 2.0, 3.0, None, "x")  # no limit
    assert torch.allclose(model.weight, torch.tensor([[-2.0, -3.0]]))


def test_nothing_to_train_skips_and_non_finite_raises_with_grads_cleared():
    model, opt = _model_with_grads([1.0, 1.0])
    assert local_update(model, opt, 0.0, 0.0, 1.0, "x") == {"skipped_update": 1.0}
    assert torch.equal(model.weight, torch.ones(1, 2)) and model.weight.grad is None
    model, opt = _model_with_grads([math.nan, 1.0])
    with pytest.raises(FloatingPointError, match=r"non-finite gradient norm at RL step 4 \(nan\)"):
        local_update(model, opt, 1.0, 1.0, 1.0, "gradient norm at RL step 4")
    assert torch.equal(model.weight, torch.ones(1, 2)) and model.weight.grad is None
