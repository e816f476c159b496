"""Router replay for mixture-of-experts policies in the torch trainer.

Owns: `RouterReplay(model)`, forward hooks on every router of a transformers MoE model
(`MixtralTopKRouter`: the hook replaces its top-k weights and indices) that, inside
`replaying(...)`, route each token to the experts generation routed it to (Rollout Routing
Replay, R3: Ma et al. 2025, arXiv:2510.11370), so small numeric differences cannot flip a
near-tie; the gate weights stay the trainer router's own (fp32 softmax gathered at the
replayed experts, renormalised), so the router still gets gradients. And `RouteCheck` /
`check_routes`: a chunk's `routed_experts` checked against the model (shape, id range, a
sample without routes) and the backfilled tokens counted (real tokens but each sequence's
last, which is never fed).

Does not own: recording routes (the native engine), carrying them (rl_core/types.py), or when
to replay (the trainer: `trainer.router_replay.enabled`). Read more: docs/moe.md.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Iterator

import torch

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _router_classes() -> tuple[type, ...]:
    """Router module classes that can be replayed: each returns (router_logits, top_k_weights,
    top_k_index) and renormalises its top-k weights (MixtralTopKRouter.forward always does)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    return (MixtralTopKRouter,)


def find_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's replayable routers, ordered by decoder layer."""
    classes = _router_classes()
    found = []
    for name, module in model.named_modules():
        if isinstance(module, classes):
            m = _LAYER.search(name)
            if m is None:
                raise ValueError(f"router {name!r} is not inside a numbered decoder layer ('layers.N.')")
            found.append((int(m.group(1)), module))
    found.sort(key=lambda pair: pair[0])
    return [module for _, module in found]


class RouterReplay:
    """Forward hooks that make every router of `model` use given expert ids."""

    def __init__(self, model: torch.nn.Module):
        self.routers = find_routers(model)
        if not self.routers:
            model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
            raise ValueError(f"the model ({model_type}) has no mixture-of-experts router that router replay supports "
                             "(MixtralTopKRouter)")
        self.num_layers = len(self.routers)
        self.top_k = int(self.routers[0].top_k)
        self.num_experts = int(self.routers[0].num_experts)
        self._routes: torch.Tensor | None = None  # [rows, layers, k] while replaying
        self._handles = [r.register_forward_hook(partial(self._hook, layer=i)) for i, r in enumerate(self.routers)]

    @property
    def route_width(self) -> int:
        """Expert ids per token in a chunk's `routed_experts`: layers x k."""
        return self.num_layers * self.top_k

    @contextmanager
    def replaying(self, routes: torch.Tensor) -> Iterator[None]:
        """Within the block, forwards over input ids [B, T] use `routes` [B, T, layers * k]
        (-1 = missing: that token keeps the model's own top-k)."""
        if routes.dim() != 3 or routes.shape[-1] != self.route_width:
            raise ValueError(f"routed_experts has shape {tuple(routes.shape)}; expected [batch, tokens, "
                             f"{self.route_width}] (layers {self.num_layers} x top-k {self.top_k})")
        self._routes = routes.reshape(-1, self.num_layers, self.top_k)
        try:
            yield
        finally:
            self._routes = None

    def _hook(self, module, args, output, layer: int):
        if self._routes is None:
            return None
        logits, _, own = output
        replay = self._routes[:, layer].to(own.device)
        if replay.shape[0] != logits.shape[0]:
            raise RuntimeError(f"layer {layer}: the router saw {logits.shape[0]} tokens but {replay.shape[0]} routes "
                               "were given (routes must be aligned with the forward's input_ids [B, T])")
        missing = (replay < 0).any(dim=-1, keepdim=True)
        index = torch.where(missing, own, replay)
        # R3 (arXiv 2510.11370): replayed experts, gate weights from the trainer's own router
        # softmax (fp32, as MixtralTopKRouter) gathered there and renormalised.
        scores = torch.softmax(logits.float(), dim=-1).gather(-1, index)
        scores = scores / scores.sum(dim=-1, keepdim=True)
        return logits, scores, index

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


@dataclass
class RouteCheck:
    """Tokens whose routes matter in a chunk, and how many of them get backfilled."""

    num_tokens: int
    num_backfilled: int


def check_routes(routes: torch.Tensor | None, attention_mask: torch.Tensor, replay: RouterReplay,
                 what: str = "chunk") -> RouteCheck:
    """Validate a chunk's routes for replay; RuntimeError for routes that cannot be replayed."""
    if routes is None:
        raise RuntimeError(
            f"trainer.router_replay.enabled is true but this {what} carries no routed experts "
            "(TrainChunk.routed_experts is None): its samples came from a generation backend that does not record "
            "routes. Generate with generation.backend 'native' (it records the routes of MoE models), or set "
            "trainer.router_replay.enabled: false.")
    if routes.shape[:2] != attention_mask.shape or routes.shape[-1] != replay.route_width:
        raise RuntimeError(f"{what}: routed_experts has shape {tuple(routes.shape)}; expected "
                           f"{tuple(attention_mask.shape)} x {replay.route_width} (layers {replay.num_layers} x top-k "
                           f"{replay.top_k} of the trained model). The routes come from another model.")
    if routes.numel() and int(routes.max()) >= replay.num_experts:
        raise RuntimeError(f"{what}: routed_experts holds expert id {int(routes.max())}; the trained model has "
                           f"{replay.num_experts} experts. The routes come from another model.")
    # tokens that matter: real tokens except the last real token of each row
    lengths = attention_mask.sum(dim=1)
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    counted = positions[None, :] < (lengths - 1).clamp(min=0)[:, None]
    missing = (routes < 0).any(dim=-1) & counted
    per_row = counted.sum(dim=1)
    empty = ((missing.sum(dim=1) == per_row) & (per_row > 0)).nonzero().flatten().tolist()
    if empty:
        raise RuntimeError(
            f"trainer.router_replay.enabled is true but sample(s) {empty[:8]} of this {what} carry no routed experts "
            "(every token's routes are missing): their generation backend did not record routes. Generate with "
            "generation.backend 'native', or set trainer.router_replay.enabled: false.")
    return RouteCheck(int(counted.sum()), int(missing.sum()))
