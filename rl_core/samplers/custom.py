"""The `custom` sampler: a user class named by import path (`async_rl.sampler.target`).

Owns: importing `module:ClassName` (through `rl_core.plugins.load_target`), constructing it as
`ClassName(num_prompts_per_step=P, **kwargs)` and checking the object against the `Sampler`
protocol (`rl_core.samplers.base`). Every failure is a RecipeError naming the field, raised at
recipe load (`rl-core validate` calls `build_custom_sampler`), before anything is built.

Does not own: the protocol itself, or the built-in samplers.
"""

from __future__ import annotations

from rl_core.errors import RecipeError
from rl_core.plugins import load_target
from rl_core.samplers.base import Sampler

PROTOCOL_METHODS = ("next_target_step", "can_admit", "admit", "select", "evict", "should_abort_inflight",
                    "required_capacity", "state_dict", "load_state_dict", "lookahead_at", "observe", "carry_over")
PROTOCOL_ATTRIBUTES = ("name", "stamps", "staleness_bound", "window", "carry_bound", "lookahead")


def load_custom_class(target: str):
    """Import `module:ClassName` and check it against the Sampler protocol (at config load)."""
    return load_target(target, field="async_rl.sampler.target", kind="class",
                       required=PROTOCOL_METHODS + PROTOCOL_ATTRIBUTES,
                       what="a class implementing the Sampler protocol (rl_core.samplers.base.Sampler)",
                       hint="subclass rl_core.samplers.base.BaseSampler or add the missing members.")


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


def from_recipe(cfg) -> Sampler:
    """The registry's builder for `type: custom`."""
    return build_custom_sampler(cfg.async_rl.sampler, cfg.grpo.num_prompts_per_step)
