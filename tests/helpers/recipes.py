"""The one recipe builder of the tests: a validated `RecipeConfig` from a few sections.

`recipe(**sections)` starts from the schema's defaults and merges each section over them
(nested dicts merge key by key; anything else replaces), then validates exactly as a recipe
file is validated (`rl_core.config.validate_dict`), so a test gets the same errors a user
would. `controller_recipe(**sections)` adds what the controller's unit tests run under: a
small step (4 prompts x 2 samples, 6 steps), no validation and no logging output.
"""

from __future__ import annotations

import copy
from typing import Any

from rl_core.config import validate_dict
from rl_core.config.schema import RecipeConfig

CONTROLLER_BASE: dict[str, Any] = {
    "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 2, "max_num_steps": 6},
    "validation": {"val_at_start": False, "val_at_end": False},
    "logging": {"tensorboard": False, "jsonl": False, "progress": "off"},
}
"""Sections of `controller_recipe`: a run the fakes of `tests.helpers.fakes` finish in well under a second."""


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` merged into a copy of `base`: nested dicts key by key, other values replace."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def recipe(base: dict[str, Any] | None = None, **sections: Any) -> RecipeConfig:
    """A validated recipe: schema defaults, then `base`, then `sections` (e.g. `grpo={...}`)."""
    return validate_dict(merge(base or {}, sections))


def controller_recipe(**sections: Any) -> RecipeConfig:
    """`recipe` over `CONTROLLER_BASE` (the controller's unit tests)."""
    return recipe(CONTROLLER_BASE, **sections)
