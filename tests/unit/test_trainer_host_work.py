"""The pieces that cut the sharded backends' host work per step (docs/performance.md, issue 18).

- `trainer.fsdp.layers_per_unit`: how decoder layers group into FSDP units, and the recipe
  error for a value below 1 (a 2-process step with grouped units against the torch trainer
  is in test_fsdp_step.py);
- megatron's gradient norm (`global_grad_norm`: multi-tensor norms, one host copy) against a
  float64 reference, and the multi-tensor main -> model weight copy against Megatron's own
  arithmetic (`model.copy_(main * 1.0)`): Megatron's Float16 optimizer needs CUDA, so the copy
  runs here on an object holding the same two lists of parameter groups (`float16_groups`,
  `fp32_from_float16_groups`).
"""

from __future__ import annotations

import pytest
import torch

from rl_core.config import apply_overrides, validate_dict
from rl_core.errors import RecipeError
from rl_core.train.fsdp import layer_units


def test_layer_units_group_consecutive_layers():
    layers = [torch.nn.Linear(2, 2) for _ in range(5)]
    assert [[layers.index(m) for m in u] for u in layer_units(layers, 1)] == [[0], [1], [2], [3], [4]]
    assert [[layers.index(m) for m in u] for u in layer_units(layers, 2)] == [[0, 1], [2, 3], [4]]
    assert [len(u) for u in layer_units(layers, 5)] == [5]
    assert [len(u) for u in layer_units(layers, 24)] == [5]  # at or above the layer count: one unit
    with pytest.raises(ValueError, match="layers_per_unit"):
        layer_units(layers, 0)


def test_layers_per_unit_below_one_is_a_recipe_error():
    assert validate_dict(apply_overrides({}, ["trainer.fsdp.layers_per_unit=24"])).trainer.fsdp.layers_per_unit == 24
    with pytest.raises(RecipeError, match="trainer.fsdp.layers_per_unit"):
        validate_dict(apply_overrides({}, ["trainer.fsdp.layers_per_unit=0"]))


def test_global_grad_norm_matches_float64():
    from rl_core.train.megatron import global_grad_norm

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(300, generator=g), torch.randn(20, 20, generator=g) * 1e-3, torch.zeros(0),
             torch.randn(7, 1, generator=g)]  # fp32, as Megatron's main gradients
    ref = torch.cat([t.double().flatten() for t in grads]).norm().item()
    assert global_grad_norm(grads) == pytest.approx(ref, rel=1e-6)
    assert global_grad_norm([]) == 0.0
    assert global_grad_norm([torch.tensor([float("inf")])]) == float("inf")


def test_main_to_model_copy_equals_megatrons_arithmetic():
    from rl_core.train.megatron import foreach_main_to_model

    g = torch.Generator().manual_seed(1)
    main = [torch.randn(64, 3, generator=g), torch.randn(5, generator=g) * 1e-3]
    model = [torch.zeros(64, 3, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.bfloat16)]

    class Holder:  # Float16OptimizerWithFloat16Params's two lists of parameter groups
        float16_groups = [[torch.nn.Parameter(t, requires_grad=False) for t in model]]
        fp32_from_float16_groups = [[torch.nn.Parameter(t, requires_grad=False) for t in main]]

    foreach_main_to_model(Holder())()
    for dst, src in zip(model, main):
        assert torch.equal(dst, (src * 1.0).to(torch.bfloat16))  # Megatron's local multi_tensor_scale(1.0)
