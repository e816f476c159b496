"""Samplers: the staleness policy of the controller (which ready groups train now).

`make_sampler(async_rl_config, num_prompts_per_step)` builds the configured one.
"""

from rl_core.samplers.in_order import InOrderSampler


def make_sampler(async_cfg, num_prompts_per_step: int):
    cfg = async_cfg.sampler
    if cfg.type == "in_order":
        return InOrderSampler(cfg, num_prompts_per_step)
    raise ValueError(f"unknown sampler type {cfg.type!r}")


__all__ = ["InOrderSampler", "make_sampler"]
