"""Recipe configuration: pydantic models (`schema`) and their loading (`loader`).

This package never imports torch, so that `rl-core validate` and every entry point can
reject a bad recipe before anything expensive is built.
"""

from rl_core.config.loader import (
    RESOLVED_CONFIG,
    apply_overrides,
    load_recipe,
    load_resolved,
    preflight,
    run_dir,
    validate_dict,
    write_resolved,
)
from rl_core.config.schema import RecipeConfig, SamplingParamsConfig

__all__ = [
    "RESOLVED_CONFIG", "RecipeConfig", "SamplingParamsConfig", "apply_overrides", "load_recipe", "load_resolved",
    "preflight", "run_dir", "validate_dict", "write_resolved",
]
