"""The sparse mixture-of-experts block of the native engine (Mixtral layout), and its weights.

Owns: `SparseMoE`, an MoE layer's feed-forward block: a linear router, softmax over experts in
fp32, the top-k kept and renormalised (Mixtral), each expert a SwiGLU MLP, the weighted sum of
the chosen experts' outputs (Shazeer et al. 2017; Jiang et al. 2024, "Mixtral of Experts"),
with transformers' in-memory `MixtralSparseMoeBlock` parameter names (`mlp.gate.weight`,
`mlp.experts.gate_up_proj` gate rows first, `mlp.experts.down_proj`) so a trainer's state dict
refits by name; after each forward `last_routes` holds the chosen expert ids [tokens, k]
(descending router probability) for router replay. `convert_legacy_moe`: the on-disk layout
(`block_sparse_moe.experts.{e}.w1/w2/w3.weight`) into the in-memory one.

Does not own: attention, norms or the decode loop (model.py), nor the trainer-side replay
(rl_core/train/router_replay.py). Read more: docs/moe.md.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn


class Router(nn.Module):
    """`mlp.gate`: one [num_experts, hidden] linear map, no bias."""

    def __init__(self, num_experts: int, hidden: int, device, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, device=device, dtype=dtype), requires_grad=False)


class Experts(nn.Module):
    """`mlp.experts`: the stacked SwiGLU weights of every expert."""

    def __init__(self, num_experts: int, hidden: int, width: int, device, dtype):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * width, hidden, device=device, dtype=dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, width, device=device, dtype=dtype),
                                      requires_grad=False)


class SparseMoE(nn.Module):
    """Top-k routed SwiGLU experts over packed tokens [N, H] -> [N, H]; routes in `last_routes`."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, width: int, normalize: bool, device, dtype):
        super().__init__()
        self.num_experts, self.top_k, self.normalize = num_experts, top_k, normalize
        self.gate = Router(num_experts, hidden, device, dtype)
        self.experts = Experts(num_experts, hidden, width, device, dtype)
        self.last_routes: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As MixtralTopKRouter: logits in the model dtype, softmax in fp32, top-k, renormalise.
        probs = F.linear(x, self.gate.weight).float().softmax(dim=-1)
        weights, routes = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        self.last_routes = routes
        return self.dispatch(x, routes, weights)

    def dispatch(self, x: torch.Tensor, routes: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_j weights[t, j] * expert_{routes[t, j]}(x[t]): the (token, expert) pairs are
        sorted by expert so that each expert runs one matmul over all its tokens; the pair
        outputs are put back in (token, j) order by a gather (no scatter-add: `index_add_`
        costs milliseconds per call on CPU) and summed over j."""
        n, k = routes.shape
        flat = routes.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        xs = x.index_select(0, order // k)  # the token of each sorted pair
        pair_weights = weights.reshape(-1)[order, None]
        ys = torch.empty_like(xs)
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            stop = start + count
            gate, up = F.linear(xs[start:stop], gate_up[expert]).chunk(2, dim=-1)
            # fp32 weights times model-dtype outputs, cast back to the model dtype (as transformers)
            ys[start:stop] = (F.linear(F.silu(gate) * up, down[expert]) * pair_weights[start:stop]).to(ys.dtype)
            start = stop
        unsorted = ys.index_select(0, order.argsort())  # pair (t, j) back at row t * k + j
        return unsorted.view(n, k, -1).sum(dim=1)


_LEGACY_EXPERT = re.compile(r"^(.*)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")


def convert_legacy_moe(state_dict: Mapping[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """HF on-disk Mixtral names -> in-memory names: `block_sparse_moe.gate` -> `mlp.gate`;
    experts' w1 (gate), w3 (up) stacked and concatenated into `mlp.experts.gate_up_proj`,
    w2 (down) stacked into `mlp.experts.down_proj`. Other names pass through unchanged.
    Raises ValueError when a layer lacks some expert's tensor."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in state_dict.items():
        m = _LEGACY_EXPERT.match(name)
        if m is None:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = tensor
            continue
        prefix, expert, which = m.group(1), int(m.group(2)), m.group(3)
        parts.setdefault(prefix, {}).setdefault(which, {})[expert] = tensor
    for prefix, by_kind in parts.items():
        stacked = {}
        for which in ("w1", "w2", "w3"):
            have = by_kind.get(which, {})
            missing = sorted(set(range(num_experts)) - set(have))
            if missing:
                raise ValueError(f"weights of {prefix}.block_sparse_moe lack experts {missing[:4]} of {which}; "
                                 f"a Mixtral layer needs w1, w2 and w3 of all {num_experts} experts.")
            stacked[which] = torch.stack([have[e] for e in range(num_experts)])
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.cat((stacked["w1"], stacked["w3"]), dim=1)
        out[f"{prefix}.mlp.experts.down_proj"] = stacked["w2"]
    return out
