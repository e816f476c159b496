"""Samplers: the staleness policy of the controller (which ready groups train now), and their registry.

`SAMPLERS` maps the recipe's `async_rl.sampler.type` to a builder `(recipe) -> Sampler`, one
module per implementation: `in_order`, `weight_fifo`, `windowed`, `ready_first`, or `custom`
(`target: "module:ClassName"`, constructed as `ClassName(num_prompts_per_step=P, **kwargs)`
and checked against the `Sampler` protocol; `custom.py`). `make_sampler(recipe)` builds the
configured one.
"""

from __future__ import annotations

from typing import Any, Callable

from rl_core.samplers import custom
from rl_core.samplers.base import BaseSampler, Sampler
from rl_core.samplers.custom import PROTOCOL_METHODS, build_custom_sampler, load_custom_class
from rl_core.samplers.in_order import InOrderSampler
from rl_core.samplers.ready_first import ReadyFirstSampler
from rl_core.samplers.weight_fifo import WeightFifoSampler
from rl_core.samplers.windowed import WindowedSampler

SAMPLERS: dict[str, Callable[[Any], Sampler]] = {
    "in_order": InOrderSampler.from_recipe,
    "weight_fifo": WeightFifoSampler.from_recipe,
    "windowed": WindowedSampler.from_recipe,
    "ready_first": ReadyFirstSampler.from_recipe,
    "custom": custom.from_recipe,
}


def make_sampler(cfg) -> Sampler:
    """Build the sampler of a whole recipe (`cfg.async_rl.sampler`)."""
    scfg = cfg.async_rl.sampler
    build = SAMPLERS.get(scfg.type)
    if build is None:
        raise ValueError(f"unknown sampler type {scfg.type!r}")
    return build(cfg)


__all__ = ["BaseSampler", "InOrderSampler", "PROTOCOL_METHODS", "ReadyFirstSampler", "SAMPLERS", "Sampler",
           "WeightFifoSampler", "WindowedSampler", "build_custom_sampler", "load_custom_class", "make_sampler"]
