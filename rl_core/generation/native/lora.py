"""LoRA adapters in the native engine: merged into the live weights at each adapter update.

Owns: `AdapterMerge`. An adapter update (rl_core.adapters' refit format: `<module>.lora_A`,
`<module>.lora_B` with the scale in B) sets each adapted weight `<module>.weight` to W0 + B @ A,
W0 being a copy of that weight taken before the first adapter touched it; a full-weight update
of a weight makes its new value the base (its copy is dropped). The forward, every decode path
(eager, static, CUDA graphs, the fused Triton kernels) and the KV cache are untouched: merging
costs one [out, r] x [r, in] product per adapted weight at refit and a copy of the adapted base
weights in memory; the low-rank alternative (two extra products per adapted projection in
every forward, threaded through every decode path) is compared in bench/lora_refit.py
(docs/lora.md, "Refit: what each generation backend does").

Does not own: when updates arrive (engine.py) or the format (rl_core.adapters).
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from rl_core.adapters import adapter_pairs, merged_weight


class AdapterMerge:
    """Adapters merged into a model's parameters (HF names; views of fused tensors included)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.base: dict[str, torch.Tensor] = {}  # HF weight name -> its value before any adapter

    @property
    def base_bytes(self) -> int:
        """Memory held by the copies of the adapted base weights."""
        return sum(t.numel() * t.element_size() for t in self.base.values())

    def apply(self, state: Mapping[str, torch.Tensor]) -> int:
        """Merge a full set of adapters (weights adapted before but absent now go back to their
        base); names and shapes are all checked before anything changes. Returns the number of
        adapted weights."""
        params = dict(self.model.named_parameters())
        todo = []
        for module, (a, b) in adapter_pairs(state).items():
            name = f"{module}.weight"
            param = params.get(name)
            if param is None:
                raise ValueError(f"adapter of {module!r}: {name!r} is not a weight of this model (expected HF module "
                                 "names such as 'model.layers.0.self_attn.q_proj')")
            if (b.shape[0], a.shape[1]) != tuple(param.shape):
                raise ValueError(f"adapter of {module!r} makes a {b.shape[0]} x {a.shape[1]} update; the weight "
                                 f"{name!r} is {tuple(param.shape)}")
            todo.append((name, param, a, b))
        with torch.no_grad():
            for name in set(self.base) - {name for name, *_ in todo}:
                params[name].copy_(self.base.pop(name))
            for name, param, a, b in todo:
                if name not in self.base:
                    self.base[name] = param.detach().clone()
                param.copy_(merged_weight(self.base[name], a, b))
        return len(todo)

    def forget(self, names) -> None:
        """Full weights were loaded under `names`: they are the new base of those weights."""
        for name in names:
            self.base.pop(name, None)
