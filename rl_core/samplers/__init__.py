"""Samplers: the staleness policy of the controller (which ready groups train now).

`make_sampler(recipe)` builds the configured one: `in_order`, `weight_fifo`, `windowed`,
`ready_first`, or `custom` (`target: "module:ClassName"`, constructed as
`ClassName(num_prompts_per_step=P, **kwargs)` and checked against the `Sampler` protocol).
"""

from __future__ import annotations

from rl_core.errors import RecipeError
from rl_core.plugins import load_target
from rl_core.samplers.base import BaseSampler, Sampler
from rl_core.samplers.in_order import InOrderSampler
from rl_core.samplers.ready_first import ReadyFirstSampler
from rl_core.samplers.weight_fifo import WeightFifoSampler
from rl_core.samplers.windowed import WindowedSampler

PROTOCOL_METHODS = ("next_target_step", "can_admit", "admit", "select", "evict", "should_abort_inflight",
                    "required_capacity", "state_dict", "load_state_dict", "lookahead_at", "observe")


def load_custom_class(target: str):
    """Import `module:ClassName` and check it against the Sampler protocol (at config load)."""
    return load_target(target, field="async_rl.sampler.target", kind="class",
                       required=PROTOCOL_METHODS + ("name", "stamps", "staleness_bound", "window"),
                       what="a class implementing the Sampler protocol (rl_core.samplers.base.Sampler)",
                       hint="subclass rl_core.samplers.base.BaseSampler or add the missing members.")


def make_sampler(cfg) -> Sampler:
    """Build the sampler of a whole recipe (`cfg.async_rl.sampler`)."""
    scfg = cfg.async_rl.sampler
    p = cfg.grpo.num_prompts_per_step
    if scfg.type == "in_order":
        return InOrderSampler(scfg, p, reproducible=cfg.async_rl.reproducible)
    if scfg.type == "weight_fifo":
        return WeightFifoSampler(scfg, p)
    if scfg.type == "windowed":
        return WindowedSampler(scfg, p)
    if scfg.type == "ready_first":
        return ReadyFirstSampler(scfg, p)
    if scfg.type == "custom":
        return build_custom_sampler(scfg, p)
    raise ValueError(f"unknown sampler type {scfg.type!r}")


def build_custom_sampler(scfg, num_prompts_per_step: int) -> Sampler:
    """Import, construct and check a `custom` sampler; every failure is a RecipeError naming
    `async_rl.sampler.target` (or `.kwargs`). `rl-core validate` calls it, so a sampler that
    does not import, construct or satisfy the protocol fails before anything is built."""
    cls = load_custom_class(scfg.target)
    try:
        obj = cls(num_prompts_per_step=num_prompts_per_step, **scfg.kwargs)
    except TypeError as exc:
        raise RecipeError.single("async_rl.sampler.kwargs", scfg.kwargs,
                                 f"keyword arguments {scfg.target} accepts besides num_prompts_per_step ({exc})",
                                 "fix async_rl.sampler.kwargs to match the constructor.") from None
    except Exception as exc:  # noqa: BLE001 - the user's constructor failed: reported as a recipe error
        raise RecipeError.single("async_rl.sampler.target", scfg.target,
                                 f"a sampler that constructs with num_prompts_per_step={num_prompts_per_step} and "
                                 f"the given kwargs ({type(exc).__name__}: {exc})",
                                 "fix the sampler's constructor or async_rl.sampler.kwargs.") from None
    if not isinstance(obj, Sampler):
        raise RecipeError.single("async_rl.sampler.target", scfg.target,
                                 "an object satisfying rl_core.samplers.base.Sampler",
                                 "subclass rl_core.samplers.base.BaseSampler.")
    return obj


__all__ = ["BaseSampler", "InOrderSampler", "ReadyFirstSampler", "Sampler", "WeightFifoSampler", "WindowedSampler",
           "build_custom_sampler", "load_custom_class", "make_sampler"]
