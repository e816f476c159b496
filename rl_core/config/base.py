"""The base of every recipe section (unknown keys are errors, attribute docstrings are docs)
and the error helper its validators raise through. No torch import."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors, docstrings are docs."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)


def _fail(field: str, value, expected: str, fix: str):
    # Raised inside validators; the loader turns it into a RecipeError paragraph.
    from rl_core.errors import RecipeError

    raise RecipeError.single(field, value, expected, fix)
