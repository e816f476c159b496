"""The base of every recipe section (unknown keys are errors, attribute docstrings are docs,
`true`/`false` are never numbers and numbers never booleans, no number is inf or NaN) and the
error helper its validators raise through. No torch import."""

from __future__ import annotations

import types
import typing
from functools import lru_cache

from pydantic import BaseModel, ConfigDict, model_validator


@lru_cache(maxsize=None)
def _admits_bool(annotation) -> bool:
    """Whether a field annotation accepts a bool as itself (bool, Any, or a Literal of bools)."""
    if annotation is bool or annotation is typing.Any:
        return True
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _admits_bool(args[0])
    if origin is typing.Literal:
        return any(isinstance(a, bool) for a in args)
    if origin in (typing.Union, types.UnionType):
        return any(_admits_bool(a) for a in args)
    return False


@lru_cache(maxsize=None)
def _bool_only(annotation) -> bool:
    """Whether a field is a plain bool (or bool | None)."""
    if annotation is bool:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return {a for a in typing.get_args(annotation)} in ({bool, type(None)}, {bool})
    return False


def _numeric_item(annotation):
    """For list[X] / dict[str, X] annotations, X when it is int or float (else None)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _numeric_item(args[0])
    if origin in (typing.Union, types.UnionType):
        for a in args:
            if (item := _numeric_item(a)) is not None:
                return item
        return None
    if origin in (list, tuple, set) and args and args[0] in (int, float):
        return args[0]
    if origin is dict and len(args) == 2 and args[1] in (int, float):
        return args[1]
    return None


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors, docstrings are docs."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True,
                              allow_inf_nan=False)  # no recipe number is infinite or NaN

    @model_validator(mode="before")
    @classmethod
    def _no_bool_numbers(cls, data):
        # pydantic's lax mode reads `true` as 1 (and 1.0); in a recipe that is always a mistake
        if not isinstance(data, dict):
            return data
        for key, value in data.items():
            info = cls.model_fields.get(key) if isinstance(key, str) else None
            if info is None:
                continue
            if isinstance(value, bool) and not _admits_bool(info.annotation):
                raise BoolNotNumber(key, value, "a value of this field's type (a number or string), not a boolean: "
                                    "true/false are not numbers")
            if _bool_only(info.annotation) and value is not None and not isinstance(value, bool):
                raise BoolNotNumber(key, value, "true or false (numbers and strings are not booleans)")
            item = _numeric_item(info.annotation) if isinstance(value, (list, dict)) else None
            if item is not None and any(isinstance(v, bool) for v in (value.values() if isinstance(value, dict) else value)):
                raise BoolNotNumber(key, value, f"{item.__name__} entries, not booleans (true/false are not numbers)")
        return data


class BoolNotNumber(ValueError):
    """A boolean given to a numeric field, or a number to a boolean one; `key` is relative to
    the section that raised it."""

    def __init__(self, key: str, value, expected: str):
        self.key, self.value, self.expected = key, value, expected
        super().__init__(f"`{key}`: {expected}")


def fail(field: str, value, expected: str, fix: str):
    """Raise the one-paragraph `RecipeError` for `field` (every config module's validators use
    this; the loader reports it as is)."""
    from rl_core.errors import RecipeError

    raise RecipeError.single(field, value, expected, fix)
