"""Recipe configuration: pydantic models (`schema`) and their loading (`loader`).

This package never imports torch, so that `rl-core validate` and every entry point can
reject a bad recipe before anything expensive is built. Loading a recipe for a run, with
the preflight of its files and plug-ins, is rl_core.launch.preflight.load_recipe.
"""

from rl_core.config.loader import (
    RESOLVED_CONFIG,
    apply_overrides,
    load_resolved,
    read_recipe,
    run_dir,
    validate_dict,
    write_resolved,
)
from rl_core.config.schema import RecipeConfig, SamplingParamsConfig

__all__ = [
    "RESOLVED_CONFIG", "RecipeConfig", "SamplingParamsConfig", "apply_overrides", "load_resolved", "read_recipe",
    "run_dir", "validate_dict", "write_resolved",
]
